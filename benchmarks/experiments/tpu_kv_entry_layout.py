"""Where the KV cache's whole-buffer copies come from in specjax's own draft step on TPU: the layout
of the cache at the program's boundary, or the layer `scan`. A compile-only experiment (docs/tpu.md,
"Where the unstacked layout's copies come from").

    python -m benchmarks.experiments.tpu_kv_entry_layout LAYERS {default|write|auto} [--stacked]
    python -m benchmarks.experiments.tpu_kv_entry_layout LAYERS loop [STEPS]

Compiles (never runs) `benchmarks.tpu_traffic`'s draft step of Qwen2.5-Coder-0.5B (`LAYERS`
layers, bfloat16, batch 64, a 2,048-slot cache) for one v5e chip, the cache donated, in the
unstacked layout (per-layer `[B, KVH, S, D]` buffers; `--stacked`: one `[L, B, KVH, S, D]` pair
through the layer `scan`), with the cache's layout at the program's boundary left to XLA
(`default`), given in and out in the block write's layout (`write`: head_dim minor,
`major_to_minor=(0, 2, 1, 3)`, or `(0, 1, 3, 2, 4)` stacked), or chosen by XLA for both
(`auto`); `loop`: `STEPS` target steps in a `fori_loop` (the cache carried, as `decode` carries it),
bytes divided by the steps. Prints the HBM bytes (`tpu_traffic.hbm_traffic`), the floor (weights +
live cache read once) and every instruction that moves a whole cache buffer. An estimate from the
compiler's programs, not a measurement.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import tpu_traffic as tt
from specjax.parallel.mesh import use_mesh

WRITE_LAYOUTS = {4: (0, 2, 1, 3), 5: (0, 1, 3, 2, 4)}  # head_dim minor, then slots


def compile_step(layers: int, mode: str, stacked: bool, steps: int):
  """`(compiled text, steps, model, cache, new tokens per row)`."""
  fn, args, donate, model, cache, length, mesh = tt.build(
      "draft_step", topology="v5e-1", batch=64, num_layers=layers, unstacked=not stacked)
  if mode == "loop":
    def loop(model, tokens, starts, cache):
      def body(i, carry):
        tok, cache = carry
        logits, cache = tt.target_step(model, tok, starts + i, cache)
        return jnp.argmax(logits, -1).astype(tok.dtype), cache
      return jax.lax.fori_loop(0, steps, body, (tokens, cache))
    return tt.compile_program(loop, *args, mesh=mesh, donate=donate).text(), steps, model, \
        cache, length
  rank = 5 if stacked else 4

  def layout(x):
    if len(x.shape) != rank or mode == "default":
      return x.sharding
    return Format(Layout.AUTO if mode == "auto" else Layout(major_to_minor=WRITE_LAYOUTS[rank]),
                  x.sharding)
  cache_in = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=layout(x)),
                          cache)
  out = (NamedSharding(mesh, P()), jax.tree.map(layout, cache))
  with use_mesh(mesh):
    compiled = jax.jit(fn, donate_argnums=donate, out_shardings=out).lower(
        args[0], args[1], args[2], cache_in).compile()
  return compiled.as_text(), 1, model, cache, length


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("layers", type=int)
  parser.add_argument("mode", choices=("default", "write", "auto", "loop"))
  parser.add_argument("steps", type=int, nargs="?", default=4)
  parser.add_argument("--stacked", action="store_true")
  args = parser.parse_args(argv)
  text, steps, model, cache, length = compile_step(args.layers, args.mode, args.stacked,
                                                   args.steps)
  traffic = tt.hbm_traffic(text)
  floor = tt.floor_bytes(model, cache, live=tt.LIVE, tokens_per_row=length)["floor"]
  buffer = jax.tree.leaves(cache.k)[0]
  elements = math.prod(buffer.sharding.shard_shape(buffer.shape))
  print(f"{'stacked' if args.stacked else 'unstacked'} {args.mode}, {args.layers} layers: "
        f"{traffic.hbm_bytes / steps / 1e9:.3f} GB per step, floor {floor / 1e9:.3f} GB, ratio "
        f"{traffic.hbm_bytes / steps / floor:.2f}, whole-buffer "
        f"{traffic.whole_buffer_bytes(elements) / steps / 1e9:.3f} GB per step")
  for moved, op, shape, name in traffic.rows:
    if any(math.prod(a.dims) == elements for a in tt._leaves(shape)):
      print(f"  {moved / steps / 1e6:8.1f} MB {op:22s} {shape[:90]} | {name[:100]}")


if __name__ == "__main__":
  main()
