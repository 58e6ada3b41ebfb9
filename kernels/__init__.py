"""Pallas kernels of specjax (installed as `specjax.kernels`)."""
