"""Deliberately broken verify rules, for proving that an exactness check can fail.

Each wraps the real rule (`specjax.rule.verify_reference`) so that only the named step is wrong.
They have the signature of `verify_impl=` callables, so `specjax.decode(..., verify_impl=rule)`
and `specjax.audit(..., verify_impl=rule)` run them; an exactness test that accepts the real rule
must reject them (its power check).
"""

from __future__ import annotations

import jax.numpy as jnp

from specjax.rule import verify_reference
from specjax.sampling import PURPOSE_RESIDUAL, VerifyResult, sample_race, warp_logits

__all__ = ["rule_warping_only_p", "rule_without_residual"]


def rule_without_residual(target_logits, draft_logits, draft_tokens, *, sampling, seeds,
                          positions, num_drafted=None):
  """On rejection, samples the correction from p instead of normalize(max(p - q, 0))."""
  extra = {} if num_drafted is None else dict(num_drafted=num_drafted)
  result = verify_reference(target_logits, draft_logits, draft_tokens, sampling=sampling,
                            seeds=seeds, positions=positions, **extra)
  if sampling.greedy:  # greedy has no residual to skip
    return result
  n = result.num_accepted
  p_at_n = jnp.take_along_axis(target_logits, n[:, None, None], axis=1)[:, 0]
  from_p = sample_race(warp_logits(p_at_n, sampling), seeds, positions + n, PURPOSE_RESIDUAL)
  proposed = draft_tokens.shape[1] if num_drafted is None else num_drafted
  final = jnp.where(n < proposed, from_p,
                    jnp.take_along_axis(result.tokens, n[:, None], axis=1)[:, 0])
  return VerifyResult(n, result.tokens.at[jnp.arange(len(n)), n].set(final))


def rule_warping_only_p(target_logits, draft_logits, draft_tokens, *, sampling, seeds,
                        positions, num_drafted=None):
  """The ratio test and residual use the draft's distribution without the temperature."""
  if draft_logits is not None and not sampling.greedy:
    draft_logits = draft_logits * sampling.temperature
  extra = {} if num_drafted is None else dict(num_drafted=num_drafted)
  return verify_reference(target_logits, draft_logits, draft_tokens, sampling=sampling,
                          seeds=seeds, positions=positions, **extra)
