"""The analytic speedup bound of DESIGN.md and the per-token acceptance it is fed with.

Pure Python formulas (no JAX): a round of `k` drafts costs `k * c + v` target steps (`c` = one
draft step / one target step, `v` = one `(k + 1)`-token verify / one target step) and emits
`(1 - a^(k+1)) / (1 - a)` tokens on average when each draft is accepted independently with
probability `a`.
"""

from __future__ import annotations


def per_token_acceptance(accepted_per_position, rounds: int) -> float:
  """The conditional per-draft acceptance `a` of the bound, from decode statistics.

  `accepted / drafted` is not that `a`: draft `j` is only tried when drafts `0 .. j-1` were
  accepted. With `n_j` acceptances at position `j` (summed over rows and rounds), draft `j` was
  reached `n_{j-1}` times (`rounds` times for `j = 0`), so the estimate is
  `sum_j n_j / (rounds + sum_{j < k-1} n_j)`.

  Args:
    accepted_per_position: `[k]` acceptance counts per draft position, summed over rows.
    rounds: rounds summed over rows.

  Returns:
    `a` in [0, 1] (0 when nothing was drafted).
  """
  counts = [int(n) for n in accepted_per_position]
  reached = rounds + sum(counts[:-1])
  return sum(counts) / reached if reached else 0.0


def expected_tokens_per_round(acceptance: float, num_draft: int) -> float:
  """`(1 - a^(k+1)) / (1 - a)`: tokens per round with i.i.d. per-draft acceptance `a`."""
  if acceptance >= 1.0:
    return float(num_draft + 1)
  return (1.0 - acceptance ** (num_draft + 1)) / (1.0 - acceptance)


def analytic_bound(acceptance: float, num_draft: int, draft_ratio: float,
                   verify_ratio: float) -> float:
  """The ideal speedup: expected tokens per round / (k * c + verify / target step).

  Args:
    acceptance: per-token acceptance `a`.
    num_draft: `k`.
    draft_ratio: `c`, one draft step's cost over one target step's (0 for a lookup drafter).
    verify_ratio: `v`, one `(k + 1)`-token verify's cost over one target step's.
  """
  return expected_tokens_per_round(acceptance, num_draft) / (num_draft * draft_ratio
                                                             + verify_ratio)
