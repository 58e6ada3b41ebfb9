"""The shipped default target/draft pair, installed as package data (`specjax._default`).

Load it with `specjax.load_default()`; README.md in this folder says how it was made.
"""
