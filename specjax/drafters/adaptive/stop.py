"""The token-level stop rule of per-row adaptive length (`AdaptiveDrafter.token_stop`), and the
row estimates it reads: `shrunk_alpha` (acceptance per position from the row's counts) and
`scored_evidence` (how far the drafter's confidence beats the row's history at predicting it).

`CostAwareStop` decides, draft by draft, whether a row proposes its next draft: from the drafter's
confidence in it, the row's running acceptance and the round costs. Why, and why it keeps the output
law: the "Token-level stop" part of `specjax.drafters.adaptive.drafter`'s docstring.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp

__all__ = ["CostAwareStop", "confidence_estimate", "log_odds", "scored_evidence", "shrunk_alpha",
           "takes_stop"]


def log_odds(a: jax.Array) -> jax.Array:
  """`log(a / (1 - a))`, for probabilities already kept away from 0 and 1."""
  return jnp.log(a) - jnp.log1p(-a)


def confidence_estimate(confidence: jax.Array, shift: jax.Array) -> jax.Array:
  """A draft's acceptance estimated from the drafter's top probability `confidence` and the row's
  log-odds `shift` (`AdaptiveDrafter.confidence_shift`): `sigmoid(logit(c) + shift)`."""
  c = jnp.clip(confidence.astype(jnp.float32), 1e-6, 1.0 - 1e-6)
  return jax.nn.sigmoid(log_odds(c) + shift)


def shrunk_alpha(accepted, reached, prior, weight: float) -> jax.Array:
  """`[B, K]` acceptance per position from a row's counts (`accepted`, `reached`: `[B, K]`),
  shrunk twice: the row's pooled odds ratio against `prior [K]` lifts or lowers the prior at every
  position, and each position's own counts (worth `weight` prior tests) pull from there."""
  prior = jnp.clip(jnp.asarray(prior, jnp.float32), 0.01, 0.99)
  pooled = jnp.mean(prior)
  seen = jnp.sum(accepted, axis=1) + weight * pooled
  expected = jnp.sum(reached * prior, axis=1) + weight * pooled
  tested = jnp.sum(reached, axis=1) + weight
  shift = (log_odds(jnp.clip(seen / tested, 0.01, 0.99))
           - log_odds(jnp.clip(expected / tested, 0.01, 0.99)))  # [B]
  row_prior = jax.nn.sigmoid(log_odds(prior)[None] + shift[:, None])  # [B, K]
  return (accepted + weight * row_prior) / (reached + weight)


def scored_evidence(evidence, by_confidence, by_history, tested, hit, decay: float) -> jax.Array:
  """`[B]` evidence after a round: decayed by `decay` per tested slot, plus the log-likelihood
  ratio of the two predictions (`[B, K]` each, the confidence estimate and the row's alpha) of
  whether each tested slot (`tested [B, K]`) was accepted (`hit [B, K]`)."""
  clip = lambda a: jnp.clip(a, 0.01, 0.99)
  by_confidence, by_history = clip(by_confidence), clip(by_history)
  ratio = jnp.where(hit, jnp.log(by_confidence) - jnp.log(by_history),
                    jnp.log1p(-by_confidence) - jnp.log1p(-by_history))
  seen = jnp.sum(tested, axis=1)
  return evidence * decay ** seen.astype(jnp.float32) + jnp.sum(jnp.where(tested, ratio, 0.0),
                                                                 axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CostAwareStop:
  """The token-level stop rule of `AdaptiveDrafter` (`specjax.drafters.adaptive.drafter`), for
  `draft_chain`'s
  `stop=`: `init(batch)` and `(index, confidence [B], stats) -> (keep [B], stats)`.

  Attributes:
    alpha: `[B, K]` each row's acceptance estimate per slot (`AdaptiveDrafter.alpha`), used for
      the slots after the one being decided.
    shift: `[B]` log-odds added to the drafter's confidence to estimate the acceptance of the slot
      being decided (`AdaptiveDrafter.confidence_shift`).
    round_ms: `K + 1` round costs for `k = 0 .. K` drafts.
    weight: `[B]` the weight of that confidence estimate against the row's `alpha` at the slot
      alone (`AdaptiveDrafter.confidence_weight`); None: the confidence estimate alone.
  """

  alpha: jax.Array
  shift: jax.Array
  round_ms: tuple[float, ...] = dataclasses.field(metadata=dict(static=True))
  weight: jax.Array | None = None

  def init(self, batch: int):
    """`(expected tokens, chance of reaching the next slot)` with nothing proposed: `(1, 1)`."""
    ones = jnp.ones((batch,), jnp.float32)
    return ones, ones

  def __call__(self, index, confidence, stats):
    expected, reach = stats
    num = self.alpha.shape[1]
    cost = jnp.asarray(self.round_ms, jnp.float32)  # [K + 1]
    log_alpha = jnp.cumsum(jnp.log(jnp.clip(self.alpha, 1e-6, 1.0)), axis=1)  # [B, K]
    slot = jnp.arange(num, dtype=jnp.int32)[None]  # 0-based slot m = draft m + 1
    here = jnp.take_along_axis(log_alpha, jnp.full((log_alpha.shape[0], 1), index), axis=1)
    beyond = jnp.where(slot > index, jnp.exp(log_alpha - here), 0.0)  # prod_{index<i<=m}
    tail = 1.0 + jnp.cumsum(beyond, axis=1)  # [B, K]: S for k = 1 .. K (index k - 1)
    accept = confidence_estimate(confidence, self.shift)
    if self.weight is not None:
      here_alpha = jnp.take_along_axis(self.alpha, jnp.full((self.alpha.shape[0], 1), index),
                                       axis=1)[:, 0]
      accept = self.weight * accept + (1.0 - self.weight) * here_alpha
    gain = (reach * accept)[:, None]
    rate = jnp.where(slot >= index, (expected[:, None] + gain * tail) / cost[None, 1:], -jnp.inf)
    keep = jnp.max(rate, axis=1) > expected / cost[index]
    return keep, (jnp.where(keep, expected + gain[:, 0], expected),
                  jnp.where(keep, gain[:, 0], reach))


def takes_stop(drafter) -> bool:
  """Whether `drafter.propose` accepts a `stop=` rule (`draft_chain`)."""
  return "stop" in inspect.signature(drafter.propose).parameters
