"""Deliberately broken grammar-constrained speculation, for the tests' power checks.

Each is a `GrammarDrafter` with one step wrong; `specjax.decode` runs one through the real loop
when it is passed as the drafter (`wrap` builds it from the `GrammarDrafter` a constraint
gives). The exactness tests must reject every one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.constrain.law import constrained_logits, stuck
from specjax.drafters.grammar import GrammarDrafter
from specjax.core.sampling import warp_logits

__all__ = ["MasksPOnly", "MasksQOnly", "RoundStartMask", "wrap"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MasksPOnly(GrammarDrafter):
  """Drafts from the restricted `q` but tells the verify the unrestricted (warped) `q`."""

  def reported_q(self, restricted, raw, sampling):
    return raw if sampling.greedy else warp_logits(raw.astype(jnp.float32), sampling)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MasksQOnly(GrammarDrafter):
  """Restricts the drafts' `q` but verifies against the target's unrestricted (warped) `p`."""

  def target_law(self, logits, states, sampling):
    logits = logits.astype(jnp.float32)
    law = logits if sampling.greedy else warp_logits(logits, sampling)
    return law, jnp.zeros(states.shape, bool)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundStartMask(GrammarDrafter):
  """Local masking done carelessly: every block position's `p` is restricted with the state at
  the round's start, not the state the drafts before it lead to."""

  def target_law(self, logits, states, sampling):
    mask = self.mask(jnp.broadcast_to(states[:, :1], states.shape))
    return constrained_logits(logits, mask, sampling), stuck(logits, mask)


def wrap(kind: type, drafter: GrammarDrafter) -> GrammarDrafter:
  """`drafter` (a `GrammarDrafter`) as the broken variant `kind`."""
  return kind(drafter.drafter, drafter.tables, drafter.schema)
