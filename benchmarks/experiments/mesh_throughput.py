"""Decode throughput against mesh shape on 8 simulated CPU devices (ratio to one device).

    python -m benchmarks.experiments.mesh_throughput [--out benchmarks/results] [--repeats 3]
        [--meshes 1x8,8x1,2x4,4x2] [--kinds auto,explicit] [--name mesh_throughput]

Runs greedy `sj.decode` (target + 1-layer draft) with the same weights and prompts on one device
(no mesh) and on `(data, model)` meshes, checks every mesh returns the single-device tokens, and
writes `<name>.json` and `<name>.png`. Mesh kinds: `auto` is `sj.make_mesh` (Auto axes) inside
`use_mesh`; `explicit` is `jax.make_mesh` (Explicit axes, JAX 0.10's default) inside
`jax.set_mesh`. The script only uses names that exist before and after the core rebuild
(`sj.make_mesh`, `sj.shard`, `specjax.sharding.use_mesh` / `specjax.parallel.use_mesh`), so the
same file measures an older checkout too.

What this can and cannot show: the 8 "devices" are XLA CPU devices that share this host's cores
and memory, so splitting a model over them adds collectives without adding compute or memory
bandwidth. The ratio measures the overhead of the sharded program (collectives, smaller
matmuls), not a speedup; real gains need real chips (a TPU slice, several GPUs). A single GPU
cannot test multi-device sharding either: it is one device.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import specjax as sj  # noqa: E402
from specjax.testing.models import tiny_config  # noqa: E402

try:  # the layout after the core rebuild
  from specjax import parallel as sharding  # noqa: E402
except ImportError:  # an older checkout
  from specjax import sharding  # noqa: E402


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out",
                      default=str(pathlib.Path(__file__).resolve().parents[1] / "results"))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--meshes", default="1x8,8x1,2x4,4x2")
  parser.add_argument("--kinds", default="auto")
  parser.add_argument("--name", default="mesh_throughput")
  args = parser.parse_args(argv)
  meshes = [None] + [(kind, tuple(int(n) for n in shape.split("x")))
                     for kind in args.kinds.split(",") for shape in args.meshes.split(",")]

  dims = dict(vocab_size=1024, embed_dim=256, num_heads=8, num_kv_heads=8, head_dim=32,
              mlp_dim=1024, max_len=512)
  target = sj.init_params(tiny_config(num_layers=4, **dims), jax.random.key(0))
  draft = sj.init_params(tiny_config(num_layers=1, **dims), jax.random.key(1))
  tokens = np.asarray(jax.random.randint(jax.random.key(2), (args.batch, 16), 1, 1024), np.int32)
  call = dict(max_new_tokens=args.new_tokens, num_draft=4)

  records, reference = [], None
  for entry in meshes:
    shape = None if entry is None else entry[1]
    if entry is None:
      label, t, d, kind = "1 device", target, draft, None
    else:
      kind = entry[0]
      if kind == "auto":
        mesh = sj.make_mesh(shape)
        context = lambda: sharding.use_mesh(mesh)  # noqa: E731
      else:
        mesh = jax.make_mesh(shape, ("data", "model"))  # Explicit axes by default
        context = lambda: jax.set_mesh(mesh)  # noqa: E731
      label = f"{shape[0]}x{shape[1]}" + ("" if kind == "auto" else f" {kind}")
      t, d = sj.shard(target, mesh), sj.shard(draft, mesh)

    def run():
      if kind is None:
        out = sj.decode(t, d, tokens, jax.random.key(3), **call)
      else:
        with context():
          out = sj.decode(t, d, tokens, jax.random.key(3), **call)
      jax.block_until_ready(out.tokens)
      return out

    start = time.perf_counter()
    try:
      out = run()  # compile
    except Exception as error:  # noqa: BLE001 (an older checkout fails on Explicit meshes)
      records.append({"mesh": label, "kind": kind, "data": shape[0], "model": shape[1],
                      "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"})
      print(f"{label:>9}: FAILED {records[-1]['error']}")
      continue
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      run()
      times.append(time.perf_counter() - start)
    tokens_out = np.asarray(out.tokens)
    if reference is None:
      reference = tokens_out
    seconds = statistics.median(times)
    records.append({
        "mesh": label, "kind": kind, "data": shape[0] if shape else 1, "model": shape[1] if shape else 1,
        "seconds": seconds, "tokens_per_second": int(np.sum(out.num_tokens)) / seconds,
        "compile_seconds": compile_s, "same_tokens_as_one_device": bool(
            np.array_equal(tokens_out, reference)),
        "param_bytes_per_device": sharding.per_device_bytes(t.params),
    })
    print(f"{label:>9}: {records[-1]['tokens_per_second']:8.1f} tok/s "
          f"(compile {compile_s:.1f}s), same tokens: {records[-1]['same_tokens_as_one_device']}")

  base = records[0]["tokens_per_second"]
  for record in records:
    if "error" not in record:
      record["ratio_to_one_device"] = record["tokens_per_second"] / base
  result = {
      "benchmark": "mesh_throughput",
      "backend": jax.default_backend(),
      "devices": jax.device_count(),
      "host_cpus": os.cpu_count(),
      "machine": platform.machine(),
      "note": ("8 simulated CPU devices share the host's cores: the ratio is the sharded "
               "program's overhead, not a multi-chip speedup"),
      "config": {"target_layers": 4, "draft_layers": 1, **dims, "batch": args.batch, **call,
                 "repeats": args.repeats, "sampling": "greedy",
                 "specjax": sj.__file__},
      "records": records,
  }
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2))
  _plot([r for r in records if "error" not in r], out_dir / f"{args.name}.png")
  return result


def _plot(records, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.5))
  labels = [r["mesh"] for r in records]
  ratios = [r["ratio_to_one_device"] for r in records]
  ax.bar(labels, ratios, color=["#888"] + ["#3b75af"] * (len(records) - 1))
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_ylabel("decode tokens/s ÷ 1 device")
  ax.set_xlabel("mesh (data x model)")
  ax.set_title("specjax decode on 8 simulated CPU devices (shared cores)")
  for x, r in enumerate(ratios):
    ax.text(x, r, f"{r:.2f}", ha="center", va="bottom")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main()
