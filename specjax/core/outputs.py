"""The result types shared by `specjax.generate` and `specjax.decode`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeStats:
  """Per-row counters of one decoding call.

  Every count describes what the row emitted: a draft the rule accepted but the round cut (after
  an EOS token, or past `max_new_tokens`) is never emitted and is not counted as accepted.

  Attributes:
    rounds: `[B]` draft/verify rounds the row took part in (for `generate`: decode steps).
    drafted: `[B]` draft tokens proposed to the row.
    accepted: `[B]` draft tokens accepted and emitted.
    accepted_per_position: `[B, k]` how often the draft at position `j` of a round was accepted
      and emitted (a tree: the path node at depth `j + 1`); its sum over `j` is `accepted`.
    target_calls: `[B]` target forward passes (prefill included) while the row was live.
    draft_calls: `[B]` drafter forward passes while the row was live.
    emitted: `[B]` tokens the row emitted (accepted drafts plus target tokens): the output's
      `num_tokens`.
    nonfinite: `[B]` bool, set when the target's logits at a position the row emitted from
      held a NaN or an infinity (broken weights or an overflow): the row's tokens are then not the
      target's. Set on device, no host sync, by `decode` and by `generate` alike.
    constraint_dead: `[B]` bool, set when a grammar constraint (`generate(..., constraint=)`)
      stopped the row because its automaton state allowed no token, or every allowed token had
      a `-inf` logit: the row ended there without emitting a token (and without a stop id).
    forced: `[B]` int32 under a grammar constraint in `decode`: emitted drafts that the grammar
      forced (the only token their state allowed), drafted with `q = 1` and accepted for free;
      with `tree=`, emitted path nodes whose parent's state allowed only their token; part of
      `accepted`. 0 otherwise.
  """

  rounds: jax.Array
  drafted: jax.Array
  accepted: jax.Array
  accepted_per_position: jax.Array
  target_calls: jax.Array
  draft_calls: jax.Array
  emitted: jax.Array
  nonfinite: jax.Array
  constraint_dead: jax.Array
  forced: jax.Array

  @property
  def acceptance_rate(self) -> jax.Array:
    """Accepted / drafted, per row (0 where nothing was drafted).

    This is the fraction of proposed tokens kept, not the per-token acceptance `a` of the
    analytic bound: drafts after a rejection are never tested, so with `a = 0.8` and `k = 4` it
    reads about 0.6. `accepted_per_position` gives `a` as accepted[j] / reached[j].
    """
    return jnp.where(self.drafted > 0, self.accepted / jnp.maximum(self.drafted, 1), 0.0)

  @property
  def mean_accepted_length(self) -> jax.Array:
    """Tokens emitted per round (accepted drafts + the correction or bonus where the round was
    not cut), per row (0 where the row had no round)."""
    return jnp.where(self.rounds > 0, self.emitted / jnp.maximum(self.rounds, 1), 0.0)

  def summary(self) -> dict:
    """Batch totals as plain Python numbers (`tokens_per_round` = emitted tokens / rounds;
    `nonfinite` = rows whose target logits were not finite; `constraint_dead` = rows a grammar
    constraint stopped with no allowed token)."""
    rounds = int(np.sum(self.rounds))
    drafted = int(np.sum(self.drafted))
    accepted = int(np.sum(self.accepted))
    emitted = int(np.sum(self.emitted))
    return {
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "emitted": emitted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_round": emitted / rounds if rounds else 0.0,
        "accepted_per_position": np.asarray(self.accepted_per_position).sum(0).tolist(),
        "target_calls": int(np.max(self.target_calls)) if self.target_calls.size else 0,
        "draft_calls": int(np.max(self.draft_calls)) if self.draft_calls.size else 0,
        "nonfinite": int(np.sum(self.nonfinite)),
        "constraint_dead": int(np.sum(self.constraint_dead)),
        "forced": int(np.sum(self.forced)),
    }


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeOutput:
  """Attributes:
    tokens: `[B, max_new_tokens]` int32 new tokens; `pad_id` after each row's end.
    num_tokens: `[B]` int32 new tokens per row (an EOS token is included and counted).
    stats: per-row `DecodeStats`.
    logprobs: None, or (`return_logprobs=True`) `[B, max_new_tokens]` float32: each new token's
      log-probability under the target, `log_softmax(logits / T)[token]` over the whole
      vocabulary (T = 1 when greedy; no top-k / top-p), from the target logits the token was
      emitted from (the verify's, or `generate`'s step); 0 after each row's end.
  """

  tokens: jax.Array
  num_tokens: jax.Array
  stats: DecodeStats
  logprobs: jax.Array | None = None
