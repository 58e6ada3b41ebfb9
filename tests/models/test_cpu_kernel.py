"""The hand-written CPU kernels (`specjax.kernels.cpu.kernel`): build here, compute the product and
a decode step's attention (against float64 numpy), compose with jit / loops / vmap / grad /
threads, lower only on CPU, fall back to XLA where they cannot be built, and leave a model's
tokens unchanged."""

import os
import pathlib
import platform
import shutil
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.kernels.cpu import kernel as cpu_gemv
from specjax.models import layers
from specjax.testing.models import random_quantized, tiny_config

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


# `slow` for CI's time (a C++ build from source, 78 to 117 s): the AVX2 build and the
# every-block-size oracle stay in CI's costly step.
@pytest.mark.slow
def test_a_fresh_cache_compiles_the_source(tmp_path, monkeypatch):
  """`build()` into an empty cache runs the compiler (the cache above may already hold the
  library) and gives a library exporting the handler, also when threads build at once (one
  library, and it loads); a later call reuses it."""
  import concurrent.futures
  import ctypes
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    paths = list(pool.map(lambda _: cpu_gemv.build(), range(4)))
  assert len(set(paths)) == 1
  library = paths[0]
  assert library.parent.parent == tmp_path and library.exists()
  assert ctypes.cdll.LoadLibrary(str(library)).specjax_cpu_gemv
  assert sorted(p.name for p in library.parent.iterdir()) == [library.name,
                                                              library.name + ".sha256"]
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


# Output rows that are not a multiple of the kernel's tile of weight rows (4 or 3 with AVX-512;
# 4, 3, 2 with AVX2) or of its parts' multiples of four, input sizes with a tail past the last
# vector; 4500 columns: two and three rows of x outgrow L1 and take the tiles too; 8250 columns:
# a single row of x outgrows L1 (with AVX-512 it then takes tiles of four weight rows).
ROW_SHAPES = [(67, 33), (101, 96), (4100, 17), (258, 1536), (37, 4500), (37, 8250)]


def _check_every_row_count(shapes):
  rng = np.random.default_rng(11)
  product = jax.jit(cpu_gemv.matvec)
  for out, n in shapes:
    w = jnp.asarray(rng.standard_normal((out, n), np.float32))
    for rows in range(1, 10):  # 9 = a block of eight and a block of one
      x = jnp.asarray(rng.standard_normal((1, rows, n), np.float32))
      _check(product(x, w), x, w)


def test_every_block_size_equals_the_float64_product():
  """Blocks of 1..9 rows (each several-row size has its own tile of weight rows)."""
  _check_every_row_count(ROW_SHAPES)


def _check_quantized_products():
  """The quantized product (int8 and int4, symmetric and with offsets, 1..9 rows, groups of 32 and
  64) against the jnp oracle `quant_reference`, which states the arithmetic exactly (integer dots
  per group)."""
  rng = np.random.default_rng(12)
  for bits in (8, 4):
    for out, n, group in ((67, 64, 32), (258, 576, 64)):
      values, scales = random_quantized(rng, out, n, bits, group)
      kernel = jax.jit(lambda x, v, s: cpu_gemv.quant_matvec(x, v, s, bits=bits, group=group))
      for rows in range(1, 10):
        x = jnp.asarray(rng.standard_normal((rows, n)).astype(np.float32))
        want = cpu_gemv.quant_reference(x, values, scales, bits=bits, group=group)
        np.testing.assert_allclose(kernel(x, values, scales), want, rtol=2e-6,
                                   atol=2e-6 * float(jnp.abs(want).max()))
  # int4 with per-group offsets (asymmetric): in units of 64 weights (n = 64, 576) and, where n is
  # not a multiple of 64 (96), the 32-weight path
  for out, n, group in ((67, 64, 32), (258, 576, 64), (40, 96, 32)):
    values, scales = random_quantized(rng, out, n, 4, group)
    offsets = jnp.asarray(rng.standard_normal(scales.shape).astype(np.float32))
    kernel = jax.jit(lambda x, v, s, o: cpu_gemv.quant_matvec(x, v, s, bits=4, group=group,
                                                              offsets=o))
    for rows in range(1, 10):
      x = jnp.asarray(rng.standard_normal((rows, n)).astype(np.float32))
      want = cpu_gemv.quant_reference(x, values, scales, bits=4, group=group, offsets=offsets)
      np.testing.assert_allclose(kernel(x, values, scales, offsets), want, rtol=2e-6,
                                 atol=2e-6 * float(jnp.abs(want).max()))


@pytest.mark.costly
def test_every_quantized_block_size_equals_the_oracle():
  _check_quantized_products()


@pytest.mark.costly
@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx512f -mno-avxvnni"])
def test_the_avx2_builds_equal_the_references(tmp_path, flags):
  """The same products and attention from the kernel built without AVX-512 (its AVX2 tiles: 16
  vector registers; with AVX-VNNI's vpdpbusd for the quantized product, and without it), each in a
  fresh process with its own cache. Skipped only where the host has no AVX-512 (then the default
  build is an AVX2 one, tested above)."""
  if "avx512f" not in pathlib.Path("/proc/cpuinfo").read_text():
    pytest.skip("this host has no AVX-512: the default build already is an AVX2 one")
  env = dict(os.environ, SPECJAX_CPU_KERNEL_FLAGS=flags, SPECJAX_CACHE_DIR=str(tmp_path),
             JAX_PLATFORMS="cpu")
  # The two builds differ only in the quantized product's integer dot (vpdpbusd or maddubs), so
  # the build without VNNI checks the quantized products alone.
  checks = ("t._check_quantized_products(); " if "avxvnni" in flags else
            "t._check_every_row_count(t.ROW_SHAPES); t._check_quantized_products(); "
            "[t._check_attention(*shape) for shape in t.ATTENTION_SHAPES]; "
            "import test_cpu_panels as p; p._check_panel_products(); ")
  code = ("import sys; sys.path.insert(0, %r); import test_cpu_kernel as t; "
          "from specjax.kernels.cpu import kernel; assert kernel.status()[0], kernel.status(); "
          "%sprint('ok')" % (str(pathlib.Path(__file__).parent), checks))
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
  (built,) = (tmp_path / "cpu_kernels").glob("*.so")
  objdump = shutil.which("objdump")
  disassembly = objdump and subprocess.run([objdump, "-d", str(built)], capture_output=True,
                                           text=True)
  if disassembly and disassembly.returncode == 0:  # the build meant: no AVX-512, VNNI or not
    assert "zmm" not in disassembly.stdout
    # Without AVX-512 the quantized dot is vpdpbusd only through AVX-VNNI (the VEX form), which
    # -march=native enables only where the host has it: AVX512-VNNI alone (Cascade Lake, Ice Lake,
    # Zen 4) leaves the maddubs path.
    host_vnni = "avx_vnni" in pathlib.Path("/proc/cpuinfo").read_text().split()
    assert ("vpdpbusd" in disassembly.stdout) == (host_vnni and "avxvnni" not in flags)


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
      "from specjax.kernels.cpu import kernel as cpu_gemv\n"
      "from specjax.testing.models import random_quantized, tiny_config\n"
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
  float32 summation noise, greedy tokens identical; the step's HLO holds the kernel's calls (the
  projections' panel products and the attention)."""
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
  for target in ("specjax_cpu_panel_gemv", "specjax_cpu_attention"):
    assert target in step.lower(on, one, starts, on.init_cache(1, 16)).as_text()
    assert target not in step.lower(off, one, starts, off.init_cache(1, 16)).as_text()
  np.testing.assert_allclose(step(on, one, starts, on.init_cache(1, 16)),
                             step(stacked, one, starts, cache), rtol=1e-5, atol=1e-5)


def _segments(q, k0, v0, k1, v1, visible):
  """The cache and the block as the two segments `layers.segment_attention` takes."""
  s0 = k0.shape[2]
  return q, (k0, k1), (v0, v1), (visible[..., :s0], visible[..., s0:])


def _kernel_attention(*args, scale, softcap):
  return layers.segment_attention(*_segments(*args), scale=scale, softcap=softcap, kernel=True)


def _jnp_attention(*args, scale, softcap):
  return layers.attention_reference(*_segments(*args), scale=scale, softcap=softcap)


def _attention_f64(q, k0, v0, k1, v1, visible, scale, softcap):
  """The attention of `layers.attention_reference` over a cache and a block, in float64 numpy
  (one softmax over both; an invisible key scores float32's lowest)."""
  q, keys, values = (np.asarray(a, np.float64) for a in (
      q, np.concatenate([k0, k1], axis=2), np.concatenate([v0, v1], axis=2)))
  scores = np.einsum("btkgd,bksd->bkgts", q, keys) * scale
  if softcap:
    scores = softcap * np.tanh(scores / softcap)
  scores = np.where(np.asarray(visible)[:, None, None], scores, np.finfo(np.float32).min)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum("bkgts,bksd->bkgtd", probs, values)


# (batch, block rows, key/value heads, query heads per kv head, head size, cache slots, block
# slots, soft cap): SmolLM2's step and verify blocks (k = 5, 6: the parts of the pool split a head's
# rows), Qwen2.5-1.5B's verify block of 8, Gemma's 256-wide heads with a soft cap, head sizes of
# 8, 24 and 72 (not multiples of 16: eight keys per block of scores, an 8-column tail of values),
# cache sizes that are not multiples of eight or sixteen, a batch of eight single rows.
ATTENTION_SHAPES = [(1, 1, 3, 3, 64, 264, 1, None), (1, 6, 3, 3, 64, 100, 6, None),
                    (1, 7, 3, 3, 64, 174, 7, None), (1, 8, 2, 6, 128, 201, 8, None),
                    (2, 3, 1, 4, 256, 37, 3, 30.0), (8, 1, 2, 2, 8, 5, 1, None),
                    (1, 2, 2, 1, 128, 9, 2, 50.0), (2, 4, 2, 3, 72, 19, 4, None),
                    (1, 5, 1, 2, 24, 33, 5, 20.0)]


@pytest.mark.parametrize("b,t,kvh,g,d,s0,s1,softcap", ATTENTION_SHAPES)
def test_attention_equals_the_float64_reference(b, t, kvh, g, d, s0, s1, softcap):
  """The kernel (jitted) against float64 numpy, with a random visibility mask that leaves one row
  seeing nothing (its softmax is uniform, as the jnp reference's) and one row seeing one key."""
  _check_attention(b, t, kvh, g, d, s0, s1, softcap)


def _check_attention(b, t, kvh, g, d, s0, s1, softcap):
  rng = np.random.default_rng(d + s0)
  q = rng.standard_normal((b, t, kvh, g, d)).astype(np.float32)
  k0, v0 = (rng.standard_normal((b, kvh, s0, d)).astype(np.float32) for _ in range(2))
  k1, v1 = (rng.standard_normal((b, kvh, s1, d)).astype(np.float32) for _ in range(2))
  visible = rng.random((b, t, s0 + s1)) < 0.6
  visible[0, 0] = False
  visible[-1, -1] = False
  visible[-1, -1, s0 // 2] = True
  run = jax.jit(lambda *a: _kernel_attention(*a, scale=d ** -0.5, softcap=softcap))
  out = run(q, k0, v0, k1, v1, visible)
  assert out.shape == (b, kvh, g, t, d)
  np.testing.assert_allclose(out, _attention_f64(q, k0, v0, k1, v1, visible, d ** -0.5, softcap),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out, _jnp_attention(
      q, k0, v0, k1, v1, visible, scale=d ** -0.5, softcap=softcap), rtol=1e-5, atol=1e-5)
  assert "specjax_cpu_attention" in run.lower(q, k0, v0, k1, v1, visible).as_text()


def test_attention_never_reads_an_invisible_slot():
  """Cache slots no query sees (the unfilled end of the buffer, entries left by a rollback) are
  not read: NaN there leaves the kernel's result equal to the float64 reference over zeros, where
  a product over every slot (the jnp reference) turns NaN."""
  rng = np.random.default_rng(0)
  q = rng.standard_normal((1, 2, 2, 3, 64)).astype(np.float32)
  k0, v0 = (rng.standard_normal((1, 2, 40, 64)).astype(np.float32) for _ in range(2))
  k1, v1 = (rng.standard_normal((1, 2, 2, 64)).astype(np.float32) for _ in range(2))
  visible = np.zeros((1, 2, 42), bool)
  visible[:, :, :17] = True  # 17 filled cache slots, then the block (causal)
  visible[:, 0, 40] = visible[:, 1, 40:] = True
  stale_k, stale_v = k0.copy(), v0.copy()
  stale_k[:, :, 17:] = stale_v[:, :, 17:] = np.nan
  out = jax.jit(lambda *a: _kernel_attention(*a, scale=0.125, softcap=None))(
      q, stale_k, stale_v, k1, v1, visible)
  clean_k, clean_v = np.nan_to_num(stale_k), np.nan_to_num(stale_v)
  np.testing.assert_allclose(out, _attention_f64(q, clean_k, clean_v, k1, v1, visible, 0.125, None),
                             rtol=1e-5, atol=1e-5)
  every_slot = _jnp_attention(q, stale_k, stale_v, k1, v1, visible, scale=0.125, softcap=None)
  assert np.isnan(np.asarray(every_slot)).any()


def test_attention_lowers_to_jnp_elsewhere_and_for_wide_blocks():
  """TPU export, bfloat16, more than eight query rows, a head size that is not a multiple of 8:
  the jnp reference, no custom call."""
  args = lambda b, t, d, dtype=jnp.float32: (
      jnp.ones((b, t, 1, 2, d), dtype), jnp.ones((b, 1, 8, d), dtype),
      jnp.ones((b, 1, 8, d), dtype), jnp.ones((b, 1, t, d), dtype), jnp.ones((b, 1, t, d), dtype),
      jnp.ones((b, t, 8 + t), bool))
  fn = jax.jit(lambda *a: _kernel_attention(*a, scale=0.5, softcap=None))
  tpu = jax.export.export(fn, platforms=["tpu"])(*args(1, 1, 64)).mlir_module()
  assert "specjax_cpu_attention" not in tpu
  for case in (args(1, 1, 64, jnp.bfloat16), args(3, 3, 64), args(1, 1, 12)):
    assert "specjax_cpu_attention" not in fn.lower(*case).as_text()
