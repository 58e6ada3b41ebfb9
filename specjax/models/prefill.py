"""The prefill: a model's forward over right-padded prompts from position 0, into an empty cache.

One function for every prefill (the target's in `specjax.generate` and `specjax.decode`, a draft
model's own in `specjax.drafters.model.ModelDrafter.init`, the calibration's), so the target's
cache is the same in `decode` and in `generate`. Two things keep a long prompt's memory linear in
its length:

  * a model that `selects_logit_rows` scores only each row's last prompt token (`logits_at`):
    `logits` is `[B, 1, V]`, not `[B, T, V]`;
  * off CPU, a prompt batch of more than `PREFILL_TOKENS` tokens runs as a loop of forwards over
    `chunk_length(B, T)` prompt positions at a time, each attending the cache the earlier ones
    wrote (`jax.lax.platform_dependent`: lowered for CPU it is one forward, as before, tokens
    and speed unchanged). One forward's activations, MLP hidden units and per-layer keys/values
    (the `[L, B, T, KVH, D]` block the layer scan returns before writing the cache) then cover
    `B x chunk` tokens, not `B x T`. The last chunk is clamped to end at `T`: it recomputes a
    few positions of the one before it (same keys and values, rewritten in their slots). Every
    row of a chunk starts at the same slot, so a model that `defers_cache_writes` has its keys
    and values written with one `dynamic_update_slice` per buffer, and on TPU the stacked cache
    leaves the loop in the layout the decode loop keeps it in (`_decode_layout`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from specjax.core.cache import KVCache, match_block, to_cache

__all__ = ["PREFILL_TOKENS", "chunk_length", "prefill"]

# Prompt tokens (rows x positions) one forward of a chunked prefill covers at most.
PREFILL_TOKENS = 8192
# A chunk is a multiple of this many positions (the attention kernels' tile), and at least one.
CHUNK_MULTIPLE = 128


def chunk_length(batch: int, width: int) -> int:
  """Prompt positions per forward of a chunked prefill: `PREFILL_TOKENS / batch` rounded down to
  a multiple of `CHUNK_MULTIPLE` (at least that), or `width` (one forward) when the batch's
  prompts fit `PREFILL_TOKENS`."""
  if batch * width <= PREFILL_TOKENS:
    return width
  chunk = max(CHUNK_MULTIPLE, PREFILL_TOKENS // batch // CHUNK_MULTIPLE * CHUNK_MULTIPLE)
  return min(chunk, width)


def prefill(model, tokens, cache, lengths=None, **features):
  """The model's forward over right-padded prompts from position 0, into `cache`.

  Args:
    model: a model (the model protocol: `model(tokens, starts, cache, **features)`).
    tokens: `[B, T]` int32 prompts, right-padded.
    cache: the model's empty KV cache of at least `T` slots.
    lengths: `[B]` int32 prompt lengths; None: every row is `T` long.
    **features: forward options (`taps`, `return_hidden`: `specjax.loop.state.target_features`).

  Returns:
    The `ForwardOutput` of the whole prompt: its cache (`lengths = T`), hidden state and taps
    over all `T` positions where asked. From a model that `selects_logit_rows`, `logits` is the
    last prompt token's only, `[B, 1, V]` (and the prefill may run in chunks off CPU, see the
    module docstring); from any other model, `[B, T, V]`.
  """
  batch, width = tokens.shape
  zeros = jnp.zeros((batch,), jnp.int32)
  if not getattr(model, "selects_logit_rows", False):
    return model(tokens, zeros, cache, **features)
  last = (jnp.full((batch,), width, jnp.int32) if lengths is None
          else jnp.asarray(lengths, jnp.int32)) - 1

  def whole(tokens, cache, last):
    return model(tokens, zeros, cache, logits_at=last[:, None], **features)

  chunk = chunk_length(batch, width)
  if chunk >= width:
    return whole(tokens, cache, last)
  chunked = functools.partial(_chunked, model, chunk=chunk, features=features)
  return jax.lax.platform_dependent(tokens, cache, last, cpu=whole, default=chunked)


def _chunked(model, tokens, cache, last, *, chunk: int, features: dict):
  """`prefill` as a `lax.fori_loop` of forwards over `chunk` positions (see the module
  docstring): the same `ForwardOutput` as one forward."""
  batch, width = tokens.shape
  count = -(-width // chunk)
  defers = getattr(model, "defers_cache_writes", False)

  def run(start, cache):
    # Row b's logits are those at its last token, in whichever chunk holds it.
    at = jnp.clip(last - start, 0, chunk - 1)[:, None]
    block = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
    starts = jnp.full((batch,), start, jnp.int32)
    if not defers:
      return model(block, starts, cache, logits_at=at, **features)
    # Every row writes at the same slot: one dynamic_update_slice per buffer, in place.
    out = model(block, starts, cache, logits_at=at, write_cache=False, **features)
    return out._replace(cache=_write_at(cache, out.block_kv, start), block_kv=None)

  # The first chunk outside the loop gives the carry's shapes and dtypes.
  first = run(jnp.int32(0), cache)

  def body(i, out):
    start = jnp.minimum(i * chunk, width - chunk)
    step = run(start, out.cache)
    mine = ((last >= start) & (last < start + chunk))[:, None, None]
    hidden, taps = out.hidden, out.taps
    if hidden is not None:
      hidden = jax.lax.dynamic_update_slice_in_dim(hidden, step.hidden, start, axis=1)
    if taps is not None:
      taps = jax.lax.dynamic_update_slice_in_dim(taps, step.taps, start, axis=2)
    return out._replace(logits=jnp.where(mine, step.logits, out.logits), hidden=hidden,
                        taps=taps, cache=step.cache)

  pad = lambda x, axis: None if x is None else jnp.pad(
      x, [(0, width - chunk if a == axis else 0) for a in range(x.ndim)])
  out = first._replace(hidden=pad(first.hidden, 1), taps=pad(first.taps, 2))
  return jax.lax.fori_loop(1, count, body, out)


def _write_at(cache, block, start):
  """`cache` with `block` (a `KVBlock`) written at slots `start ..` of every row."""
  write = lambda buffer, x, axis: jax.lax.dynamic_update_slice_in_dim(
      buffer, to_cache(jnp.swapaxes(match_block(x, buffer), axis - 1, axis), buffer.dtype), start,
      axis=axis)
  if cache.per_layer:  # per layer: `[B, KVH, S, D]` buffers, `[B, T, KVH, D]` blocks
    ks, vs = tuple(block.k), tuple(block.v)
    return KVCache(tuple(write(c, x, 2) for c, x in zip(cache.k, ks)),
                   tuple(write(c, x, 2) for c, x in zip(cache.v, vs)),
                   jnp.full_like(cache.lengths, start + ks[0].shape[1]))
  k = jnp.stack(block.k) if isinstance(block.k, (tuple, list)) else block.k
  v = jnp.stack(block.v) if isinstance(block.v, (tuple, list)) else block.v
  return KVCache(_decode_layout(write(cache.k, k, 3)), _decode_layout(write(cache.v, v, 3)),
                 jnp.full_like(cache.lengths, start + k.shape[2]))


def _decode_layout(buffer):
  """A stacked `[L, B, KVH, S, D]` cache buffer pinned, on TPU, to its row-major layout: the one
  attention's einsums read and the decode loop's writes keep (`specjax.models.cache_write`
  writes it with a Pallas kernel that fixes that layout), so the loop takes the prefill's buffer
  as it is instead of a relayout copy (a second cache at the peak). Elsewhere unchanged."""
  pinned = lambda x: with_layout_constraint(x, Layout((0, 1, 2, 3, 4)))
  return jax.lax.platform_dependent(buffer, tpu=pinned, default=lambda x: x)
