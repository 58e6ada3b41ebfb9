"""The `specjax` command (`main`), its demo (`demo`) and the arguments that load a pair
(`pair_args`)."""
