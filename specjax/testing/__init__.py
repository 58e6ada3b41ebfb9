"""Test-only helpers: deliberately broken verify rules (the power checks of the exactness tests).

Nothing in the library imports this package; tests and experiments pass its rules as
`verify_impl=` callables.
"""
