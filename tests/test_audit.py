"""`specjax.audit` passes an exact decoder and fails a deliberately broken verify rule.

Tiny random models over a 32-token vocabulary; 2 prompts x 1500 samples, first 3 positions, at
temperature 1 (acceptance around 10-20%, so both the ratio test and the residual are exercised).
The audit's own significance is alpha = 1e-3 family-wise (Bonferroni over the 6 tests), so the
exact-pair test fails by chance with probability <= 1e-3; it is seeded, so it is deterministic.
The broken rule (corrections drawn from p instead of the residual) must be rejected with
p < 1e-6, which shows the audit has the power to catch it at this sample size.
"""

import jax
import pytest

import specjax as sj
from specjax.audit import audit
from specjax.testing.models import tiny_config
from specjax.testing.rules import rule_without_residual

VOCAB = 32
PROMPTS = [[1, 2, 3, 4, 5], [7, 3, 9]]
SAMPLES = 1500
SAMPLING = sj.Sampling(temperature=1.0, top_k=24)


@pytest.fixture(scope="module")
def pair():
  target = sj.init_params(tiny_config(vocab_size=VOCAB), jax.random.key(1))
  draft = sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=1), jax.random.key(2))
  return target, draft


def run(pair, **kwargs):
  target, draft = pair
  return audit(target, draft, PROMPTS, sampling=SAMPLING, num_samples=SAMPLES, num_positions=3,
               max_new_tokens=12, num_draft=3, seed=0, **kwargs)


def test_exact_pair_passes(pair):
  report = run(pair)
  assert report.passed, str(report)
  assert report.greedy_identity_rate == 1.0 and not report.divergences
  assert len(report.tests) == len(PROMPTS) * 3
  assert all(t.dof > 0 for t in report.tests)  # every position was actually tested
  assert all(t.rows_tested == SAMPLES for t in report.tests if t.position == 1)
  assert report.corrected_alpha == pytest.approx(1e-3 / 6)
  assert 0.05 < report.acceptance_rate < 0.95
  text = str(report)
  assert text.startswith("specjax exactness audit: PASS")
  assert "Bonferroni" in text and f"{SAMPLES} samples per prompt" in text


def test_skipping_the_residual_fails(pair):
  report = run(pair, verify_impl=rule_without_residual)
  assert not report.passed
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
