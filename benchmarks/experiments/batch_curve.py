"""Speculation against batch size on CPU: the default pair (SmolLM2 + its int8 copy) at B = 1..64.

    python -m benchmarks.experiments.batch_curve [--batches 1,8,32,64] [--new 48] [--reps 2]

For each batch B, on ragged chat prompts (the 36 conversations of `benchmarks/prompts/real.json`,
chat-templated, cycled to B rows) and in one process, alternating the sides:

  * `generate`: tokens/s;
  * `decode` with the demo's configuration (int8 self-draft, k = 4): tokens/s, ratio, tau;
  * `decode` with `sj.adaptive_drafter(drafter, calibration)` and a calibration measured at that
    batch (`specjax.tuning.calibrate.measure_costs(batch=B)`, and an acceptance profile on the
    calibration prompts of `specjax.tuning.calibrate.profile_prompts`, never the benchmark's):
    tokens/s, ratio, tau, whether the plan runs plain target steps (`AdaptivePlan.plain`). The
    calibration's own time is recorded, not counted in the ratio (it is measured once per machine
    and batch, like `specjax calibrate`).

Greedy. Each figure is the minimum over `--reps` alternating repetitions; the load average before
and after is recorded. Writes benchmarks/results/batch_curve.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
PROMPTS = pathlib.Path(__file__).resolve().parents[1] / "prompts" / "real.json"


def chat_rows(tokenizer, batch: int):
  conversations = [c["messages"] for cat in json.loads(PROMPTS.read_text())["categories"].values()
                   for c in cat]
  rows = [tokenizer.apply_chat_template(conversations[i % len(conversations)])
          for i in range(batch)]
  ids = np.zeros((batch, max(map(len, rows))), np.int32)
  for i, row in enumerate(rows):
    ids[i, :len(row)] = row
  return ids, np.asarray([len(r) for r in rows], np.int32)


def main():
  import specjax as sj
  from specjax.drafters.adaptive import costs
  from specjax.tuning.calibrate import measure_acceptance, measure_costs, profile_prompts
  from specjax.pretrained.pairs import GGUF_NAME
  from specjax.io.gguf import find_packaged_gguf, from_gguf
  from specjax.io.tokenizer import load_tokenizer

  from benchmarks.timing import time_alternately

  parser = argparse.ArgumentParser()
  parser.add_argument("--batches", default="1,8,32,64")
  parser.add_argument("--new", type=int, default=48)
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--out", default=str(RESULTS / "batch_curve.json"))
  parser.add_argument("--calibrations", default=None,
                      help="a directory for each batch's calibration (reused when present)")
  args = parser.parse_args()

  gguf = find_packaged_gguf(GGUF_NAME)
  target = from_gguf(gguf, platform=jax.default_backend())
  drafter = sj.self_drafter(target, 8)
  tokenizer = load_tokenizer(gguf)
  key = jax.random.key(0)
  calib_ids, calib_lengths = profile_prompts(tokenizer)
  record = {"pair": "smollm2-int8", "machine": os.uname().machine, "new_tokens": args.new,
            "load_before": os.getloadavg(), "rows": []}
  out_path = pathlib.Path(args.out)
  for batch in [int(b) for b in args.batches.split(",")]:
    ids, lengths = chat_rows(tokenizer, batch)
    common = dict(lengths=lengths, max_new_tokens=args.new)
    start = time.perf_counter()
    cached = pathlib.Path(args.calibrations) / f"batch{batch}" if args.calibrations else None
    if cached is not None and cached.exists():
      calibration = costs.load_calibration(cached)
    else:
      table = measure_costs(target, drafter, batch=batch, max_width=6, repeats=2)
      profile = measure_acceptance(target, drafter, calib_ids, calib_lengths, num_draft=5,
                                   sampling=sj.Sampling(), max_new_tokens=48)
      calibration = costs.Calibration(table, profile)
      if cached is not None:
        cached.mkdir(parents=True, exist_ok=True)
        table.save(cached)
        profile.save(cached)
    table, profile = calibration.costs, calibration.profile
    adaptive = sj.adaptive_drafter(drafter, calibration=calibration)  # its K, plain, widths
    calibrate_s = time.perf_counter() - start
    sides = {
        "generate": lambda: sj.generate(target, ids, key, **common),
        "k=4": lambda: sj.decode(target, drafter, ids, key, num_draft=4, **common),
        "adaptive": lambda: sj.decode(target, adaptive, ids, key, **common),
    }
    timed = time_alternately(sides, args.reps)  # one warm-up (compile), then alternating
    best = {name: entry["seconds"] for name, entry in timed.items()}
    outs = {name: entry["result"] for name, entry in timed.items()}
    tokens = int(np.sum(np.asarray(outs["generate"].num_tokens)))
    row = {"batch": batch, "tokens": tokens, "calibrate_s": calibrate_s,
           "plan": {"max_draft": adaptive.max_draft, "plain": adaptive.plain,
                    "round_ms": list(adaptive.round_ms)},
           "cost_table": {"generate_step_ms": table.generate_step_ms,
                          "draft_step_ms": table.draft_step_ms, "verify_ms": list(table.verify_ms),
                          "round_overhead_ms": table.round_overhead_ms}}
    for name in sides:
      row[name] = {"ms": best[name] * 1e3, "tokens_per_s": tokens / best[name],
                   "ratio": best["generate"] / best[name]}
      if name != "generate":
        summary = outs[name].stats.summary()
        row[name].update(tau=summary["tokens_per_round"],
                         acceptance=summary["acceptance_rate"],
                         draft_calls=summary["draft_calls"],
                         identical=bool(np.array_equal(outs[name].tokens,
                                                       outs["generate"].tokens)))
    record["rows"].append(row)
    print(f"B={batch}: generate {row['generate']['tokens_per_s']:.0f} tok/s; k=4 "
          f"{row['k=4']['ratio']:.2f}x (tau {row['k=4']['tau']:.2f}); adaptive "
          f"{row['adaptive']['ratio']:.2f}x (tau {row['adaptive']['tau']:.2f}, plain "
          f"{adaptive.plain}, K {adaptive.max_draft}); calibration {calibrate_s:.0f} s",
          flush=True)
    record["load_after"] = os.getloadavg()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(record, indent=1))
  plot(record, out_path.with_suffix(".png"))


def plot(record: dict, path: pathlib.Path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  rows = record["rows"]
  batches = [r["batch"] for r in rows]
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  for name in ("generate", "k=4", "adaptive"):
    left.plot(batches, [r[name]["tokens_per_s"] for r in rows], "o-", label=name)
  left.set_xscale("log", base=2)
  left.set_xlabel("batch")
  left.set_ylabel("tokens / s")
  left.legend()
  for name in ("k=4", "adaptive"):
    right.plot(batches, [r[name]["ratio"] for r in rows], "o-", label=name)
  right.axhline(1.0, color="k", lw=0.8)
  right.axhline(0.95, color="k", lw=0.5, ls=":")
  right.set_xscale("log", base=2)
  right.set_xlabel("batch")
  right.set_ylabel("tokens/s over generate's")
  right.set_title(f"SmolLM2-135M + int8 copy, CPU, {record['new_tokens']} new tokens")
  right.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)


if __name__ == "__main__":
  main()
