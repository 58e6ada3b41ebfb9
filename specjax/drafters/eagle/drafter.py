"""EAGLE-3 and MTP heads on the target's own features as a `Drafter`.

`EagleDrafter` wraps an `EagleHead` (`specjax.drafters.eagle.network`). The head is one decoder layer
with its own KV cache; its entry at slot `t` reads the pair `(feature_t, token_{t+1})` and its
output predicts `token_{t+2}` (and stands in for `feature_{t+1}` when drafting on). Features are
the target's taps projected by the head's `fc` (EAGLE-3, `head.config.taps` non-empty) or the
target's final normed hidden state (MTP, `taps == ()`).

Invariant between rounds, per row with `L = lengths[b]`: the head's cache holds the pairs of
slots `0 .. L - 2`, each built from the *target's* feature (never the head's own prediction of
it), and `hidden`/`logits` are the head's output at slot `L - 2`, i.e. its guess for the feature
at `L - 1` and its logits for `token_L`.

* `init` runs the head over the prompt's pairs (the target's prefill features).
* `propose` samples `d_1` from the stored logits, then runs `k - 1` single-token steps, each
  feeding the previous step's output feature with the token just drafted (fewer when a
  `confidence` threshold stops every row early: `specjax.drafters.model.draft_chain`).
* `observe` runs the head over the round's verified block: block index `j < count` holds the
  target's feature for position `lengths - 1 + j`, paired with `emitted[j]` (token
  `lengths + j`). That overwrites the slots the drafting steps filled with the head's own
  features, so rejected drafts roll back for free, and it leaves the output at the last kept
  entry as the next round's starting point. Per round the head runs `k` forwards.

A parallel head (`head.config.parallel = P > 0`, P-EAGLE-style) drafts all of a round in one
forward instead of `k - 1` steps: `d_1` from the stored logits as above, then one forward over
`k - 1` slots, slot 0 the pair `(hidden, d_1)` and slots `1 .. k - 2` the head's learned
placeholders (`specjax.drafters.eagle.parallel`); slot `j`'s logits give `d_{j+2}`. Draft
`d_{j+2}` is drawn from that slot's own distribution, which depends on `d_1` but not on the
drafts between, and that distribution is the `q` the verify receives: exact like every proposal
whose `q` is the law each draft was drawn from. Per round the head runs two forwards, whatever
`k <= P + 2`. A head in vLLM's P-EAGLE layout (`parallel_reads_first=False`) drafts the same way
with placeholders in every slot, `d_2 ..` conditioned on the verified text alone (`k <= P + 1`).

Sampling: `specjax.drafters.draft_vocab`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.core.cache import KVCache
from specjax.drafters.base import Drafter
from specjax.drafters.draft_vocab import draft_tokens, take_rows
from specjax.drafters.model import draft_chain
from specjax.drafters.proposal import (Proposal, check_confidence, proposed_count,
                                       top_probability)
from specjax.drafters.eagle import network as eagle
from specjax.drafters.eagle.parallel import group_logits, max_slots

__all__ = ["EagleDrafter", "EagleState"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EagleState:
  """The head's state between rounds (see the module docstring for the invariant)."""

  cache: KVCache  # the head's own 1-layer cache; lengths = L - 1
  hidden: jax.Array  # [B, E] head output at slot L - 2 (its guess for feature_{L-1})
  logits: jax.Array  # [B, N] draft-vocabulary logits for token_L from that output


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EagleDrafter(Drafter):
  """An EAGLE-3 head (taps) or an MTP head (final hidden state) as a `Drafter`.

  Attributes:
    head: an `EagleHead`.
    target_embed: `[V, E]` the target's input embedding (the head embeds tokens with it).
    confidence: None, or a threshold in (0, 1]: a row stops drafting at its first draft whose
      top probability under the head (softmax of its draft-vocabulary logits, temperature 1) is
      below it; drafting ends once every row has stopped. Exact: see
      `specjax.drafters.model` (static: a new value compiles a new program).
  """

  head: Any
  target_embed: jax.Array
  confidence: float | None = dataclasses.field(default=None, metadata=dict(static=True))

  def __post_init__(self):
    object.__setattr__(self, "confidence", check_confidence(self.confidence))
    config = getattr(self.head, "config", None)
    shape = getattr(self.target_embed, "shape", None)  # absent for pytree placeholders
    if config is not None and shape is not None and tuple(shape) != (config.vocab_size,
                                                                     config.embed_dim):
      raise ValueError(f"target_embed has shape {tuple(shape)}, the head expects "
                       f"[{config.vocab_size}, {config.embed_dim}] (the target's embedding)")

  @property
  def taps(self) -> tuple[int, ...]:
    return tuple(self.head.config.taps)

  @property
  def needs_hidden(self) -> bool:
    return not self.taps

  @property
  def vocab_size(self) -> int:
    return int(self.head.config.vocab_size)

  @property
  def max_draft(self) -> int | None:
    """The longest round a parallel head drafts (`parallel + 2`, or `parallel + 1` in vLLM's
    P-EAGLE layout); None for a sequential head."""
    return max_slots(self.head) + 1 if self.head.config.parallel else None

  def forwards_per_round(self, num_draft: int) -> int:
    if self.head.config.parallel:
      return 1 + (num_draft > 1)
    return num_draft

  def features(self, out) -> jax.Array:
    """The head's input features `[B, T, E]` from a target `ForwardOutput`."""
    source = out.taps if self.taps else out.hidden
    if source is None:
      raise ValueError("the target forward returned no "
                       + ("taps" if self.taps else "hidden state") + " for this head")
    return eagle.project_features(self.head, source)

  def _run(self, tokens, features, starts, cache):
    return eagle.head_forward(self.head, self.target_embed, tokens, features, starts, cache)

  def init(self, tokens, lengths, buffer_len, prefill):
    batch = tokens.shape[0]
    # Pair t = (feature_t, token_{t+1}); the pad after the last pair only feeds unused slots.
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    cache = self.head.init_cache(batch, buffer_len)
    # Zero starts that XLA cannot see are zero: with literal zeros, the attention over the empty
    # cache is a constant that XLA folds, for minutes at large batch.
    starts = jnp.minimum(lengths, 0).astype(jnp.int32)
    logits, hidden, cache = self._run(shifted, self.features(prefill), starts, cache)
    last = lengths - 2  # the last prompt pair; a 1-token prompt has none (any q stays exact)
    return EagleState(cache.with_lengths(jnp.maximum(lengths - 1, 0)), take_rows(hidden, last),
                      take_rows(logits, last))

  def full_logits(self, logits: jax.Array) -> jax.Array:
    """Draft-vocabulary logits `[..., N]` -> `[..., V]` (`-inf` outside the draft vocabulary)."""
    return eagle.to_target_logits(self.head, logits)

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, limits=None,
              stop=None):
    del sequence
    if self.head.config.parallel:
      return self._propose_parallel(state, lengths, num_draft, sampling, seeds, limits, stop)
    draft = lambda logits, positions: draft_tokens(logits, self.head.draft_ids, self.full_logits,
                                                   sampling, seeds, positions)
    first, first_logits = draft(state.logits, lengths)  # [B], [B, V] or None

    def step(carry, i, token):
      cache, hidden = carry
      # Pair (guessed feature_{L-2+i}, d_i) at slot L - 2 + i predicts token_{L+i}.
      logits, out, cache = self._run(token[:, None], hidden[:, None], lengths - 2 + i, cache)
      next_token, next_logits = draft(logits[:, 0], lengths + i)
      return (cache, out[:, 0]), (next_token, next_logits, logits[:, 0])

    (cache, _), proposal = draft_chain(step, (state.cache, state.hidden),
                                       (first, first_logits, state.logits), num_draft,
                                       confidence=self.confidence, limits=limits, stop=stop)
    # Entries past the committed pairs are scratch that `observe` overwrites; lengths stay.
    state = dataclasses.replace(state, cache=cache.with_lengths(state.cache.lengths))
    return state, proposal

  def _propose_parallel(self, state, lengths, num_draft, sampling, seeds, limits, stop):
    """All `k` drafts of a parallel head: `d_1` from the stored logits, the rest from one forward
    (see the module docstring); confidence, stop rules and limits trim it (`proposed_count`)."""
    if num_draft > self.max_draft:
      raise ValueError(f"num_draft ({num_draft}) exceeds what this parallel head drafts in one "
                       f"forward ({self.max_draft}: from {self.head.config.parallel} "
                       "placeholder slots)")
    first, first_full = draft_tokens(state.logits[:, None], self.head.draft_ids,
                                     self.full_logits, sampling, seeds[:, None], lengths[:, None])
    raw, tokens, full = state.logits[:, None], first, first_full
    if num_draft > 1:
      # Slot L - 1 holds (hidden, d_1); the placeholders follow it. The head's cache is only
      # read: `observe` writes the round's pairs from the target's features.
      logits = group_logits(self.head, self.target_embed, state, lengths, first,
                            num_draft - 1)[:, 0]
      positions = lengths[:, None] + jnp.arange(1, num_draft, dtype=jnp.int32)
      rest, rest_full = draft_tokens(logits, self.head.draft_ids, self.full_logits, sampling,
                                     seeds[:, None], positions)
      raw = jnp.concatenate([raw, logits], axis=1)
      tokens = jnp.concatenate([tokens, rest], axis=1)
      if full is not None:
        full = jnp.concatenate([full, rest_full], axis=1)
    tops = top_probability(raw)  # [B, k]
    return state, Proposal(tokens, full, proposed_count(tops, self.confidence, stop, limits), tops)

  def observe(self, state, scored, block, emitted, count, lengths):
    del block
    # Block index j: the target's feature at position lengths - 1 + j with token emitted[j].
    logits, hidden, cache = self._run(emitted.astype(jnp.int32), self.features(scored),
                                      lengths - 1, state.cache)
    kept = count > 0  # rows that are done keep their state
    last = count - 1
    return EagleState(
        cache.with_lengths(jnp.where(kept, lengths - 1 + count, state.cache.lengths)),
        jnp.where(kept[:, None], take_rows(hidden, last), state.hidden),
        jnp.where(kept[:, None], take_rows(logits, last), state.logits))
