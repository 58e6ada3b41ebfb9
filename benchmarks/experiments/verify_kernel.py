"""Fused verify kernel vs the jnp reference vs the bytes-moved floor.

For V in {32k, 128k, 256k}, B in {1, 8, 64}, k in {4, 8} it times, on the default accelerator:

  kernel     the fused kernel compiled: `fused_verify` (Mosaic) on a TPU, `fused_verify_gpu`
             (Triton) on a GPU
  reference  `specjax.verify.rule.verify_reference` under jit (XLA)
  read       `max` over the same logits under jit: XLA reading them once, the practical floor
  floor      logits bytes / the chip's HBM bandwidth (when the chip is in `HBM_BANDWIDTH`)

and writes `benchmarks/results/verify_kernel.json` and `verify_kernel.png`. Timings need a TPU or
a GPU. On CPU
only `--interpret` runs: a correctness pass of the kernel in Pallas interpret mode against the
reference, at reduced batch, written to `verify_kernel_interpret.json`; its wall times are the
interpreter's and mean nothing about speed.

`--passes` needs no device: it counts, from the kernels' static schedules and default blocks,
the passes over the vocabulary and the HBM bytes each batch row streams per round at V = 128256
(float32 logits, k = 4, a draft with logits) for greedy, top-k, top-p and top-k + top-p, for the
checkout it runs in and, with `--base DIR`, for another checkout (run in a subprocess), and writes
`verify_kernel_passes.json`.

  python -m benchmarks.experiments.verify_kernel                 # on a TPU or a GPU
  python -m benchmarks.experiments.verify_kernel --interpret     # on CPU: correctness only
  python -m benchmarks.experiments.verify_kernel --passes --base /work/base   # counts, any host
"""

from __future__ import annotations

import argparse
import importlib
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core import sampling as S
from specjax.kernels import fused_verify, fused_verify_gpu

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
VOCABS = (32768, 131072, 262144)
BATCHES = (1, 8, 64)
NUM_DRAFTS = (4, 8)
# Peak HBM bandwidth, bytes/s, by `device_kind` substring (vendor figures).
HBM_BANDWIDTH = {"TPU v4": 1.2e12, "TPU v5 lite": 8.19e11, "TPU v5e": 8.19e11, "TPU v5p": 2.765e12,
                 "TPU v5": 2.765e12, "TPU v6": 1.64e12, "H100": 3.35e12, "H200": 4.8e12,
                 "A100": 2.0e12}
SAMPLINGS = {"greedy": S.GREEDY, "temperature": S.Sampling(temperature=1.0),
             "top_k_top_p": S.Sampling(temperature=0.8, top_k=50, top_p=0.9)}


def _reference():
  """`specjax.verify.rule.verify_reference` (imported late: `--passes --base` loads older
  checkouts)."""
  return importlib.import_module("specjax.verify.rule").verify_reference


def _inputs(batch, num_draft, vocab, dtype, seed=0):
  key_t, key_q, key_d = jax.random.split(jax.random.key(seed), 3)
  draft = jax.random.normal(key_q, (batch, num_draft, vocab), jnp.float32) * 3
  target = jnp.concatenate([draft, jax.random.normal(key_t, (batch, 1, vocab)) * 3], axis=1)
  target = target + 0.5 * jax.random.normal(key_t, target.shape)
  tokens = jax.random.categorical(key_d, draft, axis=-1).astype(jnp.int32)
  return dict(target_logits=target.astype(dtype), draft_logits=draft.astype(dtype),
              draft_tokens=tokens, seeds=jnp.arange(batch, dtype=jnp.uint32),
              positions=jnp.arange(batch, dtype=jnp.int32) * 7)


def _time(fn, args, repeats):
  jax.block_until_ready(fn(**args))  # compile + warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(**args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _bandwidth(device):
  kind = device.device_kind
  return next((bw for name, bw in HBM_BANDWIDTH.items() if name in kind), None)


def run_timings(args):
  device = jax.devices()[0]
  on_tpu = device.platform == "tpu"
  on_gpu = device.platform == "gpu"
  bandwidth = _bandwidth(device)
  dtype = jnp.dtype(args.dtype)
  sampling = SAMPLINGS[args.sampling]
  rows = []
  for vocab in VOCABS:
    for batch in BATCHES:
      for num_draft in NUM_DRAFTS:
        inputs = _inputs(batch, num_draft, vocab, dtype)
        logits_bytes = (inputs["target_logits"].nbytes + inputs["draft_logits"].nbytes)
        reference = jax.jit(functools.partial(_reference(), sampling=sampling))
        read = jax.jit(lambda target_logits, draft_logits, **_: (jnp.max(target_logits),
                                                                  jnp.max(draft_logits)))
        row = dict(vocab=vocab, batch=batch, num_draft=num_draft, logits_bytes=logits_bytes,
                   reference_s=_time(reference, inputs, args.repeats),
                   read_s=_time(read, inputs, args.repeats),
                   floor_s=logits_bytes / bandwidth if bandwidth else None, kernel_s=None)
        if on_tpu or on_gpu:
          kernel = jax.jit(functools.partial(fused_verify if on_tpu else fused_verify_gpu,
                                             sampling=sampling))
          row["kernel_s"] = _time(kernel, inputs, args.repeats)
          got, want = kernel(**inputs), reference(**inputs)
          row["kernel_matches_reference"] = bool(np.array_equal(got.tokens, want.tokens))
        rows.append(row)
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)
  result = dict(device=device.device_kind, platform=device.platform, dtype=str(dtype),
                sampling=args.sampling, hbm_bandwidth=bandwidth, rows=rows,
                note=None if on_tpu or on_gpu else "no TPU or GPU: the kernel was not timed")
  RESULTS.mkdir(exist_ok=True)
  (RESULTS / "verify_kernel.json").write_text(json.dumps(result, indent=1))
  _plot(result, RESULTS / "verify_kernel.png")


def _plot(result, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(VOCABS), figsize=(5 * len(VOCABS), 4), sharey=True)
  for ax, vocab in zip(axes, VOCABS):
    for num_draft, style in zip(NUM_DRAFTS, ("-", "--")):
      rows = [r for r in result["rows"] if r["vocab"] == vocab and r["num_draft"] == num_draft]
      batches = [r["batch"] for r in rows]
      for key, color in (("kernel_s", "C0"), ("reference_s", "C1"), ("read_s", "C2"),
                         ("floor_s", "C3")):
        values = [r[key] for r in rows]
        if all(v is not None for v in values):
          ax.plot(batches, np.array(values) * 1e3, style, color=color,
                  label=f"{key[:-2]} k={num_draft}")
    ax.set(xscale="log", yscale="log", xlabel="batch", title=f"V = {vocab}")
  axes[0].set_ylabel("ms")
  axes[-1].legend(fontsize=7)
  fig.suptitle(f"fused verify ({result['sampling']}, {result['dtype']}) on {result['device']}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def run_interpret(args):
  """Correctness on CPU: kernel (interpret) == reference at every V and k, reduced batch."""
  rows, all_match = [], True
  for vocab in VOCABS:
    for num_draft in NUM_DRAFTS:
      for name in args.interpret_samplings:
        sampling = SAMPLINGS[name]
        inputs = _inputs(args.interpret_batch, num_draft, vocab, jnp.float32, seed=vocab)
        start = time.perf_counter()
        got = fused_verify(**inputs, sampling=sampling, interpret=True)
        elapsed = time.perf_counter() - start
        want = _reference()(**inputs, sampling=sampling)
        match = bool(np.array_equal(got.tokens, want.tokens)
                     and np.array_equal(got.num_accepted, want.num_accepted))
        all_match &= match
        rows.append(dict(vocab=vocab, batch=args.interpret_batch, num_draft=num_draft,
                         sampling=name, match=match, interpret_wall_s=elapsed,
                         num_accepted=np.asarray(want.num_accepted).tolist()))
        print(rows[-1], flush=True)
  result = dict(mode="interpret correctness (CPU); wall times are the interpreter's, not speed",
                device=jax.devices()[0].device_kind, all_match=all_match, rows=rows)
  RESULTS.mkdir(exist_ok=True)
  (RESULTS / "verify_kernel_interpret.json").write_text(json.dumps(result, indent=1))
  return all_match


PASS_SETTINGS = {"greedy": dict(temperature=0.0), "top_k": dict(temperature=0.8, top_k=50),
                 "top_p": dict(temperature=0.8, top_p=0.9),
                 "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.9)}
PASS_KINDS = (None, "TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite")


def count_passes(vocab=128256, num_draft=4, itemsize=4) -> dict:
  """Passes over the vocabulary and HBM bytes per batch row per round, for the importable
  `specjax` (TPU kernel: per device kind's default blocks; GPU kernel: every pass streams)."""
  tpu = importlib.import_module("specjax.kernels.fused_verify")  # the checkout being counted
  logits_bytes = (2 * num_draft + 1) * vocab * itemsize  # target k+1 rows and draft k rows
  table = {}
  for name, setting in PASS_SETTINGS.items():
    sampling = S.Sampling(**setting)
    schedule = tpu.schedule_for(sampling, vocab)
    passes = schedule.num_passes
    steps = getattr(S, "RADIX_ROUNDS", None) or getattr(S, "BISECT_STEPS")
    gpu_passes = 1 if sampling.greedy else (
        1 + steps * bool(schedule.top_k) + (1 + steps) * bool(schedule.top_p)
        + bool(schedule.has_threshold) + 1)
    row = dict(tpu_passes=passes, gpu_passes=gpu_passes,
               gpu_mb_per_row=round(gpu_passes * logits_bytes / 1e6, 2))
    for kind in PASS_KINDS:
      try:
        blocks = tpu.BlockSizes.get_default(vocab, num_draft, jnp.float32, batch=8,
                                            device_kind=kind)
      except TypeError:  # a checkout without a per-generation budget
        blocks = tpu.BlockSizes.get_default(vocab, num_draft, jnp.float32, batch=8)
      tiles = -(-vocab // blocks.tile(vocab))
      streamed = logits_bytes * (1 if tiles == 1 else passes)
      row[f"tpu[{kind or 'export/default'}]"] = dict(
          block_v=blocks.tile(vocab), block_b=blocks.rows(8), tiles=tiles,
          mb_per_row=round(streamed / 1e6, 2))
    table[name] = row
  return dict(vocab=vocab, num_draft=num_draft, dtype="float32", logits_mb_per_row=round(
      logits_bytes / 1e6, 2), settings=table)


def run_passes(args):
  import subprocess  # noqa: PLC0415
  result = {"after": count_passes()}
  if args.base:
    # The other checkout's `specjax` and `kernels` directories as bare packages (no __init__
    # runs, so nothing of this checkout's editable install is mixed in).
    code = ("import json, sys, types\n"
            "for name, path in (('specjax', %r), ('specjax.kernels', %r)):\n"
            "  module = types.ModuleType(name); module.__path__ = [path]; sys.modules[name] = module\n"
            "sys.path.insert(0, %r)\n"
            "import verify_kernel\n"
            "print(json.dumps(verify_kernel.count_passes()))\n"
            % (f"{args.base}/specjax", f"{args.base}/kernels",
               str(pathlib.Path(__file__).resolve().parent)))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env={"JAX_PLATFORMS": "cpu"})
    result["before"] = json.loads(out.stdout.strip().splitlines()[-1])
  RESULTS.mkdir(exist_ok=True)
  (RESULTS / "verify_kernel_passes.json").write_text(json.dumps(result, indent=1))
  print(json.dumps(result, indent=1))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--interpret", action="store_true",
                      help="CPU: check kernel == reference in interpret mode; no timings")
  parser.add_argument("--interpret-batch", type=int, default=2)
  parser.add_argument("--interpret-samplings", nargs="+", default=["greedy", "temperature"],
                      choices=list(SAMPLINGS))
  parser.add_argument("--sampling", default="temperature", choices=list(SAMPLINGS))
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--passes", action="store_true",
                      help="count passes and HBM bytes per row (no device needed)")
  parser.add_argument("--base", default=None, help="with --passes: a checkout to compare with")
  args = parser.parse_args(argv)
  if args.passes:
    run_passes(args)
    return 0
  if args.interpret:
    return 0 if run_interpret(args) else 1
  if jax.devices()[0].platform == "cpu":
    print("Timings need a TPU (kernel) or GPU (reference and floors only); this is a CPU. "
          "Run with --interpret for the correctness pass.", file=sys.stderr)
    return 2
  run_timings(args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
