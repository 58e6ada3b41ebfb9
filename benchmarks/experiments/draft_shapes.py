"""Chain lengths, adaptive length and trees with a draft head, per category, on a real model.

The head pair (`specjax.load_pair("smollm2-head")`: SmolLM2-135M-Instruct f32 + its EAGLE-3 head, or
`--head DIR` for another head) on the held-out chat prompts of `benchmarks/prompts/real.json`
(the first `--per-category` conversations of each category), greedy (or `--temperature T`),
batch 1, every prompt padded to one width (one compile per configuration). Compared, prompt by
prompt in turns (so load bursts on a shared host hit every configuration alike):

* plain `specjax.generate` (the baseline of every speedup);
* chains with fixed `k` (`--ks`);
* the confidence stop: `k = max(--ks)` with the head's per-row confidence stop (`--confidence`) and
  the verify widths the cost table keeps (`specjax.drafters.adaptive.costs.choose_widths`), chosen
  on device;
* `auto_num_draft`: the one `k` the measured cost table and acceptance profile pick;
* `sj.adaptive_drafter`: each row's own `k` in `0 .. K` every round, decided draft by draft from the
  head's confidence, the cost table and the row's running acceptance (the token stop of
  `specjax.drafters.adaptive.drafter`), next to the best fixed `k` of each category; and "adaptive
  rows", the same with each row's `k` fixed at the start of the round from its history alone;
* trees: EAGLE-2 dynamic trees and a static tree from the head (`--trees`).

The cost table and the acceptance profile are measured first, on this backend, with prompts from
the training templates (never the held-out ones), and saved beside the head's checkpoint
(`--calibration-out`, default: a scratch folder), under the run's sampling. Every greedy output
is checked token-identical to `generate` (sampled ones draw their own streams: not compared).
Wall times on a 2-core CPU are the fastest of `--repeats` per prompt; tau (tokens per round) does
not depend on the machine.

Usage: `python -m benchmarks.experiments.draft_shapes [--per-category 2] [--max-new-tokens 64]`;
writes `benchmarks/results/draft_shapes.json` and `.png`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1]
RESULTS = BENCHMARKS / "results"
TREES = {"dynamic d4 m2 N8": dict(builder="dynamic", depth=4, width=2, num_nodes=8),
         "dynamic d5 m3 N12": dict(builder="dynamic", depth=5, width=3, num_nodes=12),
         "dynamic d6 m4 N20": dict(builder="dynamic", depth=6, width=4, num_nodes=20),
         "static d4 w2": dict(builder="static", depth=4, width=2)}


def _prompts(tokenizer, per_category: int):
  data = json.loads((BENCHMARKS / "prompts" / "real.json").read_text())
  rows, categories = [], []
  for category, conversations in data["categories"].items():
    for conversation in conversations[:per_category]:
      rows.append(tokenizer.apply_chat_template(conversation["messages"]))
      categories.append(category)
  return rows, categories


def calibrate(target, drafter, tokenizer, out: pathlib.Path, *, max_width: int, sampling):
  from specjax.drafters.adaptive import costs
  from specjax.tuning.calibrate import measure_acceptance, measure_costs, profile_prompts
  table = measure_costs(target, drafter, max_width=max_width, repeats=5)
  tokens, lengths = profile_prompts(tokenizer)
  profile = measure_acceptance(target, drafter, tokens, lengths, num_draft=max_width - 1,
                               sampling=sampling)
  table.save(out)
  profile.save(out)
  return table, profile


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--per-category", type=int, default=2)
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--ks", default="2,3,4,6", help="fixed chain lengths")
  parser.add_argument("--confidence", type=float, default=0.4)
  parser.add_argument("--trees", default=",".join(TREES), help="tree configurations (names)")
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--head", help="a head checkpoint instead of the default pair's")
  parser.add_argument("--calibration-out", help="where the cost table and profile go")
  parser.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature (0: greedy, outputs checked against generate)")
  parser.add_argument("--out", default=str(RESULTS))
  args = parser.parse_args(argv)

  import specjax as sj
  from specjax.drafters.adaptive import auto_num_draft
  from specjax.drafters.adaptive import costs
  from specjax.drafters.base import with_confidence
  from specjax.trees.structure import TreeSpec

  pair = sj.load_pair("smollm2-head")
  target, drafter, tokenizer = pair.target, pair.draft, pair.tokenizer
  head_name = "shipped"
  if args.head:
    from benchmarks.drafters import load_head_drafter
    drafter = load_head_drafter(target, args.head, num_draft=8).drafter
    head_name = args.head
  eos = tuple(int(i) for i in tokenizer.eos_ids)
  ks = [int(k) for k in args.ks.split(",")]
  began = time.perf_counter()
  calib_dir = pathlib.Path(args.calibration_out or tempfile.mkdtemp(prefix="specjax_calib_"))
  sampling = sj.Sampling(temperature=args.temperature)
  table, profile = calibrate(target, drafter, tokenizer, calib_dir, max_width=max(ks) + 3,
                             sampling=sampling)
  measured = costs.Calibration(table, profile)
  auto = auto_num_draft(drafter, calibration=measured)
  widths = costs.choose_widths(table, max(ks))
  print(json.dumps({"calibration": str(calib_dir), "alpha": profile.alpha,
                    "verify_ms": table.verify_ms, "draft_step_ms": table.draft_step_ms,
                    "round_overhead_ms": table.round_overhead_ms,
                    "generate_step_ms": table.generate_step_ms, "auto_k": auto.num_draft,
                    "auto_predicted_speedup": auto.speedup, "adaptive_widths": widths}),
        flush=True)

  rows, categories = _prompts(tokenizer, args.per_category)
  width = max(map(len, rows))
  common = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, eos_id=eos)
  rng = jax.random.key(0)
  stopping = with_confidence(drafter, args.confidence)
  head = getattr(drafter, "drafter", drafter)  # trees draft with the head alone
  configs = {"generate": lambda t, n: sj.generate(target, t, rng, lengths=n, **common)}
  for k in ks:
    configs[f"chain k={k}"] = (lambda k: lambda t, n: sj.decode(
        target, drafter, t, rng, lengths=n, num_draft=k, **common))(k)
  configs[f"stop k={max(ks)} c={args.confidence:g}"] = lambda t, n: sj.decode(
      target, stopping, t, rng, lengths=n, num_draft=max(ks), verify_widths=widths, **common)
  configs[f"auto (k={auto.num_draft})"] = lambda t, n: sj.decode(
      target, drafter, t, rng, lengths=n, num_draft=auto.num_draft, verify_widths=auto.widths,
      **common)
  adaptive = sj.adaptive_drafter(drafter, calibration=measured)  # K and the widths come with it
  configs[f"adaptive (K={adaptive.max_draft})"] = lambda t, n: sj.decode(
      target, adaptive, t, rng, lengths=n, **common)
  rows_only = sj.adaptive_drafter(drafter, calibration=measured, token_stop=False)
  configs[f"adaptive rows (K={adaptive.max_draft})"] = lambda t, n: sj.decode(
      target, rows_only, t, rng, lengths=n, **common)
  for name in [t for t in args.trees.split(",") if t]:
    spec = TreeSpec(**TREES[name])
    configs[f"tree {name}"] = (lambda spec: lambda t, n: sj.decode(
        target, head, t, rng, lengths=n, tree=spec, **common))(spec)

  def padded(row):
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(row)] = row
    return jnp.asarray(tokens), jnp.asarray([len(row)], jnp.int32)

  records = {name: [] for name in configs}
  for i, row in enumerate(rows):
    t, n = padded(row)
    for name, fn in configs.items():  # the first prompt's call compiles
      out = fn(t, n)
      jax.block_until_ready(out.tokens)
      best = float("inf")
      for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(t, n).tokens)
        best = min(best, time.perf_counter() - start)
      count = int(out.num_tokens[0])
      entry = {"category": categories[i], "seconds": best, "tokens": count,
               "ids": np.asarray(out.tokens[0, :count]).tolist()}
      if name != "generate":
        stats = out.stats
        entry["rounds"] = int(stats.rounds[0])
        entry["drafted"] = int(stats.drafted[0])
        if args.temperature == 0:
          entry["identical"] = entry["ids"] == records["generate"][i]["ids"]
      records[name].append(entry)
    print(json.dumps({"prompt": i, "category": categories[i], **{
        name: round(r[-1]["tokens"] / r[-1]["seconds"], 1) for name, r in records.items()}}),
          flush=True)

  summary = {}
  cats = list(dict.fromkeys(categories)) + ["all"]
  for name, entries in records.items():
    summary[name] = {}
    for cat in cats:
      chosen = [e for e in entries if cat == "all" or e["category"] == cat]
      gen = [e for e, c in zip(records["generate"], categories) if cat == "all" or c == cat]
      tokens = sum(e["tokens"] for e in chosen)
      item = {"tokens_per_s": tokens / sum(e["seconds"] for e in chosen),
              "speedup_vs_generate": sum(e["seconds"] for e in gen) / sum(e["seconds"]
                                                                           for e in chosen)}
      if name != "generate":
        item["tau"] = tokens / max(sum(e["rounds"] for e in chosen), 1)
        item["drafts_per_round"] = (sum(e.get("drafted", 0) for e in chosen)
                                    / max(sum(e["rounds"] for e in chosen), 1))
        if args.temperature == 0:
          item["identical_to_generate"] = all(e["identical"] for e in chosen)
      summary[name][cat] = item
  fixed = [n for n in records if n.startswith("chain")]
  best_fixed = {cat: max(fixed, key=lambda n: summary[n][cat]["tokens_per_s"]) for cat in cats}
  versus_best = {name: {cat: summary[name][cat]["tokens_per_s"]
                        / summary[best_fixed[cat]][cat]["tokens_per_s"] for cat in cats}
                 for name in records if name != "generate" and not name.startswith("chain")}
  result = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF -> float32), CPU layout",
            "head": head_name, "device": str(jax.devices()[0]), "batch": 1,
            "temperature": args.temperature,
            "max_new_tokens": args.max_new_tokens, "per_category": args.per_category,
            "prompt_width": width, "repeats": args.repeats,
            "calibration": {"alpha": profile.alpha, "verify_ms": table.verify_ms,
                            "draft_step_ms": table.draft_step_ms,
                            "round_overhead_ms": table.round_overhead_ms,
                            "generate_step_ms": table.generate_step_ms,
                            "auto_k": auto.num_draft, "auto_predicted_speedup": auto.speedup,
                            "adaptive_widths": list(widths)},
            "adaptive_plan": {"max_draft": adaptive.max_draft, "widths": list(adaptive.widths),
                              "round_ms": list(adaptive.round_ms), "prior": list(adaptive.prior),
                              "copy_prior": (list(adaptive.copy_prior) if adaptive.copy_prior
                                             else None)},
            "summary": summary, "best_fixed_chain_per_category": best_fixed,
            "speed_vs_best_fixed_chain": versus_best,
            "records": records, "wall_s": time.perf_counter() - began}
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "draft_shapes.json").write_text(json.dumps(result, indent=1))
  for name in records:
    line = " | ".join(f"{cat} {summary[name][cat].get('tau', 1):.2f}/"
                      f"{summary[name][cat]['speedup_vs_generate']:.2f}x" for cat in cats)
    print(f"{name:28s} {line}")
  for name, ratios in versus_best.items():
    print(f"{name:28s} vs best fixed k: " + " | ".join(f"{c} {r:.2f}" for c, r in ratios.items()))
  from benchmarks.plots import plot_tau_and_speedup
  names = [n for n in records if n != "generate"]
  plot_tau_and_speedup(
      names, [summary[n]["all"]["tau"] for n in names],
      [summary[n]["all"]["speedup_vs_generate"] for n in names], out_dir / "draft_shapes.png",
      title=f"SmolLM2-135M + EAGLE-3 head, "
            f"{f'T = {args.temperature:g}' if args.temperature else 'greedy'}, "
            "held-out chat prompts, 2-core CPU",
      speedup_label="wall speedup vs generate (batch 1)", figsize=(12, 4.5), rotation=60)


if __name__ == "__main__":
  main()
