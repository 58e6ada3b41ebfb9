"""Draft cost per round of a parallel EAGLE-3 head against the sequential one, K = 2..8.

Both heads have SmolLM2-135M's EAGLE-3 shape (one decoder layer at its width, the shipped head's
8,192-id draft vocabulary) with random weights: the cost of a round does not depend on the
weights. A round is the drafter's whole work (`propose` + `observe` over a block of k + 1 target
positions, `benchmarks.drafter_cost`), in a jitted loop of `steps` rounds on the state built from a
real prefill of a chat prompt, batch 1, greedy. Every (head, K) program is timed alternately in
one process (`benchmarks.timing.time_alternately`, minimum of `repeats`).

    python -m benchmarks.experiments.parallel_head_cost \\
        [--out benchmarks/results/parallel_head_cost.json]

Writes the JSON and a plot (`.png` beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.drafter_cost import draft_round_call
from benchmarks.timing import time_alternately

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
KS = tuple(range(2, 9))


def main():
  import specjax as sj
  from specjax.drafters.eagle import network as eagle
  from specjax.io.gguf import find_packaged_gguf, from_gguf
  from specjax.io.tokenizer import load_tokenizer
  from specjax.pretrained.pairs import GGUF_NAME

  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--out", default=str(RESULTS / "parallel_head_cost.json"))
  args = parser.parse_args()

  gguf = find_packaged_gguf(GGUF_NAME)
  target = from_gguf(gguf, platform=jax.default_backend())
  tokenizer = load_tokenizer(gguf)
  prompt = tokenizer.apply_chat_template(
      [{"role": "user", "content": "What are three good habits for writing readable code?"}])
  tokens = jnp.asarray([prompt], jnp.int32)
  lengths = jnp.asarray([len(prompt)], jnp.int32)
  ids = np.arange(8192, dtype=np.int32)
  drafters = {}
  for name, parallel in (("sequential", 0), ("parallel", max(KS) - 2)):
    config = eagle.head_config_for(target.config, kind="eagle3", draft_vocab_size=len(ids),
                                   parallel=parallel)
    drafters[name] = sj.EagleDrafter(eagle.init_head(config, target, jax.random.key(1), ids),
                                     target.params["embed"])
  calls = {f"{name}-k{k}": draft_round_call(target, drafter, tokens, lengths, buffer_len=512,
                                            num_draft=k, sampling=sj.Sampling(), steps=args.steps)
           for name, drafter in drafters.items() for k in KS}
  load_before = os.getloadavg()
  timed = time_alternately(calls, args.repeats)
  record = {"model": "smollm2-135m (f32, for_platform)", "head": "EAGLE-3 shape, random weights,"
            " draft vocabulary 8192", "batch": 1, "steps_per_call": args.steps,
            "repeats": args.repeats, "statistic": "min", "machine": os.uname().machine,
            "load_before": load_before, "load_after": os.getloadavg(), "rows": []}
  for name, drafter in drafters.items():
    for k in KS:
      t = timed[f"{name}-k{k}"]
      record["rows"].append({"head": name, "k": k, "round_ms": 1e3 * t["seconds"] / args.steps,
                             "median_round_ms": 1e3 * t["median_s"] / args.steps,
                             "head_forwards": drafter.forwards_per_round(k)})
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(record, indent=1) + "\n")
  for row in record["rows"]:
    print(f"{row['head']:>10} k={row['k']}: {row['round_ms']:.2f} ms a round "
          f"({row['head_forwards']} head forwards)")

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  for name in drafters:
    rows = [r for r in record["rows"] if r["head"] == name]
    ax.plot([r["k"] for r in rows], [r["round_ms"] for r in rows], "o-", label=name)
  ax.set_xlabel("drafts per round k")
  ax.set_ylabel("draft cost per round (ms)")
  ax.set_ylim(bottom=0)
  ax.set_title("EAGLE-3 head on SmolLM2-135M, batch 1 (CPU)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out.with_suffix(".png"), dpi=110)
  print("wrote", out, out.with_suffix(".png"))


if __name__ == "__main__":
  main()
