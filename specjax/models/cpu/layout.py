"""The CPU layout of a decoder layer's projections, and the ordering of its cache writes.

At batch 1 a decode step is a chain of matrix-vector products that should stream every weight once
at memory bandwidth, and a verify block of 2-9 rows should cost little more. The CPU layout keeps
each projection once (`<name>_t`), fused where that saves products (query/key/value as one matrix,
gate/up as one). Where the kernel is built (`specjax.kernels.cpu.kernel`, `Model.cpu_kernel`) the
copy is a `specjax.models.cpu.panels.PanelWeight`: panels of 48 output columns that the kernel
reads at every block size, a verify block's rows for about the time of one and a prompt's in
cache-sized steps. Elsewhere it is a `specjax.models.cpu.rows.RowMajorWeight` (`[out, in]`) for
XLA's dot. A quantized projection (`specjax.models.quant.QuantizedWeight`) takes the same place.
Each leaf type computes its own product (`specjax.models.weights`). A tied embedding goes into
panels as well (its lookups take rows from them). `split_params` restores the canonical weights.
`fuse_params` builds the layout with its weights in 2 MiB pages where Linux offers them.

The unstacked model's cache writes go through `write_after` (see there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.core.cache import write_block
from specjax.kernels.cpu import kernel as cpu_gemv
from specjax.models.cpu import host_memory
from specjax.models.cpu import panels as panel_layout
from specjax.models.cpu import rows
from specjax.models import quant
from specjax.models.config import ModelConfig

# fused name: (canonical parts, concatenated along the output axis)
_PROJECTIONS = (("wqkv", ("wq", "wk", "wv")), ("wo", ("wo",)), ("w_gate_up", ("w_gate", "w_up")),
                ("w_down", ("w_down",)))


def is_cpu_layer(lp: dict) -> bool:
  return "wqkv_t" in lp


def fuse_layer(lp: dict, panels: bool | None = None) -> dict:
  """Canonical per-layer weights -> the CPU layout: one fused copy per projection, in panels
  (`specjax.models.cpu.panels.PanelWeight`) when `panels` (default: where the kernel is built),
  else a row-major `[out, in]` copy for XLA's dot (`specjax.models.cpu.rows.RowMajorWeight`)."""
  if is_cpu_layer(lp):
    return lp
  if panels is None:
    panels = cpu_gemv.available()
  out = dict(lp)
  for fused, parts in _PROJECTIONS:
    if quant.is_quantized(lp[parts[0]]):  # quantized: `[out, in]` already, one copy, no halves
      ws = [lp[name] for name in parts]
      for name in parts:
        del out[name]
      out[fused + "_t"] = jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=-2), *ws)
      continue
    w = jnp.concatenate([jnp.asarray(lp[name]) for name in parts], axis=-1)  # [in, out]
    for name in parts:
      del out[name]
    out[fused + "_t"] = panel_layout.pack(w.T) if panels else rows.RowMajorWeight(w.T.copy())
  if all(name in lp for name in ("bq", "bk", "bv")):
    out["bqkv"] = jnp.concatenate([lp[name] for name in ("bq", "bk", "bv")], axis=-1)
    for name in ("bq", "bk", "bv"):
      del out[name]
  return out


def fuse_params(params: dict, panels: bool | None = None) -> dict:
  """An unstacked model's parameters -> the CPU layout (`fuse_layer` per layer), its new matrices
  in 2 MiB pages where Linux offers them (`specjax.models.cpu.host_memory`). With `panels`
  (default: where the kernel is built) the embedding of a model without an `lm_head` (a tied
  one: the embedding is its output projection) goes into panels too, else it stays `[V, E]` (in
  2 MiB pages), and a float `lm_head` (`[E, V]`, an untied model's) becomes panels of `[V, E]`:
  XLA's dot over `[E, V]` takes several times as long for a verify block as for one row, the
  kernel about as long for either (docs/benchmarks.md, "the untied output projection in panels").
  Parts already in the layout are kept as they are (no second copy)."""
  if panels is None:
    panels = cpu_gemv.available()
  layers = params["layers"]
  if not all(is_cpu_layer(lp) for lp in layers):
    layers = tuple(host_memory.weights_on_huge_pages(fuse_layer(lp, panels)) for lp in layers)
  embed = params["embed"]
  if (panels and "lm_head" not in params and not quant.is_quantized(embed)
      and not panel_layout.is_panels(embed)):
    embed = panel_layout.pack(embed)  # written into 2 MiB pages
  elif not panel_layout.is_panels(embed):
    embed = host_memory.on_huge_pages(embed)
  out = dict(params, layers=layers, embed=embed)
  head = params.get("lm_head")
  if panels and head is not None and not quant.is_quantized(head) and not panel_layout.is_panels(
      head):
    out["lm_head"] = panel_layout.pack(jnp.asarray(head).T)  # `[E, V]` -> panels of `[V, E]`
  if all(out[name] is params[name] for name in out):
    return params
  return out


def split_params(params: dict, c: ModelConfig) -> dict:
  """The CPU layout's parameters -> canonical ones (`split_layer` per layer, the embedding
  `[V, E]` again)."""
  layers = tuple(split_layer(lp, c) for lp in params["layers"])
  out = dict(params, layers=layers, embed=panel_layout.dense(params["embed"]))
  if panel_layout.is_panels(params.get("lm_head")):
    out["lm_head"] = params["lm_head"].T  # panels of `[V, E]` -> `[E, V]` (a new array)
  return out


def split_layer(lp: dict, c: ModelConfig) -> dict:
  """The CPU layout -> canonical per-layer weights (exact: the step copies, transposed back)."""
  if not is_cpu_layer(lp):
    return lp
  out = dict(lp)
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  sizes = {"wqkv": (q, kv, kv), "wo": (c.embed_dim,), "w_gate_up": (c.mlp_dim, c.mlp_dim),
           "w_down": (c.embed_dim,)}
  for fused, parts in _PROJECTIONS:
    step = out.pop(fused + "_t")
    offsets = [sum(sizes[fused][:i]) for i in range(1, len(parts))]
    if quant.is_quantized(step):  # split along `out` (axis -2 of the `[out, in]` integers)
      out.update((name, step.map_rows(lambda a, i=i: jnp.split(a, offsets, axis=-2)[i]))
                 for i, name in enumerate(parts))
      continue
    w = panel_layout.dense(step).T
    out.update((name, part.copy()) for name, part in zip(parts, jnp.split(w, offsets, axis=-1)))
  if "bqkv" in out:
    out.update(zip(("bq", "bk", "bv"), jnp.split(out.pop("bqkv"), [q, q + kv], axis=-1)))
  return out


def write_after(attn: jax.Array, buffers, blocks, starts: jax.Array) -> tuple:
  """Each of `blocks` (`[B, T, KVH, D]`) written into its per-layer cache buffer at `starts`
  (`specjax.core.cache.write_block`), ordered after the layer's attention output `attn`, which read
  the buffers. XLA:CPU runs independent ops concurrently, so an in-place write into a buffer that an
  unordered op still reads costs two copies of the buffer. Making the written block depend on the
  attention output (+0.0: same values) orders the write after the read."""
  after = 0.0 * attn[:1, :1, :1, None].astype(blocks[0].dtype)
  return tuple(write_block(buffer, block + after, starts) for buffer, block in zip(buffers, blocks))
