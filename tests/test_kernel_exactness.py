"""The speculative core's chi-square exactness tests, with the verify run by the fused kernel.

`tests/test_exactness.py` checks that sampled speculative decoding reproduces the target's own
distribution (N = 20,000 rows, vocabulary 8, 3 new tokens, joint of 512 cells, significance 1e-3,
seeded). Here the same decodes run with `verify_impl="interpret"`: every round's accept/reject
decision and correction / bonus token come from the Pallas kernel in interpret mode
(`specjax.kernels.fused_verify`, `interpret=True`), for the draft-model and the n-gram drafter and
all three sampling settings. With the interpret-mode default blocks (up to 1024 rows per grid step)
the file takes about 1.5 min of CPU, too long for the default selection, hence `slow`.
"""

import numpy as np
import pytest

import specjax as sj
import test_exactness as exactness  # tests/ is on sys.path under pytest
from test_exactness import draft, target  # noqa: F401  (module-scoped fixtures)

pytestmark = pytest.mark.slow


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


def test_kernel_path_equals_the_reference_path(target, draft):
  # Stronger than a goodness-of-fit test: the kernel and the reference share their random
  # numbers, so the 20,000 decodes must agree token for token.
  sampling = exactness.SETTINGS["t0.7_topk3"]
  kernel_tokens, _ = exactness.run_decode(target, draft, sampling, verify_impl="interpret")
  reference_tokens, _ = exactness.run_decode(target, draft, sampling, verify_impl="reference")
  np.testing.assert_array_equal(kernel_tokens, reference_tokens)
