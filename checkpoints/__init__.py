"""The shipped checkpoints and tables, as package data (the checkout's top-level `checkpoints/`,
installed as `specjax.checkpoints`): the EAGLE-3 head of the default pair (`eagle3_smollm2/`), the
draft vocabularies (`draft_vocab/`) and, in a checkout only, the toy pair (`toy/`). README.md here
says how each was made; `specjax.pretrained.pairs` loads them."""
