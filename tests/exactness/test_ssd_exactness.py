"""SSD (`specjax.decode` with an `SSDDrafter`) emits the target's own distribution, with and
without Saguaro sampling, and its broken variants are caught by the same test.

**Setup** (`specjax.testing.harness`): the tiny random 4-layer target over V = 64 with its output
head scaled (about 1 nat of entropy at T = 1), a noisy copy of it (relative noise 0.07) as the
draft, the three ragged prompts (8, 10, 12 tokens); N rows per prompt in ONE `decode` call
(every row its own random stream, seed 0), 24 new tokens per row, K = 4 drafts per round and
branch, a budget of 8 branches per row (geometric fan-out (2, 1, 1, 1, 3)). The outcome cache hits
in about 40-75% of the lookups per k, so rows mix hit rounds (served branches), miss rounds (a plain
target step) and every outcome length.

**Statistic:** the audit's prefix-grouped Pearson chi-square per (prompt, position)
(`specjax.testing.harness.goodness_of_fit`), Bonferroni over the run's tests at a family-wise
ALPHA = 1e-3; a broken variant must be rejected at the same corrected level.

**Settings:** T = 1 (C = 1), T = 0.7 with top-k 16 / top-p 0.9 (C = 1), and T = 1 with Saguaro
sampling C = 0.3 (the drafts' top-F_i probabilities scaled by 0.3).

**Variants** (`specjax.testing.ssd_variants`: the same call with one step of the loop broken):
  * "k_only": the cache keyed by k alone, ignoring t*, so a wrong-prefix branch is served, but
    verified with the q its drafts were drawn from. Speculative sampling is exact for ANY proposal
    distribution used consistently, so this is still exact (the test passes it; it accepts fewer
    drafts). Keying by k alone is only detectable together with the next variant.
  * "k_only_realised_q": keyed by k alone, the served (wrong-prefix) drafts verified with q
    re-scored by the draft at the realised prefix: rejected.
  * "unscaled_q" (C = 0.3): the drafts drawn from Saguaro's q' but verified with the unscaled q:
    rejected.
  * "wrong_branch_q": a hit verified with the q of the neighbouring branch slot: rejected.

N: 600 rows per prompt in the `slow` runs; the `costly` pair (the exact C < 1 path and the
k-only realised-q variant) at N = 60. Smallest p-values at this commit, N = 600 (seed 0): T = 1
0.049 (30 tests, level 3.3e-5), T = 0.7 top-k / top-p 0.077 (47 tests, level 2.1e-5), C = 0.3
0.074 (28 tests, level 3.6e-5), k_only 0.057 (passes, 28 tests); rejected: k_only_realised_q
and wrong_branch_q p = 0 (underflow), unscaled_q 3.9e-11 (level 3.8e-5).

Cost (one worker, a 2-core host shared with two other sessions, load 4-9): the three exact
N = 600 runs 463, 316 and 180 s, the four variants 99-157 s each; the `costly` test 99 s at N = 100 (load about 5), less at N = 60.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import SSDDrafter
from specjax.testing import harness, ssd_variants

N = 600
N_SMALL = 60
NEW = 24
K = 4
BUDGET = 8
ALPHA = 1e-3
SETTINGS = {
    "t1": (sj.Sampling(temperature=1.0), 1.0),
    "t0.7_topk16_topp0.9": (sj.Sampling(temperature=0.7, top_k=16, top_p=0.9), 1.0),
    "t1_saguaro0.3": (sj.Sampling(temperature=1.0), 0.3),
}


@pytest.fixture(scope="module")
def world():
  return harness.harness_world()


def _fit(world, setting: str, variant: str, num_samples: int):
  sampling, scale = SETTINGS[setting]
  prompts = world["prompts"]
  lengths = np.repeat([len(p) for p in prompts], num_samples).astype(np.int32)
  tokens = np.zeros((len(lengths), max(len(p) for p in prompts)), np.int32)
  for i, prompt in enumerate(prompts):
    tokens[i * num_samples:(i + 1) * num_samples, :len(prompt)] = prompt
  drafter = SSDDrafter(world["draft"], budget=BUDGET, saguaro=scale)
  call = dict(lengths=jnp.asarray(lengths), max_new_tokens=NEW, num_draft=K, sampling=sampling)
  if variant == "exact":
    out = sj.decode(world["target"], drafter, jnp.asarray(tokens), jax.random.key(0), **call)
  else:
    out = ssd_variants.decode_ssd_variant(world["target"], drafter, jnp.asarray(tokens),
                                          jax.random.key(0), variant=variant, **call)
  assert np.all(np.asarray(out.num_tokens) == NEW)
  new = np.asarray(out.tokens).reshape(len(prompts), num_samples, NEW)
  fit = harness.goodness_of_fit(prompts, new, sampling, world["scorer"], alpha=ALPHA)
  print(f"{setting} {variant} N={num_samples}: {fit.describe()}; tau "
        f"{out.stats.summary()['tokens_per_round']:.2f}; hit rate per k "
        f"{np.round(out.ssd.hit_rate(), 2).tolist()}")
  return fit, out


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_ssd_is_exact(world, setting):
  fit, out = _fit(world, setting, "exact", N)
  assert fit.passed, fit.describe()
  assert np.asarray(out.ssd.hits).sum() > 0 and np.asarray(out.ssd.fallbacks).max() > 1


@pytest.mark.slow
def test_k_only_cache_with_consistent_q_is_still_exact(world):
  fit, _ = _fit(world, "t1", "k_only", N)
  assert fit.passed, fit.describe()


@pytest.mark.slow
@pytest.mark.parametrize("setting, variant", [
    ("t1", "k_only_realised_q"), ("t1_saguaro0.3", "unscaled_q"), ("t1", "wrong_branch_q")])
def test_broken_variants_are_rejected(world, setting, variant):
  fit, _ = _fit(world, setting, variant, N)
  assert fit.min_pvalue <= fit.corrected_alpha, fit.describe()


@pytest.mark.costly
def test_small_n_saguaro_exact_and_k_only_realised_q_rejected(world):
  fit, _ = _fit(world, "t1_saguaro0.3", "exact", N_SMALL)
  assert fit.passed, fit.describe()
  fit, _ = _fit(world, "t1", "k_only_realised_q", N_SMALL)
  assert fit.min_pvalue <= fit.corrected_alpha, fit.describe()
