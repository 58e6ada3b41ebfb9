"""One speedup measurement: `specjax.decode` against `specjax.generate` on one batch."""

from __future__ import annotations

import jax
import numpy as np

from benchmarks.bound import analytic_bound, per_token_acceptance
from benchmarks.synthetic import SYNTHETIC_LABEL, synthetic_verify
from benchmarks.timing import first_divergence, paired_speedup, time_alternately, tokens_per_s
from specjax.loop.decode import decode
from specjax.loop.generate import generate
from specjax.core.sampling import Sampling


def speedup_case(target, draft, tokens, lengths, *, num_draft: int, sampling: Sampling,
                 max_new_tokens: int, repeats: int, costs: dict | None,
                 synthetic_acceptance: float | None = None, seed: int = 0,
                 statistic: str = "min") -> dict:
  """Times `decode` against `generate` alternately on one batch and derives the bound.

  Args:
    target, draft: the pair (`draft` may be any drafter).
    tokens, lengths: `[B, T]` prompts and `[B]` lengths.
    num_draft: k.
    sampling: sampling settings for both calls.
    max_new_tokens: new tokens per row (no EOS stop: every call does the same work).
    repeats: timed calls of each after the warm-up.
    costs: `measure_costs` output for this batch (None: no bound).
    synthetic_acceptance: if set, decode with `synthetic_verify(a)` (labelled in the record).
    seed: PRNG seed of both calls.
    statistic: "min" or "median" of the timed calls (see `time_alternately`).

  Returns:
    A JSON-ready record.
  """
  rng = jax.random.key(seed)
  verify_impl = "auto" if synthetic_acceptance is None else synthetic_verify(synthetic_acceptance)
  calls = {
      "generate": lambda: generate(target, tokens, rng, lengths=lengths,
                                   max_new_tokens=max_new_tokens, sampling=sampling),
      "decode": lambda: decode(target, draft, tokens, rng, lengths=lengths,
                               max_new_tokens=max_new_tokens, num_draft=num_draft,
                               sampling=sampling, verify_impl=verify_impl),
  }
  timed = time_alternately(calls, repeats, statistic)
  plain, spec = timed["generate"]["result"], timed["decode"]["result"]
  produced = int(np.sum(np.asarray(spec.num_tokens)))
  stats = spec.stats.summary()
  record = {
      "num_draft": num_draft,
      "batch": int(tokens.shape[0]),
      "prompt_tokens": int(tokens.shape[1]),
      "temperature": sampling.temperature,
      "max_new_tokens": max_new_tokens,
      "synthetic_acceptance": synthetic_acceptance,
      "label": SYNTHETIC_LABEL if synthetic_acceptance is not None else "exact",
      "repeats": repeats,
      "statistic": statistic,
  }
  for name in ("generate", "decode"):
    entry = timed[name]
    record[name] = {"tokens_per_s": tokens_per_s(entry, produced), "seconds": entry["seconds"],
                    "median_s": entry["median_s"],
                    "min_s": entry["min_s"], "compile_s": entry["compile_s"],
                    "times_s": entry["times_s"]}
  record["speedup"] = timed["generate"]["seconds"] / timed["decode"]["seconds"]
  record["speedup_median"] = timed["generate"]["median_s"] / timed["decode"]["median_s"]
  record["speedup_paired"] = paired_speedup(record)
  record["acceptance_rate"] = stats["acceptance_rate"]  # accepted / drafted
  record["acceptance_per_token"] = per_token_acceptance(stats["accepted_per_position"],
                                                        stats["rounds"])
  record["mean_accepted_length"] = stats["tokens_per_round"]
  record["accepted_per_position"] = stats["accepted_per_position"]
  record["rounds"] = stats["rounds"]
  if sampling.greedy and synthetic_acceptance is None:
    mismatch = [row for row in range(tokens.shape[0])
                if first_divergence(np.asarray(plain.tokens[row]), np.asarray(spec.tokens[row]))
                is not None]
    record["greedy_identical"] = not mismatch
    record["greedy_mismatch_rows"] = mismatch
  if costs is not None:
    target_s = costs["target_step_s"]
    draft_ratio = 0.0 if costs["draft_step_s"] is None else costs["draft_step_s"] / target_s
    verify_ratio = costs["verify_s"][num_draft] / target_s
    a = record["acceptance_per_token"]
    record["costs"] = {"target_step_s": target_s, "draft_step_s": costs["draft_step_s"],
                       "verify_s": costs["verify_s"][num_draft], "draft_ratio": draft_ratio,
                       "verify_ratio": verify_ratio}
    record["bound"] = analytic_bound(a, num_draft, draft_ratio, verify_ratio)
    # The same bound with the measured tokens per round in place of the i.i.d. formula.
    record["bound_measured_length"] = stats["tokens_per_round"] / (num_draft * draft_ratio
                                                                   + verify_ratio)
    record["efficiency"] = record["speedup"] / record["bound"]
    # Per-round wall time the single-forward costs predict vs what the loop took.
    # Where decode's time goes: the rounds the slowest row took, priced at the single-forward
    # costs, against the measured call; likewise generate's steps against one target step.
    rounds = int(np.max(np.asarray(spec.stats.rounds)))
    predicted = rounds * (num_draft * (costs["draft_step_s"] or 0.0)
                          + costs["verify_s"][num_draft])
    record["decode_rounds"] = rounds
    record["decode_predicted_s"] = predicted
    record["decode_overhead_fraction"] = 1.0 - predicted / record["decode"]["seconds"]
    record["generate_step_s"] = record["generate"]["seconds"] / max_new_tokens
    record["generate_overhead_fraction"] = 1.0 - target_s / record["generate_step_s"]
  return record


def case_line(r: dict) -> str:
  bound = f" bound {r['bound']:.2f}x eff {r['efficiency']:.2f}" if "bound" in r else ""
  synthetic = f" SYNTHETIC a={r['synthetic_acceptance']}" if r["synthetic_acceptance"] else ""
  return (f"  B={r['batch']:<3d} T={r['temperature']:<4} k={r['num_draft']}{synthetic}: "
          f"generate {r['generate']['tokens_per_s']:8.1f} tok/s, decode "
          f"{r['decode']['tokens_per_s']:8.1f} tok/s, speedup {r['speedup']:.2f}x{bound}, "
          f"accept {r['acceptance_rate']:.2f} (per token {r['acceptance_per_token']:.2f}), "
          f"len {r['mean_accepted_length']:.2f}")
