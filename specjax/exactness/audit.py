"""The exactness audit: does speculative decoding reproduce the target, for this pair and settings?

`audit(target, draft, prompts, ...)` runs two checks on the user's own models and sampling
settings, and a negative control that measures whether the second check could have seen a bug,
and returns an `AuditReport` (`specjax.exactness.report`) that says PASS, FAIL or INCONCLUSIVE and
why.

1. **Greedy identity.** `specjax.decode` and `specjax.generate` at temperature 0 must
   return the same tokens. The report gives the token identity rate and the first divergence (row,
   position, both tokens). A divergence where the target's two best logits are within
   `tie_tolerance` (a float32 near-tie: a different but equally valid argmax after reordered float
   arithmetic) is reported as such and does not fail the audit; any other divergence does.
2. **Sampled goodness of fit.** For each prompt, `num_samples` batch rows of that prompt are decoded
   (each row draws its own random stream; calls of `SAMPLE_CHUNK` rows, each with its own key)
   for `num_positions` tokens. At position `j` the rows are
   grouped by their sampled prefix (`j - 1` tokens); within a group every row's next token is an
   independent draw from the target's warped distribution given that prefix, which the audit
   computes from the target's own logits (`specjax.core.sampling.probabilities`, the definition
   `specjax.generate` samples from). Pearson's chi-square per group: cells with expected count
   >= 5 are kept, the rest pooled into one cell (merged into the smallest kept cell when the pool is
   itself < 5); a group contributes `cells - 1` degrees of freedom, and groups too small for two
   such cells contribute nothing (the report states how many rows were tested). Groups are
   independent given their prefixes, so their statistics add. Position 1 is the exact marginal.
   A token the target gives probability 0 (cut by top-k / top-p) fails the audit outright.
   One p-value per (prompt, position); the check passes when every p-value exceeds the Bonferroni
   level `alpha / number_of_tests`.
3. **Negative control** (`control=True`, sampled settings only). Pooling small cells means that
   on a large vocabulary with few samples most of the mass is pooled, and a passing check may only
   say that there were too few samples to see anything. So the sampled check is run a second time
   with `control_rule`, a known-broken rule (the correction sampled from p instead of the residual
   normalize(max(p - q, 0)), the classic bug), on the same draws: same prompts, seed, keys and
   settings, same statistics. If it is not rejected, the audit could not have seen that bug.

Verdicts: **FAIL** when the audited rule fails (a greedy divergence that is not a near-tie, an
impossible token, or a sampled p-value at or below the Bonferroni level); otherwise
**INCONCLUSIVE** when the control is not rejected at its Bonferroni level, or when no position had
enough samples for a test; otherwise **PASS**. The report gives the control's smallest p-value and
an estimate of the samples per prompt at which the control would be rejected with probability 0.9
(`specjax.exactness.stats.samples_needed`). The control is skipped for greedy settings (the identity
check is the whole test), when the audited rule already failed, and with `control=False` (PASS
then means only that nothing was rejected; the report says that the power was not checked).

Significance: with the default `alpha = 1e-3`, a correct decoder is reported FAIL with
probability at most 1e-3 (Bonferroni bounds the family-wise error). INCONCLUSIVE is a statement
about the sample size, not about the decoder. A rejected control shows power against the classic
bug at this sample size; subtler errors may need more samples. The defaults (2000 samples per
prompt) reject the control on tiny test pairs with p-values far below 1e-6 (see
`tests/exactness/test_audit.py`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.exactness.report import AuditReport, Divergence
from specjax.exactness.stats import (POWER, ControlCheck, PositionTest, position_tests,
                                     samples_needed, verdict)
from specjax.verify.rule import verify_reference
from specjax.core.sampling import PURPOSE_RESIDUAL, Sampling, VerifyResult, sample_race, warp_logits

TIE_TOLERANCE = 1e-3  # float32 logit gap below which two argmax candidates are a near-tie
PROBABILITY_CHUNK = 256  # prefixes scored per target forward when computing exact distributions
SAMPLE_CHUNK = 64  # rows per sampled decode call (bounds memory and compile size)


# --------------------------------------------------------------------------------------------
# The negative control.
# --------------------------------------------------------------------------------------------

def control_rule(target_logits, draft_logits, draft_tokens, *, sampling, seeds, positions,
                 num_drafted=None):
  """The audit's negative control: the exact rule (`specjax.verify.rule.verify_reference`) except
  that on
  a rejection the correction is sampled from p instead of normalize(max(p - q, 0)), the classic
  bug. Greedy settings have no residual, so there it is the exact rule. Same signature as
  `verify_impl=` callables.
  """
  extra = {} if num_drafted is None else dict(num_drafted=num_drafted)
  result = verify_reference(target_logits, draft_logits, draft_tokens, sampling=sampling,
                            seeds=seeds, positions=positions, **extra)
  if sampling.greedy:
    return result
  n = result.num_accepted
  p_at_n = jnp.take_along_axis(target_logits, n[:, None, None], axis=1)[:, 0]
  from_p = sample_race(warp_logits(p_at_n, sampling), seeds, positions + n, PURPOSE_RESIDUAL)
  proposed = draft_tokens.shape[1] if num_drafted is None else num_drafted
  final = jnp.where(n < proposed, from_p,
                    jnp.take_along_axis(result.tokens, n[:, None], axis=1)[:, 0])
  return VerifyResult(n, result.tokens.at[jnp.arange(len(n)), n].set(final))


# --------------------------------------------------------------------------------------------
# The audit.
# --------------------------------------------------------------------------------------------

def audit(target, draft, prompts, *, sampling: Sampling = Sampling(temperature=1.0),
          num_draft: int | None = None, max_new_tokens: int = 32, num_samples: int = 2000,
          num_positions: int = 3, seed: int = 0, alpha: float = 1e-3,
          tie_tolerance: float = TIE_TOLERANCE, tokenizer=None,
          verify_impl="auto", control: bool = True) -> AuditReport:
  """Audits speculative decoding of `target` with `draft` against the target alone.

  Args:
    target: the target model (a `specjax.Model` or any model following the protocol).
    draft: the drafter: a draft model or a `Drafter` such as `specjax.NGramDrafter()`.
    prompts: a list of prompts, each a sequence of token ids or (with `tokenizer`) a string.
    sampling: the settings of the sampled check (temperature > 0; greedy settings skip it).
    num_draft: draft tokens per round (`k`); None: as `specjax.decode` (4, or an
      `AdaptiveDrafter`'s own `K`).
    max_new_tokens: tokens per prompt in the greedy identity check.
    num_samples: samples per prompt in the sampled check (batch rows, one random stream each).
    num_positions: first positions tested per prompt (each adds one test per prompt).
    seed: PRNG seed of the sampled run.
    alpha: family-wise significance level of the sampled check (Bonferroni-corrected).
    tie_tolerance: greedy divergences with a top-2 logit gap below this are float32 near-ties.
    tokenizer: encodes string prompts (`specjax.io.Tokenizer`).
    verify_impl: the verify implementation under audit ("auto", "reference", "kernel",
      "interpret"), or a rule callable with the signature of `specjax.verify.rule.verify_reference`
      (the report names it; `specjax.testing.rules` holds broken rules the audit must reject).
    control: run the negative control (`control_rule` on the same draws) after a sampled check
      that did not fail, and report INCONCLUSIVE when it is not rejected. False: PASS / FAIL only
      (half the sampled decoding; the power is then not checked).

  Returns:
    An `AuditReport`; `report.verdict` is "PASS", "FAIL" or "INCONCLUSIVE" and `print(report)`
    shows why.

  Raises:
    ValueError: bad prompts or settings.
  """
  from scipy import stats as scipy_stats

  from specjax.loop.decode import check_decode_arguments, decode
  from specjax.loop.generate import generate
  from specjax.core.sampling import GREEDY
  from specjax.core.validation import check_count

  rows = _prompt_rows(prompts, tokenizer)
  tokens, lengths = _pad(rows)
  num_draft = check_decode_arguments(  # decode's own checks: k (or the drafter's K), the rest
      target, draft, tokens, jax.random.key(seed), lengths=lengths,
      max_new_tokens=max_new_tokens, num_draft=num_draft, sampling=GREEDY, eos_id=None,
      verify_impl=verify_impl).num_draft
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
  checked = None
  if sampling.greedy:
    reasons.append("sampled check skipped: the settings are greedy")
    corrected = alpha
  else:
    def sampled_tests(verify):
      samples, rate = _sample(decode, target, draft, repeated, seed=seed,
                              num_positions=num_positions, num_draft=num_draft,
                              sampling=sampling, verify_impl=verify)
      samples = samples.reshape(len(rows), num_samples, num_positions)
      return position_tests(rows, samples, sampling, scipy_stats, scores), rate

    repeated = [r for r in rows for _ in range(num_samples)]
    scores = _memoized(lambda prefixes: _last_logits(target, prefixes))
    tests, acceptance = sampled_tests(rule)
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
    if real or rejected:
      reasons.append("control: not run (the audited rule already failed)")
    elif not any(t.dof > 0 for t in tests):
      reasons.append("control: not run (nothing was testable)")
    elif not control:
      reasons.append("control: not run (control=False): the power of the sampled check was not "
                     "checked; a PASS may only mean too few samples to see an error")
    else:
      control_tests, control_rate = sampled_tests(control_rule)
      control_alpha = alpha / max(1, sum(1 for t in control_tests if t.dof > 0))
      needed, no_signal = samples_needed(control_tests, num_samples, control_alpha, scipy_stats)
      checked = ControlCheck(
          tuple(control_tests), control_alpha,
          any(t.dof > 0 and t.pvalue <= control_alpha for t in control_tests), needed, no_signal,
          control_rate)
      estimate = ("" if needed is None else
                  f"; roughly {needed} samples per prompt would reject it with probability "
                  f"{POWER:g} (an estimate)")
      if checked.rejected:
        reasons.append(f"control: the broken control rule is rejected on the same draws (p = "
                       f"{checked.min_pvalue:.3g} <= {control_alpha:.3g}): the check has power "
                       f"against skipping the residual at {num_samples} samples per prompt")
      else:
        reasons.append(f"control: the broken control rule is NOT rejected on the same draws "
                       f"(smallest p = {checked.min_pvalue:.3g} > {control_alpha:.3g}): "
                       f"{num_samples} samples per prompt are too few to see that bug{estimate}")
  failed_sampled = any((t.dof > 0 or t.impossible) and t.pvalue <= corrected for t in tests)
  return AuditReport(
      verdict=verdict(bool(real) or failed_sampled, tests, checked), reasons=tuple(reasons),
      greedy_identity_rate=identity_rate,
      greedy_rows_identical=int((matched == max_new_tokens).sum()), greedy_rows=len(rows),
      greedy_tokens=max_new_tokens, divergences=tuple(divergences), tie_tolerance=tie_tolerance,
      sampling=None if sampling.greedy else sampling, num_samples=num_samples,
      num_positions=num_positions, tests=tuple(tests), alpha=alpha, corrected_alpha=corrected,
      acceptance_rate=acceptance, num_draft=num_draft, verify_rule=rule_name, control=checked)


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


def _memoized(last_logits):
  """`last_logits` that scores each distinct prefix once (the control reuses the audited run's)."""
  seen: dict[tuple, np.ndarray] = {}

  def scores(prefixes):
    missing = list(dict.fromkeys(tuple(p) for p in prefixes if tuple(p) not in seen))
    if missing:
      seen.update(zip(missing, last_logits([list(p) for p in missing])))
    return np.stack([seen[tuple(p)] for p in prefixes])

  return scores


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
