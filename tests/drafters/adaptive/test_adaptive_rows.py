"""Per-row adaptive draft length (`sj.adaptive_drafter`,
`specjax.drafters.adaptive.drafter.AdaptiveDrafter`).

* The row's choice: with a drafter that always agrees with the target (the target itself) rows
  draft the full `K` every round after the first; with one that almost never agrees they settle
  at 0 drafts (plain target steps) and still decode; the choice is the first maximum of the
  expected tokens per millisecond, checked against a hand-worked case.
* Greedy with `sj.adaptive_drafter` equals `sj.generate` on a ragged batch, for a draft model,
  the n-gram drafter and an EAGLE-3 head, in one jitted program (one top-level while loop, no
  callbacks).
* Exactness of sampled decoding with a prior and costs that make rows switch between 0, 1 and 2
  drafts from round to round (from their history, or draft by draft with the token stop): the pooled
  chi-square harness of tests/exactness/test_exactness.py (N = 20,000 rows, ALPHA = 1e-3) at temperature 1.0
  and 0.7 with top-k; the same run through a deliberately broken rule (no residual) fails (p <
  1e-6), so the test can fail.
* The token-level stop (`CostAwareStop`): its decisions checked against a hand-worked case at the
  first and a deep slot, applied draft by draft by `stopped_count`; greedy with it equals
  `sj.generate`, and sampled decoding with it passes (and with a broken verify fails) the same
  harness.
* Bad plans raise a ValueError before anything is compiled.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import MedusaDrafter
from specjax.drafters.adaptive import costs
from specjax.drafters.adaptive.drafter import AdaptiveDrafter, CostAwareStop
from specjax.drafters.proposal import stopped_count
from specjax.drafters.adaptive.costs import AcceptanceProfile, Calibration, CostTable
from specjax.testing.models import tiny_config
from tests.exactness.test_exactness import (ALPHA, DRAFT_MODEL_BROKEN, N, NEW, POWER_ALPHA, PROMPT, SETTINGS,
                                            chi_square_pvalue, exact_joint)

VOCAB = 64


def _calibration(verify_ms, alpha, draft_step_ms=1.0, round_overhead_ms=0.0):
  table = CostTable(verify_ms=tuple(verify_ms), draft_step_ms=draft_step_ms,
                    generate_step_ms=verify_ms[0], backend=jax.default_backend(),
                    device_kind="hand-written", jax_version=jax.__version__, batch=1, context=16,
                    date="2026-01-01", round_overhead_ms=round_overhead_ms)
  profile = AcceptanceProfile(tuple(alpha), {"temperature": 0.0, "top_k": None, "top_p": None},
                              rounds=1000, prompts=4, date="2026-01-01")
  return Calibration(table, profile)


# A TPU-like table: one verify width costs about as much as another, so a row that is accepted
# drafts long; a row that is not pays for nothing but verify(2) > verify(1).
FLAT = _calibration([10.0, 12.0, 12.0, 12.5, 13.0], [0.6, 0.6, 0.6, 0.6])


def test_plan_round_costs_with_a_measured_overhead():
  # A table that measured whole rounds: round_ms[k] = verify(smallest width >= k + 1) + k draft
  # steps + the overhead (which already holds the drafter's catch-up). With 2 ms per round, K:
  # 1.6/15, 1.96/16, 2.176/17.5, 2.3056/19 = 0.1067, 0.1225, 0.1243, 0.1213 for k = 1..4: K = 3.
  measured = _calibration(FLAT.costs.verify_ms, FLAT.profile.alpha, round_overhead_ms=2.0)
  plan = costs.adaptive_plan(measured.costs, measured.profile, headroom_odds=1.0)
  assert plan.max_draft == 3 and plan.widths == (1, 3, 4)
  assert plan.round_ms == (12.0, 15.0, 16.0, 17.5)


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=4), jax.random.key(30))


@pytest.fixture(scope="module")
def ragged():
  rng = np.random.default_rng(31)
  tokens = jnp.asarray(rng.integers(0, VOCAB, size=(3, 8)), jnp.int32)
  return tokens, jnp.array([8, 2, 5], jnp.int32)


def test_plan_headroom_for_rows_that_accept_more():
  """K is the best k for a row at `headroom_odds` times the profile's acceptance odds. A CPU-like
  table (each width dearer) with alpha 0.5: the average row's best k is 1, a row at 4x the odds
  (alpha 0.8) is best served by k = 3. Hand-worked: E[tokens | k] / round_ms[k] at alpha 0.5:
  1.5/13 = 0.1154, 1.75/16 = 0.1094, 1.875/19 = 0.0987, ... (k = 1); at alpha 0.8: 1.8/13 =
  0.1385, 2.44/16 = 0.1525, 2.952/19 = 0.1554, 3.3616/22 = 0.1528, ... (k = 3)."""
  cpu = _calibration([10.0, 12.0, 14.0, 16.0, 18.0, 20.0], [0.5] * 5)
  assert costs.adaptive_plan(cpu.costs, cpu.profile, headroom_odds=1.0).max_draft == 1
  assert costs.choose_num_draft(cpu.costs, cpu.profile).num_draft == 1
  np.testing.assert_allclose(costs.lifted(cpu.profile, 4.0).alpha, 0.8)
  plan = costs.adaptive_plan(cpu.costs, cpu.profile)
  assert plan.max_draft == 3
  # Widths 1 and 4 always; 3 (14 <= 0.97 * 16) and 2 (12 <= 0.97 * 14) too.
  assert plan.widths == (1, 2, 3, 4)
  assert plan.round_ms == (11.0, 14.0, 17.0, 20.0)
  with pytest.raises(ValueError, match="headroom_odds"):
    costs.adaptive_plan(cpu.costs, cpu.profile, headroom_odds=0.5)


def test_plan_for_a_hybrid_reads_the_head_and_copy_profiles(tmp_path):
  """A profile with a head part and a lookup part (what `specjax calibrate` writes for a
  `HybridDrafter`) round-trips through its file; the plan's prior is the head's, its copy prior
  the lookup's, and K the larger of their headroom choices. The CPU-like table of the test above:
  the head at alpha 0.5 (4x odds: 0.8) wants k = 3; copies at alpha 0.9 (4x odds: 0.973) want
  k = 5 (E[tokens | k] / round_ms = 1.973/13, 2.920/16, 3.841/19, 4.737/22, 5.609/25 = 0.152,
  0.183, 0.202, 0.215, 0.224 for k = 1..5: still rising at the table's widest)."""
  cpu = _calibration([10.0, 12.0, 14.0, 16.0, 18.0, 20.0], [0.6] * 5)
  part = lambda a: dataclasses.replace(cpu.profile, alpha=(a,) * 5)
  profile = dataclasses.replace(cpu.profile, head=part(0.5), lookup=part(0.9))
  profile.save(tmp_path)
  loaded = AcceptanceProfile.load(tmp_path)
  assert loaded == profile and loaded.lookup.alpha == (0.9,) * 5
  plan = costs.adaptive_plan(cpu.costs, loaded)
  assert plan.max_draft == 5
  np.testing.assert_allclose(plan.prior, 0.5)
  np.testing.assert_allclose(plan.copy_prior, 0.9)
  assert costs.adaptive_plan(cpu.costs, cpu.profile).copy_prior is None


def test_plan_and_first_choice_hand_worked():
  plan = costs.adaptive_plan(FLAT.costs, FLAT.profile, headroom_odds=1.0)
  # K is the best fixed k: E[tokens | k] / (verify(k + 1) + k draft steps) = 1.6/13, 1.96/14,
  # 2.176/15.5, 2.3056/17 = 0.1231, 0.1400, 0.1404, 0.1356 for k = 1..4: K = 3.
  assert plan.max_draft == 3 == costs.choose_num_draft(FLAT.costs, FLAT.profile).num_draft
  # Widths: 1 and K + 1 = 4 always; 3 (12.0 <= 0.97 * 12.5); not 2 (12.0 > 0.97 * 12.0).
  assert plan.widths == (1, 3, 4)
  # round_ms[k] = verify(smallest width >= k + 1) + (k + 1) * draft_step.
  assert plan.round_ms == (11.0, 14.0, 15.0, 16.5)
  # Every position was measured on enough rounds that the prior stays near 0.6.
  np.testing.assert_allclose(plan.prior, 0.6, atol=1e-9)
  drafter = AdaptiveDrafter(sj.NGramDrafter(), plan.max_draft, plan.round_ms, plan.prior)
  state = drafter.init(jnp.zeros((4, 4), jnp.int32), jnp.full(4, 4, jnp.int32), 16, None)
  # Row 0: no history: the prior 0.6 everywhere. E = 1, 1.6, 1.96, 2.176 tokens over
  # 11, 14, 15, 16.5 ms: 0.0909, 0.1143, 0.1307, 0.1319 per ms: k = 3.
  # Row 1: position 1 rejected in 5 recent rounds: its pooled odds fall far below the prior's
  # and its alpha_1 is 0.05: k = 0.
  # Row 2: position 1 accepted 5 of 5, position 2 rejected 5 of 5: alpha about (0.86, 0.15,
  # 0.52): E = 1, 1.862, 1.989, 2.055: 0.0909, 0.1330, 0.1326, 0.1245: k = 1.
  # Row 3: position 1 accepted 5 of 5 and nothing deeper tested: the row's odds lift the prior
  # at the untested positions too (about 0.83 each), and it drafts all 3.
  accepted = jnp.array([[0, 0, 0], [0, 0, 0], [5, 0, 0], [5, 0, 0]], jnp.float32)
  reached = jnp.array([[0, 0, 0], [5, 0, 0], [5, 5, 0], [5, 0, 0]], jnp.float32)
  state = dataclasses.replace(state, accepted=accepted, reached=reached)
  np.testing.assert_array_equal(drafter.limits(state), [3, 0, 1, 3])
  # The estimate, written out here in numpy from the documented formula.
  acc, rea, prior, w = np.asarray(accepted), np.asarray(reached), np.full(3, 0.6), 2.0
  logit = lambda a: np.log(a / (1 - a))
  observed = (acc.sum(1) + w * 0.6) / (rea.sum(1) + w)
  expected = ((rea * prior).sum(1) + w * 0.6) / (rea.sum(1) + w)
  row_prior = 1 / (1 + np.exp(-(logit(prior)[None] + (logit(observed) - logit(expected))[:, None])))
  alpha = (acc + w * row_prior) / (rea + w)
  np.testing.assert_allclose(drafter.alpha(state), alpha, rtol=1e-5)
  assert alpha[3, 1:].min() > 0.8 and alpha[1, 0] < 0.06
  reach = np.concatenate([np.zeros((4, 1)), np.cumsum(np.cumprod(alpha, 1), 1)], 1)
  np.testing.assert_array_equal(np.argmax((1 + reach) / np.asarray(plan.round_ms), 1), [3, 0, 1, 3])


def test_cost_aware_stop_hand_worked():
  """Round costs 27, 36, 37, 38, 39 ms for k = 0..4 (a CPU-like table: the first draft costs a
  third of a step more, each later one 1 ms) and a row estimate alpha = 0.5 at every slot.

  Slot 1, nothing proposed (E = 1, reach 1): draft 1 pays when some k >= 1 beats 1/27 with
  E_k = 1 + c * S_k, S = 1, 1.5, 1.75, 1.875: c > (36/27 - 1)/1 = 0.3333, (37/27 - 1)/1.5 =
  0.2469, (38/27 - 1)/1.75 = 0.2328, (39/27 - 1)/1.875 = 0.2370: the threshold is 0.2328.
  Slot 4 with E = 2.2 expected tokens and reach 0.4: (2.2 + 0.4 c)/39 > 2.2/38 when
  c > 2.2 * (39/38 - 1)/0.4 = 0.1447. A fixed confidence stop at 0.4 would stop both rows."""
  round_ms = (27.0, 36.0, 37.0, 38.0, 39.0)
  stop = CostAwareStop(jnp.full((4, 4), 0.5), jnp.zeros(4), round_ms)
  keep, (expected, reach) = stop(0, jnp.array([0.24, 0.22, 0.2335, 0.2320]), stop.init(4))
  np.testing.assert_array_equal(keep, [True, False, True, False])
  np.testing.assert_allclose(expected, [1.24, 1.0, 1.2335, 1.0], rtol=1e-6)
  np.testing.assert_allclose(reach, [0.24, 1.0, 0.2335, 1.0], rtol=1e-6)
  stats = (jnp.full(4, 2.2), jnp.full(4, 0.4))
  keep, (expected, reach) = stop(jnp.int32(3), jnp.array([0.15, 0.14, 0.9, 0.0]), stats)
  np.testing.assert_array_equal(keep, [True, False, True, False])
  np.testing.assert_allclose(expected, [2.26, 2.2, 2.56, 2.2], rtol=1e-6)
  np.testing.assert_allclose(reach, [0.06, 0.4, 0.36, 0.4], rtol=1e-6)
  # Draft by draft: a row stops at its first refusal even if a later slot would pass.
  confidences = jnp.array([[0.9, 0.9, 0.9, 0.9], [0.2, 0.9, 0.9, 0.9], [0.9, 0.01, 0.9, 0.9]])
  np.testing.assert_array_equal(
      stopped_count(confidences, CostAwareStop(jnp.full((3, 4), 0.5), jnp.zeros(3), round_ms)),
      [4, 0, 1])
  # A row whose drafts were accepted at 3x the odds its confidences gave: a confidence of 0.2
  # (odds 1/4) counts as odds 3/4, acceptance 0.4286 > 0.2328: it drafts; unshifted it does not.
  stop = CostAwareStop(jnp.full((2, 4), 0.5), jnp.array([np.log(3.0), 0.0]), round_ms)
  keep, (expected, _) = stop(0, jnp.array([0.2, 0.2]), stop.init(2))
  np.testing.assert_array_equal(keep, [True, False])
  np.testing.assert_allclose(expected, [1 + 3 / 7, 1.0], rtol=1e-5)


def test_confidence_shift_hand_worked():
  """Log-odds of (accepted + 1) / (tested + 2) minus the confidences' log-odds summed over
  tested + 2 slots, with prior_weight 2: a row that accepted 6 of 8 tested drafts whose
  confidences' log-odds summed to -3 gets log(7/3) + 3/10 = 1.147; one with no history 0; one
  accepted less than it believed (1 of 8, log-odds summing to 6) log(2/8) - 6/10."""
  drafter = AdaptiveDrafter(sj.NGramDrafter(), 2, (1.0, 1.4, 1.5), (0.5, 0.5))
  state = drafter.init(jnp.zeros((3, 4), jnp.int32), jnp.full(3, 4, jnp.int32), 16, None)
  state = dataclasses.replace(
      state, reached=jnp.array([[5.0, 3.0], [0, 0], [5.0, 3.0]]),
      accepted=jnp.array([[4.0, 2.0], [0, 0], [1.0, 0.0]]),
      believed=jnp.array([[-2.0, -1.0], [0, 0], [3.5, 2.5]]))
  np.testing.assert_allclose(drafter.confidence_shift(state),
                             [np.log(7 / 3) + 0.3, 0.0, np.log(2 / 8) - 0.6], rtol=1e-5)


def test_confidence_shift_learns_a_drafter_that_is_right_when_unsure():
  """A drafter whose every confidence is 1e-4 (log-odds -9.21) and whose every tested draft is
  accepted (here 18 slots, the decay's limit): the shift must lift those confidences to the
  row's acceptance, (18 + 1) / 20 = 0.95; a mean of probabilities, capped at 0.01, would leave
  them at sigmoid(-9.21 + log(0.95 / 0.05) - log(0.01 / 0.99)) = 0.16."""
  drafter = AdaptiveDrafter(sj.NGramDrafter(), 2, (1.0, 1.4, 1.5), (0.5, 0.5))
  state = drafter.init(jnp.zeros((1, 4), jnp.int32), jnp.full(1, 4, jnp.int32), 16, None)
  lo = float(np.log(1e-4) - np.log1p(-1e-4))
  state = dataclasses.replace(state, reached=jnp.array([[9.0, 9.0]]),
                              accepted=jnp.array([[9.0, 9.0]]), believed=jnp.full((1, 2), 9 * lo))
  lifted = jax.nn.sigmoid(lo + drafter.confidence_shift(state))
  # log-odds: -9.21 * 18 / 20 + ... leaves 1/10 of the confidences' own log-odds unshifted.
  np.testing.assert_allclose(lifted, jax.nn.sigmoid(np.log(0.95 / 0.05) + lo / 10), rtol=1e-5)
  assert float(lifted[0]) > 0.5


def test_cost_aware_stop_mixes_confidence_and_history_by_weight():
  """`weight` w blends the confidence estimate with the row's alpha at the slot:
  w * sigmoid(logit(c) + shift) + (1 - w) * alpha_j. Costs as in the hand-worked case above
  (threshold 0.2328 at slot 1). A draft of confidence 0.1 in a row whose alpha is 0.9: w = 1
  estimates 0.1 (stop), w = 0 estimates 0.9 (draft), w = 0.5 estimates 0.5 (draft); a draft of
  confidence 0.1 with alpha 0.3 and w = 0.5 estimates 0.2 (stop). None is the confidence alone."""
  round_ms = (27.0, 36.0, 37.0, 38.0, 39.0)
  alpha = jnp.array([[0.9] * 4, [0.9] * 4, [0.9] * 4, [0.3] * 4, [0.9] * 4])
  stop = CostAwareStop(alpha, jnp.zeros(5), round_ms, jnp.array([1.0, 0.0, 0.5, 0.5, 0.0]))
  keep, (expected, reach) = stop(0, jnp.full(5, 0.1), stop.init(5))
  np.testing.assert_array_equal(keep, [False, True, True, False, True])
  np.testing.assert_allclose(expected, [1.0, 1.9, 1.5, 1.0, 1.9], rtol=1e-6)
  np.testing.assert_allclose(reach, [1.0, 0.9, 0.5, 1.0, 0.9], rtol=1e-6)
  unweighted = CostAwareStop(alpha, jnp.zeros(5), round_ms)
  np.testing.assert_array_equal(unweighted(0, jnp.full(5, 0.1), unweighted.init(5))[0],
                                [False] * 5)


def test_confidence_weight_follows_which_estimate_predicted_the_row():
  """`observe` scores each tested slot under both estimates (fresh rows: shift 0, alpha = the
  prior 0.5) and adds the log-likelihood ratio to `evidence`; the weight is its sigmoid.
  Row 0: confidences 0.9, 0.9, both accepted: 2 log(0.9 / 0.5) = 1.1756, weight 0.764.
  Row 1: confidences 0.1, 0.1, both accepted (a drafter right when unsure): 2 log(0.1 / 0.5) =
  -3.2189, weight 0.038. Row 2: 0.9 accepted, then 0.1 rejected: log(0.9 / 0.5) + log(0.9 / 0.5).
  Row 3 proposed nothing and its unproposed first draft (confidence 0.2) missed:
  log(0.8 / 0.5) = 0.47. A second, identical round (decay 1) moves rows 0 and 1 further the same
  way."""
  drafter = AdaptiveDrafter(sj.NGramDrafter(), 2, (1.0, 1.4, 1.5), (0.5, 0.5), decay=1.0)
  state = drafter.init(jnp.zeros((4, 4), jnp.int32), jnp.full(4, 4, jnp.int32), 16, None)
  np.testing.assert_allclose(drafter.confidence_weight(state), 0.5)
  state = dataclasses.replace(
      state, planned=jnp.array([2, 2, 2, 0], jnp.int32), first=jnp.array([5, 5, 5, 5], jnp.int32),
      confidence=jnp.array([[0.9, 0.9], [0.1, 0.1], [0.9, 0.1], [0.2, 0.3]]))
  emitted = jnp.array([[5, 6, 7], [5, 6, 7], [5, 8, 0], [4, 0, 0]], jnp.int32)
  count = jnp.array([3, 3, 2, 1], jnp.int32)
  after = drafter.observe(state, None, None, emitted, count, jnp.full(4, 4, jnp.int32))
  lr = np.log(0.9 / 0.5)
  expected = np.array([2 * lr, 2 * np.log(0.1 / 0.5), 2 * lr, np.log(0.8 / 0.5)])
  np.testing.assert_allclose(after.evidence, expected, rtol=1e-5)
  np.testing.assert_allclose(drafter.confidence_weight(after), 1 / (1 + np.exp(-expected)),
                             rtol=1e-5)
  # The next round's predictions come from the updated counts: evidence keeps accumulating.
  again = drafter.observe(dataclasses.replace(after, planned=state.planned,
                                              confidence=state.confidence, first=state.first),
                          None, None, emitted, count, jnp.full(4, 4, jnp.int32))
  assert float(again.evidence[0]) > float(after.evidence[0])
  assert float(again.evidence[1]) < float(after.evidence[1])


def _greedy_equals_generate(target, drafter, tokens, lengths, calibration, max_new=20,
                            token_stop=True):
  # token_stop=False: each row's k fixed before the round from its history alone.
  rows = sj.adaptive_drafter(drafter, calibration=calibration, token_stop=token_stop)
  decode = lambda t, l: sj.decode(target, rows, t, jax.random.key(0), lengths=l,
                                  max_new_tokens=max_new)  # K and the widths come with `rows`
  jaxpr = jax.make_jaxpr(decode)(tokens, lengths)
  assert "callback" not in str(jaxpr)
  calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("pjit", "jit")]
  body = calls[0].params["jaxpr"].jaxpr.eqns
  assert len([e for e in body if e.primitive.name == "while"]) == 1  # the round loop
  out = decode(tokens, lengths)
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=max_new)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.num_tokens, ref.num_tokens)
  return out.stats.summary()


@pytest.mark.costly
def test_a_drafter_that_always_agrees_drafts_k_and_one_that_never_does_drafts_nothing(
    target, ragged):
  tokens, lengths = ragged
  perfect = _greedy_equals_generate(target, sj.ModelDrafter(target), tokens, lengths, FLAT,
                                    token_stop=False)
  # Round 1 drafts the prior's choice (k = 3 of K = 4: FLAT's alpha 0.6 at 4x the odds is 0.86,
  # whose best k is 4); every row's estimate only rises from there: K every later round, for
  # each of the 3 rows.
  plan = costs.adaptive_plan(FLAT.costs, FLAT.profile)
  drafter = AdaptiveDrafter(sj.NGramDrafter(), plan.max_draft, plan.round_ms, plan.prior)
  first = int(drafter.limits(drafter.init(tokens, lengths, 16, None))[0])
  assert (plan.max_draft, first) == (4, 3)
  assert perfect["drafted"] == 4 * perfect["rounds"] - 3 * (4 - first)
  # Every draft is accepted; only a row's last round, cut at its limit, emits fewer than it drafted
  # (at least 1 of its 4), and an uncut round emits its drafts and the bonus.
  assert 0 <= perfect["drafted"] - perfect["accepted"] <= 3 * 3
  assert perfect["emitted"] >= perfect["accepted"] + perfect["rounds"] - 3
  stranger = sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=1), jax.random.key(99))
  poor = _greedy_equals_generate(target, sj.ModelDrafter(stranger), tokens, lengths, FLAT,
                                 max_new=48, token_stop=False)
  assert poor["accepted"] <= 0.2 * poor["drafted"]  # it rarely agrees (about 1 in 64)...
  # ...so after three or four rejected rounds per row (about 10 drafts each) the rows stop
  # drafting: most of the 48 rounds per row are plain target steps.
  assert poor["drafted"] < 0.4 * poor["rounds"]


@pytest.mark.costly
def test_greedy_ngram_and_eagle_equal_generate(target, ragged):
  from specjax.drafters.eagle import network as eagle
  tokens, lengths = ragged
  tokens = tokens.at[:, 4:].set(tokens[:, :4])  # repeats for the n-gram drafter to find
  _greedy_equals_generate(target, sj.NGramDrafter(max_ngram=2), tokens, lengths, FLAT)
  config = eagle.head_config_for(target.config, kind="eagle3", draft_vocab_size=32)
  head = eagle.init_head(config, target, jax.random.key(32), list(range(0, VOCAB, 2)))
  summary = _greedy_equals_generate(target, sj.EagleDrafter(head, target.params["embed"]),
                                    tokens, lengths, FLAT)
  assert summary["drafted"] > 0


# Cheap drafting: a row's first draft pays from a confidence of about 0.06 and deeper ones from
# about 0.1, the middle of these random drafters' top probabilities, so rows stop at every slot.
CHEAP = _calibration([10.0, 10.5, 10.6, 10.7, 10.8], [0.3] * 4, draft_step_ms=0.1)


@pytest.mark.parametrize("kind", ["model", "eagle3", "medusa"])
def test_token_stop_greedy_equals_generate(target, ragged, kind):
  from specjax.drafters.eagle import network as eagle
  from specjax.drafters.medusa import network as medusa
  tokens, lengths = ragged
  ids = list(range(0, VOCAB, 2))
  if kind == "model":
    drafter = sj.ModelDrafter(target)
  elif kind == "eagle3":
    config = eagle.head_config_for(target.config, kind="eagle3", draft_vocab_size=32)
    drafter = sj.EagleDrafter(eagle.init_head(config, target, jax.random.key(32), ids),
                              target.params["embed"])
  else:
    config = medusa.MedusaConfig(target.config.embed_dim, 4, 32, VOCAB)
    drafter = MedusaDrafter(medusa.init_medusa(config, target, ids))
  summary = _greedy_equals_generate(target, drafter, tokens, lengths, CHEAP)
  # The stop cut rounds at different lengths: some drafts were made, not all K = 4 every round.
  assert 0 < summary["drafted"] < 4 * summary["rounds"]


@pytest.mark.costly
@pytest.mark.parametrize("name, power, token_stop", [
    ("t1", False, False), ("t1", True, True),
    pytest.param("t1", True, False, marks=pytest.mark.slow),
    pytest.param("t1", False, True, marks=pytest.mark.slow),
    pytest.param("t0.7_topk3", False, False, marks=pytest.mark.slow),
    pytest.param("t0.7_topk3", False, True, marks=pytest.mark.slow)])
def test_sampled_adaptive_decode_matches_target_distribution(name, power, token_stop):
  from tests.exactness.test_exactness import VOCAB as GOF_VOCAB
  sampling = SETTINGS[name]
  gof_target = sj.init_params(tiny_config(vocab_size=GOF_VOCAB), jax.random.key(10))
  draft = sj.init_params(tiny_config(vocab_size=GOF_VOCAB, num_layers=1), jax.random.key(11))
  # Costs and a prior under which one observation moves a row between 0 and 2 drafts: from the
  # prior (0.5, 0.5) a row drafts 2 (1.75 tokens / 1.5 ms beats 1.5 / 1.4 and 1 / 1.0); after a
  # rejection at position 1 (alpha_1 = 0.25) it drafts 0, and back to 2 once its unproposed
  # first draft matches the target's token. With the token stop the same costs make a row draft
  # its first token from a confidence of about 1/3 (the draft model's top probabilities over 8
  # tokens straddle it), and the second from about 0.1 to 0.4 depending on the first.
  drafter = AdaptiveDrafter(sj.ModelDrafter(draft), 2, (1.0, 1.4, 1.5), (0.5, 0.5),
                            prior_weight=1.0, decay=1.0, token_stop=token_stop)
  tokens = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (N, 1))
  impl = DRAFT_MODEL_BROKEN[name] if power else "auto"
  out = sj.decode(gof_target, drafter, tokens, jax.random.key(3), max_new_tokens=NEW,
                  sampling=sampling, verify_impl=impl)  # K = 2 comes with the drafter
  assert np.all(np.asarray(out.num_tokens) == NEW)
  rounds = np.asarray(out.stats.rounds)
  drafted = np.asarray(out.stats.drafted)
  if token_stop:  # rows differ: some draft in some rounds, some stop short of 2
    assert np.any(drafted > 0) and np.any(drafted < 2 * rounds)
    assert 0.05 < drafted.sum() / (2 * rounds.sum()) < 0.95
  else:  # rows draft 2 in their first round, and some later rounds draft fewer (0 or 1)
    assert np.all(drafted >= 2) and np.any(drafted < 2 * rounds)
  pvalue = chi_square_pvalue(np.asarray(out.tokens), exact_joint(gof_target, sampling))
  if power:
    assert pvalue < POWER_ALPHA
  else:
    assert pvalue > ALPHA


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _PeekingDrafter(sj.ModelDrafter):
  """A broken stop: it keeps draft j only while d_j is q_j's mode, a decision that depends on the
  draft itself (the token stop decides before the draft is drawn)."""

  def propose(self, cache, sequence, lengths, *, num_draft, sampling, seeds, limits=None):
    cache, proposal = super().propose(cache, sequence, lengths, num_draft=num_draft,
                                      sampling=sampling, seeds=seeds)
    mode = (jnp.argmax(proposal.logits, axis=-1) == proposal.tokens).astype(jnp.int32)
    return cache, dataclasses.replace(proposal, num_drafted=jnp.sum(jnp.cumprod(mode, 1), 1))


@pytest.mark.costly
def test_a_stop_that_peeks_at_its_draft_is_detected():
  """The exactness condition is needed: truncating on the drawn drafts themselves biases the
  output, and the same harness (N = 20,000, p < 1e-6) rejects it."""
  from tests.exactness.test_exactness import VOCAB as GOF_VOCAB
  sampling = SETTINGS["t1"]
  gof_target = sj.init_params(tiny_config(vocab_size=GOF_VOCAB), jax.random.key(10))
  draft = sj.init_params(tiny_config(vocab_size=GOF_VOCAB, num_layers=1), jax.random.key(11))
  tokens = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (N, 1))
  out = sj.decode(gof_target, _PeekingDrafter(draft), tokens, jax.random.key(3),
                  max_new_tokens=NEW, num_draft=2, sampling=sampling)
  drafted = np.asarray(out.stats.drafted)
  assert np.any(drafted > 0) and np.any(drafted < 2 * np.asarray(out.stats.rounds))
  assert chi_square_pvalue(np.asarray(out.tokens), exact_joint(gof_target, sampling)) < POWER_ALPHA


@pytest.mark.parametrize("kwargs, message", [
    (dict(round_ms=(1.0, 2.0)), "round costs"),
    (dict(prior=(0.5, 1.5)), "acceptances in"),
    (dict(round_ms=(1.0, 0.0, 2.0)), "positive"),
    (dict(decay=0.0), "decay"),
])
def test_bad_plans_raise(kwargs, message):
  args = dict(max_draft=2, round_ms=(1.0, 1.4, 1.5), prior=(0.5, 0.5))
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    AdaptiveDrafter(sj.NGramDrafter(), **args)


def test_adaptive_needs_a_calibration():
  with pytest.raises(ValueError, match="calibrat"):
    sj.adaptive_drafter(sj.NGramDrafter(), calibration=None)
  with pytest.raises(ValueError, match="already adaptive"):
    AdaptiveDrafter(AdaptiveDrafter(sj.NGramDrafter(), 1, (1.0, 2.0), (0.5,)), 1, (1.0, 2.0),
                    (0.5,))


# --- Rounds in which no row drafts skip the drafter ------------------------------------------

def _lagging(model, tokens, lengths, lag):
  """A `ModelDrafter` cache `lag` tokens behind a normal round's (it missed `lag` rounds)."""
  drafter = sj.ModelDrafter(model)
  cache = drafter.init(tokens, lengths, 32, None)
  return drafter, cache.with_lengths(lengths - 1 - lag)


@jax.jit
def _propose_sampled(drafter, state, sequence, lengths, seeds):
  """One `propose` of 2 drafts at temperature 1, compiled once per drafter structure (eager calls
  would run the draft model's catch-up forwards op by op)."""
  return drafter.propose(state, sequence, lengths, num_draft=2,
                         sampling=sj.Sampling(temperature=1.0), seeds=seeds)


@pytest.mark.parametrize("lag", [1, 2, 3, 9, 16])
def test_a_draft_model_catches_up_on_the_rounds_it_missed(target, ragged, lag):
  # The drafter's cache was filled on the prompt; the sequence then grew by `lag` tokens that it
  # never saw (skipped rounds). Its proposal, and its q, equal those of a drafter prefilled on
  # the whole longer sequence (lag > k + 1 = 3: several catch-up forwards, no gap left).
  tokens, lengths = ragged
  drafter = sj.ModelDrafter(target)
  sequence = jnp.pad(tokens, ((0, 0), (0, 24)))
  longer = lengths + lag
  grown = jax.random.randint(jax.random.key(5), (3, 24), 0, VOCAB)
  sequence = jnp.where(jnp.arange(32)[None] >= lengths[:, None], jnp.pad(grown, ((0, 0), (8, 0))),
                       sequence)
  behind = drafter.init(sequence[:, :8], lengths, 40, None)  # lengths - 1 seen
  behind = behind.with_lengths(lengths - 1)
  fresh = drafter.init(sequence, longer, 40, None)  # longer - 1 seen
  seeds = jnp.arange(3, dtype=jnp.uint32)
  caught, late = _propose_sampled(drafter, behind, sequence, longer, seeds)
  _, ref = _propose_sampled(drafter, fresh, sequence, longer, seeds)
  np.testing.assert_array_equal(late.tokens, ref.tokens)
  np.testing.assert_allclose(late.logits, ref.logits, rtol=1e-4, atol=1e-4)
  # The round's block of 2 and one more draft step: the cache holds everything before the last
  # draft.
  np.testing.assert_array_equal(caught.lengths, longer + 1)


def _idle_drafter(draft, prior=(0.05, 0.05), token_stop=False, **kwargs):
  # Costs and a prior under which every row's best k is 0 from the start (1 / 1.0 beats
  # 1.05 / 1.4 and 1.1 / 1.5), until a probe finds its first draft matching the target's token.
  return AdaptiveDrafter(sj.ModelDrafter(draft), 2, (1.0, 1.4, 1.5), prior,
                         prior_weight=1.0, decay=1.0, token_stop=token_stop, **kwargs)


@jax.jit
def _propose_greedy(drafter, state, sequence, lengths):
  """One greedy `propose` of 2 drafts, compiled once per drafter structure (eager calls would run
  the draft model op by op)."""
  return drafter.propose(state, sequence, lengths, num_draft=2, sampling=sj.Sampling(),
                         seeds=jnp.zeros(lengths.shape[0], jnp.uint32))


def test_skipped_rounds_probe_with_a_doubling_wait(target, ragged):
  tokens, lengths = ragged
  drafter = _idle_drafter(target, probe_every=2, probe_max=4)
  state = drafter.init(tokens, lengths, 40, None)
  sequence = jnp.pad(tokens, ((0, 0), (0, 32)))
  ran = []
  for round_ in range(12):
    before = state.inner.lengths
    state, proposal = _propose_greedy(drafter, state, sequence, lengths + round_)
    np.testing.assert_array_equal(proposal.num_drafted, 0)  # every row's history says 0
    skipped = bool(state.skipped[0])
    if skipped:  # the drafter's cache is untouched
      np.testing.assert_array_equal(state.inner.lengths, before)
    ran.append(not skipped)
  # Skip twice, probe; the probe found every row still at 0 (nothing observed here), so the
  # wait doubles to 4, then stays at probe_max = 4.
  assert ran == [False, False, True, False, False, False, False, True,
                 False, False, False, False]


def test_rounds_whose_confidences_stop_every_draft_skip_the_drafter(target, ragged):
  # History says draft (prior 0.9: k = 2 pays), but the drafter's top probabilities (a random
  # 64-token model: well under the 0.26 that drafting needs at costs 1 / 1.4 / 1.5 with no
  # history to shift them) stop every draft: after stop_rounds = 2 such rounds the drafter is
  # skipped and probed like an idle one (wait 2, then 4). `confidence_prior` 50: the stop trusts
  # the confidences alone (the drafter is the target itself, so its unproposed drafts match and
  # at the default prior the row's history would soon outweigh them and resume drafting).
  tokens, lengths = ragged
  drafter = AdaptiveDrafter(sj.ModelDrafter(target), 2, (1.0, 1.4, 1.5), (0.9, 0.9),
                            prior_weight=1.0, decay=1.0, token_stop=True, probe_every=2,
                            probe_max=4, stop_rounds=2, confidence_prior=50.0)
  state = drafter.init(tokens, lengths, 40, None)
  sequence = jnp.pad(tokens, ((0, 0), (0, 32)))
  ran = []
  for round_ in range(12):
    state, proposal = _propose_greedy(drafter, state, sequence, lengths + round_)
    np.testing.assert_array_equal(proposal.num_drafted, 0)
    np.testing.assert_array_equal(drafter.limits(state), 2)  # the history alone says draft
    ran.append(not bool(state.skipped[0]))
  assert ran == [True, True, False, False, True, False, False, False, False, True, False, False]
  # Without the stop rounds' rule (a limit no run reaches) the drafter runs every round.
  never = dataclasses.replace(drafter, stop_rounds=1000)
  state = never.init(tokens, lengths, 40, None)
  for round_ in range(6):
    state, _ = _propose_greedy(never, state, sequence, lengths + round_)
    assert not bool(state.skipped[0])


def test_a_drafter_right_when_unsure_keeps_drafting():
  """Two rows with the same confidences every round, 0.99 at slot 1 and 0.005 at slot 2. Row 0's
  drafts are always both accepted (a quantized copy of the target: right when unsure); row 1's
  second is always rejected (a head whose confidence means what it says). After 12 rounds the
  confidence weight has gone to row 0's history and leans to row 1's confidences, and at the
  CPU-like costs of the hand-worked case a 0.005-confidence draft at slot 1 is proposed by row 0
  only. The confidence estimate alone (`weight` None, before the mixture) refuses it in both
  rows: the shift lifts the mean of row 0's confidences to its acceptance (0.005 -> 0.09), not
  enough for its unsure ones."""
  round_ms = (27.0, 36.0, 37.0, 38.0, 39.0)
  drafter = AdaptiveDrafter(sj.NGramDrafter(), 4, round_ms, (0.5,) * 4)
  state = drafter.init(jnp.zeros((2, 4), jnp.int32), jnp.full(2, 4, jnp.int32), 16, None)
  emitted = jnp.array([[5, 6, 7, 0, 0], [5, 8, 0, 0, 0]], jnp.int32)
  for _ in range(12):
    state = dataclasses.replace(state, planned=jnp.array([2, 2], jnp.int32),
                                first=jnp.array([5, 5], jnp.int32),
                                confidence=jnp.array([[0.99, 0.005, 0, 0], [0.99, 0.005, 0, 0]]))
    state = drafter.observe(state, None, None, emitted, jnp.array([3, 2], jnp.int32),
                            jnp.full(2, 4, jnp.int32))
  weight = np.asarray(drafter.confidence_weight(state))
  assert weight[0] < 0.05 and weight[1] > 0.5, weight
  alpha, shift = drafter.alpha(state), drafter.confidence_shift(state)
  unsure = jnp.full(2, 0.005)
  mixed = CostAwareStop(alpha, shift, round_ms, drafter.confidence_weight(state))
  np.testing.assert_array_equal(mixed(0, unsure, mixed.init(2))[0], [True, False])
  alone = CostAwareStop(alpha, shift, round_ms)
  np.testing.assert_array_equal(alone(0, unsure, alone.init(2))[0], [False, False])


@pytest.mark.parametrize("token_stop", [False, True])
def test_greedy_with_skipped_rounds_equals_generate(target, ragged, token_stop):
  # Every row starts idle under the prior (0.05, 0.05); with the token stop too (the skip reads
  # the rows' history, not the stop's decisions).
  tokens, lengths = ragged
  stranger = sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=1), jax.random.key(99))
  drafter = _idle_drafter(stranger, token_stop=token_stop, probe_every=1, probe_max=4,
                          widths=(1, 2, 3))
  out = sj.decode(target, drafter, tokens, jax.random.key(0), lengths=lengths,
                  max_new_tokens=40)
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=40)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.num_tokens, ref.num_tokens)
  calls, rounds = np.asarray(out.stats.draft_calls), np.asarray(out.stats.rounds)
  assert np.all(calls < 2 * rounds) and np.all(calls > 0)  # it skipped rounds and probed


def test_a_plan_where_drafting_never_pays_runs_plain_steps(target, ragged):
  tokens, lengths = ragged
  # A verify of 2 tokens costs 3 steps and a draft step 5: no k pays even at 4x the odds
  # (best: k = 2, 1 + 0.97 + 0.95 tokens / (40 + 2 * 50) ms, against 1 token / 10 ms).
  dear = _calibration([10.0, 30.0, 40.0], [0.9, 0.9], draft_step_ms=50.0)
  plan = costs.adaptive_plan(dear.costs, dear.profile)
  assert plan.plain
  assert not costs.adaptive_plan(FLAT.costs, FLAT.profile).plain
  # The bar is generate's step, not decode's own k = 0 round: a round overhead that makes every
  # round dearer than a step (here 10 ms + 30 ms) cannot make drafting look good.
  costly = _calibration([10.0, 11.0, 12.0], [0.9, 0.9], draft_step_ms=5.0, round_overhead_ms=30.0)
  assert costs.adaptive_plan(costly.costs, costly.profile).plain
  # Drafting must promise 10% over a step (PLAIN_MARGIN): with 8 ms draft steps the best is k = 2
  # at (1 + 0.973 + 0.947) / (11 + 2 * 8 + 0.5) = 0.106 tokens/ms, 6% over 1 / 10 ms: plain;
  # with 6 ms steps 2.92 / 23.5 = 0.124 (24% over): it drafts.
  near = lambda step: _calibration([10.0, 10.5, 11.0], [0.9, 0.9], draft_step_ms=step,
                                   round_overhead_ms=0.5)
  assert costs.adaptive_plan(near(8.0).costs, near(8.0).profile).plain
  assert not costs.adaptive_plan(near(6.0).costs, near(6.0).profile).plain
  out = sj.decode(target, sj.adaptive_drafter(target, calibration=dear), tokens,
                  jax.random.key(0), lengths=lengths, max_new_tokens=12)
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  summary = out.stats.summary()
  assert summary["drafted"] == 0 and summary["draft_calls"] == 0


# `slow` for CI's time (134 s the pair): CI checks the per-row adaptive drafter's law and its
# broken twin (`test_sampled_adaptive_decode_matches_target_distribution`) and skipped rounds'
# greedy identity.
@pytest.mark.slow
@pytest.mark.parametrize("name, power", [("t1", False), ("t1", True)])
def test_sampled_decode_with_skipped_rounds_matches_target_distribution(name, power):
  """Round 1 skips the drafter for every row, round 2 probes it, and in round 3 the rows whose
  unproposed first draft matched draft 2: the pooled chi-square of tests/exactness/test_exactness.py at
  ALPHA on 3 N = 60,000 rows (only the third token of about a third of the rows is drafted, so
  the broken rule, which must fail at POWER_ALPHA, needs three times the harness's N)."""
  from tests.exactness.test_exactness import VOCAB as GOF_VOCAB
  sampling = SETTINGS[name]
  gof_target = sj.init_params(tiny_config(vocab_size=GOF_VOCAB), jax.random.key(10))
  draft = sj.init_params(tiny_config(vocab_size=GOF_VOCAB, num_layers=1), jax.random.key(11))
  drafter = _idle_drafter(draft, probe_every=1, probe_max=1, widths=(1, 2, 3))
  tokens = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (3 * N, 1))
  impl = DRAFT_MODEL_BROKEN[name] if power else "auto"
  out = sj.decode(gof_target, drafter, tokens, jax.random.key(3), max_new_tokens=NEW,
                  sampling=sampling, verify_impl=impl)
  drafted = np.asarray(out.stats.drafted)
  assert 0.05 < np.mean(drafted > 0) < 0.95  # some rows drafted after the probe, some did not
  pvalue = chi_square_pvalue(np.asarray(out.tokens), exact_joint(gof_target, sampling))
  if power:
    assert pvalue < POWER_ALPHA
  else:
    assert pvalue > ALPHA
