"""Asymmetric int4 (`quantize(..., asymmetric=True)`: a scale and an offset per group) and mixed
widths (`embed_bits`), and the int4 kernel's unit path.

* The format: a weight built the way a Q4_1 / Q4_K block dequantizes (`d * u + m`, u in 0..15,
  every level used) comes back to float32 rounding; any weight comes back within half a step.
* The kernel (`specjax_cpu_qgemv_offsets`, and int4 in units of 64 weights where `in` is a
  multiple of 64) equals its jnp oracle on every shape family, symmetric and asymmetric; the
  oracle's offset term is checked by hand.
* A model: both layouts agree; Orbax round-trips `asymmetric` and `embed_bits` (and reads a
  checkpoint written before they were recorded); the offsets shard like the scales; decode with
  the copy as drafter exports for TPU under (1, 8) and (2, 4) meshes (`test_quant.py`'s export
  test, parametrized over both int4 copies).
* Exactness: greedy decode equals `generate` (ragged batch, both layouts); sampled decode matches
  the target's distribution (chi-square, the harness of `test_exactness.py`), and the broken
  variant (the verify told the float target's q) is rejected by the same test.
* Bad input: asymmetric int8, an unsupported `embed_bits`, offsets on an int8 product: a clear
  ValueError.
"""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.io import load, save
from specjax.io.orbax import CONFIG_FILE
from specjax.models import quant, transformer
from specjax.kernels.cpu import kernel as cpu_gemv
from specjax.testing.models import tiny_config

from tests.exactness.test_exactness import (ALPHA, POWER_ALPHA, SETTINGS, chi_square_pvalue,
                                            exact_joint, run_decode)
from tests.models.test_quant import _told_the_float_q

forward = jax.jit(transformer.forward, static_argnames=("taps", "return_hidden", "write_cache"))


def q41_like(rng, out: int, n: int, group: int = 32) -> np.ndarray:
  """A float32 `[out, n]` weight as a 4-bit block format with a minimum dequantizes: per group,
  `d * u + m` with u in 0..15 and both 0 and 15 present (d, m float16 values, as GGUF stores)."""
  d = rng.uniform(0.005, 0.05, (out, n // group)).astype(np.float16).astype(np.float32)
  m = rng.uniform(-0.4, 0.0, (out, n // group)).astype(np.float16).astype(np.float32)
  u = rng.integers(0, 16, (out, n // group, group))
  u[..., 0], u[..., -1] = 0, 15
  return (d[..., None] * u + m[..., None]).reshape(out, n).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# The format


def test_a_4_bit_block_weight_comes_back_to_float32_rounding():
  w = q41_like(np.random.default_rng(0), 40, 128)
  q = quant.quantize_weight(w, 4, 32, asymmetric=True)
  assert q.asymmetric and q.offsets.shape == q.scales.shape == (40, 4)
  assert q.values.dtype == jnp.uint8 and q.values.shape == (40, 64)
  np.testing.assert_allclose(np.asarray(q.dequantize()), w, rtol=0, atol=4e-7)
  # symmetric int4 cannot: 15 levels centred on zero for a range that is not
  sym = quant.quantize_weight(w, 4, 32)
  assert float(np.abs(np.asarray(sym.dequantize()) - w).max()) > 1e-3


def test_asymmetric_rounds_to_the_nearest_level():
  rng = np.random.default_rng(1)
  w = rng.standard_normal((24, 96)).astype(np.float32)
  w[2, 32:64] = 0.3  # a constant group: scale 0, comes back exactly
  q = quant.quantize_weight(w, 4, 32, asymmetric=True)
  dense = np.asarray(q.dequantize())
  step = np.repeat(np.asarray(q.scales), 32, axis=1)
  assert np.all(np.abs(dense - w) <= step / 2 + 1e-6)
  np.testing.assert_allclose(dense[2, 32:64], 0.3, rtol=1e-6)
  grouped = w.reshape(24, 3, 32)
  np.testing.assert_allclose(np.asarray(q.scales), (grouped.max(-1) - grouped.min(-1)) / 15,
                             rtol=1e-6)
  # the group's minimum and maximum are levels
  np.testing.assert_allclose(dense.reshape(24, 3, 32).min(-1), grouped.min(-1), atol=1e-6)
  np.testing.assert_allclose(dense.reshape(24, 3, 32).max(-1), grouped.max(-1), atol=1e-6)


def test_the_offset_term_by_hand():
  # One row, one group of 32: weight 0 stored as nibble 9 (q = 1), scale 0.5, offset 0.25, so
  # w0 = 0.75 and every other weight is q = -8 -> -3.75. x = [2, 0, ...] quantizes to [127, 0, ...]
  # with scale 2/127: integer dot 127 * 1 -> 1.0, plus offset * (x's sum 127 * 2/127) = 0.5.
  values = np.zeros((1, 16), np.uint8)
  values[0, 0] = 9
  x = jnp.zeros((1, 32), jnp.float32).at[0, 0].set(2.0)
  y = cpu_gemv.quant_reference(x, jnp.asarray(values), jnp.full((1, 1), 0.5), bits=4, group=32,
                               offsets=jnp.full((1, 1), 0.25))
  np.testing.assert_allclose(np.asarray(y), [[1.5]], rtol=1e-6)
  w = cpu_gemv.dequantize(jnp.asarray(values), jnp.full((1, 1), 0.5), bits=4, group=32,
                          offsets=jnp.full((1, 1), 0.25))
  assert float(w[0, 0]) == 0.75 and float(w[0, 1]) == -3.75


@pytest.mark.skipif(not cpu_gemv.available(), reason="the CPU kernel does not build here")
@pytest.mark.parametrize("asymmetric", [True])  # symmetric int4: test_quant.py's grid
@pytest.mark.parametrize("out,n,group,rows", [
    (64, 64, 32, 1), (100, 96, 32, 3), (576, 576, 32, 1), (1536, 576, 64, 5),
    (576, 1536, 32, 8), (200, 128, 128, 13), (3, 192, 64, 2), (77, 640, 32, 6),
    (4100, 64, 32, 1), (50, 256, 256, 4)])
def test_the_int4_kernel_equals_the_jnp_oracle(asymmetric, out, n, group, rows):
  rng = np.random.default_rng(out * n + rows + asymmetric)
  w = rng.standard_normal((out, n)).astype(np.float32) + (0.3 if asymmetric else 0.0)
  q = quant.quantize_weight(w, 4, group, asymmetric=asymmetric)
  x = jnp.asarray(rng.standard_normal((rows, n)).astype(np.float32))
  kernel = jax.jit(lambda x, q: q.matmul(x))
  text = kernel.lower(x, q).as_text()
  assert "specjax_cpu_qgemv" in text and ("specjax_cpu_qgemv_offsets" in text) == asymmetric
  want = cpu_gemv.quant_reference(x, q.values, q.scales, bits=4, group=group, offsets=q.offsets)
  np.testing.assert_allclose(kernel(x, q), want, rtol=2e-6, atol=2e-6 * float(jnp.abs(want).max()))
  # against float activations on the dequantized weight (TPU/GPU): x's rounding costs little
  dense = cpu_gemv.dequant_product(x, q.values, q.scales, bits=4, group=group, offsets=q.offsets)
  assert float(jnp.abs(want - dense).max()) < 0.03 * float(jnp.abs(dense).max())


def test_other_platforms_lower_the_dequantized_dot_with_offsets():
  q = quant.quantize_weight(np.random.default_rng(2).standard_normal((64, 64)), 4, 32,
                            asymmetric=True)
  text = jax.export.export(jax.jit(lambda x, q: q.matmul(x)), platforms=["tpu"])(
      jnp.ones((2, 64)), q).mlir_module()
  assert "specjax_cpu" not in text and "dot_general" in text


def test_the_derivative_follows_the_dequantized_product():
  rng = np.random.default_rng(3)
  q = quant.quantize_weight(rng.standard_normal((8, 64)), 4, 32, asymmetric=True)
  x = jnp.asarray(rng.standard_normal((2, 64)).astype(np.float32))

  def loss(x, offsets):
    return jnp.sum(quant.QuantizedWeight(q.values, q.scales, 4, 32, offsets).matmul(x) ** 2)

  def dense_loss(x, offsets):
    return jnp.sum(cpu_gemv.dequant_product(x, q.values, q.scales, bits=4, group=32,
                                            offsets=offsets) ** 2)

  for a, b in zip(jax.grad(loss, (0, 1))(x, q.offsets), jax.grad(dense_loss, (0, 1))(x, q.offsets)):
    np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05 * float(jnp.abs(b).max()))


# ------------------------------------------------------------------------------------------------
# Models


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=96), jax.random.key(4))


def _copy(model):
  return sj.quantize(model, 4, 32, asymmetric=True, embed_bits=8)


def test_layouts_agree_and_the_embedding_keeps_its_width(target):
  tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 96)
  zeros = jnp.zeros(2, jnp.int32)
  stacked, cpu = _copy(target), _copy(target.for_platform("cpu"))
  assert stacked.params["embed"].bits == 8 and not stacked.params["embed"].asymmetric
  assert stacked.params["layers"]["w_up"].bits == 4 and stacked.params["layers"]["w_up"].asymmetric
  a = forward(stacked, tokens, zeros).logits
  np.testing.assert_allclose(forward(cpu, tokens, zeros).logits, a, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(forward(cpu.stacked(), tokens, zeros).logits, a, atol=1e-4,
                             rtol=1e-4)
  exact = forward(target, tokens, zeros).logits
  sym = forward(sj.quantize(target, 4, 32, embed_bits=8), tokens, zeros).logits
  # on random normal weights the offset buys a finer step than symmetric int4
  assert float(jnp.abs(a - exact).max()) < float(jnp.abs(sym - exact).max())
  assert quant.quantization_of(stacked) == {"bits": 4, "group": 32, "embeddings": True,
                                         "asymmetric": True, "embed_bits": 8}


def test_orbax_round_trip_and_an_earlier_checkpoint(target, tmp_path):
  untied = sj.init_params(tiny_config(vocab_size=96, tie_embeddings=False), jax.random.key(5))
  for i, model in enumerate((_copy(target), _copy(untied.for_platform("cpu")),
                             sj.quantize(target, 4, 32, asymmetric=True))):
    save(model, tmp_path / str(i))
    restored, ref = load(tmp_path / str(i)), model.stacked()
    chex.assert_trees_all_equal_dtypes(restored, ref)  # structure and dtypes
    chex.assert_trees_all_equal(restored, ref)
  # A checkpoint written before `asymmetric` and `embed_bits` were recorded: symmetric, one width.
  save(sj.quantize(target, 8, 32), tmp_path / "old")
  config = tmp_path / "old" / CONFIG_FILE
  record = json.loads(config.read_text())
  for key in ("asymmetric", "embed_bits"):
    del record["quantization"][key]
  config.write_text(json.dumps(record))
  restored = load(tmp_path / "old")
  assert quant.quantization_of(restored)["embed_bits"] == 8
  assert not quant.quantization_of(restored)["asymmetric"]


def test_offsets_shard_like_the_scales(target):
  from specjax.parallel.mesh import param_specs
  specs = param_specs(_copy(target), sj.make_mesh((2, 4)))
  for name in ("wq", "w_gate", "w_down"):
    w = specs["layers"][name]
    assert tuple(w.offsets) == tuple(w.scales), name


# ------------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize("layout", ["stacked", "cpu"])
def test_greedy_asymmetric_self_draft_equals_generate(target, layout):
  model = target if layout == "stacked" else target.for_platform("cpu")
  tokens = jnp.array([[5, 9, 2, 7, 1, 3, 8], [3, 8, 4, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0]],
                     jnp.int32)
  lengths = jnp.array([7, 3, 2], jnp.int32)
  key = jax.random.key(0)
  want = sj.generate(model, tokens, key, lengths=lengths, max_new_tokens=24)
  drafter = sj.self_drafter(model, 4, asymmetric=True, embed_bits=8)
  for k in (2, 5):
    out = sj.decode(model, drafter, tokens, key, lengths=lengths, max_new_tokens=24, num_draft=k)
    np.testing.assert_array_equal(out.tokens, want.tokens)
    assert out.stats.summary()["accepted"] > 0


@pytest.fixture(scope="module")
def small_target():
  from tests.exactness.test_exactness import VOCAB
  return sj.init_params(tiny_config(vocab_size=VOCAB), jax.random.key(10))


@pytest.mark.costly
@pytest.mark.parametrize("name", ["t1", pytest.param("t0.7_topk3", marks=pytest.mark.slow)])
def test_sampled_asymmetric_self_draft_matches_the_target_distribution(small_target, name):
  # N = 20,000 samples, alpha 1e-3 (the harness of test_exactness.py), seeded
  sampling = SETTINGS[name]
  drafter = sj.self_drafter(small_target, 4, asymmetric=True)
  tokens, stats = run_decode(small_target, drafter, sampling)
  assert 0.05 < stats.summary()["acceptance_rate"] < 0.999
  assert chi_square_pvalue(tokens, exact_joint(small_target, sampling)) > ALPHA


@pytest.mark.slow  # the power check: CI's slow step
def test_an_asymmetric_self_draft_verified_with_the_float_q_is_rejected(small_target):
  sampling = SETTINGS["t1"]
  drafter = sj.self_drafter(small_target, 4, asymmetric=True)
  tokens, _ = run_decode(small_target, drafter, sampling, verify_impl=_told_the_float_q)
  assert chi_square_pvalue(tokens, exact_joint(small_target, sampling)) < POWER_ALPHA


# ------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("kwargs,message", [
    (dict(bits=8, asymmetric=True), "int4 only"),
    (dict(bits=4, asymmetric="yes"), "asymmetric must be a bool"),
    (dict(bits=4, embed_bits=3), "bits must be one of"),
    (dict(bits=4, embed_bits=16), "bits must be one of"),
])
def test_bad_settings_raise(target, kwargs, message):
  with pytest.raises(ValueError, match=message):
    sj.quantize(target, group=32, **kwargs)
  with pytest.raises(ValueError, match=message):
    sj.self_drafter(target, group=32, **kwargs)


def test_offsets_on_an_int8_product_raise():
  q = quant.quantize_weight(np.ones((4, 32), np.float32), 8, 32)
  with pytest.raises(ValueError, match="offsets need bits 4"):
    cpu_gemv.quant_matvec(jnp.ones((1, 32)), q.values, q.scales, bits=8, group=32,
                          offsets=q.scales)
