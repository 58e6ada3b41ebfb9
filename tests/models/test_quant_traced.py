"""`quantize` / `self_drafter` on traced weights: a policy's quantized copy built inside the caller's
own `jax.jit` (a training-eval or RL step) and decoded with there.

* The arithmetic: `quantize_weight` (pure `jax.numpy`), and its path for a canonical `[in, out]`
  weight (quantized as its transpose, with no float transpose), give, on CPU, the integers, scales
  and offsets of the same float32 arithmetic in numpy (`numpy_quantize_weight` below, the reference:
  IEEE division, round half to even), bit for bit, on concrete and on traced weights, at 8, 4
  and asymmetric 4 bits and several group sizes; so does a whole model's `quantize`, stacked,
  unstacked and in the CPU layout, inside and outside `jax.jit`.
* The check has teeth: a 4-bit copy is told from an 8-bit one, and the same jnp arithmetic with
  XLA's plain division (which XLA turns into a product with the reciprocal) from the reference.
* `sj.self_drafter(policy, bits)` built inside a jitted step decodes as the one built outside:
  same tokens and acceptance, and greedy, the tokens of `sj.generate`.
* TPU: the jitted step (self-drafter built inside, sampled decode) compiles for one v5e chip at
  Qwen2.5-Coder-1.5B's widths (2 layers, bfloat16) with libtpu's compiler, ahead of time.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import with_draft_vocab
from specjax.models import quant
from specjax.testing.models import tiny_config


def numpy_quantize_weight(w, bits: int, group: int, asymmetric: bool = False):
  """`(values, scales, offsets or None)`: the quantization in float32 numpy, the reference."""
  w = np.asarray(w, np.float32)
  top = 2 ** (bits - 1) - 1
  grouped = w.reshape(w.shape[:-1] + (w.shape[-1] // group, group))
  offsets = None
  if asymmetric:
    low, high = grouped.min(axis=-1), grouped.max(axis=-1)
    scales = (high - low) / np.float32(15)
    safe = np.where(scales > 0, scales, np.float32(1))
    q = np.clip(np.rint((grouped - low[..., None]) / safe[..., None]), 0, 15) - 8
    q = q.astype(np.int32).reshape(w.shape)
    offsets = (low + np.float32(8) * scales).astype(np.float32)
  else:
    scales = np.abs(grouped).max(axis=-1) / np.float32(top)
    safe = np.where(scales > 0, scales, np.float32(1))
    q = np.clip(np.rint(grouped / safe[..., None]), -top, top).astype(np.int32).reshape(w.shape)
  if bits == 8:
    values = q.astype(np.int8)
  else:
    runs = (q + 8).astype(np.uint8).reshape(w.shape[:-1] + (w.shape[-1] // 32, 2, 16))
    values = (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(w.shape[:-1] + (w.shape[-1] // 2,))
  assert scales.dtype == np.float32
  return values, scales, offsets


def differences(a, b) -> list[str]:
  """Where two trees of weights (float arrays and `QuantizedWeight`s, or `(values, scales,
  offsets)` tuples) differ, bit for bit: structure, settings, shapes, dtypes, values. Empty when
  they are identical."""
  is_leaf = quant.is_quantized
  a_leaves, a_tree = jax.tree.flatten_with_path(a, is_leaf=is_leaf)
  b_leaves, b_tree = jax.tree.flatten_with_path(b, is_leaf=is_leaf)
  if a_tree != b_tree:
    return [f"tree structure: {a_tree} != {b_tree}"]
  found = []
  for (path, x), (_, y) in zip(a_leaves, b_leaves):
    name = jax.tree_util.keystr(path)
    if quant.is_quantized(x) or quant.is_quantized(y):
      if not (quant.is_quantized(x) and quant.is_quantized(y)):
        found.append(f"{name}: quantized on one side only")
        continue
      if (x.bits, x.group, x.asymmetric) != (y.bits, y.group, y.asymmetric):
        found.append(f"{name}: settings {(x.bits, x.group, x.asymmetric)} != "
                     f"{(y.bits, y.group, y.asymmetric)}")
        continue
      found += differences((x.values, x.scales, x.offsets), (y.values, y.scales, y.offsets))
      continue
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or x.dtype != y.dtype:
      found.append(f"{name}: {x.dtype}{x.shape} != {y.dtype}{y.shape}")
    elif x.tobytes() != y.tobytes():  # bitwise: -0.0 differs from 0.0
      found.append(f"{name}: {np.sum(x != y)} of {x.size} elements differ")
  return found


def weights(shape, seed: int = 0, dtype=np.float32) -> np.ndarray:
  """Random weights over a wide range of magnitudes, with the cases rounding is decided on: an
  all-zero group, a constant group (asymmetric scale 0), rows whose quotients fall on exact halves
  (ties, rounded to even) at 8, 4 and asymmetric 4 bits, and a group holding one large weight."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(shape).astype(np.float32)
  w *= np.exp(rng.uniform(-8, 8, shape[:-1] + (1,))).astype(np.float32)
  flat = w.reshape(-1, shape[-1])
  flat[0, :32] = 0.0
  flat[1, :32] = 0.37
  flat[2, :] = rng.integers(-14, 15, shape[-1])  # int4: scale 14 / 7 = 2, odd weights tie
  flat[2, ::32] = 14
  flat[3, :] = rng.integers(-254, 255, shape[-1]) / 2  # int8: scale 127 / 127 = 1
  flat[3, ::32] = 127
  flat[4, :] = rng.integers(-15, 16, shape[-1]) / 2  # asymmetric: scale 15 / 15 = 1 from -7.5
  flat[4, ::32], flat[4, 1::32] = -7.5, 7.5
  flat[5, :32] = 1e-3
  flat[5, 5] = 1e3
  return w.astype(dtype)


SETTINGS = [(8, 32, False), (8, 64, False), (8, 128, False), (4, 32, False), (4, 64, False),
            (4, 32, True), (4, 128, True)]


@pytest.mark.parametrize("bits,group,asymmetric", SETTINGS)
def test_quantize_weight_is_numpys_arithmetic_bit_for_bit_concrete_and_traced(bits, group,
                                                                              asymmetric):
  w = weights((3, 1024, 256), seed=bits + group)  # a stacked [L, out, in] weight, ~790k weights
  want = numpy_quantize_weight(w, bits, group, asymmetric)
  concrete = quant.quantize_weight(w, bits, group, asymmetric=asymmetric)
  traced = jax.jit(lambda x: quant.quantize_weight(x, bits, group, asymmetric=asymmetric))(w)
  got = lambda q: (q.values, q.scales, q.offsets)
  assert differences(got(concrete), want) == []
  assert differences(got(traced), want) == []
  # one matrix of the stack, and inside a larger program (a transpose and a cast fused before it)
  assert differences(got(quant.quantize_weight(w[1], bits, group, asymmetric=asymmetric)),
                     numpy_quantize_weight(w[1], bits, group, asymmetric)) == []
  fused = jax.jit(lambda x: quant.quantize_weight(jnp.swapaxes(x, -1, -2) * 1.0, bits, group,
                                                  asymmetric=asymmetric))(np.swapaxes(w, -1, -2))
  assert differences(got(fused), want) == []
  # a canonical `[in, out]` weight, quantized as its transpose without a float transpose (what
  # `quantize` does to a model's canonical matrices), concrete and traced
  columns = np.ascontiguousarray(np.swapaxes(w, -1, -2))
  assert differences(got(quant._quantize_columns(columns, bits, group, asymmetric)), want) == []
  assert differences(got(jax.jit(lambda x: quant._quantize_columns(x, bits, group, asymmetric))(
      columns)), want) == []


@pytest.mark.parametrize("bits,asymmetric", [(8, False), (4, False), (4, True)])
def test_bfloat16_weights_quantize_as_their_float32_values(bits, asymmetric):
  w = jnp.asarray(weights((256, 128), seed=3)).astype(jnp.bfloat16)
  want = numpy_quantize_weight(np.asarray(w.astype(jnp.float32)), bits, 32, asymmetric)
  traced = jax.jit(lambda x: quant.quantize_weight(x, bits, 32, asymmetric=asymmetric))(w)
  assert differences((traced.values, traced.scales, traced.offsets), want) == []


def test_the_check_tells_a_different_copy_apart(monkeypatch):
  """The equality check has teeth: a 4-bit copy is not an 8-bit one, and the same jnp arithmetic
  with XLA's plain division (a product with the reciprocal after XLA's simplifier) is not the
  reference either."""
  w = weights((512, 256), seed=7)
  eight = quant.quantize_weight(w, 8, 32)
  four = quant.quantize_weight(w, 4, 32)
  assert differences(eight, four)
  assert differences((four.values, four.scales, four.offsets), numpy_quantize_weight(w, 8, 32))
  one_off = dataclasses.replace(eight, values=eight.values.at[9, 9].add(1))
  assert differences(eight, one_off) == ["[0]: 1 of 131072 elements differ"]
  naive = jax.jit(quant._quantize_arrays.__wrapped__, static_argnames=("bits", "group",
                                                                       "asymmetric"))
  monkeypatch.setattr(quant, "_divide", lambda a, b: a / b)
  plain = naive(jnp.asarray(w), bits=8, group=32, asymmetric=False)
  assert differences(plain, numpy_quantize_weight(w, 8, 32)), (
      "XLA divided by a broadcast exactly: `_divide`'s barrier may no longer be needed")


@pytest.fixture(scope="module")
def policy():  # tied; 64 wide, so `self_drafter`'s default int8 group is 64
  return sj.init_params(tiny_config(embed_dim=64, head_dim=16, mlp_dim=128, tie_embeddings=True),
                       jax.random.key(1))


@pytest.fixture(scope="module")
def untied_policy():
  return sj.init_params(tiny_config(vocab_size=96, embed_dim=128, head_dim=32, mlp_dim=256,
                                    tie_embeddings=False, qkv_bias=True), jax.random.key(2))


QUANTIZE = [dict(bits=8, group=32), dict(bits=8, group=64), dict(bits=4, group=32),
            dict(bits=4, group=64, asymmetric=True), dict(bits=4, group=32, embed_bits=8)]
LAYOUTS = {"stacked": lambda m: m, "unstacked": lambda m: m.unstacked(),
           "cpu": lambda m: m.for_platform("cpu")}


@pytest.mark.parametrize("layout", ["stacked", "unstacked", "cpu"])
@pytest.mark.parametrize("kwargs", QUANTIZE, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_quantize_a_model_inside_jit_equals_outside(policy, untied_policy, layout, kwargs):
  for target in (policy, untied_policy):
    model = LAYOUTS[layout](target)
    outside = sj.quantize(model, **kwargs)
    inside = jax.jit(lambda m: sj.quantize(m, **kwargs))(model)
    assert inside.config == outside.config and inside.cpu_kernel == outside.cpu_kernel
    assert differences(inside.params, outside.params) == []
    assert quant.quantization_of(inside) == quant.quantization_of(outside)
  # and a stacked model's every quantized matrix is the numpy reference's
  if layout == "stacked":
    q = sj.quantize(untied_policy, **kwargs)
    bits, group = kwargs["bits"], kwargs["group"]
    asym = kwargs.get("asymmetric", False)
    embed_bits = kwargs.get("embed_bits", bits)
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
      w = np.swapaxes(np.asarray(untied_policy.params["layers"][name]), -1, -2)
      got = q.params["layers"][name]
      assert differences((got.values, got.scales, got.offsets),
                         numpy_quantize_weight(w, bits, group, asym)) == [], name
    for name, w in (("embed", untied_policy.params["embed"]),
                    ("lm_head", np.asarray(untied_policy.params["lm_head"]).T)):
      got = q.params[name]
      assert differences((got.values, got.scales, got.offsets), numpy_quantize_weight(
          w, embed_bits, group, asym and embed_bits == 4)) == [], name


def test_a_traced_model_is_validated_by_shape_before_compiling(policy):
  """Bad settings raise the same ValueError inside jit as outside (no weight value is read)."""
  for kwargs, match in ((dict(bits=3), "bits"), (dict(bits=8, group=48), "group"),
                        (dict(bits=8, asymmetric=True), "asymmetric")):
    with pytest.raises(ValueError, match=match):
      jax.jit(lambda m: sj.quantize(m, **kwargs))(policy)
  already = sj.quantize(policy, 8)
  with pytest.raises(ValueError, match="already quantized"):
    jax.jit(lambda m: sj.quantize(m, 8))(already)


TOKENS = np.array([[5, 9, 2, 7, 1, 3, 8], [3, 8, 4, 0, 0, 0, 0]], np.int32)
LENGTHS = np.array([7, 3], np.int32)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_self_drafter_built_inside_jit_decodes_as_one_built_outside(policy, bits):
  tokens, lengths, key = jnp.asarray(TOKENS), jnp.asarray(LENGTHS), jax.random.key(0)
  kwargs = dict(lengths=lengths, max_new_tokens=16, num_draft=4)

  @jax.jit
  def step(model, tokens, lengths, key):  # the policy's copy of the current weights, in the step
    drafter = sj.self_drafter(model, bits=bits)
    out = sj.decode(model, drafter, tokens, key, lengths=lengths, max_new_tokens=16, num_draft=4)
    return out, drafter.model.params

  inside, inside_params = step(policy, tokens, lengths, key)
  drafter = sj.self_drafter(policy, bits=bits)
  assert differences(inside_params, drafter.model.params) == []
  outside = sj.decode(policy, drafter, tokens, key, **kwargs)
  want = sj.generate(policy, tokens, key, lengths=lengths, max_new_tokens=16)
  np.testing.assert_array_equal(inside.tokens, outside.tokens)
  np.testing.assert_array_equal(inside.tokens, want.tokens)  # greedy: the target's own tokens
  assert differences(inside.stats, outside.stats) == []  # the same drafts accepted
  assert outside.stats.summary()["accepted"] > 0


@pytest.mark.parametrize("tied", [True, False])
def test_a_self_drafter_over_a_draft_vocabulary_builds_inside_jit(policy, untied_policy, tied):
  """`vocab=` (host ids) with traced weights: the restricted copy is the one built outside."""
  model, vocab = (policy, np.arange(0, 64, 3)) if tied else (untied_policy, np.arange(0, 96, 2))
  context = 2 if tied else 0  # context rows come from a tied model's embedding
  build = lambda m: sj.self_drafter(m, bits=4, vocab=vocab, context=context)
  inside, outside = jax.jit(build)(model), build(model)
  assert inside.context_vocab == outside.context_vocab == context
  assert differences((inside.model.params, inside.draft_ids, inside.context_head),
                     (outside.model.params, outside.draft_ids, outside.context_head)) == []
  # and a float drafter restricted inside jit (`with_draft_vocab`: the float rows, transposed)
  restrict = lambda m: with_draft_vocab(sj.ModelDrafter(m), vocab, context=context)
  assert differences(jax.jit(restrict)(model).model.params, restrict(model).model.params) == []


# `slow` for CI's time (90-minute budget on 2 cores; 89 s on a 2-core host): the TPU compile
# tier compiles the int8 / int4 / q4 self-drafts built inside the jitted call on one v5e chip.
@pytest.mark.slow
def test_the_jitted_self_draft_step_compiles_for_one_v5e_chip():
  pytest.importorskip("libtpu")
  from specjax.testing import tpu

  mesh = tpu.topology_mesh("v5e-1")
  config = tpu.with_layers(tpu.REAL_CONFIGS["qwen2.5-coder-1.5b"], 2)
  target = tpu.abstract_model(config, mesh, jnp.bfloat16)
  tokens, rng = tpu.abstract_tokens(mesh, 1, 64)
  sampling = sj.Sampling(temperature=0.7, top_k=50, top_p=0.9)

  def step(t, tokens, rng):
    return sj.decode(t, sj.self_drafter(t, bits=8), tokens, rng, max_new_tokens=32, num_draft=4,
                     sampling=sampling).tokens

  compiled = tpu.compile_call(step, target, tokens, rng, mesh=mesh)
  text = compiled.text()
  assert "tpu_custom_call" in text  # the Pallas verify kernel, compiled by Mosaic
  assert compiled.total_bytes < 16 << 30  # within one v5e chip's HBM
