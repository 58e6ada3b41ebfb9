"""Test-only helpers: deliberately broken verify rules (`rules`: the power checks of the exactness
tests) and small models (`models`: `tiny_config`, and `load_toy`, the 7M toy pair).

Nothing in the library imports this package; tests, benchmarks and the Colab notebooks do (the
rules are passed as `verify_impl=` callables).
"""
