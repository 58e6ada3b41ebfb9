"""The int8 self-draft's scale group: one scale per 32 input columns against one per 64.

    python -m benchmarks.experiments.self_draft_group [--ks 4,5,6] [--reps 5] [--new 96]
        [--questions 4]

SmolLM2-135M-Instruct (float32, the CPU layout) drafting with its own int8 copy quantized per
group of 32 and of 64 columns (`specjax.self_drafter(target, 8, group)`), greedy, batch 1, on the
demo's question and three other ordinary chat questions (`benchmarks.self_draft.QUESTIONS`). Per
group and k: tau, greedy identity with `generate`, and `decode` against `generate` timed in one
process, every call of a repetition back to back (generate, then each configuration), so that the
ratio of adjacent calls sees nearly the same background load: the paired median over repetitions
is the figure to read, the minimum is recorded beside it. Bytes read per draft step come from the
quantized copy's own leaves. Writes benchmarks/results/self_draft_group.json and .png.
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

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
GROUPS = (32, 64)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ks", default="4,5,6")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--new", type=int, default=96)
  parser.add_argument("--questions", type=int, default=4, help="the first N questions")
  parser.add_argument("--out", default=str(RESULTS / "self_draft_group.json"))
  args = parser.parse_args(argv)
  import specjax as sj
  from benchmarks.self_draft import QUESTIONS

  ks = [int(k) for k in args.ks.split(",")]
  pair = sj.load_pair("smollm2-int8")
  target, tokenizer = pair.target, pair.tokenizer
  drafters = {g: sj.self_drafter(target, 8, g) for g in GROUPS}
  nbytes = {g: int(sum(x.nbytes for x in jax.tree.leaves(d.model.params)))
            for g, d in drafters.items()}
  rng = jax.random.PRNGKey(0)
  greedy = sj.Sampling(temperature=0.0)
  eos = tuple(tokenizer.eos_ids) or None
  records = []
  for question in QUESTIONS[:args.questions]:
    ids = np.asarray([tokenizer.apply_chat_template([{"role": "user", "content": question}])],
                     np.int32)
    common = dict(lengths=np.asarray([ids.shape[1]], np.int32), max_new_tokens=args.new,
                  sampling=greedy, eos_id=eos)
    calls = {"generate": lambda: sj.generate(target, ids, rng, **common)}
    for g in GROUPS:
      for k in ks:
        calls[f"g{g}_k{k}"] = (lambda d=drafters[g], k=k:
                               sj.decode(target, d, ids, rng, num_draft=k, **common))
    reference = jax.block_until_ready(calls["generate"]())
    record = {"question": question, "prompt_tokens": int(ids.shape[1]),
              "new_tokens": int(reference.num_tokens[0]), "configs": {}}
    for name, fn in calls.items():
      if name == "generate":
        continue
      out = jax.block_until_ready(fn())  # compiles
      summary = out.stats.summary()
      record["configs"][name] = {
          "tau": float(summary["tokens_per_round"]), "rounds": int(summary["rounds"]),
          "identical": bool(np.array_equal(np.asarray(out.tokens), np.asarray(reference.tokens)))}
    times = {name: [] for name in calls}
    for _ in range(args.reps):
      for name, fn in calls.items():
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times[name].append(time.perf_counter() - start)
    record["generate_s"] = times["generate"]
    for name, entry in record["configs"].items():
      entry["decode_s"] = times[name]
      entry["speedup_min"] = min(times["generate"]) / min(times[name])
      entry["speedup_paired_median"] = statistics.median(
          g / d for g, d in zip(times["generate"], times[name]))
    records.append(record)
    print(question[:40], {n: (round(e["tau"], 2), round(e["speedup_paired_median"], 3))
                          for n, e in record["configs"].items()}, flush=True)

  overall = {}
  for g in GROUPS:
    for k in ks:
      name = f"g{g}_k{k}"
      entries = [r["configs"][name] for r in records]
      overall[name] = {
          "group": g, "k": k, "tau_mean": float(np.mean([e["tau"] for e in entries])),
          "speedup_paired_median_mean": float(np.mean([e["speedup_paired_median"]
                                                        for e in entries])),
          "all_identical": all(e["identical"] for e in entries)}
  result = {
      "benchmark": "self_draft_group", "model": "SmolLM2-135M-Instruct (float32, CPU layout)",
      "drafter": "specjax.self_drafter(target, 8, group)", "draft_bytes": nbytes,
      "settings": {"ks": ks, "reps": args.reps, "max_new_tokens": args.new, "greedy": True,
                   "questions": args.questions},
      "environment": {"platform": jax.devices()[0].platform, "cpu_count": os.cpu_count(),
                      "jax": jax.__version__, "load_average": list(os.getloadavg()),
                      "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
      "records": records, "overall": overall}
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  _plot(overall, ks, out.with_suffix(".png"))
  for name, entry in overall.items():
    print(name, {key: (round(v, 3) if isinstance(v, float) else v) for key, v in entry.items()})
  return result


def _plot(overall: dict, ks, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
  width = 0.38
  for i, g in enumerate(GROUPS):
    xs = np.arange(len(ks)) + (i - 0.5) * width
    left.bar(xs, [overall[f"g{g}_k{k}"]["speedup_paired_median_mean"] for k in ks], width,
             label=f"group {g}")
    right.bar(xs, [overall[f"g{g}_k{k}"]["tau_mean"] for k in ks], width, label=f"group {g}")
  for ax, title in ((left, "speedup over generate (paired median)"), (right, "tau")):
    ax.set_xticks(np.arange(len(ks)), [f"k = {k}" for k in ks])
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
  left.axhline(1.0, color="grey", lw=0.8)
  fig.suptitle("SmolLM2-135M, int8 self-draft: one scale per 32 vs 64 columns (CPU)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  main()
