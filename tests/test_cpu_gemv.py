"""The hand-written CPU matrix-vector kernel (`specjax.kernels.cpu_gemv`): builds here, computes
the product (against float64 numpy), composes with jit / loops / vmap / grad / threads, lowers only
on CPU, falls back to XLA's dot where it cannot be built, and leaves a model's tokens unchanged."""

import os
import platform
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.kernels import cpu_gemv
from specjax.models import tiny_config

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the kernel is written for x86-64 (AVX2 + FMA)")

SHAPES = [(960, 576), (576, 1536), (3072, 576), (3, 5), (67, 33), (64, 64), (65, 64), (4100, 17),
          (1, 1), (130, 8)]


def _reference(x, w):
  return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


def _check(y, x, w):
  ref = _reference(x, w)
  # float32 products summed in a different order: error ~ eps * sqrt(n) * |x| |w|
  scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
  np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - ref), 1e-6 * scale + 1e-30)


def test_the_kernel_builds_on_this_machine():
  """On x86-64 with a C++ compiler (this machine and CI) the kernel must build: a silent fallback
  to XLA's dot would pass every other test while losing the speed."""
  ok, why = cpu_gemv.status()
  assert ok, why


def test_a_fresh_cache_compiles_the_source(tmp_path, monkeypatch):
  """`build()` into an empty cache runs the compiler (the cache above may already hold the
  library) and gives a library exporting the handler; a second call reuses it."""
  import ctypes
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
  library = cpu_gemv.build()
  assert library.parent.parent == tmp_path and library.exists()
  assert ctypes.cdll.LoadLibrary(str(library)).specjax_cpu_gemv
  stamp = library.stat().st_mtime_ns
  assert cpu_gemv.build() == library and library.stat().st_mtime_ns == stamp
  # A cached file that is not what was built (truncated here) is rebuilt, never loaded.
  digest = library.with_name(library.name + ".sha256")
  size = library.stat().st_size
  library.write_bytes(library.read_bytes()[:size // 2])
  assert cpu_gemv.build() == library and library.stat().st_size > size // 2
  assert cpu_gemv._sha256(library) == digest.read_text().strip()
  # So is one without its recorded digest (a library from before digests, or copied in by hand).
  digest.unlink()
  library.write_bytes(b"not a library")
  assert cpu_gemv.build() == library and library.stat().st_size > 1000
  assert cpu_gemv._sha256(library) == digest.read_text().strip()


def test_concurrent_first_builds_agree(tmp_path, monkeypatch):
  """Threads that build into an empty cache at once get one library, and it loads."""
  import concurrent.futures
  import ctypes
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    paths = list(pool.map(lambda _: cpu_gemv.build(), range(4)))
  assert len(set(paths)) == 1 and ctypes.cdll.LoadLibrary(str(paths[0])).specjax_cpu_gemv
  assert sorted(p.name for p in paths[0].parent.iterdir()) == [paths[0].name,
                                                               paths[0].name + ".sha256"]


@pytest.mark.parametrize("out,n", SHAPES)
def test_matvec_equals_the_float64_product(out, n):
  rng = np.random.default_rng(out * 1000 + n)
  w = jnp.asarray(rng.standard_normal((out, n), np.float32))
  x = jnp.asarray(rng.standard_normal((1, 1, n), np.float32))
  y = jax.jit(cpu_gemv.matvec)(x, w)
  assert y.shape == (1, 1, out) and y.dtype == jnp.float32
  _check(y, x, w)
  assert "specjax_cpu_gemv" in jax.jit(cpu_gemv.matvec).lower(x, w).as_text()


def test_several_rows_and_a_loop_of_products():
  """Rows beyond the first are each a product; a `fori_loop` of dependent products (as a decode
  step chains them) gives the product chain of float64 numpy."""
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.standard_normal((96, 96), np.float32) / 10)
  x = jnp.asarray(rng.standard_normal((3, 2, 96), np.float32))
  _check(jax.jit(cpu_gemv.matvec)(x, w), x, w)
  chained = jax.jit(lambda v: jax.lax.fori_loop(0, 5, lambda i, v: cpu_gemv.matvec(v, w), v))
  ref = np.asarray(x[:1, :1], np.float64)
  for _ in range(5):
    ref = ref @ np.asarray(w, np.float64).T
  np.testing.assert_allclose(chained(x[:1, :1]), ref, rtol=1e-4, atol=1e-5)


def test_vmap_and_grad_agree_with_einsum():
  rng = np.random.default_rng(4)
  w = jnp.asarray(rng.standard_normal((80, 48), np.float32))
  xs = jnp.asarray(rng.standard_normal((5, 1, 48), np.float32))
  einsum = lambda x, w: jnp.einsum("...i,oi->...o", x, w)
  np.testing.assert_allclose(jax.vmap(cpu_gemv.matvec, (0, None))(xs, w), einsum(xs, w),
                             rtol=1e-5, atol=1e-5)
  loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))
  for argnum in (0, 1):
    ours = jax.grad(loss(cpu_gemv.matvec), argnum)(xs[0], w)
    theirs = jax.grad(loss(einsum), argnum)(xs[0], w)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_concurrent_callers_get_their_own_products():
  """Two threads running jitted products at once, both splitting their rows over XLA's intra-op
  pool (a caller takes the parts the busy pool has not started): neither sees the other's rows."""
  rng = np.random.default_rng(5)
  ws = [jnp.asarray(rng.standard_normal((512, 256), np.float32)) for _ in range(2)]
  xs = [jnp.asarray(rng.standard_normal((1, 256), np.float32)) for _ in range(2)]
  fn = jax.jit(cpu_gemv.matvec)
  expected = [np.asarray(fn(x, w)) for x, w in zip(xs, ws)]
  failures = []

  def hammer(i):
    for _ in range(200):
      if not np.array_equal(np.asarray(fn(xs[i], ws[i])), expected[i]):
        failures.append(i)

  threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not failures
  for x, w, y in zip(xs, ws, expected):
    _check(y, x, w)


def test_mismatched_shapes_raise_before_tracing():
  with pytest.raises(ValueError, match="last axis"):
    cpu_gemv.matvec(jnp.ones((1, 5)), jnp.ones((4, 6)))


def test_other_platforms_and_dtypes_lower_to_a_plain_dot():
  x, w = jnp.ones((1, 1, 64)), jnp.ones((128, 64))
  tpu = jax.export.export(jax.jit(cpu_gemv.matvec), platforms=["tpu"])(x, w).mlir_module()
  assert "specjax_cpu_gemv" not in tpu and "dot_general" in tpu
  bf16 = jax.jit(cpu_gemv.matvec).lower(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)).as_text()
  assert "specjax_cpu_gemv" not in bf16


def test_a_failed_build_falls_back_to_xla(tmp_path):
  """No usable compiler: `status()` says why, the CPU layout keeps XLA's dot, decoding works."""
  script = (
      "import jax, numpy as np, specjax as sj\n"
      "from specjax.kernels import cpu_gemv\n"
      "from specjax.models import tiny_config\n"
      "ok, why = cpu_gemv.status()\n"
      "assert not ok and 'failed' in why, why\n"
      "m = sj.init_params(tiny_config(vocab_size=97), jax.random.key(0)).for_platform('cpu')\n"
      "assert not m.cpu_kernel\n"
      "out = sj.generate(m, np.ones((1, 4), np.int32), jax.random.key(0), max_new_tokens=3)\n"
      "print('fallback ok', why.splitlines()[0])\n")
  env = dict(os.environ, CXX="false", SPECJAX_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "fallback ok" in done.stdout
  assert "XLA's dot is used" in done.stderr  # one warning says so


def test_the_model_with_the_kernel_gives_the_same_steps_and_tokens():
  """A batch-1 decode in the CPU layout, kernel on and off, against the stacked scan: logits within
  float32 summation noise, greedy tokens identical; the step's HLO holds the kernel's calls."""
  config = tiny_config(vocab_size=97, embed_dim=64, mlp_dim=128, num_heads=4, num_kv_heads=2)
  stacked = sj.init_params(config, jax.random.key(1))
  on = stacked.for_platform("cpu")
  off = stacked.unstacked().with_fused_projections(cpu_kernel=False)
  assert on.cpu_kernel and not off.cpu_kernel and not on.stacked().cpu_kernel
  prompt = jax.random.randint(jax.random.key(2), (1, 6), 0, 97, jnp.int32)
  key = jax.random.key(0)
  tokens = {label: sj.generate(m, prompt, key, max_new_tokens=20).tokens
            for label, m in (("stacked", stacked), ("on", on), ("off", off))}
  np.testing.assert_array_equal(tokens["on"], tokens["stacked"])
  np.testing.assert_array_equal(tokens["off"], tokens["stacked"])
  step = jax.jit(lambda m, t, s, c: m(t, s, c).logits)
  cache = stacked.init_cache(1, 16)
  starts = jnp.full((1,), 0, jnp.int32)
  one = prompt[:, :1]
  assert "specjax_cpu_gemv" in step.lower(on, one, starts, on.init_cache(1, 16)).as_text()
  assert "specjax_cpu_gemv" not in step.lower(off, one, starts, off.init_cache(1, 16)).as_text()
  np.testing.assert_allclose(step(on, one, starts, on.init_cache(1, 16)),
                             step(stacked, one, starts, cache), rtol=1e-5, atol=1e-5)
