"""What a drafter returns each round (`Proposal`) and the confidence helpers of its stop rule.

A chain drafter's `propose` returns a `Proposal`: `k` draft tokens per row, the logits of the
distributions they were drawn from (None: a point mass), and optionally a per-row draft count and
per-slot confidences. The helpers turn a drafter's top probabilities into how many drafts a row
keeps (`confident_count`, `stopped_count`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Proposal", "check_confidence", "confident_count", "proposed_count", "stopped_count",
           "top_probability"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
  """One round of drafts.

  Attributes:
    tokens: `[B, k]` int32 draft tokens.
    logits: `[B, k, V]` float32 raw logits of the distribution each draft was sampled from, over
      the full vocabulary (`-inf` outside a reduced draft vocabulary); None = point mass (the
      drafter proposed deterministically: n-gram lookup, argmax).
    num_drafted: `[B]` int32 in `[0, k]`: row `b` proposes only `tokens[b, :num_drafted[b]]`
      (a confidence stop); later entries are not drafts, and the verify samples the token at
      slot `num_drafted[b]` from the target (the bonus). None = every row proposes all `k`.
    confidence: `[B, k]` float32 the drafter's top probability at each slot it decided (its
      stop rule's input; 0 past the slot where every row had stopped), or None.
    grammar_states: `[B, k + 1]` int32 under a grammar constraint
      (`specjax.drafters.grammar.GrammarDrafter`): each row's automaton state before each
      position of the verify block, whose target logits the verify restricts to what it allows;
      else None.
  """

  tokens: jax.Array
  logits: jax.Array | None
  num_drafted: jax.Array | None = None
  confidence: jax.Array | None = None
  grammar_states: jax.Array | None = None


def check_confidence(confidence) -> float | None:
  """A drafter's confidence threshold: None (no stop) or a number in (0, 1]; else a ValueError."""
  if confidence is None:
    return None
  if isinstance(confidence, bool) or not isinstance(confidence, (int, float, np.floating)):
    raise ValueError(f"confidence must be None or a number in (0, 1], got {confidence!r}")
  if not 0.0 < float(confidence) <= 1.0:  # also rejects NaN
    raise ValueError(f"confidence must be in (0, 1] (the top probability below which a row stops "
                     f"drafting), got {confidence}")
  return float(confidence)


def top_probability(logits: jax.Array) -> jax.Array:
  """`max(softmax(logits))` over the last axis (temperature 1, no top-k / top-p): `[..., N]` ->
  `[...]` float32. A drafter's confidence in its next draft."""
  x = logits.astype(jnp.float32)
  return 1.0 / jnp.sum(jnp.exp(x - jnp.max(x, axis=-1, keepdims=True)), axis=-1)


def confident_count(confidences: jax.Array, threshold: float) -> jax.Array:
  """`[B, k]` top probabilities -> `[B]` int32 leading drafts whose confidence is >= threshold:
  a row stops at its first draft below the threshold (that one and later ones are not proposed)."""
  keep = (confidences >= threshold).astype(jnp.int32)
  return jnp.sum(jnp.cumprod(keep, axis=-1), axis=-1).astype(jnp.int32)


def stopped_count(confidences: jax.Array, stop) -> jax.Array:
  """`[B, k]` top probabilities -> `[B]` int32 leading drafts a stop rule keeps (the rule of
  `specjax.drafters.model.draft_chain`'s `stop`, applied draft by draft)."""
  batch, num_draft = confidences.shape
  stats, alive = stop.init(batch), jnp.ones((batch,), bool)
  count = jnp.zeros((batch,), jnp.int32)
  for index in range(num_draft):
    keep, stats = stop(index, confidences[:, index], stats)
    alive = alive & keep
    count = count + alive.astype(jnp.int32)
  return count


def proposed_count(confidences: jax.Array, confidence: float | None, stop, limits
                   ) -> jax.Array | None:
  """`[B]` leading drafts a row proposes when all `k` came from one forward (Medusa, a parallel
  EAGLE head): the fewest that the confidence threshold (`confident_count`), the stop rule
  (`stopped_count`) and the limits allow; None when none of them is set (every row proposes `k`).
  Each draft's confidence is known before any later draft is drawn, so trimming here is the same
  as stopping in a loop."""
  counts = [] if confidence is None else [confident_count(confidences, confidence)]
  if stop is not None:
    counts.append(stopped_count(confidences, stop))
  if limits is not None:
    counts.append(limits)
  if not counts:
    return None
  count = counts[0]
  for other in counts[1:]:
    count = jnp.minimum(count, other)
  return count
