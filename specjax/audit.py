"""The exactness audit: does speculative decoding reproduce the target, for this pair and settings?

`audit(target, draft, prompts, ...)` runs two checks on the user's own models and sampling settings
and returns an `AuditReport` that says PASS or FAIL and why.

1. **Greedy identity.** `specjax.decode` and `specjax.generate` at temperature 0 must return the same
   tokens. The report gives the token identity rate and the first divergence (row, position, both
   tokens). A divergence where the target's two best logits are within `tie_tolerance` (a float32
   near-tie: a different but equally valid argmax after reordered float arithmetic) is reported as
   such and does not fail the audit; any other divergence does.
2. **Sampled goodness of fit.** For each prompt, `num_samples` batch rows of that prompt are decoded
   (each row draws its own random stream; calls of `SAMPLE_CHUNK` rows, each with its own key)
   for `num_positions` tokens. At position `j` the rows are
   grouped by their sampled prefix (`j - 1` tokens); within a group every row's next token is an
   independent draw from the target's warped distribution given that prefix, which the audit
   computes from the target's own logits (`specjax.sampling.probabilities`, the definition
   `specjax.generate` samples from). Pearson's chi-square per group: cells with expected count
   >= 5 are kept, the rest pooled into one cell (merged into the smallest kept cell when the pool is
   itself < 5); a group contributes `cells - 1` degrees of freedom, and groups too small for two
   such cells contribute nothing (the report states how many rows were tested). Groups are
   independent given their prefixes, so their statistics add. Position 1 is the exact marginal.
   A token the target gives probability 0 (cut by top-k / top-p) fails the audit outright.
   One p-value per (prompt, position); the audit passes when every p-value exceeds the Bonferroni
   level `alpha / number_of_tests`.

Significance: with the default `alpha = 1e-3`, a correct decoder fails the sampled check with
probability at most 1e-3 (Bonferroni bounds the family-wise error). Power grows with
`num_samples`: the defaults (2000 samples per prompt) detect a skipped residual correction on
tiny test pairs with p-values far below 1e-6 (see `tests/test_audit.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.audit_stats import MIN_EXPECTED, PositionTest, position_tests
from specjax.sampling import Sampling

TIE_TOLERANCE = 1e-3  # float32 logit gap below which two argmax candidates are a near-tie
PROBABILITY_CHUNK = 256  # prefixes scored per target forward when computing exact distributions
SAMPLE_CHUNK = 64  # rows per sampled decode call (bounds memory and compile size)


# --------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------

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
    passed: the verdict.
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
  """

  passed: bool
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

  @property
  def min_pvalue(self) -> float:
    tested = [t.pvalue for t in self.tests if t.dof > 0 or t.impossible]
    return min(tested) if tested else 1.0

  def __str__(self) -> str:
    lines = [f"specjax exactness audit: {'PASS' if self.passed else 'FAIL'}"
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
    return "\n".join(lines)

  @property
  def num_tests(self) -> int:
    return max(1, sum(1 for t in self.tests if t.dof > 0 or t.impossible))


# --------------------------------------------------------------------------------------------
# The audit.
# --------------------------------------------------------------------------------------------

def audit(target, draft, prompts, *, sampling: Sampling = Sampling(temperature=1.0),
          num_draft: int = 4, max_new_tokens: int = 32, num_samples: int = 2000,
          num_positions: int = 3, seed: int = 0, alpha: float = 1e-3,
          tie_tolerance: float = TIE_TOLERANCE, tokenizer=None,
          verify_impl="auto") -> AuditReport:
  """Audits speculative decoding of `target` with `draft` against the target alone.

  Args:
    target: the target model (a `specjax.Model` or any model following the protocol).
    draft: the drafter: a draft model or a `Drafter` such as `specjax.NGramDrafter()`.
    prompts: a list of prompts, each a sequence of token ids or (with `tokenizer`) a string.
    sampling: the settings of the sampled check (temperature > 0; greedy settings skip it).
    num_draft: draft tokens per round (`k`).
    max_new_tokens: tokens per prompt in the greedy identity check.
    num_samples: samples per prompt in the sampled check (batch rows, one random stream each).
    num_positions: first positions tested per prompt (each adds one test per prompt).
    seed: PRNG seed of the sampled run.
    alpha: family-wise significance level of the sampled check (Bonferroni-corrected).
    tie_tolerance: greedy divergences with a top-2 logit gap below this are float32 near-ties.
    tokenizer: encodes string prompts (`specjax.Tokenizer`).
    verify_impl: the verify implementation under audit ("auto", "reference", "kernel",
      "interpret"), or a rule callable with the signature of `specjax.rule.verify_reference`
      (the report names it; `specjax.testing.rules` holds broken rules the audit must reject).

  Returns:
    An `AuditReport`; `report.passed` is the verdict and `print(report)` shows why.

  Raises:
    ValueError: bad prompts or settings.
  """
  from scipy import stats as scipy_stats

  from specjax.decode import decode
  from specjax.generate import generate
  from specjax.sampling import GREEDY
  from specjax.validation import check_count

  rows = _prompt_rows(prompts, tokenizer)
  num_draft = check_count(num_draft, "num_draft")
  max_new_tokens = check_count(max_new_tokens, "max_new_tokens")
  num_samples = check_count(num_samples, "num_samples", 2)
  num_positions = check_count(num_positions, "num_positions")
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a specjax.Sampling, got {type(sampling).__name__}")
  if not 0.0 < alpha < 1.0:
    raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
  rule = verify_impl
  rule_name = "exact" if isinstance(rule, str) else getattr(rule, "__name__", repr(rule))

  # 1. Greedy identity.
  tokens, lengths = _pad(rows)
  spec = decode(target, draft, tokens, jax.random.key(seed), lengths=lengths,
                max_new_tokens=max_new_tokens, num_draft=num_draft, sampling=GREEDY,
                verify_impl=rule)
  plain = generate(target, tokens, jax.random.key(seed), lengths=lengths,
                   max_new_tokens=max_new_tokens, sampling=GREEDY)
  spec_tokens, plain_tokens = np.asarray(spec.tokens), np.asarray(plain.tokens)
  equal = spec_tokens == plain_tokens
  matched = np.where(equal.all(1), max_new_tokens, np.argmin(equal, axis=1))  # leading matches
  identity_rate = float(matched.sum() / matched.size / max_new_tokens)
  divergences = []
  for row in np.flatnonzero(matched < max_new_tokens):
    position = int(matched[row])
    prefix = list(rows[row]) + plain_tokens[row, :position].tolist()
    logits = _last_logits(target, [prefix])[0]
    top2 = np.sort(logits)[-2:]
    gap = float(top2[1] - top2[0])
    divergences.append(Divergence(int(row), position, int(spec_tokens[row, position]),
                                  int(plain_tokens[row, position]), gap, gap < tie_tolerance))
  reasons = []
  real = [d for d in divergences if not d.near_tie]
  if real:
    d = real[0]
    reasons.append(f"greedy: decode differs from generate at row {d.row}, new token {d.position} "
                   f"({d.decode_token} vs {d.generate_token}) where the target's top-2 logit gap "
                   f"is {d.logit_gap:.3g} >= {tie_tolerance:g}: not a float32 near-tie")
  elif divergences:
    reasons.append(f"greedy: {len(divergences)} row(s) diverge, each at a float32 near-tie of the "
                   "target's logits (allowed)")
  else:
    reasons.append(f"greedy: decode equals generate on all {len(rows)} x {max_new_tokens} tokens")

  # 2. Sampled goodness of fit.
  tests: list[PositionTest] = []
  acceptance = float(spec.stats.summary()["acceptance_rate"])
  if sampling.greedy:
    reasons.append("sampled check skipped: the settings are greedy")
    corrected = alpha
  else:
    repeated = [r for r in rows for _ in range(num_samples)]
    sampled, acceptance = _sample(decode, target, draft, repeated, seed=seed,
                                  num_positions=num_positions, num_draft=num_draft,
                                  sampling=sampling, verify_impl=rule)
    sampled = sampled.reshape(len(rows), num_samples, num_positions)
    tests = position_tests(rows, sampled, sampling, scipy_stats,
                           lambda prefixes: _last_logits(target, prefixes))
    num_tests = max(1, sum(1 for t in tests if t.dof > 0 or t.impossible))
    corrected = alpha / num_tests
    impossible = sum(t.impossible for t in tests)
    rejected = [t for t in tests if (t.dof > 0 or t.impossible) and t.pvalue <= corrected]
    if impossible:
      reasons.append(f"sampled: {impossible} token(s) the target gives probability 0 under "
                     "these settings were emitted")
    if rejected:
      worst = min(rejected, key=lambda t: t.pvalue)
      reasons.append(f"sampled: {len(rejected)} of {num_tests} position tests reject the target's "
                     f"distribution at Bonferroni level {corrected:.3g} (worst: prompt "
                     f"{worst.prompt}, position {worst.position}, p = {worst.pvalue:.3g})")
    elif not any(t.dof > 0 for t in tests):
      reasons.append("sampled: no position had enough samples for a test (raise num_samples)")
    else:
      reasons.append(f"sampled: all {num_tests} position tests pass at Bonferroni level "
                     f"{corrected:.3g} (smallest p = {min(t.pvalue for t in tests):.3g})")
  failed_sampled = any((t.dof > 0 or t.impossible) and t.pvalue <= corrected for t in tests)
  untested = not sampling.greedy and not any(t.dof > 0 for t in tests)
  passed = not real and not failed_sampled and not untested
  return AuditReport(
      passed=passed, reasons=tuple(reasons), greedy_identity_rate=identity_rate,
      greedy_rows_identical=int((matched == max_new_tokens).sum()), greedy_rows=len(rows),
      greedy_tokens=max_new_tokens, divergences=tuple(divergences), tie_tolerance=tie_tolerance,
      sampling=None if sampling.greedy else sampling, num_samples=num_samples,
      num_positions=num_positions, tests=tuple(tests), alpha=alpha, corrected_alpha=corrected,
      acceptance_rate=acceptance, num_draft=num_draft, verify_rule=rule_name)


def _sample(decode, target, draft, rows, *, seed, num_positions, num_draft, sampling,
            verify_impl) -> tuple[np.ndarray, float]:
  """Decodes `num_positions` tokens for every row, `SAMPLE_CHUNK` rows per call (one compiled
  shape). Chunk `c` uses key `fold_in(key(seed), c)`, so every row has its own random stream.

  Returns:
    `(tokens [len(rows), num_positions], acceptance rate over all rows)`.
  """
  tokens, lengths = _pad(rows)
  chunk = min(SAMPLE_CHUNK, len(rows))
  outputs, accepted, drafted = [], 0, 0
  for index, start in enumerate(range(0, len(rows), chunk)):
    chunk_tokens, chunk_lengths = tokens[start:start + chunk], lengths[start:start + chunk]
    count = len(chunk_lengths)
    if count < chunk:  # pad with copies to keep one shape; their samples are dropped
      chunk_tokens = np.resize(chunk_tokens, (chunk, tokens.shape[1]))
      chunk_lengths = np.resize(chunk_lengths, (chunk,))
    out = decode(target, draft, chunk_tokens, jax.random.fold_in(jax.random.key(seed), index),
                 lengths=chunk_lengths, max_new_tokens=num_positions, num_draft=num_draft,
                 sampling=sampling, verify_impl=verify_impl)
    outputs.append(np.asarray(out.tokens)[:count])
    accepted += int(np.sum(np.asarray(out.stats.accepted)[:count]))
    drafted += int(np.sum(np.asarray(out.stats.drafted)[:count]))
  return np.concatenate(outputs), accepted / drafted if drafted else 0.0


def _prompt_rows(prompts, tokenizer) -> list[list[int]]:
  if isinstance(prompts, str) or not isinstance(prompts, Sequence) and not hasattr(
      prompts, "__len__"):
    prompts = [prompts]
  prompts = list(prompts)
  if not prompts:
    raise ValueError("audit needs at least one prompt")
  rows = []
  for prompt in prompts:
    if isinstance(prompt, str):
      if tokenizer is None:
        raise ValueError("string prompts need tokenizer= (or pass token ids)")
      prompt = tokenizer.encode(prompt)
    row = [int(t) for t in np.asarray(prompt).reshape(-1)]
    if not row:
      raise ValueError("empty prompt: every prompt needs at least one token")
    rows.append(row)
  return rows


def _pad(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  lengths = np.asarray([len(r) for r in rows], np.int32)
  tokens = np.zeros((len(rows), int(lengths.max())), np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  return tokens, lengths


@jax.jit
def _scored(target, tokens, lengths):
  cache = target.init_cache(tokens.shape[0], tokens.shape[1])
  logits = target(tokens, jnp.zeros_like(lengths), cache).logits
  return jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]


def _last_logits(target, prefixes: list[list[int]]) -> np.ndarray:
  """The target's float32 logits after each prefix, `[len(prefixes), V]`, in fixed-size chunks."""
  tokens, lengths = _pad(prefixes)
  out = []
  for start in range(0, len(prefixes), PROBABILITY_CHUNK):
    chunk_tokens = tokens[start:start + PROBABILITY_CHUNK]
    chunk_lengths = lengths[start:start + PROBABILITY_CHUNK]
    count = len(chunk_lengths)
    if len(prefixes) > PROBABILITY_CHUNK and count < PROBABILITY_CHUNK:  # keep one shape
      chunk_tokens = np.resize(chunk_tokens, (PROBABILITY_CHUNK, tokens.shape[1]))
      chunk_lengths = np.resize(chunk_lengths, (PROBABILITY_CHUNK,))
    out.append(np.asarray(_scored(target, chunk_tokens, chunk_lengths))[:count])
  return np.concatenate(out)
