"""A small decoder-only transformer in Flax (NNX and Linen) that speaks specjax's cache protocol.

Both modules map `(tokens [B, T], starts [B], cache: KVCache) -> (logits [B, T, V], KVCache)`:
keys and values of the block are written into the fixed-shape cache at each row's own offset
(`specjax.core.cache.write_block`) and the returned cache's lengths are `starts + T`. That is all
`specjax.decode` needs from a model; `specjax.models.adapter` turns either module plus its
parameters into a pytree following the specjax model protocol. They are deliberately plain
(learned absolute positions, clipped to the table: `_positions`; pre-norm, multi-head attention,
GELU MLP): a template for adapting your own Flax model, not a replacement for the built-in
Llama/Gemma decoder. Flax is not in the core install: `pip install 'specjax[train]'` brings it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.core.extras import require
from specjax.core.cache import KVCache, write_block

nn = require("flax.linen", "train")
nnx = require("flax.nnx", "train")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Attributes: vocabulary, widths, depth and context length of the Flax decoder."""

  vocab_size: int = 64
  embed_dim: int = 32
  num_layers: int = 2
  num_heads: int = 4
  mlp_dim: int = 64
  max_len: int = 128

  @property
  def head_dim(self) -> int:
    return self.embed_dim // self.num_heads


def cached_attention(q, k, v, starts, cache: KVCache, layer: int):
  """Causal attention of a block against the cache, after writing the block's keys/values.

  Args:
    q, k, v: `[B, T, H, D]` the block's projections.
    starts: `[B]` int32 slot of each row's first block token.
    cache: the cache; layer `layer` is updated.

  Returns:
    `(out [B, T, H, D], cache with layer updated)`.
  """
  keys = write_block(cache.k[layer], k, starts)  # [B, H, S, D]
  values = write_block(cache.v[layer], v, starts)
  cache = dataclasses.replace(cache, k=cache.k.at[layer].set(keys),
                              v=cache.v.at[layer].set(values))
  q_pos = starts[:, None] + jnp.arange(q.shape[1])  # [B, T]
  k_pos = jnp.arange(keys.shape[2])  # [S]
  mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, T, S]: stale slots are in the future
  scores = jnp.einsum("bthd,bhsd->bhts", q, keys.astype(q.dtype)) / jnp.sqrt(q.shape[-1])
  scores = jnp.where(mask[:, None], scores, -1e30)
  out = jnp.einsum("bhts,bhsd->bthd", jax.nn.softmax(scores, axis=-1), values.astype(q.dtype))
  return out, cache


def _positions(tokens, starts, max_len: int):
  """`[B, T]` indices into the learned position table: `starts + t`, clipped to `max_len - 1`.

  Speculative decoding feeds a round's drafts after each row's last token, so the last rounds of
  a decode that runs to the full context (prompt + `max_new_tokens` = `max_len`) score drafts at
  positions up to `max_len + k - 1`. Those drafts lie past every row's limit and are never
  emitted, and causal attention keeps them out of the logits of every earlier position, so any
  finite embedding there leaves the emitted tokens exact. An index past the table would not be
  finite: `jnp.take` fills it with NaN, and the NaN values reach every position of the row's
  block through the attention's `0 * NaN`. Clipping keeps them finite, and decode accepts every
  prompt `generate` accepts, with no slots reserved for the last round.
  """
  positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
  return jnp.minimum(positions, max_len - 1)


# --------------------------------------------------------------------------------------------
# NNX.
# --------------------------------------------------------------------------------------------

class NNXBlock(nnx.Module):
  def __init__(self, config: DecoderConfig, rngs: nnx.Rngs):
    e = config.embed_dim
    self.heads = config.num_heads
    self.attn_norm = nnx.RMSNorm(e, rngs=rngs)
    self.qkv = nnx.Linear(e, 3 * e, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(e, e, use_bias=False, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(e, rngs=rngs)
    self.up = nnx.Linear(e, config.mlp_dim, rngs=rngs)
    self.down = nnx.Linear(config.mlp_dim, e, rngs=rngs)

  def __call__(self, x, starts, cache, layer):
    b, t, e = x.shape
    q, k, v = jnp.split(self.qkv(self.attn_norm(x)).reshape(b, t, 3 * self.heads, -1), 3, axis=2)
    attended, cache = cached_attention(q, k, v, starts, cache, layer)
    x = x + self.out(attended.reshape(b, t, e))
    return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x)))), cache


class NNXDecoder(nnx.Module):
  """The Flax NNX decoder: `module(tokens, starts, cache) -> (logits, cache)`."""

  def __init__(self, config: DecoderConfig, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.embed_dim, rngs=rngs)
    self.position = nnx.Embed(config.max_len, config.embed_dim, rngs=rngs)
    self.blocks = nnx.List([NNXBlock(config, rngs) for _ in range(config.num_layers)])
    self.final_norm = nnx.RMSNorm(config.embed_dim, rngs=rngs)
    self.head = nnx.Linear(config.embed_dim, config.vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens, starts, cache: KVCache):
    x = self.embed(tokens) + self.position(_positions(tokens, starts, self.config.max_len))
    for layer, block in enumerate(self.blocks):
      x, cache = block(x, starts, cache, layer)
    logits = self.head(self.final_norm(x)).astype(jnp.float32)
    return logits, cache.with_lengths(starts + tokens.shape[1])


# --------------------------------------------------------------------------------------------
# Linen.
# --------------------------------------------------------------------------------------------

class LinenBlock(nn.Module):
  config: DecoderConfig

  @nn.compact
  def __call__(self, x, starts, cache, layer):
    b, t, e = x.shape
    h = self.config.num_heads
    qkv = nn.Dense(3 * e, use_bias=False, name="qkv")(nn.RMSNorm(name="attn_norm")(x))
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * h, -1), 3, axis=2)
    attended, cache = cached_attention(q, k, v, starts, cache, layer)
    x = x + nn.Dense(e, use_bias=False, name="out")(attended.reshape(b, t, e))
    hidden = nn.Dense(self.config.mlp_dim, name="up")(nn.RMSNorm(name="mlp_norm")(x))
    return x + nn.Dense(e, name="down")(jax.nn.gelu(hidden)), cache


class LinenDecoder(nn.Module):
  """The Flax Linen decoder: `apply(params, tokens, starts, cache) -> (logits, cache)`."""

  config: DecoderConfig

  @nn.compact
  def __call__(self, tokens, starts, cache: KVCache):
    c = self.config
    x = (nn.Embed(c.vocab_size, c.embed_dim, name="embed")(tokens)
         + nn.Embed(c.max_len, c.embed_dim, name="position")(
             _positions(tokens, starts, c.max_len)))
    for layer in range(c.num_layers):
      x, cache = LinenBlock(c, name=f"block_{layer}")(x, starts, cache, layer)
    x = nn.RMSNorm(name="final_norm")(x)
    logits = nn.Dense(c.vocab_size, use_bias=False, name="head")(x).astype(jnp.float32)
    return logits, cache.with_lengths(starts + tokens.shape[1])
