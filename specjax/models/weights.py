"""A model's products, one dispatch for every layout: a weight's leaf type says how it lies.

  * a float array: a canonical projection or an `lm_head`, `[in, out]` (XLA's dot); an embedding
    table `[V, E]` (rows; a tied one is also the output projection, contracted as it lies);
  * `specjax.models.quant.QuantizedWeight`, `[out, in]`: its own product (on CPU the kernel reads
    the integers where it is built; elsewhere XLA dequantizes inside the dot);
  * `specjax.models.cpu.panels.PanelWeight`, `[out, in]` in panels: the CPU kernel at every block
    size;
  * `specjax.models.cpu.rows.RowMajorWeight`, `[out, in]`: XLA's dot (the kernel's row-major
    product for a block of a few rows).

`Ops` carries what the leaves do not: whether the model's products and attention go through the CPU
kernel (`Model.cpu_kernel`). A layer holds its projections apart (`wq`, `wk`, `wv`, `wo`, `w_gate`,
`w_up`, `w_down`: the canonical layout) or fused, each kept once (`wqkv_t`, `wo_t`, `w_gate_up_t`,
`w_down_t`: the CPU layout, `specjax.models.cpu.layout`); `Ops.qkv`, `Ops.gate_up` and `Ops.output`
read either, so the decoder's body (`specjax.models.transformer.forward`) is the same for every
layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.kernels.cpu import kernel as cpu_gemv
from specjax.models.config import ModelConfig
from specjax.models.cpu import layout as cpu_layout
from specjax.models.cpu import panels
from specjax.models.cpu import rows
from specjax.models.layers import attention
from specjax.models.quant import QuantizedWeight

__all__ = ["Ops", "embed"]


def embed(table, ids: jax.Array) -> jax.Array:
  """Rows `ids` of an `[n, d]` table (an embedding): a float array, a `PanelWeight`, or a
  `QuantizedWeight` (its rows dequantized)."""
  if isinstance(table, QuantizedWeight):
    return table.map_rows(lambda a: a[ids]).dequantize(table.dtype)
  return table[ids]


@dataclasses.dataclass(frozen=True)
class Ops:
  """The products of one model's weights and its attention, by leaf type (see the module
  docstring).

  Attributes:
    cpu_kernel: the model's products of panels and row-major weights, its tied output projection
      as a float `[V, E]` table, and its attention of a decode step or a verify block go through
      the CPU kernel (`specjax.kernels.cpu.kernel`) on CPU where it is usable; a quantized weight
      reads it wherever it is built. `Model.cpu_kernel`.
  """

  cpu_kernel: bool = False

  @classmethod
  def of(cls, model) -> "Ops":
    """The products of `model` (a `specjax.Model`: its `cpu_kernel`)."""
    return cls(bool(model.cpu_kernel))

  def matmul(self, x: jax.Array, w) -> jax.Array:
    """`x [..., in]` times a layer weight -> `[..., out]`: a float `[in, out]` array or any
    `[out, in]` leaf type (see the module docstring)."""
    if isinstance(w, QuantizedWeight):
      return w.matmul(x)
    if panels.is_panels(w) or rows.is_rows(w):
      return w.matmul(x, self.cpu_kernel)
    return jnp.einsum("...i,io->...o", x, w)

  def qkv(self, h: jax.Array, lp: dict, c: ModelConfig):
    """`h [B, T, E]` -> the layer's queries `[B, T, H * D]`, keys and values `[B, T, KVH * D]`,
    each with its bias where the layer has one: three products where the layer holds them apart,
    one split in three where it holds them fused."""
    if not cpu_layout.is_cpu_layer(lp):
      return tuple(self._biased(h, lp[w], lp.get(b))
                   for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    n_q, n_kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv = self._biased(h, lp["wqkv_t"], lp.get("bqkv"))
    return qkv[..., :n_q], qkv[..., n_q:n_q + n_kv], qkv[..., n_q + n_kv:]

  def query(self, h: jax.Array, lp: dict) -> jax.Array:
    """`h [B, T, E]` -> the queries `[B, T, H * D]` alone (a KV-shared layer, which has no key or
    value projection of its own; canonical layout)."""
    return self._biased(h, lp["wq"], lp.get("bq"))

  def gate_up(self, h: jax.Array, lp: dict, c: ModelConfig):
    """`h [B, T, E]` -> the layer's MLP gate and up projections `[B, T, F]`: two products where
    the layer holds them apart, one split in two where it holds them fused."""
    if not cpu_layout.is_cpu_layer(lp):
      return self.matmul(h, lp["w_gate"]), self.matmul(h, lp["w_up"])
    gate_up = self.matmul(h, lp["w_gate_up_t"])
    return gate_up[..., :c.mlp_dim], gate_up[..., c.mlp_dim:]

  def output(self, a: jax.Array, lp: dict, name: str) -> jax.Array:
    """`a` through the layer's output projection `name` (`"wo"`, `"w_down"`), in whichever layout
    the layer holds it."""
    return self.matmul(a, lp[name + "_t"] if cpu_layout.is_cpu_layer(lp) else lp[name])

  def logits(self, x: jax.Array, params: dict, c: ModelConfig) -> jax.Array:
    """`x [B, T, E]` -> `[B, T, V]` float32 through the model's `lm_head` (a float `[E, V]`, or
    `[V, E]` quantized or in panels; a tied model's `[E, V]` copy, `Model.with_output_copy`), or a
    tied model's embedding `[V, E]` as it lies (`embed.T` inside jit would copy `[E, V]` per
    call)."""
    if c.tie_embeddings and "lm_head" not in params:
      table = params["embed"]
      if isinstance(table, QuantizedWeight) or panels.is_panels(table):
        return self.matmul(x, table)
      if self.cpu_kernel:
        return cpu_gemv.matvec(x, table)  # the kernel reads `[V, E]` as it lies
      return jnp.einsum("...i,oi->...o", x, table, preferred_element_type=jnp.float32)
    head = params["lm_head"]
    if isinstance(head, QuantizedWeight) or panels.is_panels(head):
      return self.matmul(x, head)
    return jnp.einsum("...i,io->...o", x, head, preferred_element_type=jnp.float32)

  def attention(self, q, segments, q_pos, window, config: ModelConfig, *,
                causal_block: bool = False, stacked_cache=None) -> jax.Array:
    """`specjax.models.layers.attention`, through the CPU kernel where the model uses it."""
    return attention(q, segments, q_pos, window, config, kernel=self.cpu_kernel,
                     causal_block=causal_block, stacked_cache=stacked_cache)

  def _biased(self, h, w, bias):
    out = self.matmul(h, w)
    return out if bias is None else out + bias
