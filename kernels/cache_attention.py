"""Attention of a short block of queries over the live part of a stacked KV cache, on TPU: a
Pallas kernel that reads only the key/value blocks holding live slots (`slot < starts[b]`) and
returns flash-decoding partial results, which the caller merges with the block's own scores.

Why a kernel. A decode step or a verify block attends the cache with dense einsums over all `S`
slots of its capacity, masked; XLA reads every slot, live or not (at 1,024 live of 2,048 slots, a
batch-64 draft step moved 1.48x its floor of weights plus live cache). The kernel's key/value
block index is clamped to each row's last live block, so the pipeline does not fetch a block past
it (a repeated block index is not fetched again) and the steps past it compute nothing.

What runs. Grid `(B, S / block)`: one row per outer step; the inner steps walk the row's slots a
block at a time over all key/value heads of the row (a static loop over heads inside the kernel,
so a step moves `2 x heads x block x E` bytes, not a sliver). `starts`, the layer index and the
sliding window are scalar-prefetched into SMEM; the keys and values are the whole stacked
`[L, B, C, S, E]` buffers (the layer picked in the index map, so the layer scan hands the kernel
no per-layer slice, which XLA would copy for a custom call). Queries come in as rows: `[B, C, R, E]`
with `R = p G T` rows per head group (a packed cache's `p` heads per row: each query spread into
its head's lanes of an `E = p D`-wide row, zeros elsewhere, as
`specjax.models.layers._scores` reads packed rows), with each row's query position `[B, R, 1]`.
A slot `s` is visible to a row at position `q` when `s < starts[b]`, `s <= q`, and, with a window
`w > 0`, `s > q - w` (the masks `specjax.models.layers.attention` puts on the cache segment).
An online softmax keeps the running max, sum and weighted values in VMEM scratch (float32); scores
are scaled, then soft-capped (`cap * tanh(x / cap)`) where `softcap` is given.

What it returns. `(m [B, C, R, 1], l [B, C, R, 1], acc [B, C, R, E])` float32: per row the max
score `m` over the visible slots (`-inf` where none is visible), `l = sum exp(score - m)` and
`acc = sum exp(score - m) v` (the probabilities cast to the values' dtype before the product, as
`attention_reference` does). `specjax.models.layers.merge_cache_partials` (jnp) combines them with the block segment's scores; the
result equals `specjax.models.layers.attention_reference` to float32 rounding (bfloat16 caches:
to the rounding of the probabilities cast to bfloat16, normalised after the product here and
before it in the reference). A row with no visible slot at all contributes nothing; each row
fetches at least its first block (a row with `starts == 0` fetches block 0 and computes nothing).

Blocks and VMEM. `block` (slots per step) is the largest of 512, 256, 128 dividing `S` whose step
fits `VMEM_BUDGET` (8 MiB, half of v5e's default 16 MiB scoped VMEM), counted conservatively
(`vmem_bytes`): double-buffered query rows, key and value blocks and outputs, the scratch, and
three float32 `[R, block]` temporaries, every row padded to whole 128-lane vregs. The slot count
must be a multiple of 128.

Interpret mode (`interpret=True`) runs the same kernel on CPU for its numbers
(tests/models/test_cache_attention.py); `specjax.models.layers.attention` calls it only in
programs lowered for TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax.core.cache import read_dtype, widen

__all__ = ["BLOCKS", "VMEM_BUDGET", "block_slots", "cache_attention", "fetched_slots",
           "vmem_bytes"]

VMEM_BUDGET = 8 << 20
BLOCKS = (512, 256, 128)  # slots per grid step, largest first
_LANES = 128
KERNEL_NAME = "specjax_cache_attention"


def _lanes(n: int) -> int:
  return -(-n // _LANES) * _LANES


def _sublanes(n: int) -> int:
  return -(-n // 8) * 8


def vmem_bytes(heads: int, rows: int, width: int, block: int, q_dtype, kv_dtype) -> int:
  """VMEM one grid step plans on (static, conservative): query rows, keys and values, outputs
  (each double-buffered), the float32 scratch and three `[rows, block]` float32 temporaries."""
  r, e = _sublanes(rows), _lanes(width)
  q = 2 * heads * r * e * jnp.dtype(q_dtype).itemsize
  kv = 2 * 2 * heads * block * e * jnp.dtype(kv_dtype).itemsize
  out = 2 * heads * r * (e + 2 * _LANES) * 4
  scratch = heads * r * (e + 2 * _LANES) * 4
  temps = 3 * r * _lanes(block) * 4
  return q + kv + out + scratch + temps + 2 * r * _LANES * 4  # + the positions


def block_slots(slots: int, heads: int, rows: int, width: int, q_dtype, kv_dtype,
                budget: int = VMEM_BUDGET) -> int:
  """Slots per grid step (static): the largest of `BLOCKS` dividing `slots` whose step fits
  `budget`; 0 where none does (the caller keeps its reference)."""
  for block in BLOCKS:
    if slots % block == 0 and vmem_bytes(heads, rows, width, block, q_dtype,
                                         kv_dtype) <= budget:
      return block
  return 0


def fetched_slots(live: int, slots: int, block: int) -> int:
  """Slots of one row the kernel's schedule fetches when `live` are live: whole blocks up to the
  last live one, at least one block (static; the traffic count's)."""
  return min(slots, max(1, -(-live // block)) * block)


def _last_block(start, block: int):
  # (lax.div, not `//`: jnp's floor division lowers through `sign`, whose Mosaic rule asks the
  # local TPU's generation, which an AOT compile on another host does not have.)
  return jnp.maximum(jax.lax.div(start + (block - 1), block) - 1, 0)


def _kernel(starts_ref, layer_ref, window_ref, pos_ref, q_ref, k_ref, v_ref, m_out, l_out,
            acc_out, m_scr, l_scr, acc_scr, *, block: int, heads: int, scale: float,
            softcap: float | None):
  del layer_ref  # used by the index maps only
  b, step = pl.program_id(0), pl.program_id(1)
  start = starts_ref[b]

  @pl.when(step == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when(step * block < start)
  def _attend():
    pos = pos_ref[...]  # [R, 1] int32
    window = window_ref[0]
    rows = pos.shape[0]
    slot = step * block + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 1)
    visible = (slot < start) & (slot <= pos) & ((window == 0) | (slot > pos - window))
    for c in range(heads):  # static: the row's key/value heads (groups)
      q = q_ref[c]  # [R, E]
      k = k_ref[c].astype(q.dtype)  # [block, E]
      s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32) * scale
      if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
      s = jnp.where(visible, s, -jnp.inf)
      m_prev = m_scr[c]  # [R, 1]
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen nothing yet
      p = jnp.exp(s - m_safe)
      alpha = jnp.exp(m_prev - m_safe)
      v = widen(v_ref[c], q.dtype)  # an 8-bit float cache: widened to the queries' dtype
      pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
      l_scr[c] = alpha * l_scr[c] + jnp.sum(p, axis=1, keepdims=True)
      acc_scr[c] = alpha * acc_scr[c] + pv
      m_scr[c] = m_new

  @pl.when(step == pl.num_programs(1) - 1)
  def _finish():
    m_out[...] = m_scr[...]
    l_out[...] = l_scr[...]
    acc_out[...] = acc_scr[...]


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "block", "interpret"))
def _cache_attention_rows(q_rows, keys, values, starts, layer, window, row_pos, *, scale,
                          softcap, block, interpret):
  _, batch, heads, slots, width = keys.shape
  rows = q_rows.shape[2]

  def kv_map(b, step, starts, layer, window):
    return layer[0], b, 0, jnp.minimum(step, _last_block(starts[b], block)), 0

  row_map = lambda b, step, *_: (b, 0, 0, 0)
  kv_spec = pl.BlockSpec((None, None, heads, block, width), kv_map)
  stat_spec = pl.BlockSpec((None, heads, rows, 1), row_map)
  f32 = jnp.float32
  return pl.pallas_call(
      functools.partial(_kernel, block=block, heads=heads, scale=scale, softcap=softcap),
      out_shape=(jax.ShapeDtypeStruct((batch, heads, rows, 1), f32),
                 jax.ShapeDtypeStruct((batch, heads, rows, 1), f32),
                 jax.ShapeDtypeStruct((batch, heads, rows, width), f32)),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(batch, slots // block),
          in_specs=[pl.BlockSpec((None, rows, 1), lambda b, step, *_: (b, 0, 0)),
                    pl.BlockSpec((None, heads, rows, width), row_map), kv_spec, kv_spec],
          out_specs=[stat_spec, stat_spec,
                     pl.BlockSpec((None, heads, rows, width), row_map)],
          scratch_shapes=[pltpu.VMEM((heads, rows, 1), f32), pltpu.VMEM((heads, rows, 1), f32),
                          pltpu.VMEM((heads, rows, width), f32)]),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name=f"{KERNEL_NAME}_block{block}",
  )(starts, layer, window, row_pos, q_rows, keys, values)


def _rows(q, pack: int):
  """Queries `[B, T, KVH, G, D]` as rows `[B, C, p G T, p D]` (C = KVH / p): each query in its
  head's lanes of a `p D`-wide row."""
  b, t, kvh, g, d = q.shape
  groups = kvh // pack
  q = q.reshape(b, t, groups, pack, g, d)
  if pack > 1:
    eye = jnp.eye(pack, dtype=q.dtype)
    q = jnp.einsum("btcjgd,ji->btcjgid", q, eye).reshape(b, t, groups, pack, g, pack * d)
  return q.transpose(0, 2, 3, 4, 1, 5).reshape(b, groups, pack * g * t, pack * d)


def _unrows(m, l, acc, shape, pack: int):
  """The kernel's row outputs back in the queries' layout: `m, l [B, KVH, G, T]`,
  `acc [B, KVH, G, T, D]` (a packed row keeps its head's lanes)."""
  b, t, kvh, g, d = shape
  groups = kvh // pack
  m = m.reshape(b, kvh, g, t)
  l = l.reshape(b, kvh, g, t)
  acc = acc.reshape(b, groups, pack, g, t, pack, d)
  if pack > 1:
    acc = jnp.einsum("bcjgtid,ji->bcjgtd", acc, jnp.eye(pack, dtype=acc.dtype))
  return m, l, acc.reshape(b, kvh, g, t, d)


def cache_attention(q, keys, values, starts, q_pos, *, layer=0, window=0, scale: float,
                    softcap: float | None = None, block: int | None = None,
                    interpret: bool = False):
  """Flash-decoding partial results of `q` over the live slots of one layer of a stacked cache.

  Args:
    q: `[B, T, KVH, G, D]` queries.
    keys, values: `[L, B, C, S, E]` all layers' cache (`C = KVH / p`, `E = p D`: `p` heads per
      row of a packed cache, `specjax.core.cache.head_pack`), or one layer's `[B, C, S, E]`.
    starts: `[B]` int32 live slots of each row (`slot < starts[b]` are valid).
    q_pos: `[B, T]` int32 position of each query (slot `s` holds position `s`).
    layer: int32 scalar, the layer of `keys` / `values` attended.
    window: int32 scalar sliding window, 0 for global attention.
    scale, softcap: as `specjax.models.layers.attention_reference`.
    block: slots per grid step (default `block_slots`).
    interpret: run the kernel in Pallas interpret mode (any backend).

  Returns:
    `(m, l [B, KVH, G, T], acc [B, KVH, G, T, D])` float32 (module docstring); `specjax.models.layers.merge_cache_partials` finishes.
  """
  if keys.ndim == 4:
    keys, values = keys[None], values[None]
  b, t, kvh, g, d = q.shape
  _, batch, groups, slots, width = keys.shape
  pack = width // d
  if batch != b or groups * pack != kvh or width != pack * d or values.shape != keys.shape:
    raise ValueError(f"cache_attention: q {q.shape} does not match keys {keys.shape} / values "
                     f"{values.shape}")
  dtype = read_dtype(q.dtype, keys.dtype)
  rows = pack * g * t
  if block is None:
    block = block_slots(slots, groups, rows, width, dtype, keys.dtype)
  if not block or slots % block or block % _LANES:
    raise ValueError(f"cache_attention: {slots} slots take no block of {BLOCKS} within "
                     f"{VMEM_BUDGET} bytes of VMEM ({groups} heads, {rows} rows x {width})")
  q_rows = _rows(q.astype(dtype), pack)
  row_pos = jnp.broadcast_to(jnp.asarray(q_pos, jnp.int32)[:, None, None, :],
                             (b, pack, g, t)).reshape(b, rows, 1)
  m, l, acc = _cache_attention_rows(
      q_rows, keys, values, jnp.asarray(starts, jnp.int32),
      jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(window, jnp.int32).reshape(1),
      row_pos, scale=float(scale), softcap=softcap, block=block, interpret=interpret)
  return _unrows(m, l, acc, q.shape, pack)
