"""CPU speed of `sj.decode` and `sj.generate` on the toy pair in `checkpoints/toy/`
(before/after).

    python benchmarks/core_speed.py --label after [--out benchmarks/results] [--repeats 5]
    PYTHONPATH=<older checkout> python benchmarks/core_speed.py --label before ...

Loads `checkpoints/toy/target`, `checkpoints/toy/draft` and
`checkpoints/toy/tokenizer.json` (the 7.2M/0.66M stdlib pair) in float32, encodes four Python
prompts, and times (median of `--repeats`, after one compiling call) greedy and sampled (T=0.8)
`decode` at k=4 and greedy `generate`, batch 4, 64 new tokens. Only names present before and after
the core rebuild are used (`sj.load`, `sj.load_tokenizer`, `sj.decode`, `sj.generate`), so one file
measures both checkouts. Appends a record per label to `core_speed.json` and plots every label in
`core_speed.png`.

The machine is shared: read ratios measured in the same session, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import specjax as sj  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef ", "class Stack:\n    def ",
           "for i in range(10):\n"]


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--label", required=True)
  parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--new-tokens", type=int, default=64)
  args = parser.parse_args(argv)

  target = sj.load(ROOT / "checkpoints" / "toy" / "target", dtype="float32")
  draft = sj.load(ROOT / "checkpoints" / "toy" / "draft", dtype="float32")
  tokenizer = sj.load_tokenizer(ROOT / "checkpoints" / "toy" / "tokenizer.json")
  rows = [tokenizer.encode(p) for p in PROMPTS]
  lengths = np.array([len(r) for r in rows], np.int32)
  tokens = np.zeros((len(rows), lengths.max()), np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  common = dict(lengths=lengths, max_new_tokens=args.new_tokens)
  cases = {
      "decode_greedy_k4": lambda: sj.decode(target, draft, tokens, jax.random.key(0),
                                            num_draft=4, **common),
      "decode_t0.8_k4": lambda: sj.decode(target, draft, tokens, jax.random.key(0), num_draft=4,
                                          sampling=sj.Sampling(temperature=0.8), **common),
      "generate_greedy": lambda: sj.generate(target, tokens, jax.random.key(0), **common),
  }
  record = {"label": args.label, "specjax": sj.__file__, "batch": len(rows),
            "new_tokens": args.new_tokens, "repeats": args.repeats, "cases": {}}
  for name, run in cases.items():
    start = time.perf_counter()
    out = jax.block_until_ready(run())
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(run())
      times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    record["cases"][name] = {
        "seconds": seconds, "min_seconds": min(times), "first_call_seconds": compile_s,
        "tokens_per_second": int(np.sum(out.num_tokens)) / seconds,
        "target_calls": int(np.max(out.stats.target_calls))}
    print(f"{args.label:>8} {name:>18}: {seconds * 1e3:8.1f} ms  "
          f"{record['cases'][name]['tokens_per_second']:8.1f} tok/s  (first call {compile_s:.1f}s)")

  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / "core_speed.json"
  results = json.loads(path.read_text()) if path.exists() else {"benchmark": "core_speed",
                                                                "records": []}
  results["records"] = [r for r in results["records"] if r["label"] != args.label] + [record]
  results["host_cpus"] = os.cpu_count()
  path.write_text(json.dumps(results, indent=2))
  _plot(results["records"], out_dir / "core_speed.png")
  return record


def _plot(records, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = list(records[0]["cases"])
  fig, ax = plt.subplots(figsize=(7, 3.5))
  width = 0.8 / len(records)
  for i, record in enumerate(records):
    values = [record["cases"][n]["tokens_per_second"] for n in names]
    ax.bar([x + i * width for x in range(len(names))], values, width, label=record["label"])
  ax.set_xticks([x + width * (len(records) - 1) / 2 for x in range(len(names))], names)
  ax.set_ylabel("new tokens / s (batch 4)")
  ax.set_title("specjax on the toy stdlib pair, CPU float32 (shared host)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main()
