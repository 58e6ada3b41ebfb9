"""What the batch-64 decode of the Qwen2.5-Coder pair needs in HBM on one v5e chip when the KV
cache's per-layer buffers get a layout chosen by specjax instead of by XLA. A compile-only
experiment (docs/tpu.md, "The batch-64 decode's memory: layout trials").

    python -m benchmarks.experiments.tpu_decode_memory_layout {stacked|unstacked} [PIN]

Compiles (never runs) `sj.decode` of Qwen2.5-Coder-1.5B drafted by Qwen2.5-Coder-0.5B (real depth,
bfloat16, k = 4, T = 0.7 with top-k 50 and top-p 0.9, batch 64, 3,584 prompt + 512 new tokens:
`benchmarks.tpu_memory`'s case) for one v5e chip, in the stacked layout (what `for_platform()`
picks on TPU) or the unstacked one (`Model.unstacked()`: per-layer `[B, KVH, S, D]` buffers).
`PIN` (unstacked only) pins every per-layer buffer, where it is created, written by the prefill
and written by a step, to one physical layout on TPU (`with_layout_constraint`), by patching
this process's copies of the three functions that make those buffers; the library is unchanged:

  * `none`: XLA chooses (the default);
  * `auto`: head_dim 128 and more as `[B, S, KVH, D]` (the block write's window minor), narrower
    heads as `[B, KVH, D, S]` (slots minor: a 64-wide head minor would be padded to 128 lanes);
  * `bshd`: every buffer as `[B, S, KVH, D]`.

Prints the compiler's verdict and `memory_analysis()` in GiB. An estimate from the compiler, not a
measurement.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.layout import Layout, with_layout_constraint  # noqa: E402

GIB = 1 << 30


def pin(buffer, mode: str):
  """`buffer` (`[B, KVH, S, D]`) pinned on TPU to `mode`'s layout; unchanged elsewhere."""
  if mode == "none":
    return buffer
  order = (0, 2, 1, 3) if mode == "bshd" or buffer.shape[-1] >= 128 else (0, 1, 3, 2)
  pinned = lambda x: with_layout_constraint(x, Layout(order))
  return jax.lax.platform_dependent(buffer, tpu=pinned, default=lambda x: x)


def patch(mode: str) -> None:
  """Routes this process's per-layer cache creation and writes through `pin`."""
  from specjax.core import cache as cache_mod  # pylint: disable=import-outside-toplevel
  from specjax.models import prefill as prefill_mod  # pylint: disable=import-outside-toplevel
  from specjax.models.cpu import layout as cpu_layout  # pylint: disable=import-outside-toplevel

  write_block = cache_mod.write_block
  cpu_layout.write_block = lambda buffer, block, starts: pin(write_block(buffer, block, starts),
                                                             mode)
  create = cache_mod.KVCache.create.__func__

  def pinned_create(cls, *args, **kwargs):
    cache = create(cls, *args, **kwargs)
    if not cache.per_layer:
      return cache
    return dataclasses.replace(cache, k=tuple(pin(x, mode) for x in cache.k),
                               v=tuple(pin(x, mode) for x in cache.v))
  cache_mod.KVCache.create = classmethod(pinned_create)
  write_at = prefill_mod._write_at  # pylint: disable=protected-access

  def pinned_write_at(cache, block, start):
    out = write_at(cache, block, start)
    if not out.per_layer:
      return out
    return dataclasses.replace(out, k=tuple(pin(x, mode) for x in out.k),
                               v=tuple(pin(x, mode) for x in out.v))
  prefill_mod._write_at = pinned_write_at  # pylint: disable=protected-access


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  layout = argv[0]
  mode = argv[1] if len(argv) > 1 else "none"
  if layout == "stacked" and mode != "none":
    raise SystemExit("PIN applies to the unstacked layout")
  patch(mode)
  import specjax as sj  # pylint: disable=import-outside-toplevel
  from specjax.parallel.mesh import param_shardings  # pylint: disable=import-outside-toplevel
  from specjax.testing import tpu  # pylint: disable=import-outside-toplevel

  mesh = tpu.topology_mesh("v5e-1")

  def model(name):
    m = tpu.abstract_model(tpu.REAL_CONFIGS[name], mesh, jnp.bfloat16)
    if layout == "unstacked":
      shapes = jax.eval_shape(lambda m: m.unstacked(), m)
      m = dataclasses.replace(shapes, params=tpu.abstract_like(
          shapes.params, param_shardings(shapes, mesh)))
    return m

  target, draft = model("qwen2.5-coder-1.5b"), model("qwen2.5-coder-0.5b")
  tokens, rng = tpu.abstract_tokens(mesh, 64, 3_584)
  sampling = sj.Sampling(temperature=0.7, top_k=50, top_p=0.9)

  def run(target, draft, tokens, rng):
    return sj.decode(target, draft, tokens, rng, max_new_tokens=512, num_draft=4,
                     sampling=sampling)

  start = time.perf_counter()
  try:
    compiled = tpu.compile_call(run, target, draft, tokens, rng, mesh=mesh)
  except tpu.TpuCompileError as error:
    print(f"{layout} pin={mode}: rejected after {time.perf_counter() - start:.0f} s: "
          f"{str(error).splitlines()[0][:300]}")
    return
  m = compiled.memory
  print(f"{layout} pin={mode}: compiled in {time.perf_counter() - start:.0f} s; arguments "
        f"{m.argument_size_in_bytes / GIB:.2f} GiB, temporaries {m.temp_size_in_bytes / GIB:.2f} "
        f"GiB, total {compiled.total_bytes / GIB:.2f} GiB (v5e: 16 GiB)")


if __name__ == "__main__":
  main()
