"""Two source trees of specjax on a shipped pair, in alternating processes: `decode` and `generate`
on the demo's timed conversations (`specjax.cli.demo.DEMO_SET`), greedy, at the suite's budget.

    python -m benchmarks.experiments.body_ab --base /path/to/old/tree --new /path/to/new/tree \\
        --pair qwen2.5-coder --conversations 2 --rounds 2 --out benchmarks/results/body_ab.json

For a change that should not move CPU speed (one model body for every layout): each process loads
the pair from one tree, compiles both programs for the first `--conversations` conversations
(padded to a multiple of 32 tokens, as the demo pads them), then times each call `--repeats` times,
decode and generate alternating; the driver runs base, new, base, new, ... (`--rounds` of each) and
reports, per call, new / base of the medians over rounds of each process's median time, with every
process's times in the JSON. Two trees cannot share one process (both are `specjax`), so a host
whose speed drifts between processes shows up as spread between rounds: read the per-round ratios
beside the median. The tree is picked by mapping the editable install's `specjax`,
`specjax.kernels` and `specjax.checkpoints` onto it before anything imports them (`_CHILD`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import sys, json
    root = sys.argv[1]
    try:
      import __editable___specjax_0_1_0_finder as finder
      finder.MAPPING.update({"specjax": root + "/specjax", "specjax.kernels": root + "/kernels",
                             "specjax.checkpoints": root + "/checkpoints"})
    except ImportError:
      pass
    sys.path.insert(0, root)
    import statistics, time
    import jax, numpy as np
    import specjax as sj
    assert sj.__file__.startswith(root), sj.__file__
    from specjax.cli import demo
    pair, count, repeats, budget = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    loaded = sj.load_pair(pair)
    target, draft, tokenizer = loaded.target, loaded.draft, loaded.tokenizer
    rng, greedy = jax.random.PRNGKey(0), sj.Sampling(temperature=0.0)
    eos = tuple(tokenizer.eos_ids) or None
    out = {"root": root, "calls": {}}
    for category, messages in demo.DEMO_SET[-count:]:
      row = tokenizer.apply_chat_template(messages)
      width = -(-len(row) // 32) * 32
      ids = np.zeros((1, width), np.int32)
      ids[0, :len(row)] = row
      common = dict(lengths=np.asarray([len(row)], np.int32), max_new_tokens=budget,
                    sampling=greedy, eos_id=eos)
      calls = {"decode": lambda: sj.decode(target, draft, ids, rng, num_draft=loaded.num_draft,
                                           **common),
               "generate": lambda: sj.generate(target, ids, rng, **common)}
      times = {name: [] for name in calls}
      results = {name: jax.block_until_ready(call()) for name, call in calls.items()}  # compiles
      for index in range(repeats):
        for name in (("decode", "generate") if index % 2 == 0 else ("generate", "decode")):
          start = time.perf_counter()
          jax.block_until_ready(calls[name]())
          times[name].append(time.perf_counter() - start)
      tokens = [int(results[n].num_tokens[0]) for n in calls]
      same = bool(np.array_equal(np.asarray(results["decode"].tokens),
                                 np.asarray(results["generate"].tokens)))
      out["calls"][category] = {"times_s": times, "new_tokens": tokens[0], "identical": same,
                                "tokens": np.asarray(results["decode"].tokens[0]).tolist()}
    print("RESULT " + json.dumps(out))
""")


def run_child(root: str, args) -> dict:
  command = [sys.executable, "-c", _CHILD, root, args.pair, str(args.conversations),
             str(args.repeats), str(args.budget)]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
  line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
  if done.returncode != 0 or line is None:
    raise RuntimeError(f"child in {root} failed ({done.returncode}):\n{done.stderr[-3000:]}")
  return json.loads(line[len("RESULT "):])


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base", required=True, help="the old source tree (a checkout)")
  parser.add_argument("--new", required=True, help="the new source tree (a checkout)")
  parser.add_argument("--pair", default="qwen2.5-coder")
  parser.add_argument("--conversations", type=int, default=2,
                      help="the last N of the demo's conversations (default 2: math, code)")
  parser.add_argument("--repeats", type=int, default=2, help="timed calls of each per process")
  parser.add_argument("--rounds", type=int, default=2, help="processes per tree, alternating")
  parser.add_argument("--budget", type=int, default=96, help="new tokens per call")
  parser.add_argument("--out", default="benchmarks/results/body_ab.json")
  args = parser.parse_args(argv)
  runs = []
  for index in range(args.rounds):
    for side in ("base", "new"):
      started = os.getloadavg()
      record = run_child(getattr(args, side), args)
      runs.append({"side": side, "round": index, "load_before": started,
                   "load_after": os.getloadavg(), **record})
      print(f"round {index} {side}: " + ", ".join(
          f"{c}: decode {statistics.median(v['times_s']['decode']):.2f}s generate "
          f"{statistics.median(v['times_s']['generate']):.2f}s"
          for c, v in record["calls"].items()), flush=True)
  summary = {}
  categories = list(runs[0]["calls"])
  for category in categories:
    for call in ("decode", "generate"):
      side_medians = {side: [statistics.median(r["calls"][category]["times_s"][call])
                             for r in runs if r["side"] == side] for side in ("base", "new")}
      per_round = [n / b for b, n in zip(side_medians["base"], side_medians["new"])]
      summary[f"{category}/{call}"] = {
          "new_over_base": statistics.median(side_medians["new"])
                           / statistics.median(side_medians["base"]),
          "per_round": per_round, **side_medians}
  same_tokens = all(r["calls"][c]["tokens"] == runs[0]["calls"][c]["tokens"]
                    for r in runs for c in categories)
  result = {"settings": vars(args), "runs": runs, "summary": summary,
            "tokens_identical_across_trees": same_tokens}
  pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
  for key, row in summary.items():
    print(f"{key}: new / base {row['new_over_base']:.3f} (rounds "
          f"{', '.join(f'{r:.3f}' for r in row['per_round'])})")
  print(f"tokens identical across the trees: {same_tokens}")
  return result


if __name__ == "__main__":
  main()
