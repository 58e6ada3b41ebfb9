"""Speculation on a GPU, for the shapes specjax ships: self-drafting and the Qwen pair, batch 1-64.

    python -m benchmarks.experiments.gpu_speculation --out DIR [--quick]
        [--parts exact,costs,curve,qwen]

Run on a lent GPU (JAX with CUDA). No weights can travel to that machine, so every model here has
**random weights** in the real architecture's shapes (SmolLM2-135M; Qwen2.5-Coder-1.5B and its
0.5B draft): the times are the real models' times (a forward's cost does not depend on the
values), while tau (tokens per target pass) is that of random weights. Acceptance is
hardware-independent and is measured with the real weights on CPU (`benchmarks/self_draft.py`);
this script also reports the speedup those CPU-measured tau values would give under the costs
measured here (`projected`), labelled as such.

Parts, each written to `DIR/gpu_speculation.json` as soon as it is done (a timeout keeps what
finished):

  * `exact`: greedy identity of `decode` (int8 self-draft, k = 4, ragged batch of 4) with
    `generate` in float32 at `precision="highest"`, and the fraction of identical rows in bfloat16
    at the default precision; a T = 0.7 top-p run that must finish.
  * `costs`: per batch B in 1, 8, 32, 64 (bfloat16 target, int8 copy): one target forward of
    `r` rows (r = 1 is a decode step, r = k + 1 a verify block) against a 128-token cache, and one
    draft step; ratio verify / step.
  * `curve`: `decode` (int8 self-draft, k = 4) against `generate` at B = 1, 8, 32, 64 on ragged
    random prompts (16..64 tokens), 128 new tokens, alternating, best of 3: tokens/s and ratio.
  * `qwen`: the 1.5B target (bfloat16) with the 0.5B draft in int8, batch 1, k = 5: costs,
    decode vs generate.
  * `adaptive`: at the smallest and largest batch, `sj.adaptive_drafter` with a calibration
    measured there (`specjax.tuning.calibrate`), against `generate`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

SMOLLM2 = dict(vocab_size=49152, embed_dim=576, num_layers=30, num_heads=9, num_kv_heads=3,
               head_dim=64, mlp_dim=1536, tie_embeddings=True, rope_theta=100_000.0,
               norm_eps=1e-5, family="llama")
QWEN_15B = dict(vocab_size=151936, embed_dim=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                head_dim=128, mlp_dim=8960, tie_embeddings=False, qkv_bias=True,
                rope_theta=1_000_000.0, family="qwen2")
QWEN_05B = dict(vocab_size=151936, embed_dim=896, num_layers=24, num_heads=14, num_kv_heads=2,
                head_dim=64, mlp_dim=4864, tie_embeddings=True, qkv_bias=True,
                rope_theta=1_000_000.0, family="qwen2")
TINY = dict(vocab_size=512, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            mlp_dim=128, tie_embeddings=True)
# tau measured with the real weights on CPU (benchmarks/results/self_draft_*.json, greedy).
CPU_TAU = {"smollm2 int8 k=4": 4.62, "qwen 0.5b-int8 k=5": 5.21}


def model(shape: dict, dtype, seed: int):
  import specjax as sj
  from specjax.models.config import ModelConfig
  from specjax.models.transformer import init_params
  config = ModelConfig(max_len=1024, **shape)
  return init_params(config, jax.random.key(seed), dtype).for_platform()


def best_of(fn, reps: int) -> float:
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def forward_ms(m, batch: int, rows: int, reps: int = 20, context: int = 128) -> float:
  cache = m.init_cache(batch, context + 16).with_lengths(jnp.full((batch,), context, jnp.int32))
  tokens = jnp.ones((batch, rows), jnp.int32)
  starts = jnp.full((batch,), context, jnp.int32)
  step = jax.jit(lambda m, t, s, c: m(t, s, c).logits)
  jax.block_until_ready(step(m, tokens, starts, cache))
  return best_of(lambda: step(m, tokens, starts, cache), reps) * 1e3


def prompts(batch: int, vocab: int, seed: int, low: int = 16, high: int = 64):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(low, high + 1, size=batch).astype(np.int32)
  ids = rng.integers(3, vocab, size=(batch, high)).astype(np.int32)
  return ids, lengths


def race(target, drafter, ids, lengths, new: int, k: int | None, reps: int, **extra):
  """`decode` (k drafts per round; None: the drafter's own, an adaptive drafter's K) against
  `generate`, alternating."""
  import specjax as sj
  key = jax.random.key(0)
  common = dict(lengths=lengths, max_new_tokens=new)
  spec = lambda: sj.decode(target, drafter, ids, key, num_draft=k, **common, **extra)
  plain = lambda: sj.generate(target, ids, key, **common)
  out, ref = spec(), plain()
  jax.block_until_ready((out.tokens, ref.tokens))
  decode_s = generate_s = float("inf")
  for _ in range(reps):  # alternate, so that any drift hits both
    decode_s = min(decode_s, best_of(lambda: spec().tokens, 1))
    generate_s = min(generate_s, best_of(lambda: plain().tokens, 1))
  stats = out.stats.summary()
  tokens = int(np.sum(np.asarray(out.num_tokens)))
  same_rows = np.all(np.asarray(out.tokens) == np.asarray(ref.tokens), axis=1)
  return {"k": k, "batch": int(ids.shape[0]), "tau": stats["tokens_per_round"],
          "acceptance": stats["acceptance_rate"], "rounds": stats["rounds"],
          "decode_ms": decode_s * 1e3, "generate_ms": generate_s * 1e3,
          "decode_tok_s": tokens / decode_s, "generate_tok_s": tokens / generate_s,
          "speedup": generate_s / decode_s, "identical_rows": float(np.mean(same_rows))}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_speculation"))
  parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU dry run)")
  parser.add_argument("--parts", default="exact,costs,curve,qwen,adaptive")
  parser.add_argument("--batches", default="1,8,32,64")
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--reps", type=int, default=3)
  args = parser.parse_args()
  import specjax as sj

  parts = args.parts.split(",")
  batches = [int(b) for b in args.batches.split(",")]
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / "gpu_speculation.json"
  small = TINY if args.quick else SMOLLM2
  dev = jax.devices()[0]
  record = {"device": dev.device_kind, "backend": jax.default_backend(),
            "jax": jax.__version__, "weights": "random (real architecture shapes)",
            "new_tokens": args.new, "cpu_tau": CPU_TAU, "parts": {}}
  t0 = time.perf_counter()

  def save(name, value):
    record["parts"][name] = value
    record["elapsed_s"] = time.perf_counter() - t0
    path.write_text(json.dumps(record, indent=1))
    print(f"[{record['elapsed_s']:.0f} s] {name}: {json.dumps(value)[:1500]}", flush=True)

  if "exact" in parts:
    ids, lengths = prompts(4, small["vocab_size"], seed=1)
    with jax.default_matmul_precision("highest"):
      target = model(small, jnp.float32, 0)
      r32 = race(target, sj.self_drafter(target, 8), ids, lengths, 64, 4, 1)
    target16 = model(small, jnp.bfloat16, 0)
    r16 = race(target16, sj.self_drafter(target16, 8), ids, lengths, 64, 4, 1)
    hot = sj.decode(target16, sj.self_drafter(target16, 8), ids, jax.random.key(3),
                    lengths=lengths, max_new_tokens=64, num_draft=4,
                    sampling=sj.Sampling(temperature=0.7, top_p=0.9))
    save("exact", {"float32_highest": r32, "bfloat16_default": r16,
                   "t07_top_p09_tau": hot.stats.summary()["tokens_per_round"],
                   "t07_finite": bool(np.all(np.asarray(hot.num_tokens) == 64))})
    del target

  if "exact_batch" in parts:
    # Whether rows that differ from `generate` in bfloat16 at larger batches differ in float32
    # at the highest precision too (an algorithmic error) or only in bfloat16 (numerics).
    batch_check = {}
    for b in (8, 32):
      ids, lengths = prompts(b, small["vocab_size"], seed=b)
      with jax.default_matmul_precision("highest"):
        target = model(small, jnp.float32, 0)
        batch_check[f"float32_highest_b{b}"] = race(target, sj.self_drafter(target, 8), ids,
                                                    lengths, 64, 4, 1)
      target = model(small, jnp.bfloat16, 0)
      batch_check[f"bfloat16_b{b}"] = race(target, sj.self_drafter(target, 8), ids, lengths,
                                           64, 4, 1)
      save("exact_batch", batch_check)

  if "costs" in parts or "curve" in parts:
    target = model(small, jnp.bfloat16, 0)
    drafter = sj.self_drafter(target, 8)
  if "costs" in parts:
    costs = {}
    for b in batches:
      step = forward_ms(target, b, 1)
      row = {"target_step_ms": step, "draft_step_ms": forward_ms(drafter.model, b, 1),
             "verify_ms": {r: forward_ms(target, b, r) for r in (2, 3, 5, 6, 8)}}
      row["verify_over_step"] = {r: v / step for r, v in row["verify_ms"].items()}
      row["draft_over_step"] = row["draft_step_ms"] / step
      costs[b] = row
      save("costs", costs)
  if "curve" in parts:
    curve = {}
    for b in batches:
      ids, lengths = prompts(b, small["vocab_size"], seed=b)
      curve[b] = race(target, drafter, ids, lengths, args.new, 4, args.reps)
      save("curve", curve)

  if "qwen" in parts:
    big = model(TINY if args.quick else QWEN_15B, jnp.bfloat16, 0)
    from specjax.models.quant import quantize
    draft = sj.ModelDrafter(quantize(model(TINY if args.quick else QWEN_05B, jnp.bfloat16, 1), 8))
    q = {"target_step_ms": forward_ms(big, 1, 1), "draft_step_ms": forward_ms(draft.model, 1, 1),
         "verify_6_ms": forward_ms(big, 1, 6)}
    ids, lengths = prompts(1, big.config.vocab_size, seed=7)
    q["race"] = race(big, draft, ids, lengths, args.new, 5, args.reps)
    c, v = q["draft_step_ms"] / q["target_step_ms"], q["verify_6_ms"] / q["target_step_ms"]
    q["projected_speedup_cpu_tau"] = CPU_TAU["qwen 0.5b-int8 k=5"] / (5 * c + v)
    q["random_draft_note"] = ("the 0.5B and 1.5B have independent random weights here: tau ~1 "
                              "is expected; the projection uses the real pair's CPU tau")
    save("qwen", q)

  if "adaptive" in parts:
    from specjax.tuning.calibrate import measure_acceptance, measure_costs
    from specjax.drafters.adaptive.costs import Calibration
    target = model(small, jnp.bfloat16, 0)
    drafter = sj.self_drafter(target, 8)
    from specjax.drafters.adaptive.costs import adaptive_plan
    adaptive = {}
    for b in batches:
      ids, lengths = prompts(b, small["vocab_size"], seed=b)
      table = measure_costs(target, drafter, batch=b, max_width=6, repeats=3)
      profile = measure_acceptance(target, drafter, ids, lengths, num_draft=5,
                                   sampling=sj.Sampling(), max_new_tokens=64)
      plan = adaptive_plan(table, profile, max_draft=drafter.max_draft)
      wrapped = sj.adaptive_drafter(drafter, calibration=Calibration(table, profile))
      adaptive[b] = race(target, wrapped, ids, lengths, args.new, None, args.reps)
      adaptive[b]["plan"] = {"max_draft": plan.max_draft, "plain": plan.plain,
                             "round_ms": list(plan.round_ms), "prior": list(plan.prior),
                             "generate_step_ms": table.generate_step_ms,
                             "profile_alpha": list(profile.alpha)}
      save("adaptive", adaptive)

  if "costs" in parts:
    for b, row in record["parts"]["costs"].items():
      c, v = row["draft_over_step"], row["verify_over_step"][5]
      row["projected_speedup_cpu_tau_k4"] = CPU_TAU["smollm2 int8 k=4"] / (4 * c + v)
    save("costs", record["parts"]["costs"])
  plot(record, out_dir / "gpu_speculation.png")
  print("done", flush=True)


def plot(record: dict, path: pathlib.Path):
  """Left: verify block / step and draft step / step per batch; right: decode / generate."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  parts = record["parts"]
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  for b, row in parts.get("costs", {}).items():
    rows = sorted(int(r) for r in row["verify_over_step"])
    left.plot(rows, [row["verify_over_step"][str(r) if str(r) in row["verify_over_step"] else r]
                     for r in rows], "o-", label=f"B={b}: verify / step")
    left.axhline(row["draft_over_step"], ls="--", lw=0.8, color=left.lines[-1].get_color())
  left.set_xlabel("rows in the target forward (k + 1)")
  left.set_ylabel("target steps (dashed: int8 draft step)")
  left.set_title(f"{record['device']}: SmolLM2-135M shapes, bf16")
  left.legend(fontsize=8)
  curve = parts.get("curve", {})
  batches = list(curve)
  right.plot(batches, [curve[b]["speedup"] for b in batches], "o-", label="k = 4, int8 self-draft")
  adaptive = parts.get("adaptive", {})
  if adaptive:
    right.plot(list(adaptive), [adaptive[b]["speedup"] for b in adaptive], "s--",
               label="adaptive")
  right.axhline(1.0, color="k", lw=0.8)
  right.set_xlabel("batch")
  right.set_ylabel("decode tokens/s over generate's")
  right.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def replot(json_path: str):
  path = pathlib.Path(json_path)
  plot(json.loads(path.read_text()), path.with_suffix(".png"))


if __name__ == "__main__":
  main()
