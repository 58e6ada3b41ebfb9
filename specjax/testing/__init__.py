"""Test-only helpers: deliberately broken verify rules (`rules`: the power checks of the exactness
tests), SSD's broken twins (`ssd_variants`: the power checks of its exactness tests), small models
(`models`: `tiny_config`, and `load_toy`, the 7M toy pair), and the exactness harness (`harness`:
a V = 64 target, prompts, one decode per path, the audit's prefix-grouped chi-square over it).

Nothing in the library imports this package; tests, benchmarks and the Colab notebooks do (the
rules are passed as `verify_impl=` callables). Like the toy pair it is part of a checkout (an
editable install), not of the wheel.
"""
