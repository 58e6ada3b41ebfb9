"""The panel layout of CPU float32 weights (`specjax.models.cpu.panels`) and the kernel that reads
it (`specjax_cpu_panel_gemv`): packing is exact, the product equals float64 numpy for every block
size (1..8 rows, a prompt of many blocks), output sizes that leave a partial panel or vector, and
input sizes of any length; it composes with vmap / grad; bad shapes fail before compiling; a model
in panels gives the row-major layout's tokens."""

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.kernels.cpu import kernel
from specjax.models.cpu import layout as cpu_layout
from specjax.models.cpu import panels
from specjax.testing.models import tiny_config

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the kernel is written for x86-64 (AVX2 + FMA)")

# (out, in): a partial last panel (out % 48), a partial vector within it (out % 16), fewer outputs
# than one panel, input sizes with no multiple of 16 and one past the kernel's 256-column chunk.
PANEL_SHAPES = [(100, 64), (48, 32), (17, 40), (5, 16), (2048, 1536), (97, 200), (250, 8960),
                (1, 1), (49, 300)]


def _check(y, x, w):
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  ref = x64 @ w64.T
  # float32 products summed in another order: error ~ eps * sqrt(n) * |x| |w|
  scale = np.abs(x64) @ np.abs(w64).T
  np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - ref), 1e-6 * scale + 1e-30)


def test_packing_is_exact_and_pads_with_zeros():
  rng = np.random.default_rng(0)
  for out, n in PANEL_SHAPES:
    w = rng.standard_normal((out, n)).astype(np.float32)
    p = panels.pack(w)
    assert p.panels.shape == (-(-out // 48), n, 48) and p.shape == (out, n) and p.out == out
    np.testing.assert_array_equal(np.asarray(p.dense()), w)
    # panels[g, i, j] = w[48 g + j, i], and zero past `out`
    g, j = divmod(out - 1, 48)
    np.testing.assert_array_equal(np.asarray(p.panels[g, :, j]), w[out - 1])
    assert not np.asarray(p.panels[g, :, j + 1:]).any()
  # a transposed view packs like its copy (the CPU layout packs `[in, out].T`)
  w = rng.standard_normal((64, 100)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(panels.pack(w.T).panels),
                                np.asarray(panels.pack(w.T.copy()).panels))


def _check_panel_products():
  """Every block size (1..9 rows: eight and one; 20 and 67: several blocks of a prompt) against
  float64 numpy, and the jnp reference against the same."""
  rng = np.random.default_rng(1)
  product = jax.jit(lambda x, p: p.matmul(x))
  for out, n in PANEL_SHAPES:
    w = rng.standard_normal((out, n)).astype(np.float32)
    p = panels.pack(w)
    for rows in (*range(1, 10), 20, 67):
      x = rng.standard_normal((1, rows, n)).astype(np.float32)
      _check(product(jnp.asarray(x), p), x, w)
    _check(panels.reference(jnp.asarray(x), p.panels, out), x, w)


def test_every_block_size_equals_the_float64_product():
  _check_panel_products()


def test_the_product_lowers_to_the_kernel_on_cpu_only():
  p = panels.pack(np.ones((100, 64), np.float32))
  x = jnp.ones((3, 64), jnp.float32)
  lowered = jax.jit(lambda x, p: p.matmul(x)).lower(x, p)
  assert kernel.PANEL_TARGET in lowered.as_text()
  exported = jax.export.export(jax.jit(lambda x, p: p.matmul(x)), platforms=["tpu"])(x, p)
  assert kernel.PANEL_TARGET not in exported.mlir_module()
  assert kernel.PANEL_TARGET not in jax.jit(lambda x, p: p.matmul(x, kernel=False)).lower(
      x, p).as_text()


def test_vmap_and_grad_agree_with_the_reference():
  rng = np.random.default_rng(2)
  w = rng.standard_normal((80, 48)).astype(np.float32)
  p = panels.pack(w)
  xs = jnp.asarray(rng.standard_normal((5, 2, 48)).astype(np.float32))
  np.testing.assert_allclose(jax.vmap(lambda x: p.matmul(x))(xs), xs @ w.T, rtol=1e-5,
                             atol=1e-5)
  loss = lambda x, q: jnp.sum(jnp.sin(q.matmul(x)))
  dense = lambda x, w: jnp.sum(jnp.sin(x @ w.T))
  np.testing.assert_allclose(jax.grad(loss)(xs[0], p), jax.grad(dense)(xs[0], w), rtol=1e-4,
                             atol=1e-5)
  grad_panels = jax.grad(loss, 1)(xs[0], p)
  np.testing.assert_allclose(grad_panels.dense(), jax.grad(dense, 1)(xs[0], jnp.asarray(w)),
                             rtol=1e-4, atol=1e-5)


def test_bad_shapes_fail_with_a_clear_error():
  with pytest.raises(ValueError, match="2-D"):
    panels.pack(np.ones((2, 3, 4), np.float32))
  p = panels.pack(np.ones((100, 64), np.float32))
  with pytest.raises(ValueError, match="input size 64"):
    p.matmul(jnp.ones((1, 63)))
  # the kernel's own check: panels that do not match `out` (built and registered first: this
  # test may be the first of its process to reach the kernel)
  assert kernel.available(), kernel.status()[1]
  bad = jax.ffi.ffi_call(kernel.PANEL_TARGET, jax.ShapeDtypeStruct((1, 200), jnp.float32))
  with pytest.raises(Exception, match="ceil"):
    jax.block_until_ready(bad(jnp.ones((1, 64)), p.panels, out=np.int64(200)))


@pytest.mark.parametrize("tied", [False, True])
def test_a_model_in_panels_gives_the_row_major_layouts_tokens(tied):
  """Greedy tokens of plain and speculative decoding: canonical, row-major CPU layout, panels;
  splitting gives back the canonical weights exactly. A tied model's embedding goes into panels
  too (lookups and the output projection); an untied one's embedding stays `[V, E]` and its
  output projection (`[E, V]`) goes into panels of `[V, E]`; the quantized copy, a draft vocabulary
  (with the recent tokens' rows) and a head's view of the output projection see the same
  matrix."""
  config = tiny_config(vocab_size=97, embed_dim=64, mlp_dim=160, num_heads=4, num_kv_heads=2,
                       tie_embeddings=tied)
  stacked = sj.init_params(config, jax.random.key(3))
  unstacked = stacked.unstacked()
  in_panels = unstacked.with_fused_projections(cpu_kernel=True)
  rows = unstacked.with_fused_projections(cpu_kernel=False)
  assert panels.is_panels(in_panels.params["layers"][0]["w_gate_up_t"])
  assert not panels.is_panels(rows.params["layers"][0]["w_gate_up_t"])
  assert panels.is_panels(in_panels.params["embed"]) == tied
  assert not panels.is_panels(rows.params["embed"])
  assert panels.is_panels(in_panels.params.get("lm_head")) == (not tied)
  assert not panels.is_panels(rows.params.get("lm_head"))
  for model in (in_panels, in_panels.stacked().unstacked()):
    canonical = model.without_fused_projections().params
    np.testing.assert_array_equal(np.asarray(canonical["embed"]),
                                  np.asarray(unstacked.params["embed"]))
    assert ("lm_head" in canonical) == (not tied)
    if not tied:  # back to `[E, V]`, exactly
      np.testing.assert_array_equal(np.asarray(canonical["lm_head"]),
                                    np.asarray(unstacked.params["lm_head"]))
    for lp, want in zip(canonical["layers"], unstacked.params["layers"]):
      for name, value in lp.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want[name]))
  ids = jnp.asarray([[0, 47, 48, 96], [95, 1, 49, 3]])
  np.testing.assert_array_equal(in_panels.params["embed"][ids],
                                np.asarray(unstacked.params["embed"])[np.asarray(ids)])
  prompts = jnp.asarray(np.random.default_rng(4).integers(1, 97, (2, 7)), jnp.int32)
  key = jax.random.key(0)
  want = sj.generate(stacked, prompts, key, max_new_tokens=12).tokens
  for model in (in_panels, rows, in_panels.with_output_copy()):
    np.testing.assert_array_equal(sj.generate(model, prompts, key, max_new_tokens=12).tokens,
                                  want)
  from specjax.drafters.eagle.network import target_output_head
  from specjax.drafters.model import ModelDrafter, restrict_output, with_draft_vocab
  np.testing.assert_array_equal(np.asarray(target_output_head(in_panels)),
                                np.asarray(target_output_head(unstacked)))  # `[E, V]` both
  vocab = np.arange(0, 97, 2)
  restricted, _ = restrict_output(in_panels, vocab)
  canonical_restricted, _ = restrict_output(unstacked, vocab)
  np.testing.assert_array_equal(np.asarray(restricted.params["lm_head"]),
                                np.asarray(canonical_restricted.params["lm_head"]))  # [E, N]
  with pytest.raises(ValueError, match="already restricted"):
    restrict_output(restricted, vocab[:4])
  # The quantized copy quantizes the same `[V, E]` matrix from panels as from `[E, V]`.
  for name in ("embed", "lm_head"):
    if name in unstacked.params:
      a = sj.quantize(in_panels, 8, 32).params[name]
      b = sj.quantize(unstacked, 8, 32).params[name]
      np.testing.assert_array_equal(np.asarray(a.values), np.asarray(b.values))
      np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
  drafters = [sj.self_drafter(in_panels, 8, 32),  # a draft vocabulary: rows of the output head
              sj.self_drafter(in_panels, 8, 32, vocab=vocab),
              with_draft_vocab(ModelDrafter(in_panels), vocab, context=5)]
  for drafter in drafters:
    spec = sj.decode(in_panels, drafter, prompts, key, max_new_tokens=12, num_draft=3)
    np.testing.assert_array_equal(spec.tokens, want)
  # layers quantized, the embedding kept: still panels, read by the same kernel
  layers_only = sj.quantize(in_panels, 8, 32, embeddings=False)
  assert panels.is_panels(layers_only.params["embed"]) == tied
  assert sj.generate(layers_only, prompts, key, max_new_tokens=4).tokens.shape == (2, 4)


@pytest.mark.parametrize("tied", [True, False])
def test_the_cpu_layout_builds_inside_jit_from_traced_weights(tied):
  # An RL step builds its policy's CPU layout from the traced weights: the same panels (packed in
  # jnp), the same logits, as the layout built at load from concrete ones.
  model = sj.init_params(tiny_config(vocab_size=100, tie_embeddings=tied), jax.random.key(3))
  for out, n in PANEL_SHAPES[:4]:
    w = np.random.default_rng(out).standard_normal((out, n)).astype(np.float32)
    traced = jax.jit(lambda w: panels.pack(w).panels)(w)
    np.testing.assert_array_equal(traced, panels.pack(w).panels)
  tokens = jnp.array([[5, 9, 2, 7, 1], [3, 8, 4, 0, 0]], jnp.int32)
  starts = jnp.zeros((2,), jnp.int32)
  concrete = model.for_platform("cpu")
  inside = jax.jit(lambda m: m.for_platform("cpu")(tokens, starts).logits)(model)
  np.testing.assert_allclose(inside, concrete(tokens, starts).logits, atol=1e-5)
