"""Quantized weights (`specjax.models.quant`) and self-drafting (`sj.self_drafter`).

* The format: int8 / packed int4 per group with float32 scales; `quantize_weight` rounds to the
  nearest level (error at most half a step), int4 nibbles unpack to the integers they packed.
* The CPU kernel (`specjax_cpu_qgemv`) equals its jnp oracle (`quant_reference`: rows of x
  quantized per group, integer dot products) on every shape family, and that oracle is checked
  by hand on a small case.
* A quantized model: stacked (TPU/GPU layout) and CPU layout give the same logits; its logits stay
  near the float model's; it round-trips through Orbax; it exports for TPU under meshes with a
  plain dot (no CPU custom call) and its leaves shard like the float weights they replace.
* Self-drafting is exact: greedy decode equals `generate` (ragged batch, int8 and int4, both
  layouts); sampled decode matches the target's distribution (chi-square, the harness of
  `test_exactness.py`), and a broken variant (the verify told the float target's q while the
  int4 copy drafts) is rejected by the same test.
* A self-draft starts from the target's keys/values over the prompt (one prefill, not two); a
  draft model of another shape runs its own.
* Bad input: unsupported bits or group, a group that does not divide a dimension, a model quantized
  twice: a clear ValueError, before anything is compiled.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.io import load, save
from specjax.models import dequantize_model, QuantizedWeight
from specjax.pretrained import PAIRS
from specjax.kernels.cpu import kernel as cpu_gemv
from specjax.models import quant, transformer
from specjax.testing.models import random_quantized, tiny_config

from tests.exactness.test_exactness import (ALPHA, POWER_ALPHA, SETTINGS, chi_square_pvalue, exact_joint,
                                            run_decode)

# The forward jitted, as every caller runs it (eagerly each op of a forward dispatches alone).
forward = jax.jit(transformer.forward, static_argnames=("taps", "return_hidden", "write_cache"))


# ------------------------------------------------------------------------------------------------
# The format


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_weight_rounds_to_the_nearest_level(bits):
  rng = np.random.default_rng(0)
  w = rng.standard_normal((48, 96)).astype(np.float32)
  w[3, :32] = 0.0  # an all-zero group: scale 0, dequantizes to exact zeros
  q = quant.quantize_weight(w, bits, 32)
  assert q.shape == (48, 96) and q.values.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
  dense = np.asarray(q.dequantize())
  step = np.repeat(np.asarray(q.scales), 32, axis=1)
  assert np.all(np.abs(dense - w) <= step / 2 + 1e-6)
  np.testing.assert_array_equal(dense[3, :32], 0.0)
  top = 127 if bits == 8 else 7  # the largest magnitude of each group is represented exactly
  np.testing.assert_allclose(np.asarray(q.scales), np.abs(w.reshape(48, 3, 32)).max(-1) / top,
                             rtol=1e-6)


def test_int4_nibbles_unpack_to_what_was_packed():
  # Run of 32 weights 0..31 with integer values -7..7 (scale 1): byte j holds weight j (low
  # nibble) and weight j + 16 (high nibble), each stored as q + 8.
  ints = np.array([(i % 15) - 7 for i in range(32)], np.float32)
  q = quant.quantize_weight(ints[None] * (7 / np.abs(ints).max()), 4, 32)
  values = np.asarray(q.values)[0]
  assert values[0] == ((ints[0] + 8).astype(np.uint8) | ((ints[16] + 8).astype(np.uint8) << 4))
  np.testing.assert_allclose(np.asarray(q.dequantize())[0] / np.asarray(q.scales)[0, 0],
                             np.rint(ints * (7 / np.abs(ints).max())), atol=1e-5)


def test_the_oracle_by_hand():
  # One output row, one group of 32: w = 1 (scale 0.5), x = [2, 0, 0, ...]: x quantizes to
  # [127, 0, ...] with scale 2/127; the integer dot is 127 * 1 = 127; times 0.5 * 2/127 = 1.0.
  values = jnp.ones((1, 32), jnp.int8)
  scales = jnp.full((1, 1), 0.5, jnp.float32)
  x = jnp.zeros((1, 32), jnp.float32).at[0, 0].set(2.0)
  y = cpu_gemv.quant_reference(x, values, scales, bits=8, group=32)
  np.testing.assert_allclose(np.asarray(y), [[1.0]], rtol=1e-6)
  # x rounds half to even: 127 * 0.5 / 1 = 63.5 -> 64, 127 * 1.5 / ... (per group scale = 1/127)
  xq, xs = cpu_gemv.quantize_rows(jnp.asarray([[1.0, 0.5] + [0.0] * 30]), 32)
  assert int(xq[0, 0]) == 127 and int(xq[0, 1]) == 64 and float(xs[0, 0]) == pytest.approx(1 / 127)


@pytest.mark.skipif(not cpu_gemv.available(), reason="the CPU kernel does not build here")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("out,n,group,rows", [
    (64, 64, 32, 1), (100, 96, 32, 3), (576, 576, 32, 1), (1536, 576, 64, 5), (576, 1536, 32, 8),
    (200, 128, 128, 13), (3, 32, 32, 2), (77, 64, 32, 6), (4100, 64, 32, 1)])
def test_kernel_equals_the_jnp_oracle(bits, out, n, group, rows):
  rng = np.random.default_rng(out * n + rows)
  values, scales = random_quantized(rng, out, n, bits, group)
  x = jnp.asarray(rng.standard_normal((rows, n)).astype(np.float32))
  kernel = jax.jit(lambda x, v, s: cpu_gemv.quant_matvec(x, v, s, bits=bits, group=group))
  assert "specjax_cpu_qgemv" in kernel.lower(x, values, scales).as_text()
  want = cpu_gemv.quant_reference(x, values, scales, bits=bits, group=group)
  np.testing.assert_allclose(kernel(x, values, scales), want, rtol=2e-6,
                             atol=2e-6 * float(jnp.abs(want).max()))
  # The rounding of x costs little against float activations (`dequant_product`, TPU/GPU).
  dense = cpu_gemv.dequant_product(x, values, scales, bits=bits, group=group)
  assert float(jnp.abs(want - dense).max()) < 0.03 * float(jnp.abs(dense).max())


def test_other_platforms_lower_the_dequantized_dot():
  rng = np.random.default_rng(1)
  values, scales = random_quantized(rng, 64, 64, 8, 32)
  fn = jax.jit(lambda x, v, s: cpu_gemv.quant_matvec(x, v, s, bits=8, group=32))
  text = jax.export.export(fn, platforms=["tpu"])(jnp.ones((2, 64)), values, scales).mlir_module()
  assert "specjax_cpu_qgemv" not in text and "dot_general" in text


# ------------------------------------------------------------------------------------------------
# Quantized models


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=96), jax.random.key(4))


@pytest.mark.parametrize("bits", [8, 4])
def test_layouts_agree_and_stay_near_the_float_model(target, bits):
  tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 96)
  zeros = jnp.zeros(2, jnp.int32)
  stacked = sj.quantize(target, bits)
  cpu = sj.quantize(target.for_platform("cpu"), bits)
  assert isinstance(stacked.params["embed"], QuantizedWeight)
  if target.config.tie_embeddings:
    assert "lm_head" not in cpu.params  # one (quantized) copy of the tied table
  else:
    assert isinstance(cpu.params["lm_head"], QuantizedWeight)
  assert not any(name.endswith("_halves") for name in cpu.params["layers"][0])
  a = forward(stacked, tokens, zeros).logits
  b = forward(cpu, tokens, zeros).logits
  np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
  back = cpu.stacked()  # quantized leaves stack (and split their fused projections) too
  np.testing.assert_allclose(forward(back, tokens, zeros).logits, a, atol=1e-4, rtol=1e-4)
  exact = forward(target, tokens, zeros).logits
  error = float(jnp.abs(a - exact).max()) / float(jnp.abs(exact).max())
  assert error < (0.05 if bits == 8 else 0.5)  # int4 of random normal weights is coarse
  # the dequantized float model computes the same weights with float activations
  dense = forward(dequantize_model(stacked), tokens, zeros).logits
  assert float(jnp.abs(dense - a).max()) < 0.05 * float(jnp.abs(exact).max())


def test_orbax_round_trip(target, tmp_path):
  untied = sj.init_params(tiny_config(vocab_size=96, tie_embeddings=False), jax.random.key(5))
  for i, model in enumerate((sj.quantize(target, 4), sj.quantize(untied.for_platform("cpu"), 8),
                             sj.quantize(target, 8, 32, embeddings=False))):
    save(model, tmp_path / str(i))
    restored = load(tmp_path / str(i))
    ref = model.stacked()
    chex.assert_trees_all_equal_dtypes(restored, ref)  # structure and dtypes
    chex.assert_trees_all_equal(restored, ref)
    tokens = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    np.testing.assert_allclose(forward(restored, tokens, jnp.zeros(1, jnp.int32)).logits,
                               forward(ref, tokens, jnp.zeros(1, jnp.int32)).logits, rtol=1e-6)


def test_quantized_leaves_shard_like_the_float_weights(target):
  from specjax.parallel.mesh import param_specs
  mesh = sj.make_mesh((2, 4))
  floats, quants = param_specs(target, mesh), param_specs(sj.quantize(target, 8), mesh)
  for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
    want = tuple(floats["layers"][name])
    got = tuple(quants["layers"][name].values)
    assert got == want[:1] + want[1:][::-1], name  # stored [L, out, in]
  assert tuple(quants["embed"].values) == tuple(floats["embed"])  # [V, E] both


@pytest.mark.parametrize("settings", [dict(bits=4), dict(bits=4, asymmetric=True, embed_bits=8)],
                         ids=["int4", "int4-asymmetric"])
@pytest.mark.parametrize("shape", [(1, 8), (2, 4)], ids=str)
def test_decode_with_a_quantized_drafter_exports_for_tpu(target, shape, settings):
  mesh = sj.make_mesh(shape)
  tokens = jnp.array([[5, 9, 2, 7, 1, 3]] * 4 + [[3, 8, 4, 0, 0, 0]] * 4, jnp.int32)
  lengths = jnp.array([6] * 4 + [3] * 4, jnp.int32)
  model = sj.shard(target, mesh)
  drafter = sj.self_drafter(target, **settings)
  drafter = type(drafter)(sj.shard(drafter.model, mesh))

  def run(target, drafter, tokens, lengths, rng):
    return sj.decode(target, drafter, tokens, rng, lengths=lengths, max_new_tokens=8,
                     num_draft=3, sampling=sj.Sampling(temperature=0.7, top_k=20)).tokens

  with jax.set_mesh(mesh):
    text = jax.export.export(jax.jit(run), platforms=["tpu"])(
        model, drafter, tokens, lengths, jax.random.key(3)).mlir_module()
  assert "specjax_cpu" not in text and "tpu_custom_call" in text  # the verify kernel, no CPU call
  assert "ui8" in text  # the int4 nibbles travel packed


# ------------------------------------------------------------------------------------------------
# Self-drafting is exact


@pytest.mark.costly
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("layout", ["stacked", "cpu"])
def test_greedy_self_draft_equals_generate(target, bits, layout):
  model = target if layout == "stacked" else target.for_platform("cpu")
  tokens = jnp.array([[5, 9, 2, 7, 1, 3, 8], [3, 8, 4, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0]],
                     jnp.int32)
  lengths = jnp.array([7, 3, 2], jnp.int32)
  key = jax.random.key(0)
  want = sj.generate(model, tokens, key, lengths=lengths, max_new_tokens=24)
  drafter = sj.self_drafter(model, bits=bits)
  for k in (2, 5):
    out = sj.decode(model, drafter, tokens, key, lengths=lengths, max_new_tokens=24, num_draft=k)
    np.testing.assert_array_equal(out.tokens, want.tokens)
    assert out.stats.summary()["accepted"] > 0


@pytest.mark.parametrize("layout", ["stacked", "cpu"])
def test_a_self_draft_starts_from_the_targets_prompt_cache(target, layout):
  model = target if layout == "stacked" else target.for_platform("cpu")
  tokens = jnp.array([[5, 9, 2, 7, 1, 3, 8], [3, 8, 4, 0, 0, 0, 0]], jnp.int32)
  lengths = jnp.array([7, 3], jnp.int32)
  prefill = model(tokens, jnp.zeros(2, jnp.int32), model.init_cache(2, 16))
  shared = sj.self_drafter(model, 8)
  assert shared.share_prompt
  cache = shared.init(tokens, lengths, 16, prefill)
  for mine, its in zip(jax.tree.leaves((cache.k, cache.v)),
                       jax.tree.leaves((prefill.cache.k, prefill.cache.v))):
    np.testing.assert_array_equal(mine, its)  # the target's keys and values, not recomputed
  np.testing.assert_array_equal(cache.lengths, lengths - 1)
  # Without sharing (or without a prefill) the copy runs its own: different keys (quantized).
  own = dataclasses.replace(shared, share_prompt=False).init(tokens, lengths, 16, prefill)
  assert not np.array_equal(np.asarray(jax.tree.leaves(own.k)[0]),
                            np.asarray(jax.tree.leaves(cache.k)[0]))
  fallback = shared.init(tokens, lengths, 16, None)
  np.testing.assert_array_equal(jax.tree.leaves(fallback.k)[0], jax.tree.leaves(own.k)[0])
  # A draft model of another shape cannot share the target's cache: it runs its own prefill.
  other = sj.init_params(tiny_config(vocab_size=96, num_layers=1), jax.random.key(8))
  small = sj.ModelDrafter(other, share_prompt=True).init(tokens, lengths, 16, prefill)
  assert jax.tree.leaves(small.k)[0].shape != jax.tree.leaves(prefill.cache.k)[0].shape


@pytest.mark.costly
def test_a_self_draft_streams_and_calibrates_with_donated_state(target):
  # The shared prompt cache is a copy: the loop state's two caches are separate buffers, so the
  # stream (state donated every round) and the calibration (draft state donated) run.
  from specjax.tuning.calibrate import measure_costs
  tokens = jnp.array([[5, 9, 2, 7, 1, 3, 8], [3, 8, 4, 0, 0, 0, 0]], jnp.int32)
  lengths = jnp.array([7, 3], jnp.int32)
  drafter = sj.self_drafter(target, 8)
  want = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12)
  rows = [[], []]
  for new, _ in sj.decode_stream(target, drafter, tokens, jax.random.key(0), lengths=lengths,
                                 max_new_tokens=12, num_draft=3):
    for b in range(2):
      rows[b].extend(np.asarray(new[b]).tolist())
  np.testing.assert_array_equal(np.asarray(rows), want.tokens)
  table = measure_costs(target, drafter, batch=2, max_width=3, context=8, repeats=1)
  # It ran (a timing's size is not a test: a tiny model's draft step can measure as 0 on a busy
  # host).
  assert len(table.verify_ms) == 3 and table.draft_step_ms >= 0


@pytest.fixture(scope="module")
def small_target():
  from tests.exactness.test_exactness import VOCAB
  return sj.init_params(tiny_config(vocab_size=VOCAB), jax.random.key(10))  # test_exactness's


def _told_the_float_q(target_logits, draft_logits, draft_tokens, **kwargs):
  """The broken variant: drafts come from the int4 copy, but the verify is told q = the float
  target's own distribution (a self-drafter that reports its source's logits)."""
  from specjax.verify.rule import verify_reference
  k = draft_tokens.shape[1]
  return verify_reference(target_logits, target_logits[:, :k], draft_tokens, **kwargs)


# T = 1 by default; the warped settings are `slow`: CI's slow step runs the int4 self-drafter
# through the exactness harness at T = 0.7 with top-k / top-p, with this broken variant.
@pytest.mark.costly
@pytest.mark.parametrize("name", ["t1", pytest.param("t0.7_topk3", marks=pytest.mark.slow),
                                  pytest.param("t0.9_topp0.8", marks=pytest.mark.slow)])
def test_sampled_self_draft_matches_the_target_distribution(small_target, name):
  sampling = SETTINGS[name]
  tokens, stats = run_decode(small_target, sj.self_drafter(small_target, bits=4), sampling)
  assert 0.05 < stats.summary()["acceptance_rate"] < 0.999
  assert chi_square_pvalue(tokens, exact_joint(small_target, sampling)) > ALPHA


@pytest.mark.costly
@pytest.mark.parametrize("name", ["t1", pytest.param("t0.7_topk3", marks=pytest.mark.slow)])
def test_a_self_draft_verified_with_the_float_q_is_rejected(small_target, name):
  sampling = SETTINGS[name]
  tokens, _ = run_decode(small_target, sj.self_drafter(small_target, bits=4), sampling,
                         verify_impl=_told_the_float_q)
  assert chi_square_pvalue(tokens, exact_joint(small_target, sampling)) < POWER_ALPHA


# ------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("kwargs,message", [
    (dict(bits=3), "bits must be one of"),
    (dict(bits=8, group=16), "positive multiple of 32"),
    (dict(bits=8, group=48), "positive multiple of 32"),
    (dict(bits=4, group=0), "positive multiple of 32"),
    (dict(bits=8, group=64), "does not divide"),
])
def test_bad_settings_raise(target, kwargs, message):
  # tiny_config: embed_dim 32, so a group of 64 divides nothing along it
  with pytest.raises(ValueError, match=message):
    sj.quantize(target, **kwargs)


def test_bad_weights_and_models_raise(target):
  with pytest.raises(ValueError, match="does not divide the weight's input size 96"):
    quant.quantize_weight(np.ones((4, 96), np.float32), 8, 64)
  with pytest.raises(ValueError, match="needs a matrix"):
    quant.quantize_weight(np.ones(64, np.float32))
  with pytest.raises(ValueError, match="already quantized"):
    sj.quantize(sj.quantize(target, 8), 4)
  with pytest.raises(ValueError, match="needs a specjax.Model"):
    sj.quantize({"embed": np.ones((4, 32))}, 8)
  w = quant.quantize_weight(np.ones((8, 64), np.float32), 8)
  with pytest.raises(ValueError, match="input size 64"):
    w.matmul(jnp.ones((1, 32)))


def test_an_unknown_pair_name_lists_the_known_ones():
  with pytest.raises(ValueError, match="unknown pair 'nope'; known: smollm2-int8"):
    sj.load_pair("nope")
  assert {"smollm2-int8", "smollm2-head", "qwen2.5-coder"} <= set(PAIRS)


@pytest.mark.costly
def test_the_self_drafts_default_group_is_64_for_int8_where_it_divides():
  from specjax.drafters.model import default_group
  wide = tiny_config(vocab_size=96, embed_dim=64, mlp_dim=128, num_heads=4, head_dim=16)
  model = sj.init_params(wide, jax.random.key(5))
  assert default_group(model, 8) == 64
  assert default_group(model, 4) == 32
  narrow = sj.init_params(tiny_config(vocab_size=96, embed_dim=96), jax.random.key(5))
  assert default_group(narrow, 8) == 32  # 96 = 1.5 groups of 64
  drafter = sj.self_drafter(model)
  groups = {w.group for w in jax.tree.leaves(drafter.model.params, is_leaf=quant.is_quantized)
            if quant.is_quantized(w)}
  assert groups == {64}
  assert {w.group for w in jax.tree.leaves(sj.self_drafter(model, 8, 32).model.params,
                                           is_leaf=quant.is_quantized)
          if quant.is_quantized(w)} == {32}
  tokens = jnp.array([[5, 9, 2, 7, 1, 3, 8], [3, 8, 4, 0, 0, 0, 0]], jnp.int32)
  lengths = jnp.array([7, 3], jnp.int32)
  key = jax.random.key(0)
  want = sj.generate(model, tokens, key, lengths=lengths, max_new_tokens=16)
  out = sj.decode(model, drafter, tokens, key, lengths=lengths, max_new_tokens=16, num_draft=4)
  np.testing.assert_array_equal(out.tokens, want.tokens)
