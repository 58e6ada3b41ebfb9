"""HBM traffic of the draft step with the draft model's KV cache in 8-bit floats, beside the
bfloat16 cache's, from the compiled programs (compile-only: an estimate from the TPU compiler's
program, not a measurement).

    python -m benchmarks.experiments.tpu_traffic_fp8 [--batches 1 8 64]

The draft step of `benchmarks.tpu_traffic` (Qwen2.5-Coder-0.5B at real depth, bfloat16 weights,
`LIVE` of `CAPACITY` slots live, the cache donated, one v5e chip) compiled twice per batch: its
cache in bfloat16 and in float8_e4m3fn (`Model.init_cache(dtype=...)`, what
`ModelDrafter(cache_dtype=...)` creates). Bytes are counted by `tpu_traffic.hbm_traffic` and
compared with `tpu_traffic.floor_bytes`: the weights plus the live cache read once, so the 8-bit
floor holds half the cache bytes. Writes `benchmarks/results/tpu_traffic_fp8.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import tpu_traffic as tt  # noqa: E402

JSON_PATH = tt.RESULTS / "tpu_traffic_fp8.json"
DTYPES = ("bfloat16", "float8_e4m3fn")


def measure(batch: int, dtype: str, *, chip: str = "v5e") -> dict:
  from specjax.testing import tpu  # pylint: disable=import-outside-toplevel
  topology = tt.CHIPS[chip][0]
  _, args, donate, model, cache, length, mesh = tt.build("draft_step", topology=topology,
                                                         batch=batch)
  model_arg, tokens, starts, _ = args
  narrow = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=x.sharding)
  cache = dataclasses.replace(cache, k=narrow(cache.k), v=narrow(cache.v))
  compiled = tt.compile_program(tt.target_step, model_arg, tokens, starts, cache, mesh=mesh,
                                donate=donate)
  traffic = tt.hbm_traffic(compiled.text(), live_slots=tt.LIVE)
  floor = tt.floor_bytes(model, cache, live=tt.LIVE, tokens_per_row=length)
  buffer = cache.k
  del tpu
  return {"chip": chip, "batch": batch, "cache_dtype": dtype, "hbm_bytes": traffic.hbm_bytes,
          **floor, "ratio": traffic.hbm_bytes / floor["floor"],
          "cache_buffer_bytes": traffic.whole_buffer_bytes(
              math.prod(buffer.sharding.shard_shape(buffer.shape))),
          "top": [{"hbm_bytes": b, "op": op, "shape": shape[:160]}
                  for b, op, shape, _ in traffic.rows[:6]]}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
  args = parser.parse_args(argv)
  records = []
  for batch in args.batches:
    for dtype in DTYPES:
      record = measure(batch, dtype)
      records.append(record)
      print(f"v5e B={batch} draft step, cache {dtype}: {record['hbm_bytes'] / 1e9:.3f} GB, floor "
            f"{record['floor'] / 1e9:.3f} GB (live cache {record['kv_live'] / 1e9:.3f}), ratio "
            f"{record['ratio']:.3f}, whole-cache-buffer ops "
            f"{record['cache_buffer_bytes'] / 1e9:.3f} GB", flush=True)
      JSON_PATH.write_text(json.dumps({"label": "compile-only estimate (TPU compiler's program)",
                                       "live": tt.LIVE, "capacity": tt.CAPACITY,
                                       "jax": jax.__version__, "records": records}, indent=1))


if __name__ == "__main__":
  main()
