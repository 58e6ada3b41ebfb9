"""The exactness audit's report: `AuditReport` (PASS / FAIL / INCONCLUSIVE, and why), `Divergence`.

See `specjax.audit` for the procedure; `str(report)` is the readable report.
"""

from __future__ import annotations

import dataclasses

from specjax.exactness.stats import MIN_EXPECTED, POWER, ControlCheck, PositionTest
from specjax.core.sampling import Sampling


@dataclasses.dataclass(frozen=True)
class Divergence:
  """The first place where greedy speculative decoding and plain generation disagree.

  Attributes:
    row: prompt index.
    position: index of the new token (0 = first generated token).
    decode_token: what `specjax.decode` produced.
    generate_token: what `specjax.generate` produced.
    logit_gap: the target's top-1 minus top-2 logit at that point (same prefix for both).
    near_tie: `logit_gap < tie_tolerance`, a float32 near-tie rather than a rule error.
  """

  row: int
  position: int
  decode_token: int
  generate_token: int
  logit_gap: float
  near_tie: bool


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """What `audit` found. `str(report)` is the readable report.

  Attributes:
    verdict: "PASS", "FAIL" or "INCONCLUSIVE" (see `specjax.audit`); `passed` is `verdict
      == "PASS"`.
    reasons: one line per reason for the verdict.
    greedy_identity_rate: fraction of compared greedy tokens equal in `decode` and `generate`
      (tokens after a row's first divergence count as different).
    greedy_rows_identical: rows whose greedy outputs are identical.
    greedy_rows: rows compared.
    greedy_tokens: tokens compared per row.
    divergences: the first divergence of each row that has one.
    tie_tolerance: the near-tie threshold on the top-2 logit gap.
    sampling: the settings of the sampled check (None when it was skipped: greedy settings).
    num_samples: samples (batch rows) per prompt.
    num_positions: positions tested per prompt.
    tests: one `PositionTest` per (prompt, position).
    alpha: family-wise significance level.
    corrected_alpha: Bonferroni level each p-value is compared with.
    acceptance_rate: acceptance rate of the sampled run (of the greedy run when skipped).
    num_draft: draft tokens per round.
    verify_rule: "exact" (a built-in implementation) or the name of the rule callable audited.
    control: the negative control (`ControlCheck`: its p-values, whether it was rejected, the
      estimated samples needed), or None when it did not run (the reasons say why).
  """

  verdict: str
  reasons: tuple[str, ...]
  greedy_identity_rate: float
  greedy_rows_identical: int
  greedy_rows: int
  greedy_tokens: int
  divergences: tuple[Divergence, ...]
  tie_tolerance: float
  sampling: Sampling | None
  num_samples: int
  num_positions: int
  tests: tuple[PositionTest, ...]
  alpha: float
  corrected_alpha: float
  acceptance_rate: float
  num_draft: int
  verify_rule: str
  control: ControlCheck | None = None

  @property
  def passed(self) -> bool:
    return self.verdict == "PASS"

  @property
  def min_pvalue(self) -> float:
    tested = [t.pvalue for t in self.tests if t.dof > 0 or t.impossible]
    return min(tested) if tested else 1.0

  def __str__(self) -> str:
    lines = [f"specjax exactness audit: {self.verdict}"
             + ("" if self.verify_rule == "exact" else f"  [verify rule: {self.verify_rule}]")]
    lines += [f"  - {reason}" for reason in self.reasons]
    lines.append("")
    lines.append(f"greedy identity (decode vs generate, k={self.num_draft}): "
                 f"{self.greedy_identity_rate:.2%} of {self.greedy_rows} x {self.greedy_tokens} "
                 f"tokens; {self.greedy_rows_identical}/{self.greedy_rows} rows identical")
    for d in self.divergences:
      kind = ("near-tie (float32), not a rule error" if d.near_tie
              else "NOT a near-tie")
      lines.append(f"  row {d.row}, new token {d.position}: decode {d.decode_token} vs generate "
                   f"{d.generate_token}; target top-2 logit gap {d.logit_gap:.3g} "
                   f"(tolerance {self.tie_tolerance:g}): {kind}")
    if self.sampling is None:
      lines.append("sampled goodness of fit: skipped (greedy settings; the identity check is the "
                   "whole test)")
      return "\n".join(lines)
    s = self.sampling
    lines.append(f"sampled goodness of fit: temperature={s.temperature:g} top_k={s.top_k} "
                 f"top_p={s.top_p}; {self.num_samples} samples per prompt, first "
                 f"{self.num_positions} positions, acceptance rate {self.acceptance_rate:.1%}")
    lines.append(f"  Pearson chi-square per (prompt, position), prefix groups pooled, cells with "
                 f"expected < {MIN_EXPECTED:g} merged; Bonferroni: alpha {self.alpha:g} / "
                 f"{self.num_tests} tests = {self.corrected_alpha:.3g}")
    lines.append("  prompt  pos   chi2       dof   p-value     rows tested  groups  impossible")
    for t in self.tests:
      flag = "" if t.dof == 0 and not t.impossible else (
          "  <- reject" if t.pvalue <= self.corrected_alpha else "")
      lines.append(f"  {t.prompt:6d}  {t.position:3d}  {t.statistic:9.2f}  {t.dof:4d}  "
                   f"{t.pvalue:10.3g}  {t.rows_tested:11d}  {t.groups_tested:6d}  "
                   f"{t.impossible:10d}{flag}")
    c = self.control
    if c is None:
      lines.append("negative control: not run (see above)" + (
          "; the power was not checked: this PASS does not show that the sample size could see "
          "an error" if self.passed else ""))
      return "\n".join(lines)
    lines.append(f"negative control (control_rule: corrections from p instead of the "
                 f"residual, same draws): smallest p = {c.min_pvalue:.3g} vs Bonferroni level "
                 f"{c.corrected_alpha:.3g}: {'rejected' if c.rejected else 'NOT rejected'}; "
                 f"acceptance rate {c.acceptance_rate:.1%}")
    if c.samples_needed is not None:
      basis = ("no signal above noise at" if c.no_signal else "the noncentrality observed at")
      lines.append(f"  samples per prompt for power {POWER:g} against it: about "
                   f"{c.samples_needed} (an estimate from {basis} {self.num_samples} samples)")
    return "\n".join(lines)

  @property
  def num_tests(self) -> int:
    return max(1, sum(1 for t in self.tests if t.dof > 0 or t.impossible))
