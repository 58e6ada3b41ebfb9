"""Deliberately broken grammar-constrained speculation, for the tests' power checks.

Each is a `GrammarDrafter` (chains) or a `GrammarTreeDrafter` (trees) with one step wrong;
`specjax.decode` runs one through the real loop when it is passed as the drafter (`wrap` builds
it from the wrapper a constraint gives; a tree variant with `tree=` its spec). The exactness
tests must reject every one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.constrain.law import constrained_logits, stuck
from specjax.drafters.grammar import GrammarDrafter
from specjax.drafters.grammar_tree import GrammarTreeDrafter
from specjax.core.sampling import warp_logits

__all__ = ["MasksPOnly", "MasksQOnly", "RoundStartMask", "TreeMasksPOnly", "TreeMasksQOnly",
           "TreeRootMask", "wrap"]


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeMasksPOnly(GrammarTreeDrafter):
  """Builds the tree from the unrestricted (warped) `q`: children drawn from it and reported
  with it, the disallowed ones dropped afterwards, the target's `p` restricted at every node.
  Dropping a child the rule would have rejected skips its residual step: the i.i.d. rule's
  correction is then drawn from the wrong residual."""

  def draft_law(self, logits, mask, sampling):
    logits = logits.astype(jnp.float32)
    return logits if sampling.greedy else warp_logits(logits, sampling)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeMasksQOnly(GrammarTreeDrafter):
  """Builds the tree from the restricted `q` but verifies against the target's unrestricted
  (warped) `p` at every node."""

  def target_law(self, logits, states, sampling):
    return MasksQOnly.target_law(self, logits, states, sampling)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeRootMask(GrammarTreeDrafter):
  """Local masking done carelessly: every node's `p` is restricted with the root's state, not
  the state the path to the node leads to."""

  def target_law(self, logits, states, sampling):
    mask = self.mask(jnp.broadcast_to(states[:, :1], states.shape))
    return constrained_logits(logits, mask, sampling), stuck(logits, mask)


def wrap(kind: type, drafter):
  """`drafter` (a `GrammarDrafter`, or a `GrammarTreeDrafter` for the tree variants) as the
  broken variant `kind`."""
  return kind(drafter.drafter, drafter.tables, drafter.schema)
