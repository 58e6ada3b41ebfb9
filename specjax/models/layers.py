"""The decoder's layer math: RMSNorm, rotary embeddings (with Llama 3.1 / linear scaling),
grouped-query attention over cache segments with causal and sliding-window masks (its jnp
reference, `attention_reference`, is the math every platform runs where the CPU kernel does not),
and the MLP activation. Pure functions of arrays, shared by the target forward and the draft
heads."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from specjax.core.cache import is_float8, read_dtype, unpack_heads, widen
from specjax.kernels import cache_attention as cache_kernel
from specjax.models import long_attention
from specjax.parallel.rules import active_rules, auto_mesh_shape
from specjax.kernels.cpu import kernel as cpu_gemv
from specjax.models.config import ModelConfig, RopeScaling


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
  """Inverse frequencies, `[head_dim // 2]` float32, with optional Llama 3.1 / linear /
  proportional scaling."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if scaling is None:
    return inv_freq
  if scaling.kind == "linear":
    return inv_freq / scaling.factor
  if scaling.kind == "proportional":  # Gemma 4: the leading pairs rotate, the rest stay put
    rotated = int(scaling.partial_rotary_factor * head_dim // 2)
    inv_freq = jnp.where(jnp.arange(head_dim // 2) < rotated, inv_freq, 0.0)
    return inv_freq / scaling.factor
  low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
  wavelen = 2 * jnp.pi / inv_freq
  smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor))
  smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  return jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor,
                   jnp.where(wavelen < high_wavelen, inv_freq, smoothed))


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`sin`, `cos` of shape `[B, T, 1, D]` in the rotate-half layout (as Hugging Face Llama)."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  return jnp.sin(angles), jnp.cos(angles)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)


def _softcap(x: jax.Array, cap: float | None) -> jax.Array:
  return x if cap is None else cap * jnp.tanh(x / cap)


def attention_reference(q, keys, values, masks, *, scale: float, softcap: float | None):
  """Grouped-query attention over key/value segments in jnp: the decoder's attention math
  (`attention` runs it wherever the CPU kernel does not) and the kernel's oracle.

  `q [B, T, KVH, G, D]`; per segment `keys`, `values` `[B, KVH, S, D]` and `masks [B, T, S]` bool
  (which keys each query sees). One softmax spans all segments, an invisible key scoring
  float32's lowest; only the (small) scores are concatenated, never the keys, so attending over a
  long cache plus a new block copies neither. Returns `[B, KVH, G, T, D]` float32."""
  all_scores = []
  for k, visible in zip(keys, masks):
    scores = _scores(q, k) * scale
    if softcap is not None:
      scores = softcap * jnp.tanh(scores / softcap)
    all_scores.append(jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min))
  probs = jax.nn.softmax(jnp.concatenate(all_scores, axis=-1), axis=-1)
  out = 0.0
  offset = 0
  for v in values:
    part = probs[..., offset:offset + v.shape[2]].astype(_probs_dtype(q, v))
    # Heads-major output: with a `btkgd` output XLA:CPU computes the transposed product and copies
    # a transposed value slab per layer; the small result is transposed by the caller instead.
    out = out + _weighted_values(part, v, q.shape[-1])
    offset += v.shape[2]
  return out


# A packed cache segment (`specjax.core.cache.head_pack`: `[B, C, S, p D]`, heads `c p + j` side
# by side in a row) is read as it lies, with no unpacking copy: each query is placed in its head's
# lanes of a `p D`-wide row (zeros elsewhere), so the product over the whole row is its head's
# score; the value product gives every head's `p D`-wide mix, of which a head keeps its own lanes.
# `p` times the flops of the segment's two products, none of its bytes.

def _scores(q, k):
  """`[B, KVH, G, T, S]` float32 scores of `q [B, T, KVH, G, D]` against keys `[B, KVH, S, D]`
  or a packed `[B, KVH / p, S, p D]`."""
  b, t, kvh, g, d = q.shape
  k = widen(k, q.dtype)  # an 8-bit float cache
  if k.shape[-1] == d:
    return jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
  groups, pack = k.shape[1], k.shape[-1] // d
  eye = jnp.eye(pack, dtype=q.dtype)
  spread = jnp.einsum("btcjgd,ji->btcjgid", q.reshape(b, t, groups, pack, g, d), eye)
  spread = spread.reshape(b, t, groups, pack, g, pack * d)
  scores = jnp.einsum("btcjge,bcse->bcjgts", spread, k, preferred_element_type=jnp.float32)
  return scores.reshape(b, kvh, g, t, k.shape[2])


def _probs_dtype(q, v):
  """The dtype probabilities take before their product with values `v`: the values' own, or for
  an 8-bit float cache (widened for the product) the queries'."""
  return q.dtype if is_float8(v.dtype) else v.dtype


def _weighted_values(probs, v, head_dim: int):
  """`[B, KVH, G, T, D]` float32: `probs [B, KVH, G, T, S]` times values `[B, KVH, S, D]` or a
  packed `[B, KVH / p, S, p D]`. An 8-bit float `v` is widened to `probs`' dtype."""
  v = widen(v, probs.dtype)
  if v.shape[-1] == head_dim:
    return jnp.einsum("bkgts,bksd->bkgtd", probs, v, preferred_element_type=jnp.float32)
  b, kvh, g, t, s = probs.shape
  groups, pack = v.shape[1], v.shape[-1] // head_dim
  mixed = jnp.einsum("bcjgts,bcse->bcjgte", probs.reshape(b, groups, pack, g, t, s), v,
                     preferred_element_type=jnp.float32)
  mixed = mixed.reshape(b, groups, pack, g, t, pack, head_dim)
  own = jnp.einsum("bcjgtid,ji->bcjgtd", mixed, jnp.eye(pack, dtype=jnp.float32))
  return own.reshape(b, kvh, g, t, head_dim)


def segment_attention(q, keys, values, masks, *, scale: float, softcap: float | None,
                      kernel: bool = False):
  """`attention_reference`'s result: with `kernel`, the CPU kernel
  (`specjax.kernels.cpu.kernel.attention_kernel`) on CPU where it is usable (two segments, a
  decode step or a verify block), else jnp. Not differentiable through the kernel (decode only;
  training runs the cache-free forward)."""
  keys, values, masks = tuple(keys), tuple(values), tuple(masks)
  ref = functools.partial(attention_reference, scale=scale, softcap=softcap)
  # A packed or 8-bit float cache segment: jnp only (the CPU kernel reads neither).
  jnp_only = any(k.shape[-1] != q.shape[-1] or is_float8(k.dtype) for k in keys)
  if jnp_only or not (kernel and cpu_gemv.attention_usable(q, keys)):
    return ref(q, keys, values, masks)
  fast = functools.partial(cpu_gemv.attention_kernel, scale=scale, softcap=softcap)
  return jax.lax.platform_dependent(q, keys, values, masks, cpu=fast, default=ref)


def attention(q, segments, q_pos, window, config: ModelConfig, kernel: bool = False,
              causal_block: bool = False, stacked_cache=None):
  """Grouped-query attention over one or more key/value segments, with causal and sliding-window
  masking: the masks here, the math in `attention_reference` (one softmax over all segments; only
  the small scores are concatenated, never the keys).

  A long block attending a cache (at least `long_attention.LONG_BLOCK` query rows, every `valid`
  None or `[B, 1, S]`: a prompt's prefill) goes through `specjax.models.long_attention`, which
  never holds the `[B, H, T, S]` scores off CPU (same math, a tile at a time; the splash kernel
  on TPU where `causal_block`); on CPU it is this reference as before.

  Args:
    q: `[B, T, H, D]` queries.
    segments: a sequence of `(keys [B, KVH, S, D], values [B, KVH, S, D], k_pos [B, S],
      valid [B, T, S] bool or None)` in the cache's layout; a key is visible to a query when it is
      valid, not after the query's position and inside the window.
    q_pos: `[B, T]` absolute position of each query.
    window: scalar int, 0 for global attention.
    config: the model config.
    kernel: a cache and a block (two segments) of at most 8 query rows go through the CPU kernel
      (`segment_attention`; same math up to float32 rounding; XLA:CPU spends tens of microseconds on
      each of the two small products), where it is usable.
    causal_block: the caller's promise that the last segment is the query block itself (its
      `k_pos` is `q_pos`, its `valid` None) and that every valid key of the earlier segments lies
      at or before every query's position and inside the window (a cache before the block): a
      long block may then run the TPU kernel, whose masks are static.
    stacked_cache: `(keys [L, B, C, S, E], values, layer, starts [B])`: the first of two
      segments is layer `layer` of these stacked buffers, its `k_pos` the slot index and its
      `valid` exactly `slot < starts[b]` (the forward's cache segment). A short block then runs,
      on TPU, the cache kernel (`specjax.kernels.cache_attention`: only the live slots' blocks
      are read, the block segment merged in jnp; same math up to float32 rounding); everywhere
      else this changes nothing.

  Returns:
    `[B, T, H * D]`.
  """
  b, t, h, d = q.shape
  kvh = segments[0][0].shape[1] * (segments[0][0].shape[-1] // d)  # a packed cache's heads too
  q = q.reshape(b, t, kvh, h // kvh, d)
  if long_attention.is_long(q, segments):
    keys, values, k_pos, valid = zip(*segments)
    # The long-block kernels take `[B, KVH, S, D]`: a packed cache segment is unpacked (a
    # prefill's chunk copies the layer's cache once; its own concatenation copies it anyway).
    # An 8-bit float cache is widened to the queries' dtype there too.
    keys = tuple(widen(unpack_heads(k, d), q.dtype) for k in keys)
    values = tuple(widen(unpack_heads(v, d), q.dtype) for v in values)
    out = long_attention.long_attention(
        q, keys, values, k_pos, valid, q_pos, window, scale=config.attention_scale,
        softcap=config.attn_logit_softcap,
        reference=functools.partial(attention_reference, scale=config.attention_scale,
                                    softcap=config.attn_logit_softcap),
        kernel_fits=long_attention.splash_fits(config, causal_block))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h * d).astype(q.dtype)
  masks = []
  for _, _, k_pos, valid in segments:
    visible = k_pos[:, None, :] <= q_pos[:, :, None]  # [B, T, S]
    visible &= (window == 0) | (k_pos[:, None, :] > q_pos[:, :, None] - window)
    if valid is not None:
      visible &= valid
    masks.append(visible)
  keys, values = [s[0] for s in segments], [s[1] for s in segments]
  reference = functools.partial(segment_attention, keys=keys, values=values, masks=masks,
                                scale=config.attention_scale, softcap=config.attn_logit_softcap,
                                kernel=kernel)
  if stacked_cache is None or len(segments) != 2:
    out = reference(q)
  else:
    tpu = functools.partial(_cache_kernel_attention, stacked_cache=stacked_cache,
                            block=segments[1], block_mask=masks[1], q_pos=q_pos, window=window,
                            config=config, reference=reference)
    out = jax.lax.platform_dependent(q, tpu=tpu, default=reference)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h * d).astype(q.dtype)


def _cache_kernel_attention(q, *, stacked_cache, block, block_mask, q_pos, window,
                            config: ModelConfig, reference):
  """TPU: the cache segment's live slots through `specjax.kernels.cache_attention` (inside
  `jax.shard_map` under a mesh, each device on its rows and key/value heads as the sharding rules
  place them), merged with the block segment's scores; `reference(q)` where the kernel does not
  fit (VMEM, slot count) or the mesh splits the cache's layers or slots.
  `[B, KVH, G, T, D]` float32."""
  cache_k, cache_v, layer, starts = stacked_cache
  _, t, _, g, d = q.shape
  _, _, groups, slots, width = cache_k.shape
  scale, softcap = config.attention_scale, config.attn_logit_softcap
  run = functools.partial(cache_kernel.cache_attention, scale=scale, softcap=softcap)
  mesh_shape = auto_mesh_shape()
  if mesh_shape is None:  # one device, or inside the caller's shard_map
    local_groups = groups
  else:
    rules = active_rules()
    cache_spec = rules.spec(("layers", "batch", "kv_heads", "length", None), cache_k.shape,
                            mesh_shape)
    if cache_spec[0] is not None or cache_spec[3] is not None:
      return reference(q)
    # The queries follow the cache's placement (a packed cache's groups may not split where the
    # queries' heads do: each device then attends all heads of its rows).
    q_spec = jax.sharding.PartitionSpec(cache_spec[1], None, cache_spec[2], None, None)
    size = lambda axes: 1 if axes is None else (
        mesh_shape[axes] if isinstance(axes, str) else math.prod(mesh_shape[a] for a in axes))
    local_groups = groups // size(cache_spec[2])
  dtype = read_dtype(q.dtype, cache_k.dtype)
  if not cache_kernel.block_slots(slots, local_groups, (width // d) * g * t, width, dtype,
                                  cache_k.dtype):
    return reference(q)
  layer = jnp.asarray(layer, jnp.int32)
  window = jnp.asarray(window, jnp.int32)
  if mesh_shape is None:
    partials = run(q, cache_k, cache_v, starts, q_pos, layer=layer, window=window)
  else:
    rows = jax.sharding.PartitionSpec(cache_spec[1])
    stat = jax.sharding.PartitionSpec(q_spec[0], q_spec[2], None, None)
    acc = jax.sharding.PartitionSpec(q_spec[0], q_spec[2], None, None, None)
    scalar = jax.sharding.PartitionSpec()
    partials = jax.shard_map(
        lambda q, k, v, s, p, layer, window: run(q, k, v, s, p, layer=layer, window=window),
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(q_spec, cache_spec, cache_spec, rows,
                  jax.sharding.PartitionSpec(cache_spec[1], None), scalar, scalar),
        out_specs=(stat, stat, acc), check_vma=False)(
            q, cache_k, cache_v, starts, q_pos, layer, window)
  block_k, block_v = block[0], block[1]
  scores = _scores(q, block_k) * scale
  if softcap is not None:
    scores = softcap * jnp.tanh(scores / softcap)
  scores = jnp.where(block_mask[:, None, None], scores, -jnp.inf)
  return merge_cache_partials(partials, scores, block_v, d)


def cache_attention_reference(q, keys, values, starts, q_pos, *, layer=0, window=0,
                              scale: float, softcap: float | None = None):
  """`specjax.kernels.cache_attention.cache_attention`'s partial results in jnp, over every slot (the kernel's oracle)."""
  if keys.ndim == 5:
    keys, values = keys[layer], values[layer]
  slots = keys.shape[2]
  s = _scores(q, keys) * scale  # [B, KVH, G, T, S]
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  slot = jnp.arange(slots)[None, None, :]
  pos = jnp.asarray(q_pos)[:, :, None]
  visible = (slot < jnp.asarray(starts)[:, None, None]) & (slot <= pos)
  visible &= (window == 0) | (slot > pos - window)  # [B, T, S]
  s = jnp.where(visible[:, None, None], s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
  return m, p.sum(-1), _weighted_values(p.astype(_probs_dtype(q, values)), values, q.shape[-1])


def merge_cache_partials(partials, block_scores, block_values, head_dim: int):
  """Attention over the cache and the block: the cache's partial results combined with the
  block segment's (masked, scaled, soft-capped) scores.

  Args:
    partials: `(m, l [B, KVH, G, T], acc [B, KVH, G, T, D])` float32 from `specjax.kernels.cache_attention.cache_attention`.
    block_scores: `[B, KVH, G, T, T']` float32 scores of the block's keys, an invisible key at
      `-inf` (every query sees at least its own key).
    block_values: `[B, KVH, T', D]` the block's values.
    head_dim: `D`.

  Returns:
    `[B, KVH, G, T, D]` float32, `attention_reference`'s result over the two segments.
  """
  m, l, acc = partials
  top = jnp.maximum(m, jnp.max(block_scores, axis=-1))
  top = jnp.where(top == -jnp.inf, 0.0, top)
  cache_weight = jnp.exp(m - top)  # 0 where the cache showed nothing
  p = jnp.exp(block_scores - top[..., None])
  total = cache_weight * l + p.sum(-1)
  out = cache_weight[..., None] * acc + _weighted_values(p.astype(_probs_dtype(p, block_values)),
                                                          block_values, head_dim)
  return out / jnp.where(total == 0, 1.0, total)[..., None]  # (0 only where nothing is visible)


def _mlp_activation(x, kind):
  return jax.nn.silu(x) if kind == "silu" else jax.nn.gelu(x, approximate=True)
