"""Test set-up: 8 simulated CPU devices (for sharding tests) and float32 everywhere."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's compiled programs after each test module, so that one long pytest process does
  not accumulate every module's executables (tests of 8-device meshes compile large programs)."""
  yield
  jax.clear_caches()
