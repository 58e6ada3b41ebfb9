"""Medusa heads on the target's final hidden state as a `Drafter`.

`MedusaDrafter` keeps the target's final hidden state at the last position whose token the
target scored and kept (`lengths - 2` between rounds); head `i` reads it and predicts
`token_{lengths + i}`, so all `k` drafts come out of one forward.

Sampling: `specjax.drafters.draft_vocab`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.drafters.base import Drafter
from specjax.drafters.draft_vocab import draft_tokens, take_rows
from specjax.drafters.proposal import (Proposal, check_confidence, proposed_count,
                                       top_probability)
from specjax.drafters.medusa import network as medusa

__all__ = ["MedusaDrafter", "MedusaState"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MedusaState:
  hidden: jax.Array  # [B, E] the target's final hidden state at position lengths - 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Drafter):
  """Medusa heads as a `Drafter`: all `k` drafts from one forward over the target's final
  hidden state. `num_draft` may not exceed the number of heads.

  Attributes:
    heads: `MedusaHeads`.
    confidence: None, or a threshold in (0, 1]: a row proposes only its leading drafts whose
      head's top probability (raw softmax) is at least this (exact: see
      `specjax.drafters.model`; all heads still run in their one forward).
  """

  heads: Any
  confidence: float | None = dataclasses.field(default=None, metadata=dict(static=True))

  taps = ()
  needs_hidden = True

  @property
  def vocab_size(self) -> int:
    return int(self.heads.config.vocab_size)

  @property
  def num_heads(self) -> int:
    return medusa.num_heads(self.heads)

  @property
  def max_draft(self) -> int:
    return self.num_heads

  def __post_init__(self):
    object.__setattr__(self, "confidence", check_confidence(self.confidence))

  def forwards_per_round(self, num_draft: int) -> int:
    del num_draft
    return 1

  def init(self, tokens, lengths, buffer_len, prefill):
    del tokens, buffer_len
    if prefill.hidden is None:
      raise ValueError("the target forward returned no hidden state for the Medusa heads")
    return MedusaState(take_rows(prefill.hidden, lengths - 2))

  def full_logits(self, logits: jax.Array) -> jax.Array:
    return medusa.to_target_logits(self.heads, logits)

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, limits=None,
              stop=None):
    del sequence
    if num_draft > self.num_heads:
      raise ValueError(f"num_draft ({num_draft}) exceeds the number of Medusa heads "
                       f"({self.num_heads})")
    hidden = state.hidden[:, None]  # [B, 1, E]
    logits = medusa.medusa_forward(self.heads, hidden)[:, 0, :num_draft]  # [B, k, N]
    positions = lengths[:, None] + jnp.arange(num_draft, dtype=jnp.int32)  # [B, k]
    tokens, full = draft_tokens(logits, self.heads.draft_ids, self.full_logits, sampling,
                                seeds[:, None], positions)
    tops = top_probability(logits)  # [B, k]: head j's does not depend on the drafts before it
    return state, Proposal(tokens, full, proposed_count(tops, self.confidence, stop, limits), tops)

  def observe(self, state, scored, block, emitted, count, lengths):
    del block, emitted, lengths
    hidden = take_rows(scored.hidden, count - 1)
    return MedusaState(jnp.where((count > 0)[:, None], hidden, state.hidden))
