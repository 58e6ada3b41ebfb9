"""One model body for every layout: `forward` has no layout branches, and the same weights in each
layout give the same logits through it.

* Behaviour: one model's float weights stacked, unstacked, in the CPU layout row-major (XLA's dot,
  and the kernel's row-major product) and in panels (the kernel where it is built), with a tied and
  an untied output projection, give the stacked model's logits (float32, up to summation order)
  for a prompt, a decode step and a verify block over the cache; its int8 copy gives the same
  logits stacked and in the CPU layout (the same integers). `Ops.matmul` gives one product for
  each leaf type of one matrix.
* Structure: `forward`'s source names no leaf type, layout test or kernel switch
  (`layout_branches`), and the check finds one planted in a copy of that source (its power). The
  attention reference lives in `specjax.models.layers`, not in the CPU kernel module.
"""

import dataclasses
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.kernels.cpu import kernel
from specjax.models import layers, quant, transformer
from specjax.models.cpu import panels, rows
from specjax.models.weights import Ops
from specjax.testing.models import tiny_config

# Names whose presence in the model body means it branches on a layout or picks a kernel itself.
LAYOUT_NAMES = ("is_cpu_layer", "is_panels", "is_rows", "is_quantized", "isinstance",
                "QuantizedWeight", "PanelWeight", "RowMajorWeight", "cpu_kernel", "kernel",
                "wqkv", "w_gate_up", "_t", "lm_head", "linear", "einsum", "matvec")


def layout_branches(source: str) -> list[str]:
  """The `LAYOUT_NAMES` that occur in `source` as whole identifiers; `_t` stands for any quoted
  key of the CPU layout's fused weights (`"wo_t"`)."""
  patterns = {name: rf"\b{re.escape(name)}\b" for name in LAYOUT_NAMES}
  patterns["_t"] = r"['\"][A-Za-z_]+_t['\"]"
  return [name for name in LAYOUT_NAMES if re.search(patterns[name], source)]


def test_forward_has_no_layout_branches():
  assert layout_branches(inspect.getsource(transformer.forward)) == []


@pytest.mark.parametrize("branch", [
    "    if cpu_layout.is_cpu_layer(lp):\n",
    "  if quant.is_quantized(p['lm_head']):\n",
    "    out = cpu_layout.project(a, lp, name, kernel)\n",
    "      qkv = ops.matmul(h, lp[\"wqkv_t\"])\n",
    "  elif panel_layout.is_panels(p[\"embed\"]):\n",
    "    attn = attention(q, segments, q_pos, window, c, kernel=model.cpu_kernel)\n",
])
def test_the_check_finds_a_planted_branch(branch):
  """Power: `forward`'s source with one layout branch (or kernel switch) added is caught."""
  source = inspect.getsource(transformer.forward)
  at = source.index("    q, k, v = ops.qkv(h, lp, c)\n")
  assert layout_branches(source[:at] + branch + source[at:])


def test_the_attention_reference_lives_in_models():
  assert not hasattr(kernel, "attention_reference") and not hasattr(kernel, "attention")
  assert "attention_reference" in inspect.getsource(layers.attention)
  assert "cpu_gemv.attention_reference" not in inspect.getsource(layers)


def _layouts(model):
  """The same weights in every float layout, by name."""
  unstacked = model.unstacked()
  return {
      "unstacked": unstacked,
      "rows": unstacked.with_fused_projections(cpu_kernel=False),
      "rows, output copy": unstacked.with_fused_projections(cpu_kernel=False).with_output_copy(),
      # row-major weights read by the kernel's row-major product (blocks of up to 8 rows)
      "rows, kernel": dataclasses.replace(unstacked.with_fused_projections(cpu_kernel=False),
                                          cpu_kernel=True),
      "panels": unstacked.with_fused_projections(cpu_kernel=True),
      "for_platform(cpu)": model.for_platform("cpu"),
  }


def _steps(model):
  """Logits of a prompt (no cache), then a prompt, a decode step and a verify block over a cache."""
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 7)), jnp.int32)
  step = jax.jit(lambda m, tokens, starts, cache: m(tokens, starts, cache))
  out = [jax.jit(lambda m, tokens: m(tokens, jnp.zeros((2,), jnp.int32)).logits)(model, prompt)]
  cache = model.init_cache(2, 32)
  starts = jnp.zeros((2,), jnp.int32)
  for tokens in (prompt, prompt[:, :1], prompt[:, 1:5]):
    result = step(model, tokens, starts, cache)
    out.append(result.logits)
    cache, starts = result.cache, starts + tokens.shape[1]
  return out


@pytest.mark.parametrize("tied", [True, False])
def test_every_layout_gives_the_same_logits(tied):
  config = tiny_config(vocab_size=97, embed_dim=64, mlp_dim=96, num_heads=4, num_kv_heads=2,
                       tie_embeddings=tied, qkv_bias=True)
  model = sj.init_params(config, jax.random.key(1))
  want = _steps(model)
  for name, layout in _layouts(model).items():
    for got, ref in zip(_steps(layout), want):
      np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5, err_msg=name)


def test_a_quantized_copy_gives_the_same_logits_in_every_layout():
  config = tiny_config(vocab_size=97, embed_dim=64, mlp_dim=96, num_heads=4, num_kv_heads=2)
  model = sj.init_params(config, jax.random.key(2))
  want = _steps(quant.quantize(model, 8, 32))
  for layout in (model.unstacked(), model.for_platform("cpu"),
                 model.unstacked().with_fused_projections(cpu_kernel=False)):
    for got, ref in zip(_steps(quant.quantize(layout, 8, 32)), want):
      np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def test_one_product_for_every_leaf_type():
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.standard_normal((64, 100)), jnp.float32)  # [in, out]
  x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  leaves = {"float": w, "rows": rows.RowMajorWeight(w.T), "panels": panels.pack(w.T)}
  for cpu_kernel in (False, True):
    for name, leaf in leaves.items():
      got = jax.jit(Ops(cpu_kernel).matmul)(x, leaf)
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{name} {cpu_kernel}")
    int8 = quant.quantize_weight(w.T, 8, 32)  # on CPU: x quantized per group too
    np.testing.assert_allclose(
        jax.jit(Ops(cpu_kernel).matmul)(x, int8),
        kernel.quant_reference(x, int8.values, int8.scales, bits=8, group=32), rtol=1e-5,
        atol=1e-5)
