"""Markdown tables for the README, from suite results."""

from __future__ import annotations

from benchmarks.timing import paired_speedup


def _maybe(value: float, unit: str = "") -> str:
  """`value` to two places, or n/a where it was not measured (NaN)."""
  return "n/a" if value != value else f"{value:.2f}{unit}"


def readme_table(result: dict) -> str:
  """The markdown table the README quotes, from a `readme` suite result."""
  env = result["environment"]
  lines = [f"<!-- written by `specjax bench --suite readme` on {env['date']} -->",
           f"Measured on {env['device']} ({env['platform']}, {env['cpu_count']} cores, "
           f"jax {env['jax']}), float32, {result['settings']['max_new_tokens']} new tokens per "
           f"row, ratios of calls timed alternately in one process ({result['settings']['statistic']}"
           f" of {result['settings']['repeats']} timed calls each after a warm-up). speedup = "
           "generate time / decode time; paired = median of that ratio over back-to-back call "
           "pairs; bound = DESIGN.md's analytic speedup from the measured per-token acceptance a "
           "and measured draft-step, target-step and (k+1)-verify costs; efficiency = speedup / "
           "bound.", ""]
  pair = result.get("pair_records") or []
  if pair:
    lines += [f"**{pair[0]['pair']}**: `decode` vs `generate` (best k per row)", "",
              "| batch | temperature | k | generate tok/s | decode tok/s | speedup | paired | "
              "bound | efficiency | a (per token) | tokens/round |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    best: dict = {}
    for r in pair:
      key = (r["batch"], r["temperature"])
      if key not in best or r["speedup"] > best[key]["speedup"]:
        best[key] = r
    for (batch, temperature), r in sorted(best.items()):
      lines.append(f"| {batch} | {temperature} | {r['num_draft']} | "
                   f"{r['generate']['tokens_per_s']:.0f} | {r['decode']['tokens_per_s']:.0f} | "
                   f"**{r['speedup']:.2f}x** | {paired_speedup(r):.2f}x | {r['bound']:.2f}x | "
                   f"{r['efficiency']:.2f} | {r['acceptance_per_token']:.2f} | {r['mean_accepted_length']:.2f} |")
    lines.append("")
  synthetic = result.get("synthetic_records") or []
  if synthetic:
    lines += ["**Synthetic acceptance** (benchmark-only rule: each draft accepted with probability "
              f"a; random weights; not exact; greedy; {synthetic[0]['max_new_tokens']} new tokens)",
              "",
              "| target | params | batch | a (set / measured) | k | generate tok/s | decode tok/s | "
              "speedup | paired | bound | efficiency |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in synthetic:
      lines.append(f"| {r['target_size']} | {r['target']['params'] / 1e6:.0f}M | {r['batch']} | "
                   f"{r['synthetic_acceptance']} / {r['acceptance_per_token']:.2f} | {r['num_draft']} | "
                   f"{r['generate']['tokens_per_s']:.1f} | {r['decode']['tokens_per_s']:.1f} | "
                   f"**{r['speedup']:.2f}x** | {paired_speedup(r):.2f}x | {r['bound']:.2f}x | "
                   f"{r['efficiency']:.2f} |")
    lines.append("")
  peer = result.get("peer")
  if peer:
    s = peer["tokens_per_s"]
    lines += [f"**Same weights, transformers vs specjax** ({peer['pair']}, batch 1, greedy, "
              f"k={peer['num_draft']}, CPU float32)", "",
              "| | plain tok/s | speculative tok/s | speculative speedup |", "|---|---|---|---|",
              f"| transformers (`generate`, `assistant_model=`) | {s['hf_generate']:.1f} | "
              f"{s['hf_assisted']:.1f} | {peer['hf_speculative_speedup']:.2f}x |",
              f"| specjax (`generate`, `decode`) | {s['specjax_generate']:.1f} | "
              f"{s['specjax_decode']:.1f} | {peer['specjax_speculative_speedup']:.2f}x |", "",
              f"specjax `decode` / transformers assisted: "
              f"**{peer['specjax_decode_over_hf_assisted']:.2f}x**; greedy token streams "
              f"identical: **{'yes' if peer['greedy_streams_identical'] else 'NO'}**", ""]
  return "\n".join(lines) + "\n"


CATEGORY_NAMES = {"multi_turn": "multi-turn chat", "translation": "translation",
                  "summarization": "summarization", "qa": "QA over a text", "math": "math reasoning",
                  "code": "code", "all": "**overall**"}


def _nodes(row: dict) -> str:
  return f" (tree, {row['tree_nodes']})" if row.get("tree_nodes") else ""


def _round_cost_table(summary: list[dict]) -> list[str]:
  """Markdown lines: each row's round, measured, beside its parts timed on their own (ms)."""
  lines = ["**Per round (ms)**: round = the decode calls without their prefills over their "
           "rounds; draft and verify = the round's drafting (k draft steps) and its (k+1)-token "
           "verify, each timed on its own; other = round - draft - verify (acceptance, cache "
           "bookkeeping, the loop; below zero where the parts timed on their own ran slower than "
           "in the loop). generate per token = `generate`'s calls without their prefills over "
           "their tokens, beside one target step timed on its own.", "",
           "| sampling | category | drafter | tau | round | draft | verify | other | "
           "generate per token | target step |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in summary:
    lines.append(f"| {r['sampling']} | {CATEGORY_NAMES.get(r['category'], r['category'])} | "
                 f"{r['drafter']} | {r['tokens_per_round']:.2f} | {_maybe(r['round_ms'])} | "
                 f"{_maybe(r['draft_ms'])} | {_maybe(r['verify_ms'])} | "
                 f"{_maybe(r['other_ms'])} | {_maybe(r['generate_token_ms'])} | "
                 f"{_maybe(r['target_step_ms'])} |")
  return lines + [""]


def real_table(result: dict) -> str:
  """The markdown table of a `real` suite result (per category and overall, each drafter)."""
  env, settings, costs = result["environment"], result["settings"], result["costs"]
  lines = [f"<!-- written by `specjax bench --suite real` on {env['date']} -->",
           f"**{result['model_description']}**, {settings['prompts']} prompts written for this "
           f"benchmark ({settings['prompts_per_category']} per category, Spec-Bench's categories, "
           f"chat-templated, never used for training), batch 1, up to "
           f"{settings['max_new_tokens']} new tokens, stopping at the model's EOS. Measured on "
           f"{env['device']} ({env['platform']}, {env['cpu_count']} cores, jax {env['jax']}), "
           "float32; `generate` and `decode` timed alternately in one process, prompt by prompt. "
           "a = per-token acceptance; tau = tokens per round; speedup, greedy = decode tok/s / "
           "generate tok/s (the same text on both sides); per-token speedup, sampled = generate "
           "ms per token / decode ms per token, each call over the tokens it emitted itself "
           "(the texts differ), mean over the prompts; both over whole calls (prefill included); "
           "loop speedup = the same with the prompt's prefill (timed beside the calls, paid by "
           "both) taken out of both (n/a where a call was not longer than its prefill); "
           "bound = (1 - a^(k+1)) / (1 - a) / (k c + v) with v = one (k+1)-token verify / one "
           "target step = "
           f"{costs['verify_s'][min(costs['verify_s'])] / costs['target_step_s']:.2f} at "
           f"k={min(costs['verify_s'])} and c = the drafter's own work per draft token / one "
           "target step (both measured); efficiency = loop speedup / bound."
           + (" A tree drafter's k is its depth (its node budget in brackets) and its bound is "
              "its measured tau / (k c + v at the node budget)."
              if any(r.get("tree_nodes") for r in result["summary"]) else "")
           + (f" Load average at the end of the run: {env['load_average'][0]:.1f} on "
              f"{env['cpu_count']} cores." if env.get("load_average") else "")
           + (f" {result['run_note']}" if result.get("run_note") else ""), ""]
  summary = result["summary"]
  for sampling in dict.fromkeys(r["sampling"] for r in summary):
    rows = [r for r in summary if r["sampling"] == sampling]
    greedy = sampling == "greedy"
    columns = ("generate tok/s | decode tok/s | speedup | loop speedup" if greedy else
               "generate ms/token | decode ms/token | per-token speedup | loop per-token speedup")
    lines += [f"**{sampling}**", "",
              f"| category | drafter | k | a | tau | {columns} | bound | efficiency |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
      if greedy:
        rates = f"{r['generate_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f}"
      else:  # a result written before the per-token columns: the summed ones
        rates = (f"{r.get('generate_ms_per_token', 1e3 / r['generate_tokens_per_s']):.2f} | "
                 f"{r.get('decode_ms_per_token', 1e3 / r['decode_tokens_per_s']):.2f}")
      lines.append(f"| {CATEGORY_NAMES.get(r['category'], r['category'])} | {r['drafter']} | "
                   f"{r['num_draft']}{_nodes(r)} | {r['acceptance_per_token']:.2f} | "
                   f"{r['tokens_per_round']:.2f} | {rates} | **{r['speedup']:.2f}x** | "
                   f"{_maybe(r['speedup_excl_prefill'], 'x')} | {r['bound']:.2f}x | "
                   f"{_maybe(r['efficiency'])} |")
    lines.append("")
  if all("round_ms" in r for r in summary):
    lines += _round_cost_table(summary)
  peer_rows = [r for r in summary if "hf_generate_tokens_per_s" in r]
  if peer_rows:
    drafter = peer_rows[0]["drafter"]
    peer_rows = [r for r in peer_rows if r["drafter"] == drafter]
    lines += [f"**Same weights and prompt ids, greedy: transformers vs specjax** (transformers "
              f"`generate` and `prompt_lookup_num_tokens={peer_rows[0]['num_draft']}`; specjax "
              f"`generate` and `decode` with the {drafter} drafter)", "",
              "| category | transformers tok/s | transformers prompt lookup tok/s | its speedup | "
              "specjax generate tok/s | specjax decode tok/s | its speedup |",
              "|---|---|---|---|---|---|---|"]
    for r in peer_rows:
      lines.append(f"| {CATEGORY_NAMES.get(r['category'], r['category'])} | "
                   f"{r['hf_generate_tokens_per_s']:.1f} | "
                   f"{r['hf_prompt_lookup_tokens_per_s']:.1f} | "
                   f"{r['hf_prompt_lookup_speedup']:.2f}x | {r['generate_tokens_per_s']:.1f} | "
                   f"{r['decode_tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    lines.append("")
  identical = [r.get("greedy_identical") for r in summary
               if r["category"] == "all" and "greedy_identical" in r]
  if identical:
    lines.append(f"Greedy `decode` tokens identical to `generate` on every prompt: "
                 f"**{'yes' if all(identical) else 'NO'}**. Suite wall time "
                 f"{result['wall_s'] / 60:.1f} min (model loading {result['load_s']:.0f}s).")
  return "\n".join(lines) + "\n"
