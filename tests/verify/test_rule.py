"""The verify rule alone, against its closed form, with a power check for every statistical test.

For fixed p and q over a small vocabulary the theory says: a draft x ~ q is accepted with
probability min(1, p(x)/q(x)), so the acceptance rate is beta = sum_x min(p(x), q(x)); a rejected
position is resampled from normalize(max(p - q, 0)); the emitted token is distributed exactly as
p; after k acceptances the bonus comes from the target's distribution one past the drafts. The
decision of every single row is checked exactly against the uniform it drew (the counter-based
stream is public); the distributions are checked with chi-square / binomial tests over N = 50,000
rows at significance 1e-3. Every statistical test also runs a deliberately broken rule through
the same assertion at the same N and requires p < 1e-6 (its power check):

  rule_without_residual    the correction drawn from p instead of the residual
                           (`specjax.testing.rules`)
  rule_ignoring_q          the ratio test run as if the draft were a point mass (accept w.p. p(x))
  rule_bonus_off_by_one    the bonus drawn from the last draft position's p
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import specjax as sj
from specjax.loop import row_seeds
from specjax.verify.rule import verify_reference
from specjax.core.sampling import PURPOSE_ACCEPT, VerifyResult, uniform
from specjax.testing.rules import rule_without_residual

N = 50_000
ALPHA = 1e-3
POWER_ALPHA = 1e-6
SEEDS = row_seeds(jax.random.key(2024), N)  # [N] one stream per row
P_LOGITS = np.log(np.array([0.30, 0.25, 0.20, 0.15, 0.07, 0.03]))
Q_LOGITS = np.log(np.array([0.05, 0.10, 0.40, 0.30, 0.05, 0.10]))
BONUS_LOGITS = np.log(np.array([0.05, 0.05, 0.10, 0.20, 0.30, 0.30]))  # p one past the drafts
P = np.exp(P_LOGITS)
Q = np.exp(Q_LOGITS)
P_BONUS = np.exp(BONUS_LOGITS)
V = len(P)


def rule_ignoring_q(target_logits, draft_logits, draft_tokens, **kwargs):
  """Broken: the ratio test and residual treat the sampled draft as a point mass."""
  del draft_logits
  return verify_reference(target_logits, None, draft_tokens, **kwargs)


def rule_bonus_off_by_one(target_logits, draft_logits, draft_tokens, **kwargs):
  """Broken: the bonus token is drawn from the last draft position's distribution."""
  k = draft_tokens.shape[1]
  shifted = target_logits.at[:, k].set(target_logits[:, k - 1])
  return verify_reference(shifted, draft_logits, draft_tokens, **kwargs)


def _chi2(observed, probs):
  expected = probs / probs.sum() * observed.sum()
  keep = expected > 0
  if observed[~keep].sum():  # a token of probability 0 was emitted
    return 0.0
  return stats.chisquare(observed[keep], expected[keep]).pvalue


def _one_position(rule=verify_reference, q_logits=Q_LOGITS, draft_tokens=None,
                  sampling=sj.Sampling(1.0)):
  rng = np.random.default_rng(0)
  if draft_tokens is None:
    draft_tokens = rng.choice(V, size=N, p=np.exp(q_logits) / np.exp(q_logits).sum())
  target = jnp.broadcast_to(jnp.asarray(np.stack([P_LOGITS, BONUS_LOGITS]), jnp.float32),
                            (N, 2, V))
  draft = None if q_logits is None else jnp.broadcast_to(
      jnp.asarray(q_logits, jnp.float32), (N, 1, V))
  result = jax.jit(lambda t, d, x: rule(t, d, x, sampling=sampling, seeds=SEEDS,
                                        positions=jnp.zeros(N, jnp.int32)))(
      target, draft, jnp.asarray(draft_tokens, jnp.int32)[:, None])
  return np.asarray(draft_tokens), np.asarray(result.num_accepted), np.asarray(result.tokens)


def test_every_decision_is_u_below_p_over_q():
  drafts, accepted, _ = _one_position()
  u = np.asarray(uniform(SEEDS[:, None], jnp.zeros((N, 1), jnp.int32), 0, PURPOSE_ACCEPT))[:, 0]
  ratio = np.minimum(1.0, P[drafts] / Q[drafts])
  expected = u < ratio
  clear = np.abs(u - ratio) > 1e-6  # float32 vs float64 at the boundary
  np.testing.assert_array_equal(accepted[clear].astype(bool), expected[clear])


def _acceptance_pvalue(rule):
  _, accepted, _ = _one_position(rule)
  beta = np.minimum(P, Q).sum()  # 0.62
  return stats.binomtest(int(accepted.sum()), N, beta).pvalue


def _emitted_pvalue(rule):
  _, _, tokens = _one_position(rule)
  return _chi2(np.bincount(tokens[:, 0], minlength=V), P)


def _residual_pvalue(rule):
  _, accepted, tokens = _one_position(rule)
  residual = np.maximum(P - Q, 0)  # zero where q >= p: such corrections fail the test
  return _chi2(np.bincount(tokens[accepted == 0, 0], minlength=V), residual)


def _bonus_pvalue(rule):
  _, accepted, tokens = _one_position(rule)
  return _chi2(np.bincount(tokens[accepted == 1, 1], minlength=V), P_BONUS)


@pytest.mark.parametrize("statistic, broken", [
    (_acceptance_pvalue, rule_ignoring_q), (_emitted_pvalue, rule_without_residual),
    (_residual_pvalue, rule_without_residual), (_bonus_pvalue, rule_bonus_off_by_one)],
    ids=["acceptance", "emitted", "residual", "bonus"])
def test_one_position_matches_the_closed_form(statistic, broken):
  assert statistic(verify_reference) > ALPHA
  assert statistic(broken) < POWER_ALPHA  # power: the same test at the same N rejects it


def test_emitted_tokens_are_not_q():
  _, _, tokens = _one_position()
  assert _chi2(np.bincount(tokens[:, 0], minlength=V), Q) < POWER_ALPHA


def _point_mass(rule):
  x = 2
  _, accepted, tokens = _one_position(rule, q_logits=None, draft_tokens=np.full(N, x))
  return (stats.binomtest(int(accepted.sum()), N, P[x]).pvalue,
          _chi2(np.bincount(tokens[:, 0], minlength=V), P),
          int(np.sum(tokens[accepted == 0, 0] == x)))


def test_point_mass_draft_accepts_with_p_and_resamples_without_the_draft():
  acceptance, emitted, rejected_then_reemitted = _point_mass(verify_reference)
  assert acceptance > ALPHA and emitted > ALPHA
  assert rejected_then_reemitted == 0
  # Power: drawing the correction from p re-emits the rejected draft and skews the output.
  _, emitted, rejected_then_reemitted = _point_mass(rule_without_residual)
  assert emitted < POWER_ALPHA and rejected_then_reemitted > 0


def _geometric(rule):
  k = 3
  rng = np.random.default_rng(1)
  drafts = rng.choice(V, size=(N, k), p=Q)
  target = jnp.broadcast_to(jnp.asarray(P_LOGITS, jnp.float32), (N, k + 1, V))
  draft = jnp.broadcast_to(jnp.asarray(Q_LOGITS, jnp.float32), (N, k, V))
  result = jax.jit(lambda t, d, x: rule(t, d, x, sampling=sj.Sampling(1.0), seeds=SEEDS,
                                        positions=jnp.full(N, 5, jnp.int32)))(
      target, draft, jnp.asarray(drafts, jnp.int32))
  beta = np.minimum(P, Q).sum()
  probs = np.array([beta ** j * (1 - beta) for j in range(k)] + [beta ** k])
  counts = np.bincount(np.asarray(result.num_accepted), minlength=k + 1)
  return _chi2(counts, probs), drafts, result


def test_number_accepted_over_k_positions_is_geometric():
  k = 3
  pvalue, drafts, result = _geometric(verify_reference)
  assert pvalue > ALPHA
  tokens = np.asarray(result.tokens)
  n = np.asarray(result.num_accepted)
  np.testing.assert_array_equal(np.where(np.arange(k)[None] < n[:, None], tokens[:, :k], -1),
                                np.where(np.arange(k)[None] < n[:, None], drafts, -1))
  assert np.all(tokens[np.arange(k + 1)[None] > n[:, None]] == 0)
  assert _geometric(rule_ignoring_q)[0] < POWER_ALPHA  # power


def test_identical_p_and_q_accept_everything():
  drafts, accepted, _ = _one_position(q_logits=P_LOGITS)
  assert accepted.all()


@pytest.mark.parametrize("sampling", [sj.Sampling(1.0, top_k=1), sj.Sampling(5.0, top_p=0.3),
                                      sj.Sampling(0.05), sj.Sampling(1.0, top_k=2, top_p=0.1)])
def test_ids_always_inside_the_vocabulary(sampling):
  key = jax.random.key(3)
  vocab = 37
  target = 30 * jax.random.normal(key, (512, 4, vocab))
  target = target.at[:, :, 5:].set(-1e30)  # almost all of the vocabulary is impossible
  draft = 30 * jax.random.normal(jax.random.fold_in(key, 1), (512, 3, vocab))
  drafts = jax.random.randint(jax.random.fold_in(key, 2), (512, 3), 0, vocab)
  result = jax.jit(lambda t, d, x: verify_reference(
      t, d, x, sampling=sampling, seeds=SEEDS[:512], positions=jnp.zeros(512, jnp.int32)))(
          target, draft, drafts)
  tokens = np.asarray(result.tokens)
  n = np.asarray(result.num_accepted)
  final = tokens[np.arange(512), n]
  assert final.min() >= 0 and final.max() < 5  # corrections only where the target has mass


def test_first_argmax_is_jnp_argmax_on_ties_infinities_and_nans():
  """The greedy pick (`first_argmax`) is `jnp.argmax` exactly: random rows with many exact ties
  (values drawn from 5 levels), all `-inf` rows, `+inf`, and NaNs (the first NaN wins)."""
  rng = np.random.default_rng(7)
  x = rng.integers(0, 5, size=(64, 3, 1000)).astype(np.float32)  # ties everywhere
  x[0] = -np.inf
  x[1, :, 17] = np.inf
  x[1, :, 900] = np.inf
  x[2, :, 400] = np.nan
  x[2, :, 3] = np.nan
  x[3, 1, 999] = np.nan
  x[4] = rng.standard_normal((3, 1000)).astype(np.float32)
  got = jax.jit(sj.core.sampling.first_argmax)(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
  assert got.dtype == jnp.int32
  assert int(got[2, 0]) == 3 and int(got[1, 0]) == 17 and int(got[0, 0]) == 0


class TestReferenceWithAndWithoutJit(chex.TestCase):
  """The reference rule's exact checks run compiled (`jax.jit`) and op by op (`chex.variants`):
  its decisions do not depend on how it runs, and a shape mismatch is the same ValueError, raised
  before anything runs, either way."""

  def _rule(self, sampling):
    return self.variant(functools.partial(verify_reference, sampling=sampling))

  @chex.variants(with_jit=True, without_jit=True)
  def test_greedy_hand_worked(self):
    # Target argmax per position: [3, 1, 4, 0]. Drafts [3, 1, 2]: two accepted, correction 4;
    # drafts [3, 1, 4]: all three accepted, then the bonus 0 (the argmax one past them).
    logits = jnp.full((1, 4, 5), -1.0).at[0, [0, 1, 2, 3], [3, 1, 4, 0]].set(2.0)
    rule = self._rule(sj.Sampling(0.0))
    for drafts, accepted in (([3, 1, 2], 2), ([3, 1, 4], 3)):
      result = rule(logits, None, jnp.array([drafts]), seeds=SEEDS[:1],
                    positions=jnp.zeros(1, jnp.int32))
      chex.assert_shape(result.tokens, (1, 4))
      chex.assert_type([result.num_accepted, result.tokens], jnp.int32)
      chex.assert_trees_all_equal(result, VerifyResult(np.array([accepted]),
                                                       np.array([[3, 1, 4, 0]])))

  @chex.variants(with_jit=True, without_jit=True)
  def test_every_decision_is_u_below_p_over_q(self):
    n = 4_000
    drafts = np.random.default_rng(5).choice(V, size=n, p=Q)
    target = jnp.broadcast_to(jnp.asarray(np.stack([P_LOGITS, BONUS_LOGITS]), jnp.float32),
                              (n, 2, V))
    draft = jnp.broadcast_to(jnp.asarray(Q_LOGITS, jnp.float32), (n, 1, V))
    result = self._rule(sj.Sampling(1.0))(target, draft, jnp.asarray(drafts, jnp.int32)[:, None],
                                          seeds=SEEDS[:n], positions=jnp.zeros(n, jnp.int32))
    chex.assert_shape(result.num_accepted, (n,))
    chex.assert_shape(result.tokens, (n, 2))
    u = np.asarray(uniform(SEEDS[:n, None], jnp.zeros((n, 1), jnp.int32), 0, PURPOSE_ACCEPT))[:, 0]
    ratio = np.minimum(1.0, P[drafts] / Q[drafts])
    clear = np.abs(u - ratio) > 1e-6  # float32 vs float64 at the boundary
    accepted = np.asarray(result.num_accepted).astype(bool)
    np.testing.assert_array_equal(accepted[clear], (u < ratio)[clear])
    # An accepted row emits its draft; a rejected one a token of the residual max(p - q, 0).
    tokens = np.asarray(result.tokens)
    np.testing.assert_array_equal(tokens[accepted, 0], drafts[accepted])
    assert np.all(P[tokens[~accepted, 0]] > Q[tokens[~accepted, 0]])

  @chex.variants(with_jit=True, without_jit=True)
  def test_a_shape_mismatch_is_a_clear_error_before_anything_runs(self):
    rule = self._rule(sj.Sampling(1.0))
    drafts = jnp.zeros((2, 3), jnp.int32)  # B = 2, k = 3
    rows = dict(seeds=SEEDS[:2], positions=jnp.zeros(2, jnp.int32))
    with self.assertRaisesRegex(ValueError,
                                r"target_logits must be \[B, k \+ 1, V\] with B, k = 2, 3"):
      rule(jnp.zeros((2, 3, 7)), None, drafts, **rows)  # one position short
    with self.assertRaisesRegex(ValueError, r"draft_logits must be \[B, k, V\]"):
      rule(jnp.zeros((2, 4, 7)), jnp.zeros((2, 3, 6)), drafts, **rows)  # another vocabulary
    with self.assertRaisesRegex(ValueError, r"seeds must be \[B\]"):
      rule(jnp.zeros((2, 4, 7)), None, drafts, seeds=SEEDS[:3], positions=rows["positions"])
    with self.assertRaisesRegex(ValueError, r"draft_tokens must be \[B, k\]"):
      rule(jnp.zeros((2, 4, 7)), None, drafts[0], **rows)
