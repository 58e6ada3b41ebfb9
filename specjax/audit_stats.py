"""The audit's sampled check: Pearson chi-square per (prompt, position), prefix groups pooled.

See `specjax.audit` for the procedure and its significance; this module holds the statistics.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.sampling import probabilities

MIN_EXPECTED = 5.0  # Pearson's rule of thumb: cells with a smaller expected count are pooled


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

