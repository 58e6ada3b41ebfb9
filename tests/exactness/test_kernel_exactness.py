"""The speculative core's chi-square exactness tests, with the verify run by the fused kernel.

`tests/exactness/test_exactness.py` checks that sampled speculative decoding reproduces the target's own
distribution (N = 20,000 rows, vocabulary 8, 3 new tokens, joint of 512 cells, significance 1e-3,
seeded). Here the same decodes run with `verify_impl="interpret"`: every round's accept/reject
decision and correction / bonus token come from the Pallas kernel in interpret mode
(`specjax.kernels.fused_verify`, `interpret=True`), for the draft-model and the n-gram
drafter and all three sampling settings. Each goodness-of-fit test has a power check through the
kernel path: `kernel_rule_without_residual` takes the kernel's accept/reject decisions and replaces
the correction at a rejection by a draw from p (the residual step skipped); at the same N it must be
rejected with p < 1e-6. With the interpret-mode default blocks (up to 1024 rows per grid step) the
file takes minutes of CPU, too long for the default selection, hence `slow`.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.verify.local import local_verify
from specjax.core.sampling import PURPOSE_RESIDUAL, VerifyResult, sample_race, warp_logits
from tests.exactness import test_exactness as exactness  # tests/ is on sys.path under pytest
from tests.exactness.test_exactness import draft, target  # noqa: F401  (module-scoped fixtures)

pytestmark = pytest.mark.slow


def kernel_rule_without_residual(target_logits, draft_logits, draft_tokens, *, sampling, seeds,
                                 positions):
  """Broken, through the kernel: the correction after a rejection is drawn from p."""
  result = local_verify(target_logits, draft_logits, draft_tokens, sampling=sampling, seeds=seeds,
                        positions=positions, impl="interpret")
  n = result.num_accepted
  p_at_n = jnp.take_along_axis(target_logits, n[:, None, None], axis=1)[:, 0]
  from_p = sample_race(warp_logits(p_at_n, sampling), seeds, positions + n, PURPOSE_RESIDUAL)
  final = jnp.where(n < draft_tokens.shape[1], from_p,
                    jnp.take_along_axis(result.tokens, n[:, None], axis=1)[:, 0])
  return VerifyResult(n, result.tokens.at[jnp.arange(len(n)), n].set(final))


@pytest.mark.parametrize("drafter", ["draft_model", "ngram"])
@pytest.mark.parametrize("name", sorted(exactness.SETTINGS))
def test_kernel_path_power(target, draft, drafter, name):
  sampling = exactness.SETTINGS[name]
  if drafter == "ngram":
    tokens, _ = exactness.run_decode(target, sj.NGramDrafter(max_ngram=2), sampling, num_draft=3,
                                     verify_impl=kernel_rule_without_residual)
  else:
    tokens, _ = exactness.run_decode(target, draft, sampling,
                                     verify_impl=kernel_rule_without_residual)
  pvalue = exactness.chi_square_pvalue(tokens, exactness.exact_joint(target, sampling))
  assert pvalue < exactness.POWER_ALPHA


@pytest.mark.parametrize("name", sorted(exactness.SETTINGS))
def test_draft_model_decode_with_the_kernel_matches_target_distribution(target, draft, name):
  sampling = exactness.SETTINGS[name]
  tokens, stats = exactness.run_decode(target, draft, sampling, verify_impl="interpret")
  assert 0.05 < stats.summary()["acceptance_rate"] < 0.95  # the rule is exercised both ways
  pvalue = exactness.chi_square_pvalue(tokens, exactness.exact_joint(target, sampling))
  print(f"draft model, {name}: p = {pvalue:.4g}")
  assert pvalue > exactness.ALPHA


@pytest.mark.parametrize("name", sorted(exactness.SETTINGS))
def test_ngram_decode_with_the_kernel_matches_target_distribution(target, name):
  sampling = exactness.SETTINGS[name]
  tokens, stats = exactness.run_decode(target, sj.NGramDrafter(max_ngram=2), sampling,
                                       num_draft=3, verify_impl="interpret")
  assert stats.summary()["accepted"] > 0
  pvalue = exactness.chi_square_pvalue(tokens, exactness.exact_joint(target, sampling))
  print(f"n-gram, {name}: p = {pvalue:.4g}")
  assert pvalue > exactness.ALPHA


@pytest.mark.parametrize("name", sorted(exactness.SETTINGS))
def test_kernel_path_equals_the_reference_path(target, draft, name):
  # Stronger than a goodness-of-fit test: the kernel and the reference share their random
  # numbers, so the 20,000 decodes must agree token for token, in every setting.
  sampling = exactness.SETTINGS[name]
  kernel_tokens, _ = exactness.run_decode(target, draft, sampling, verify_impl="interpret")
  reference_tokens, _ = exactness.run_decode(target, draft, sampling, verify_impl="reference")
  np.testing.assert_array_equal(kernel_tokens, reference_tokens)
