"""The audit's sampled check: Pearson chi-square per (prompt, position), prefix groups pooled,
and the sample size its negative control would need.

See `specjax.audit` for the procedure and its significance; this module holds the
statistics.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.core.sampling import probabilities

MIN_EXPECTED = 5.0  # Pearson's rule of thumb: cells with a smaller expected count are pooled
POWER = 0.9  # the power the control's sample-size estimate aims at


@dataclasses.dataclass(frozen=True)
class PositionTest:
  """Goodness of fit of the sampled token at one position of one prompt.

  Attributes:
    prompt: prompt index.
    position: 1-based position of the generated token.
    statistic: Pearson chi-square, summed over prefix groups.
    dof: degrees of freedom (0 = nothing testable at this sample size).
    pvalue: upper tail of chi-square(dof) at `statistic`; 1.0 when `dof == 0`; 0.0 when a token
      the target cannot produce was sampled.
    rows_tested: rows in prefix groups large enough to test.
    groups_tested: prefix groups that contributed degrees of freedom.
    impossible: rows whose token has probability 0 under the target's warped distribution.
  """

  prompt: int
  position: int
  statistic: float
  dof: int
  pvalue: float
  rows_tested: int
  groups_tested: int
  impossible: int


@dataclasses.dataclass(frozen=True)
class ControlCheck:
  """The audit's negative control: a known-broken rule run on the same draws (see
  `specjax.audit`).

  Attributes:
    tests: one `PositionTest` per (prompt, position) of the control's sampled run.
    corrected_alpha: the Bonferroni level its p-values are compared with (`alpha` over its tests).
    rejected: some test rejects the control at `corrected_alpha`: the audit could see the bug.
    samples_needed: an ESTIMATE of the samples per prompt at which the control is rejected with
      probability `POWER` (None when no position was testable); see `samples_needed`.
    no_signal: no test of the control rose above the null's noise, so `samples_needed` rests on
      the noise level rather than on an observed effect (rougher still).
    acceptance_rate: acceptance rate of the control's sampled run.
  """

  tests: tuple[PositionTest, ...]
  corrected_alpha: float
  rejected: bool
  samples_needed: int | None
  no_signal: bool
  acceptance_rate: float

  @property
  def min_pvalue(self) -> float:
    return min((t.pvalue for t in self.tests if t.dof > 0), default=1.0)


def verdict(failed: bool, tests, control: ControlCheck | None) -> str:
  """The audit's verdict: "FAIL" when the audited rule failed (a greedy divergence that is not a
  near-tie, an impossible token, or a rejected position test); else "INCONCLUSIVE" when the sampled
  check ran (`tests` non-empty) but no position had degrees of freedom, or when the control ran and
  was not rejected; else "PASS". `tests` is empty for greedy settings.
  """
  if failed:
    return "FAIL"
  if tests and not any(t.dof > 0 for t in tests):
    return "INCONCLUSIVE"
  if control is not None and not control.rejected:
    return "INCONCLUSIVE"
  return "PASS"


def samples_needed(tests, num_samples: int, corrected_alpha: float, scipy_stats,
                   power: float = POWER) -> tuple[int | None, bool]:
  """An estimate of the samples per prompt at which one of `tests` rejects with probability `power`.

  Under a fixed alternative, Pearson's statistic is approximately noncentral chi-square(dof,
  lambda) with lambda growing linearly with the sample size N. Per test, lambda at N is estimated
  as `statistic - dof` (its expectation is dof + lambda), floored at the null's standard deviation
  sqrt(2 dof) (below it the test saw no signal); the needed lambda' solves
  `ncx2.sf(chi2.isf(corrected_alpha, dof), dof, lambda') = power`, and N' = N * lambda' / lambda.
  The smallest N' over the tests is returned. It is an estimate, and a rough one at small N: lambda
  is noisy, and the pooled cells and prefix groups change with N (pooling hides most of an effect
  when few cells are kept, so N' can be too high). When the test has not rejected, N' > N.

  Returns:
    `(N' or None when no test has degrees of freedom, whether that N' came from a test with no
    signal above noise)`.
  """
  from scipy import optimize  # lazily, as the caller imports scipy.stats
  best = None
  for t in tests:
    if t.dof <= 0:
      continue
    critical = float(scipy_stats.chi2.isf(corrected_alpha, t.dof))
    floor = float(np.sqrt(2.0 * t.dof))
    observed = t.statistic - t.dof
    high = 1.0
    while scipy_stats.ncx2.sf(critical, t.dof, high) < power:
      high *= 2.0
    needed = optimize.brentq(lambda lam: scipy_stats.ncx2.sf(critical, t.dof, lam) - power,
                             0.0, high)
    count = int(np.ceil(num_samples * needed / max(observed, floor)))
    if t.statistic < critical:  # not rejected at N: more than N is needed, whatever the estimate
      count = max(count, num_samples + 1)
    if best is None or count < best[0]:
      best = (count, observed < floor)
  return (None, False) if best is None else best


def position_tests(rows, sampled, sampling, scipy_stats, last_logits) -> list[PositionTest]:
  """Chi-square tests per (prompt, position) of `sampled [P, N, positions]`.

  Args:
    rows: the prompts (token id lists).
    sampled: `[P, N, positions]` sampled tokens.
    sampling: the settings the target distribution is warped with.
    scipy_stats: `scipy.stats` (imported by the caller, lazily).
    last_logits: maps a list of prefixes to the target's `[len, V]` logits after each.
  """
  num_prompts, num_samples, num_positions = sampled.shape
  # Prefix groups large enough to test: two cells of >= 5 need at least 10 rows.
  groups = {}  # (prompt, position) -> {prefix tuple: row indices}
  wanted = []
  for p in range(num_prompts):
    for j in range(num_positions):
      by_prefix: dict[tuple, list[int]] = {}
      for i, prefix in enumerate(map(tuple, sampled[p, :, :j].tolist())):
        by_prefix.setdefault(prefix, []).append(i)
      groups[p, j] = by_prefix
      wanted += [(p, prefix) for prefix, members in by_prefix.items()
                 if len(members) >= 2 * MIN_EXPECTED]
  index = {key: n for n, key in enumerate(wanted)}
  probs = np.zeros((0, 0))
  if wanted:
    logits = last_logits([rows[p] + list(prefix) for p, prefix in wanted])
    probs = np.asarray(probabilities(jnp.asarray(logits), sampling), np.float64)
  tests = []
  for p in range(num_prompts):
    for j in range(num_positions):
      statistic, dof, tested, group_count, impossible = 0.0, 0, 0, 0, 0
      for prefix, members in groups[p, j].items():
        if (p, prefix) not in index:
          continue
        dist = probs[index[p, prefix]]
        dist = dist / dist.sum()
        counts = np.bincount(sampled[p, members, j], minlength=len(dist)).astype(np.float64)
        impossible += int(counts[dist == 0].sum())
        chi2, cells = _pearson(counts, dist * len(members))
        if cells > 1:
          statistic += chi2
          dof += cells - 1
          tested += len(members)
          group_count += 1
      if impossible:
        pvalue = 0.0
      else:
        pvalue = float(scipy_stats.chi2.sf(statistic, dof)) if dof > 0 else 1.0
      tests.append(PositionTest(p, j + 1, float(statistic), dof, pvalue, tested, group_count,
                                impossible))
  return tests


def _pearson(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
  """Pearson's statistic with cells of expected count < `MIN_EXPECTED` pooled; `(chi2, cells)`."""
  support = expected > 0
  observed, expected = observed[support], expected[support]
  small = expected < MIN_EXPECTED
  kept_o, kept_e = observed[~small], expected[~small]
  pool_o, pool_e = observed[small].sum(), expected[small].sum()
  if pool_e > 0:
    if pool_e < MIN_EXPECTED and len(kept_e):
      smallest = int(np.argmin(kept_e))
      kept_o = kept_o.copy()
      kept_e = kept_e.copy()
      kept_o[smallest] += pool_o
      kept_e[smallest] += pool_e
    else:
      kept_o = np.append(kept_o, pool_o)
      kept_e = np.append(kept_e, pool_e)
  if len(kept_e) < 2:
    return 0.0, len(kept_e)
  return float(np.sum((kept_o - kept_e) ** 2 / kept_e)), len(kept_e)

