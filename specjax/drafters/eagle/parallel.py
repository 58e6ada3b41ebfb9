"""The placeholder slots of a parallel-drafting EAGLE head (P-EAGLE-style).

A head with `HeadConfig.parallel = P > 0` carries two `[P, E]` parameters, `parallel_embed` and
`parallel_feature` (`network.init_head` draws them). In a drafting forward
(`specjax.drafters.eagle.drafter`) and in the training-time unroll
(`specjax.training.heads.eagle_unroll`), slot `j >= 1` after the first drafted token reads
`parallel_embed[j - 1]` in place of a token's embedding and `parallel_feature[j - 1]` in place of
a feature, so every draft of a round comes out of one forward, before any of the drafts it
follows exist. A head in vLLM's P-EAGLE layout (`HeadConfig.parallel_reads_first=False`, imported
by `specjax.drafters.load_eagle3`) has no first-draft slot: its slot `j >= 0` reads placeholder
`j`, every row the embedding of its `ptd_token_id` and its projected `mask_hidden`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.eagle import network as eagle
from specjax.drafters.eagle.network import EagleHead
from specjax.models.transformer import attention

__all__ = ["committed_segment", "group_logits", "max_slots", "parallel_inputs",
           "placeholders"]


def placeholders(head: EagleHead, index, shape: tuple[int, ...], dtype):
  """`(embedded, features)`: placeholder slot(s) `index` (an int, or a slice of slots) broadcast
  to `shape` (`[..., E]`) in `dtype`, the inputs `head_qkv` reads with `embed=None`."""
  p = head.params
  take = lambda name: jnp.broadcast_to(p[name][index].astype(dtype), shape)
  return take("parallel_embed"), take("parallel_feature")


def parallel_inputs(head: EagleHead, embed: jax.Array, token: jax.Array, feature: jax.Array,
                    count: int) -> tuple[jax.Array, jax.Array]:
  """The inputs of a parallel head's drafting forward: `count` slots per row, the first at the
  position after the head's last committed pair.

  With `config.parallel_reads_first` (specjax's heads) slot 0 is the ordinary pair `(feature,
  token)` (the head's guess of the feature at the first drafted token's position, that token)
  and slots `1 .. count - 1` read the placeholders `parallel_embed[j - 1]` and
  `parallel_feature[j - 1]`. Without it (vLLM's P-EAGLE layout) every slot `j` reads placeholder
  `j` and `token` / `feature` are unused. Either way the forward's output at slot `j` predicts
  the draft `j + 2` tokens ahead of the stored logits, without the drafts between.

  Args:
    head: a parallel head with enough slots: `count <= max_slots(head)`.
    embed: `[V, E]` the target's embedding table.
    token: `[B]` int32 the first drafted token.
    feature: `[B, E]` the head's output feature that precedes it.
    count: slots, `>= 1`.

  Returns:
    `(embedded [B, count, E], features [B, count, E])` for `head_forward(head, None, ...)`.
  """
  c = head.config
  if not 1 <= count <= max_slots(head):
    raise ValueError(f"a head with {c.parallel} placeholder slots drafts at most "
                     f"{max_slots(head) + 1} tokens a round; asked for {count + 1}")
  dtype = feature.dtype
  shape = (token.shape[0], count, c.embed_dim)
  if not c.parallel_reads_first:
    return placeholders(head, slice(0, count), shape, dtype)
  rest_embed, rest_feature = placeholders(head, slice(0, count - 1),
                                          (token.shape[0], count - 1, c.embed_dim), dtype)
  return (jnp.concatenate([embed[token].astype(dtype)[:, None], rest_embed], axis=1),
          jnp.concatenate([feature[:, None], rest_feature], axis=1))


def max_slots(head: EagleHead) -> int:
  """The most slots a drafting forward of this parallel head holds: `P + 1` when the first reads
  the first draft, else `P` (every slot a placeholder)."""
  c = head.config
  return c.parallel + 1 if c.parallel_reads_first else c.parallel


def committed_segment(cache, base: jax.Array):
  """The head cache's committed slots `0 .. base` (`[B]`) as an `attention` segment."""
  batch, size = base.shape[0], cache.max_len
  slot_positions = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (batch, size))
  committed = (slot_positions <= base[:, None])[:, None, :]  # [B, 1, S]
  return cache.k[0], cache.v[0], slot_positions, committed


def group_logits(head: EagleHead, embed: jax.Array, state, lengths: jax.Array,
                 tokens: jax.Array, slots: int) -> jax.Array:
  """A parallel head's drafting forward for `G` first drafts per row at once: `[B, G, S, N]`
  draft-vocabulary logits (the chain drafts with `G = 1`, a tree with one group per depth-1
  node).

  Group `g` holds the `slots` slots of `parallel_inputs` with first draft `tokens[:, g]`, from
  position `L - 1`; slot `j`'s logits are those of the draft `j + 2` tokens ahead of the stored
  logits. Every slot attends to the committed slots `0 .. L - 2` of the head's cache and to the
  slots of its own group up to itself (one attention call over a block-diagonal causal mask);
  the cache is read, never written.

  Args:
    head: a parallel head; embed: `[V, E]` the target's embedding table.
    state: the drafter's `EagleState` (its `cache` and `hidden`).
    lengths: `[B]` int32 tokens per row (`L`).
    tokens: `[B, G]` int32 first drafts (target ids).
    slots: `S`, `1 <= S <= max_slots(head)`.
  """
  c = head.config
  batch, groups = tokens.shape
  embedded, features = parallel_inputs(head, embed, tokens.reshape(-1),
                                       jnp.repeat(state.hidden, groups, axis=0), slots)
  embedded = embedded.reshape(batch, groups * slots, c.embed_dim)
  features = features.reshape(batch, groups * slots, c.embed_dim)
  slot = jnp.tile(jnp.arange(slots, dtype=jnp.int32), groups)  # [G * S]
  group = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), slots)
  positions = (lengths.astype(jnp.int32) - 1)[:, None] + slot[None]  # [B, G * S]
  q, k, v = eagle.head_qkv(head, None, embedded, features, positions)
  same_group = jnp.broadcast_to(group[:, None] == group[None, :],
                                (batch, groups * slots, groups * slots))
  segments = [committed_segment(state.cache, lengths.astype(jnp.int32) - 2),
              (k.swapaxes(1, 2), v.swapaxes(1, 2), positions, same_group)]
  attn = attention(q, segments, positions, jnp.int32(0), c.layer_config)
  logits, _ = eagle.head_finish(head, features, attn)
  return logits.reshape(batch, groups, slots, -1)
