"""Cache write and verify-forward cost of two checkouts (`--before`, `--after`) on CPU, either
cache layout (`[L, B, KVH, S, D]` or the older `[L, B, S, KVH, D]`, detected per checkout).

    python -m benchmarks.experiments.cache_write --before /path/to/old/checkout \\
        --after /path/to/new/checkout

Each tree runs in its own worker process (8 simulated CPU devices), alternately, `--repeats`
times; the JSON keeps every worker's median and the best of them. Measured per tree:
  * one donated `write_stacked_block` of a T=5 block at B=32 (L=4, S=512, KVH=8, D=64: a 134 MB
    cache), on one device and under an 8x1 (data) mesh;
  * one jitted verify forward (T=5, B=1 and B=4, S=512) of a SmolLM2-135M-shaped model with random
    weights, plus the number of transpose/copy instructions over a cache-slab shape in its HLO.
Writes `benchmarks/results/cache_write.json` and `.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
L, B, S, KVH, D, T = 4, 32, 512, 8, 64, 5


def _median_ms(fn, *args, number=20):
  import jax
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(number):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  times.sort()
  return 1e3 * times[len(times) // 2]


def _worker():
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  import specjax as sj
  from specjax.core.cache import KVCache, write_stacked_block

  new_layout = KVCache.create(1, 1, 4, 2, 8).k.shape == (1, 1, 2, 4, 8)
  shape = (L, B, KVH, S, D) if new_layout else (L, B, S, KVH, D)
  result = {"layout": "[L, B, KVH, S, D]" if new_layout else "[L, B, S, KVH, D]"}
  block = jnp.ones((L, B, T, KVH, D), jnp.float32)
  starts = jnp.arange(B, dtype=jnp.int32) * 7
  write = jax.jit(write_stacked_block, donate_argnums=0)

  # The donated buffer is consumed by each call, so time calls that feed the output back.
  def loop(buffer, mesh=None):
    ctx = jax.set_mesh(mesh) if mesh is not None else _null()
    with ctx:
      buffer = write(buffer, block_, starts_)
      jax.block_until_ready(buffer)
      times = []
      for _ in range(30):
        t0 = time.perf_counter()
        buffer = write(buffer, block_, starts_)
        jax.block_until_ready(buffer)
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]

  block_, starts_ = block, starts
  result["write_ms_one_device"] = loop(jnp.zeros(shape, jnp.float32))
  mesh = sj.make_mesh((8, 1))
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  block_, starts_ = put(block, P(None, "data")), put(starts, P("data"))
  result["write_ms_mesh_8x1"] = loop(put(jnp.zeros(shape, jnp.float32), P(None, "data")), mesh)

  config = sj.ModelConfig(vocab_size=49152, embed_dim=576, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64, mlp_dim=1536, max_len=2048,
                          tie_embeddings=True)
  model = sj.init_params(config, jax.random.key(0))
  fwd = jax.jit(lambda m, tok, st, c: m(tok, st, c), donate_argnums=3)
  for batch in (1, 4):
    cache = model.init_cache(batch, S)
    tokens = jnp.ones((batch, T), jnp.int32)
    starts_b = jnp.full((batch,), 200, jnp.int32)
    hlo = fwd.lower(model, tokens, starts_b, cache).compile().as_text()
    shapes = {f"f32[{','.join(map(str, s))}]" for s in
              [(batch, config.num_kv_heads, S, config.head_dim),
               (batch, S, config.num_kv_heads, config.head_dim),
               (batch, config.num_kv_heads, config.head_dim, S)]}
    moves = [line for line in hlo.splitlines()
             if re.search(r"= f32\[[^\]]*\]\S* (fusion|transpose|copy)\(", line)
             and any(f"= {s}" in line for s in shapes)
             and ("transpose" in line or "copy" in line)]
    times = []
    for _ in range(10):
      t0 = time.perf_counter()
      out = fwd(model, tokens, starts_b, cache)
      jax.block_until_ready(out.logits)
      cache = out.cache.with_lengths(starts_b)
      times.append(time.perf_counter() - t0)
    times.sort()
    result[f"verify_forward_ms_b{batch}"] = 1e3 * times[len(times) // 2]
    result[f"verify_forward_slab_moves_b{batch}"] = len(moves)
    result[f"verify_forward_slab_move_examples_b{batch}"] = [m.strip()[:140] for m in moves[:2]]
  print("RESULT " + json.dumps(result))


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def _run(tree: str) -> dict:
  env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True,
                       text=True, cwd=tree, check=True).stdout
  return json.loads(out.split("RESULT ", 1)[1])


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--worker", action="store_true")
  parser.add_argument("--before", default="/work/base")
  parser.add_argument("--after", default=str(pathlib.Path(__file__).resolve().parents[2]))
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  if args.worker:
    return _worker()
  runs = {"before": [], "after": []}
  for _ in range(args.repeats):
    for label in runs:
      runs[label].append(_run(getattr(args, label)))
      print(label, runs[label][-1], flush=True)
  best = {label: {key: (min(r[key] for r in rs) if key.endswith("_ms") or "_ms_" in key
                        else rs[0][key]) for key in rs[0]} for label, rs in runs.items()}
  record = {"setup": dict(L=L, B=B, S=S, KVH=KVH, D=D, T=T, devices="8 simulated CPU devices",
                          cpu_count=os.cpu_count(), note="median per worker; best over workers"),
            "best": best, "runs": runs}
  RESULTS.mkdir(exist_ok=True)
  (RESULTS / "cache_write.json").write_text(json.dumps(record, indent=1))
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  keys = ["write_ms_one_device", "write_ms_mesh_8x1", "verify_forward_ms_b1",
          "verify_forward_ms_b4"]
  fig, ax = plt.subplots(figsize=(7, 3.5))
  for i, label in enumerate(runs):
    ax.bar([k + 0.4 * i for k in range(len(keys))], [best[label][k] for k in keys], 0.4,
           label=f"{label} {best[label]['layout']}")
  ax.set_xticks([k + 0.2 for k in range(len(keys))], [k.replace("_ms", "") for k in keys],
                fontsize=7)
  ax.set_yscale("log")
  ax.set_ylabel("ms (log)")
  ax.set_title(f"Cache write (B={B}, {L}x{S}x{KVH}x{D}) and SmolLM2-shaped verify forward")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(RESULTS / "cache_write.png", dpi=120)


if __name__ == "__main__":
  main()
