"""`specjax.audit` passes an exact decoder, fails a deliberately broken verify rule, and
says
INCONCLUSIVE when its negative control shows the sample size was too small.

Tiny random models over a 32-token vocabulary; 2 prompts x 1500 samples, first 3 positions, at
temperature 1 (acceptance around 10-20%, so both the ratio test and the residual are exercised).
The audit's own significance is alpha = 1e-3 family-wise (Bonferroni over the 6 tests), so the
exact-pair test fails by chance with probability <= 1e-3; it is seeded, so it is deterministic.
The broken rule (corrections drawn from p instead of the residual) must be rejected with
p < 1e-6, which shows the audit has the power to catch it at this sample size; the same rule is
the audit's built-in negative control, run on the same draws, so the exact pair's PASS carries
that power check in the report. At 64 samples per prompt (most of the mass pooled, one test per
prompt) the control is not rejected: INCONCLUSIVE, not PASS. All runs use seed 0.
"""

import jax
import pytest
from scipy import stats

import specjax as sj
from specjax.exactness.audit import audit, control_rule
from specjax.exactness.stats import POWER, ControlCheck, PositionTest, samples_needed, verdict
from specjax.testing.models import tiny_config
from specjax.testing.rules import rule_without_residual

VOCAB = 32
PROMPTS = [[1, 2, 3, 4, 5], [7, 3, 9]]
SAMPLES = 1500
FEW_SAMPLES = 64  # too few to see the control's bug on this pair
SAMPLING = sj.Sampling(temperature=1.0, top_k=24)


@pytest.fixture(scope="module")
def pair():
  target = sj.init_params(tiny_config(vocab_size=VOCAB), jax.random.key(1))
  draft = sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=1), jax.random.key(2))
  return target, draft


def run(pair, **kwargs):
  target, draft = pair
  kwargs = dict(dict(num_samples=SAMPLES), **kwargs)
  return audit(target, draft, PROMPTS, sampling=SAMPLING, num_positions=3, max_new_tokens=12,
               num_draft=3, seed=0, **kwargs)


@pytest.fixture(scope="module")
def exact_report(pair):
  return run(pair)


@pytest.mark.costly
def test_exact_pair_passes(exact_report):
  report = exact_report
  assert report.passed and report.verdict == "PASS", str(report)
  assert report.greedy_identity_rate == 1.0 and not report.divergences
  assert len(report.tests) == len(PROMPTS) * 3
  assert all(t.dof > 0 for t in report.tests)  # every position was actually tested
  assert all(t.rows_tested == SAMPLES for t in report.tests if t.position == 1)
  assert report.corrected_alpha == pytest.approx(1e-3 / 6)
  assert 0.05 < report.acceptance_rate < 0.95
  text = str(report)
  assert text.startswith("specjax exactness audit: PASS")
  assert "Bonferroni" in text and f"{SAMPLES} samples per prompt" in text


@pytest.mark.costly
def test_exact_pair_pass_shows_the_power_of_its_control(exact_report):
  control = exact_report.control
  assert control is not None and control.rejected
  assert control.min_pvalue < control.corrected_alpha and control.min_pvalue < 1e-6
  assert control.corrected_alpha >= exact_report.alpha / len(exact_report.tests)
  assert 0 < control.samples_needed < SAMPLES  # power 0.9 is reached below the size used
  text = str(exact_report)
  assert "negative control (control_rule" in text and "rejected;" in text
  assert f"samples per prompt for power {POWER:g}" in text and "an estimate" in text


def test_too_few_samples_is_inconclusive_not_pass(pair):
  report = run(pair, num_samples=FEW_SAMPLES)
  assert report.verdict == "INCONCLUSIVE" and not report.passed, str(report)
  assert not any(t.pvalue <= report.corrected_alpha for t in report.tests)  # nothing rejected
  control = report.control
  assert not control.rejected and control.min_pvalue > control.corrected_alpha
  assert control.samples_needed > FEW_SAMPLES
  text = str(report)
  assert text.startswith("specjax exactness audit: INCONCLUSIVE")
  assert "NOT rejected" in text and f"{control.samples_needed} samples per prompt would" in text
  # Without the control the same run is today's PASS, and the report says the power is unknown.
  unchecked = run(pair, num_samples=FEW_SAMPLES, control=False)
  assert unchecked.verdict == "PASS" and unchecked.control is None
  assert "the power was not checked" in str(unchecked)


def test_verdicts():
  tested = PositionTest(0, 1, 3.0, 4, 0.56, 100, 1, 0)
  untested = PositionTest(0, 2, 0.0, 0, 1.0, 0, 0, 0)
  def control(rejected):
    return ControlCheck((tested,), 1e-4, rejected, 500, False, 0.2)
  assert verdict(True, [tested], None) == "FAIL"
  assert verdict(True, [tested], control(False)) == "FAIL"  # a failure needs no power check
  assert verdict(False, [tested], control(True)) == "PASS"
  assert verdict(False, [tested], control(False)) == "INCONCLUSIVE"
  assert verdict(False, [untested, untested], None) == "INCONCLUSIVE"  # nothing was testable
  assert verdict(False, [tested, untested], None) == "PASS"  # control=False: today's verdict
  assert verdict(False, [], None) == "PASS"  # greedy settings: the identity check only


@pytest.mark.slow  # a decode compiled for 4 rows; the verdict itself is covered by test_verdicts
def test_nothing_testable_is_inconclusive(pair):
  report = run(pair, num_samples=2)  # prefix groups under 10 rows are not tested
  assert report.verdict == "INCONCLUSIVE" and report.control is None, str(report)
  assert "raise num_samples" in str(report)


def test_the_control_rule_is_the_testing_rule_without_residual():
  assert rule_without_residual is control_rule


def test_samples_needed_grows_past_the_size_of_a_test_that_did_not_reject():
  alpha = 1e-3 / 6
  critical = stats.chi2.isf(alpha, 10)
  weak = PositionTest(0, 1, critical - 1.0, 10, stats.chi2.sf(critical - 1.0, 10), 100, 1, 0)
  strong = PositionTest(0, 1, 4 * critical, 10, stats.chi2.sf(4 * critical, 10), 100, 1, 0)
  noise = PositionTest(0, 1, 8.0, 10, stats.chi2.sf(8.0, 10), 100, 1, 0)
  untested = PositionTest(0, 2, 0.0, 0, 1.0, 0, 0, 0)
  needed, no_signal = samples_needed([weak, untested], 100, alpha, stats)
  assert needed > 100 and not no_signal
  needed_strong, _ = samples_needed([strong, weak], 100, alpha, stats)
  assert needed_strong < 100  # the smallest over the tests
  def power(n):  # the noncentrality extrapolated linearly from 100 samples to n
    return stats.ncx2.sf(critical, 10, (4 * critical - 10) * n / 100)
  assert power(needed_strong) >= POWER > power(needed_strong - 1)  # the smallest such size
  assert samples_needed([noise], 100, alpha, stats)[1]  # below the noise: flagged
  assert samples_needed([noise], 100, 0.5, stats)[0] > 100  # not rejected: more than N, always
  assert samples_needed([untested], 100, alpha, stats) == (None, False)


def test_skipping_the_residual_fails(pair):
  report = run(pair, verify_impl=rule_without_residual)
  assert not report.passed and report.verdict == "FAIL"
  assert report.control is None  # a failed rule needs no power check
  assert report.min_pvalue < 1e-6
  assert report.greedy_identity_rate == 1.0  # greedy has no residual: only sampling can tell
  text = str(report)
  assert text.startswith("specjax exactness audit: FAIL")
  assert "reject the target's distribution" in text


def test_greedy_settings_skip_the_sampled_check(pair):
  target, draft = pair
  report = audit(target, draft, PROMPTS, sampling=sj.Sampling(temperature=0.0),
                 max_new_tokens=12, num_draft=3)
  assert report.passed and report.sampling is None and not report.tests
  assert report.verdict == "PASS" and report.control is None  # greedy identity is the whole test
  assert "skipped" in str(report)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[]), "at least one prompt"),
    (dict(prompts=["text"]), "tokenizer"),
    (dict(prompts=[[1], []]), "empty prompt"),
    (dict(alpha=0.0), "alpha"),
    (dict(num_samples=1), "num_samples"),
    (dict(verify_impl="nope"), "verify_impl"),
])
def test_bad_arguments(pair, kwargs, message):
  target, draft = pair
  kwargs = dict(dict(prompts=PROMPTS), **kwargs)
  with pytest.raises(ValueError, match=message):
    audit(target, draft, kwargs.pop("prompts"), **kwargs)
