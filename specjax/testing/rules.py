"""Deliberately broken verify rules, for proving that an exactness check can fail.

Each wraps the real rule (`specjax.verify.rule.verify_reference`) so that only the named step is
wrong. `rule_without_residual` (on a rejection, the correction is sampled from p instead of
normalize(max(p - q, 0))) is `specjax.exactness.audit.control_rule`, the audit's own negative
control. They have the signature of `verify_impl=` callables, so `specjax.decode(...,
verify_impl=rule)` and `specjax.audit(..., verify_impl=rule)` run them; an exactness test
that accepts the real rule must reject them (its power check).

Random-stream misuse (the chain's streams are keyed by row seed, absolute position and purpose,
`specjax.core.sampling`): `rule_residual_with_draft_stream` draws the correction with the noise that
drew the rejected draft; `rule_round_local_stream` keys the ratio tests and the correction by the
slot within the round, so every round reuses the previous round's numbers. (Keying every round
one position back, `positions - 1`, is NOT a bug: shifting all positions by one constant relabels
the streams and uses no number twice; `tests/exactness/test_exactness_harness.py`'s statistic passed it
at 4,000 rows per prompt, as it should.) `rule_q_from_float_model` is the quantized
self-drafter's classic slip: drafts come from the int4 copy but verify divides by the float
model's q (the target's own distribution over the same prefix). `rule_stop_from_residual` breaks
the confidence stop: the token at the stop slot drawn from a residual instead of from p.
"""

from __future__ import annotations

import jax.numpy as jnp

from specjax.exactness.audit import control_rule
from specjax.verify.rule import LocalVocab, _correction, softmax, verify_reference
from specjax.core.sampling import PURPOSE_DRAFT, VerifyResult, warp_logits

__all__ = ["rule_q_from_float_model", "rule_residual_with_draft_stream",
           "rule_round_local_stream", "rule_stop_from_residual", "rule_warping_only_p",
           "rule_without_residual"]


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


def _set_final(result: VerifyResult, final, where) -> VerifyResult:
  """`result` with the token at slot `num_accepted` replaced by `final` where `where`."""
  n = result.num_accepted
  rows = jnp.arange(len(n))
  return VerifyResult(n, result.tokens.at[rows, n].set(jnp.where(where, final,
                                                                 result.tokens[rows, n])))


def rule_residual_with_draft_stream(target_logits, draft_logits, draft_tokens, *, sampling, seeds,
                                    positions, num_drafted=None):
  """On a rejection at slot `n` the correction is the residual race run with the DRAFT stream of
  position `positions + n`: the very noise that drew the rejected draft (one stream shared by
  drafting and verification). Exact rule otherwise."""
  extra = {} if num_drafted is None else dict(num_drafted=num_drafted)
  result = verify_reference(target_logits, draft_logits, draft_tokens, sampling=sampling,
                            seeds=seeds, positions=positions, **extra)
  if sampling.greedy or draft_logits is None:
    return result
  ops = LocalVocab()
  n = result.num_accepted
  proposed = jnp.full_like(n, draft_tokens.shape[1]) if num_drafted is None else num_drafted
  p = softmax(ops, warp_logits(target_logits, sampling))
  q = softmax(ops, warp_logits(draft_logits, sampling))
  token = _correction(ops, p, q, draft_tokens, n, proposed, seeds, positions,
                      purpose=PURPOSE_DRAFT)
  return _set_final(result, token, n < proposed)


def rule_q_from_float_model(target_logits, draft_logits, draft_tokens, *, sampling, seeds,
                            positions, num_drafted=None):
  """For a self-drafter (a quantized copy of the target): verify is told the float model's q, i.e.
  the target's own logits at the draft slots (`target_logits[:, :k]`, the float copy's
  distribution over the same prefixes), while the drafts were drawn from the quantized copy's q.
  The ratio test then accepts every draft: the output follows the quantized model."""
  del draft_logits
  k = draft_tokens.shape[1]
  extra = {} if num_drafted is None else dict(num_drafted=num_drafted)
  return verify_reference(target_logits, target_logits[:, :k], draft_tokens, sampling=sampling,
                          seeds=seeds, positions=positions, **extra)


def rule_stop_from_residual(target_logits, draft_logits, draft_tokens, *, sampling, seeds,
                            positions, num_drafted=None):
  """At a confidence (or adaptive) stop (`n == num_drafted < k`) the token at the stop slot is drawn
  from normalize(max(p - q, 0)) of the drafter's unproposed distribution there, as if the slot
  held a rejected draft, instead of from p (the bonus)."""
  result = verify_reference(target_logits, draft_logits, draft_tokens, sampling=sampling,
                            seeds=seeds, positions=positions, num_drafted=num_drafted)
  if num_drafted is None or sampling.greedy or draft_logits is None:
    return result
  ops = LocalVocab()
  k = draft_tokens.shape[1]
  p = softmax(ops, warp_logits(target_logits, sampling))
  q = softmax(ops, warp_logits(draft_logits, sampling))
  n = result.num_accepted
  as_if_drafted = _correction(ops, p, q, draft_tokens, n, jnp.full_like(n, k), seeds, positions)
  return _set_final(result, as_if_drafted, (n == num_drafted) & (n < k))


def rule_round_local_stream(target_logits, draft_logits, draft_tokens, *, sampling, seeds,
                            positions, num_drafted=None):
  """The ratio tests and the correction keyed by the slot within the round (position 0 at every
  round's first slot) instead of the absolute position: every round reuses the previous round's
  uniforms and residual noise, slot for slot. The drafts keep their own (correct) stream."""
  extra = {} if num_drafted is None else dict(num_drafted=num_drafted)
  return verify_reference(target_logits, draft_logits, draft_tokens, sampling=sampling,
                          seeds=seeds, positions=jnp.zeros_like(positions), **extra)
