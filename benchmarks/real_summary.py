"""The real suite's summary: per (sampling, drafter, category) and overall, the speedup, tau,
acceptance, the analytic bound and efficiency, the token loop's speedup without the prefill, and
a round's cost broken down (`round_costs`). Pure functions of `benchmarks.real`'s records and
measured costs: no model, no timing.

The speedup (`speedup`): greedy, decode and generate emit the same text, and the speedup is
generate's time over decode's, summed over the prompts. Sampled (T > 0), the two draw from
different random streams and emit texts of different lengths: the speedup is the ratio of
per-token times (`per_token_speedup`), each call's milliseconds per token over the tokens it
emitted itself, averaged over the prompts so that every prompt weighs the same on both sides
(summed instead, a prompt would weigh by the length of each side's own text).
"""

from __future__ import annotations

import numpy as np

from benchmarks.bound import analytic_bound, per_token_acceptance
from benchmarks.drafters import DrafterEntry


def loop_resolved(records, names) -> bool:
  """Whether every call of `names` in `records` took longer than its prompt's prefill, so that
  the token loop's time (call - prefill) is positive and the loop speedup is measured."""
  return all(r["calls"][name]["seconds"] > r.get("prefill_s", 0.0)
             for r in records for name in names)


def _rate(records, name, *, exclude_prefill: bool = False) -> float:
  tokens = sum(r["calls"][name]["new_tokens"] for r in records)
  seconds = sum(r["calls"][name]["seconds"] - (r.get("prefill_s", 0.0) if exclude_prefill
                                                 else 0.0) for r in records)
  return tokens / seconds if seconds > 0 else float("nan")


def per_token_ms(records, name, *, exclude_prefill: bool = False) -> float:
  """Milliseconds per emitted token of call `name`, each record's over the tokens that call
  emitted itself, averaged over `records` (the prefill, timed beside the calls, taken out where
  `exclude_prefill`). NaN where a call emitted no token."""
  times = []
  for record in records:
    call = record["calls"][name]
    seconds = call["seconds"] - (record.get("prefill_s", 0.0) if exclude_prefill else 0.0)
    times.append(1e3 * seconds / call["new_tokens"] if call["new_tokens"] else float("nan"))
  return float(np.mean(times)) if times else float("nan")


def per_token_speedup(records, name, *, exclude_prefill: bool = False) -> float:
  """Generate's milliseconds per emitted token over decode's (drafter `name`), each over its own
  emitted tokens and averaged over the prompts (`per_token_ms`): the speedup of a sampled run,
  whose two calls emit texts of different lengths."""
  return (per_token_ms(records, "generate", exclude_prefill=exclude_prefill)
          / per_token_ms(records, name, exclude_prefill=exclude_prefill))


def speedup(records, name, sampling: str, *, exclude_prefill: bool = False) -> float:
  """Decode's (drafter `name`) speedup over generate on `records` of one sampling: greedy (the
  same text on both sides), generate's time over decode's summed over the prompts, i.e. the
  ratio of tokens/s; sampled, `per_token_speedup`."""
  if sampling != "greedy":
    return per_token_speedup(records, name, exclude_prefill=exclude_prefill)
  return (_rate(records, name, exclude_prefill=exclude_prefill)
          / _rate(records, "generate", exclude_prefill=exclude_prefill))


def round_costs(group: list[dict], entry: DrafterEntry, costs: dict, rounds: int,
                resolved: bool) -> dict:
  """A round's cost, measured and broken down, in milliseconds: `round_ms` = the drafter's
  calls without their prefills over their rounds; `draft_ms` and `verify_ms` = the round's
  drafting and its verify block, each timed on its own (`measure_suite`'s costs); `other_ms` =
  the rest (acceptance, cache bookkeeping, the loop). `generate_token_ms` = `generate`'s calls
  without their prefills over their tokens, beside `target_step_ms` timed on its own: where
  the in-loop step is the faster, parts timed on their own overstate a round too, and
  `other_ms` can come out below zero. An adaptive drafter's draft cost is its inner drafter's
  fixed-k chain (its rows draft fewer). NaN where the calls did not outlast their prefills."""
  nan = float("nan")
  step_s = costs["target_step_s"]
  # As `summarize` prices the round: an entry's own draft ratio first, else its measured drafting.
  draft_s = (entry.draft_ratio * entry.num_draft * step_s if entry.draft_ratio is not None
             else costs.get("draft_round_s", {}).get(entry.name))
  loop_s = sum(r["calls"][entry.name]["seconds"] - r["prefill_s"] for r in group)
  plain_s = sum(r["calls"]["generate"]["seconds"] - r["prefill_s"] for r in group)
  plain_tokens = sum(r["calls"]["generate"]["new_tokens"] for r in group)
  out = {"round_ms": 1e3 * loop_s / rounds if resolved and rounds else nan,
         "draft_ms": nan if draft_s is None else 1e3 * draft_s,
         "verify_ms": 1e3 * costs["verify_s"][entry.verify_k],
         "target_step_ms": 1e3 * step_s,
         "generate_token_ms": 1e3 * plain_s / plain_tokens if resolved and plain_tokens else nan}
  out["other_ms"] = out["round_ms"] - out["draft_ms"] - out["verify_ms"]
  return out


def summarize(records: list[dict], drafters: list[DrafterEntry], costs: dict,
              peer_records: list[dict] | None = None) -> list[dict]:
  """Aggregates per (sampling, drafter, category) and overall ("all")."""
  summary = []
  samplings = list(dict.fromkeys(r["sampling"] for r in records))
  categories = list(dict.fromkeys(r["category"] for r in records))
  for sampling in samplings:
    for entry in drafters:
      for category in categories + ["all"]:
        group = [r for r in records if r["sampling"] == sampling
                 and (category == "all" or r["category"] == category)]
        calls = [r["calls"][entry.name] for r in group]
        rounds = sum(c["rounds"] for c in calls)
        per_position = np.sum([c["accepted_per_position"] for c in calls], axis=0).tolist()
        a = per_token_acceptance(per_position, rounds)
        k = entry.num_draft
        verify_ratio = costs["verify_s"][entry.verify_k] / costs["target_step_s"]
        draft_ratio = entry.draft_ratio
        if draft_ratio is None and costs.get("draft_round_s", {}).get(entry.name) is not None:
          draft_ratio = costs["draft_round_s"][entry.name] / (k * costs["target_step_s"])
        # Tau: the tokens the calls emitted per round (a round cut at EOS or at the token limit
        # emits fewer than its accepted drafts plus one).
        tokens_per_round = sum(c["new_tokens"] for c in calls) / rounds if rounds else 0.0
        if entry.tree is None:
          bound = analytic_bound(a, k, draft_ratio or 0.0, verify_ratio)
        else:  # a tree: its measured tokens per round over a round at the full node budget
          bound = tokens_per_round / (k * (draft_ratio or 0.0) + verify_ratio)
        row = {"sampling": sampling, "drafter": entry.name, "category": category,
               "prompts": len(group), "num_draft": k, "acceptance_per_token": a,
               "tokens_per_round": tokens_per_round,
               "tree_nodes": None if entry.tree is None else entry.tree.size,
               "generate_tokens_per_s": _rate(group, "generate"),
               "decode_tokens_per_s": _rate(group, entry.name),
               "new_tokens": sum(c["new_tokens"] for c in calls),
               "verify_ratio": verify_ratio, "draft_ratio": draft_ratio or 0.0,
               "bound": bound}
        # Per emitted token, each call over its own text; greedy: summed, as the ratio below.
        greedy = sampling == "greedy"
        row["generate_ms_per_token"] = (1e3 / row["generate_tokens_per_s"] if greedy
                                        else per_token_ms(group, "generate"))
        row["decode_ms_per_token"] = (1e3 / row["decode_tokens_per_s"] if greedy
                                      else per_token_ms(group, entry.name))
        row["speedup"] = speedup(group, entry.name, sampling)
        row["speedup_basis"] = ("total time, the same text on both sides" if greedy else
                                "per-token times, each call over its own emitted tokens, mean "
                                "over the prompts")
        # The bound prices rounds against steps: compare it with the speedup of the token loop,
        # i.e. with the prefill both calls pay taken out of both.
        # NaN (and `loop_resolved` False) where a call was not longer than its prefill: a
        # short call on a loaded machine, whose loop time is below the timing's resolution.
        row["loop_resolved"] = loop_resolved(group, ("generate", entry.name))
        row["speedup_excl_prefill"] = (speedup(group, entry.name, sampling, exclude_prefill=True)
                                       if row["loop_resolved"] else float("nan"))
        row["prefill_share_of_generate"] = (sum(r["prefill_s"] for r in group) / sum(
            r["calls"]["generate"]["seconds"] for r in group))
        row["efficiency"] = row["speedup_excl_prefill"] / bound
        row.update(round_costs(group, entry, costs, rounds, row["loop_resolved"]))
        # Robust to a shared machine's drift: the median of the per-prompt ratios of calls that
        # ran back to back.
        row["speedup_median_prompt"] = float(np.median([
            (r["calls"][entry.name]["new_tokens"] / r["calls"][entry.name]["seconds"])
            / (r["calls"]["generate"]["new_tokens"] / r["calls"]["generate"]["seconds"])
            for r in group]))
        if sampling == "greedy":
          row["greedy_identical"] = all(c.get("first_divergence_from_generate") is None
                                        for c in calls)
        if peer_records and sampling == "greedy":
          peer = [p for p in peer_records if category == "all" or p["category"] == category]
          row["hf_generate_tokens_per_s"] = _rate(peer, "hf_generate")
          row["hf_prompt_lookup_tokens_per_s"] = _rate(peer, "hf_prompt_lookup")
          row["hf_prompt_lookup_speedup"] = (row["hf_prompt_lookup_tokens_per_s"]
                                             / row["hf_generate_tokens_per_s"])
        summary.append(row)
  return summary
