"""Deliberately broken verify rules, for proving that an exactness check can fail.

Each wraps the real rule (`specjax.rule.verify_reference`) so that only the named step is wrong.
`rule_without_residual` (on a rejection, the correction is sampled from p instead of
normalize(max(p - q, 0))) is `specjax.audit.control_rule`, the audit's own negative control.
They have the signature of `verify_impl=` callables, so `specjax.decode(..., verify_impl=rule)`
and `specjax.audit(..., verify_impl=rule)` run them; an exactness test that accepts the real rule
must reject them (its power check).
"""

from __future__ import annotations

from specjax.audit import control_rule
from specjax.rule import verify_reference

__all__ = ["rule_warping_only_p", "rule_without_residual"]


# The audit's negative control is this bug: one definition, in the library.
rule_without_residual = control_rule


def rule_warping_only_p(target_logits, draft_logits, draft_tokens, *, sampling, seeds,
                        positions, num_drafted=None):
  """The ratio test and residual use the draft's distribution without the temperature."""
  if draft_logits is not None and not sampling.greedy:
    draft_logits = draft_logits * sampling.temperature
  extra = {} if num_drafted is None else dict(num_drafted=num_drafted)
  return verify_reference(target_logits, draft_logits, draft_tokens, sampling=sampling,
                          seeds=seeds, positions=positions, **extra)
