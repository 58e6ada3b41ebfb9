"""Attention for a long block of queries (a prompt's prefill) that never holds its `[heads, T, S]`
scores: the same math as `specjax.models.layers.attention_reference`, computed a tile at a time.

`specjax.models.layers.attention` sends a block of at least `LONG_BLOCK` query rows that attends
a cache (two or more segments) here; shorter blocks (decode steps, verify blocks, trees) and the
cache-free training pass keep the reference. The implementation follows the platform the program
is lowered for (`jax.lax.platform_dependent`, as the verify kernels choose theirs):

  * CPU: the reference, unchanged (the CPU layout's own kernels, speed and numbers as before);
  * TPU: the splash attention kernel that ships with JAX
    (`jax.experimental.pallas.ops.tpu.splash_attention`) where its static masks can express the
    visibility: the caller declares `causal_block` (the last segment is the block itself, its
    keys in query order, and every valid key of the earlier segments, the cache, lies before
    every query) and the model has no sliding window. The cache and the block are concatenated
    along the key axis; the block is causal through a `CausalMask` offset by the cache length,
    and which cache slots are valid goes in through the kernel's segment ids (valid slots share
    the queries' id, the rest another), so ragged rows and cache offsets cost no mask array.
    Grouped queries run as multi-query attention per key/value head. Under a mesh the kernel
    runs inside `jax.shard_map`, each device on its rows and key/value heads (a Mosaic kernel
    cannot be partitioned automatically);
  * TPU where the kernel's static masks do not fit (sliding windows, whose per-layer width is a
    traced value inside the layer scan; a block that is not `causal_block`), CUDA and ROCm:
    `blockwise_attention`, jnp: a loop over query tiles and, inside it, over key tiles of every
    segment with an online softmax, skipping key tiles no query of the tile sees (the unfilled
    cache of a prefill, the causal upper triangle). Its temporaries are a few tiles.

Every implementation returns `attention_reference`'s `[B, KVH, G, T, D]` float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_masks
from jax.sharding import PartitionSpec

from specjax.parallel.rules import active_rules

__all__ = ["LONG_BLOCK", "blockwise_attention", "is_long", "long_attention", "splash_attention",
           "splash_fits"]

# Query rows from which a block attending a cache goes through this module (static: the block's
# length). Decode steps and verify blocks are far shorter; a chunked prefill's chunks
# (`specjax.models.prefill.CHUNK_MULTIPLE`) are at least this long.
LONG_BLOCK = 128

# `blockwise_attention`'s tile: query and key rows per tile, at most `MAX_TILE`, halved (down to
# `MIN_TILE`) while one tile's float32 scores `[B, H, tile, tile]` exceed `TILE_BYTES`.
MAX_TILE, MIN_TILE, TILE_BYTES = 512, 128, 64 << 20

# Splash attention's tiles (multiples of 128, the lane width): query rows, key rows.
SPLASH_BLOCK_Q, SPLASH_BLOCK_KV = 512, 512


def is_long(q, segments) -> bool:
  """Whether `attention` sends this call here: at least `LONG_BLOCK` query rows, a cache before
  the block (two or more segments), and every `valid` mask None or broadcast over the queries
  (`[B, 1, S]`; a per-query mask such as a tree's is only given for short blocks)."""
  return (q.shape[1] >= LONG_BLOCK and len(segments) > 1
          and all(valid is None or valid.shape[1] == 1 for *_, valid in segments))


def _tile(batch: int, heads: int, length: int) -> int:
  tile = MAX_TILE
  while tile > MIN_TILE and batch * heads * tile * tile * 4 > TILE_BYTES:
    tile //= 2
  return min(tile, length)


def blockwise_attention(q, keys, values, k_pos, valid, q_pos, window, *, scale: float,
                        softcap: float | None, tile: int | None = None) -> jax.Array:
  """`attention_reference` with the visibility of `specjax.models.layers.attention`, a tile of
  queries and a tile of keys at a time, with an online softmax.

  Args:
    q: `[B, T, KVH, G, D]` queries.
    keys, values: per segment `[B, KVH, S, D]`.
    k_pos: per segment `[B, S]` int32 key positions; `valid`: per segment `[B, 1, S]` bool or
      None. A key is visible to a query when valid, at or before the query's position and inside
      `window` (0: global).
    q_pos: `[B, T]` int32 query positions.
    window: scalar int (may be traced).
    scale, softcap: as `attention_reference`.
    tile: query and key rows per tile (default `_tile`: at most 512, smaller at large batch).

  Returns:
    `[B, KVH, G, T, D]` float32. A query that sees no key at all (never the case for a block that
    sees itself) gets zeros, where the reference averages every value.
  """
  b, t, kvh, g, d = q.shape
  tile = tile or _tile(b, kvh * g, t)
  q_tile = min(tile, t)
  low = jnp.finfo(jnp.float32).min

  def visible_at(kp, vd, qp):  # kp [B, Sk], vd [B, 1, Sk] or None, qp [B, Tq] -> [B, Tq, Sk]
    seen = kp[:, None, :] <= qp[:, :, None]
    seen &= (window == 0) | (kp[:, None, :] > qp[:, :, None] - window)
    return seen if vd is None else seen & vd

  def query_tile(i, out):
    # The last tile is clamped to end at T (it recomputes some rows of the one before it).
    start = jnp.minimum(i * q_tile, t - q_tile)
    qi = jax.lax.dynamic_slice_in_dim(q, start, q_tile, axis=1)
    qp = jax.lax.dynamic_slice_in_dim(q_pos, start, q_tile, axis=1)
    m = jnp.full((b, kvh, g, q_tile), low, jnp.float32)
    l = jnp.zeros((b, kvh, g, q_tile), jnp.float32)
    acc = jnp.zeros((b, kvh, g, q_tile, d), jnp.float32)
    for k, v, kp, vd in zip(keys, values, k_pos, valid):
      s = k.shape[2]
      k_tile = min(tile, s)

      def key_tile(j, carry, k=k, v=v, kp=kp, vd=vd, s=s, k_tile=k_tile):
        # Clamped like the query tiles; keys an earlier tile already counted are masked.
        first = j * k_tile
        at = jnp.minimum(first, s - k_tile)
        kp_j = jax.lax.dynamic_slice_in_dim(kp, at, k_tile, axis=1)
        vd_j = None if vd is None else jax.lax.dynamic_slice_in_dim(vd, at, k_tile, axis=2)
        seen = visible_at(kp_j, vd_j, qp)
        seen &= (at + jnp.arange(k_tile, dtype=jnp.int32) >= first)[None, None, :]

        def update(carry):
          m, l, acc = carry
          kj = jax.lax.dynamic_slice_in_dim(k, at, k_tile, axis=2)
          vj = jax.lax.dynamic_slice_in_dim(v, at, k_tile, axis=2)
          scores = jnp.einsum("btkgd,bksd->bkgts", qi, kj,
                              preferred_element_type=jnp.float32) * scale
          if softcap is not None:
            scores = softcap * jnp.tanh(scores / softcap)
          scores = jnp.where(seen[:, None, None], scores, low)
          m_new = jnp.maximum(m, scores.max(axis=-1))
          p = jnp.where(seen[:, None, None], jnp.exp(scores - m_new[..., None]), 0.0)
          decay = jnp.exp(m - m_new)
          l = l * decay + p.sum(axis=-1)
          acc = acc * decay[..., None] + jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), vj,
                                                    preferred_element_type=jnp.float32)
          return m_new, l, acc

        return jax.lax.cond(jnp.any(seen), update, lambda carry: carry, carry)

      m, l, acc = jax.lax.fori_loop(0, -(-s // k_tile), key_tile, (m, l, acc))
    tile_out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jax.lax.dynamic_update_slice_in_dim(out, tile_out, start, axis=3)

  out = jnp.zeros((b, kvh, g, t, d), jnp.float32)
  return jax.lax.fori_loop(0, -(-t // q_tile), query_tile, out)


def splash_fits(config, causal_block: bool) -> bool:
  """Whether the splash kernel's static masks express this attention: a `causal_block` call of
  a model without sliding windows."""
  return causal_block and config.sliding_window is None


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _splash_kernel(heads: int, q_len: int, kv_len: int, offset: int, block_q: int,
                   block_kv: int, softcap: float | None, interpret: bool):
  """The multi-query splash kernel of a causal block after `offset` cache slots. Built per trace,
  not cached: it holds its mask tables as arrays, which would outlive the trace they were made
  in."""
  causal = splash_masks.CausalMask((q_len, kv_len), offset=offset)
  sizes = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv)
  return splash.make_splash_mqa_single_device(
      splash_masks.MultiHeadMask([causal] * heads), block_sizes=sizes,
      attn_logits_soft_cap=softcap, interpret=interpret)


def splash_attention(q, keys, values, valid, *, scale: float, softcap: float | None,
                     interpret: bool = False) -> jax.Array:
  """Attention of a `causal_block` call by the splash kernel (see the module docstring), on one
  device's arrays.

  Args:
    q: `[B, T, KVH, G, D]` queries.
    keys, values: per segment `[B, KVH, S, D]`, the last segment the block itself (`S = T`).
    valid: per segment `[B, 1, S]` bool or None (all valid); the last one is ignored (the block
      is causal).
    scale, softcap: as `attention_reference`.
    interpret: run the kernel in Pallas interpret mode (any platform; for tests).

  Returns:
    `[B, KVH, G, T, D]` float32.
  """
  b, t, kvh, g, d = q.shape
  cache_len = sum(k.shape[2] for k in keys[:-1])
  block_q = min(SPLASH_BLOCK_Q, _round_up(t, 128))
  q_len = _round_up(t, block_q)
  block_kv = min(SPLASH_BLOCK_KV, _round_up(cache_len + t, 128))
  kv_len = _round_up(cache_len + t, block_kv)
  # Queries `[B, KVH, G, T', D]`, pre-scaled (the kernel takes no scale); padded rows are dropped.
  qs = (q.astype(jnp.float32) * scale).astype(q.dtype).transpose(0, 2, 3, 1, 4)
  qs = jnp.pad(qs, ((0, 0),) * 3 + ((0, q_len - t), (0, 0)))
  pad = ((0, 0), (0, 0), (0, kv_len - cache_len - t), (0, 0))
  ks = jnp.pad(jnp.concatenate(keys, axis=2).astype(q.dtype), pad)
  vs = jnp.pad(jnp.concatenate(values, axis=2).astype(q.dtype), pad)
  # Segment ids: the queries and every key they may see 0, invalid cache slots and padding 1.
  ids = [jnp.zeros((b, k.shape[2]), jnp.int32) if vd is None else (~vd[:, 0]).astype(jnp.int32)
         for k, vd in zip(keys[:-1], valid[:-1])]
  ids.append(jnp.zeros((b, t), jnp.int32))
  ids.append(jnp.ones((b, kv_len - cache_len - t), jnp.int32))
  kv_ids = jnp.concatenate(ids, axis=1)
  q_ids = jnp.zeros((b, q_len), jnp.int32)

  kernel = _splash_kernel(g, q_len, kv_len, cache_len, block_q, block_kv, softcap, interpret)
  per_head = lambda q, k, v, qi, ki: kernel(q, k, v, segment_ids=splash.SegmentIds(qi, ki))
  per_row = jax.vmap(per_head, in_axes=(0, 0, 0, None, None))  # over key/value heads
  out = jax.vmap(per_row)(qs, ks, vs, q_ids, kv_ids)  # [B, KVH, G, T', D]
  return out[:, :, :, :t].astype(jnp.float32)


def _sharded_splash(q, keys, values, valid, *, scale, softcap):
  """`splash_attention` under the active mesh: inside `jax.shard_map`, each device on its rows
  and key/value heads (as the sharding rules place them); directly without a mesh."""
  # The cache segments' masks as arrays (None: every slot valid); the block's is not read.
  valid = [jnp.ones((k.shape[0], 1, k.shape[2]), bool) if vd is None else vd
           for k, vd in zip(keys[:-1], valid[:-1])]
  run = lambda q, keys, values, valid: splash_attention(
      q, keys, values, valid + [None], scale=scale, softcap=softcap)
  mesh = jax.sharding.get_abstract_mesh()
  mesh_shape = None if mesh is None or mesh.empty else {
      name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
      if kind == jax.sharding.AxisType.Auto and size > 1}
  if not mesh_shape:  # one device, or inside the caller's shard_map (per-device arrays already)
    return run(q, list(keys), list(values), valid)
  rules = active_rules()
  spec = lambda x, axes: rules.spec(axes, x.shape, mesh_shape)
  q_spec = spec(q, ("batch", None, "kv_heads", None, None))
  kv_specs = [spec(k, ("batch", "kv_heads", None, None)) for k in keys]
  valid_specs = [spec(vd, ("batch", None, None)) for vd in valid]
  out_spec = PartitionSpec(q_spec[0], q_spec[2])  # [B, KVH, G, T, D]
  return jax.shard_map(run, mesh=mesh, in_specs=(q_spec, kv_specs, kv_specs, valid_specs),
                       out_specs=out_spec, check_vma=False)(q, list(keys), list(values), valid)


def long_attention(q, keys, values, k_pos, valid, q_pos, window, *, scale: float,
                   softcap: float | None, reference, kernel_fits: bool) -> jax.Array:
  """The platform's attention of a long block (see the module docstring).

  Args:
    q, keys, values, k_pos, valid, q_pos, window, scale, softcap: as `blockwise_attention`.
    reference: `(q, keys, values, masks) -> [B, KVH, G, T, D]`, the CPU branch.
    kernel_fits: `splash_fits(...)`: the TPU branch runs the splash kernel, else
      `blockwise_attention`.

  Returns:
    `[B, KVH, G, T, D]` float32.
  """
  keys, values, k_pos, valid = tuple(keys), tuple(values), tuple(k_pos), tuple(valid)

  def masks():
    out = []
    for kp, vd in zip(k_pos, valid):
      seen = kp[:, None, :] <= q_pos[:, :, None]
      seen &= (window == 0) | (kp[:, None, :] > q_pos[:, :, None] - window)
      out.append(seen if vd is None else seen & vd)
    return out

  def cpu(q):
    return reference(q, keys, values, masks())

  def blockwise(q):
    return blockwise_attention(q, keys, values, k_pos, valid, q_pos, window, scale=scale,
                               softcap=softcap)

  def tpu(q):
    if not kernel_fits:
      return blockwise(q)
    return _sharded_splash(q, keys, values, valid, scale=scale, softcap=softcap)

  return jax.lax.platform_dependent(q, cpu=cpu, tpu=tpu, default=blockwise)
