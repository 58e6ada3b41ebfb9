"""Where the CPU step loses to the read-bandwidth floor: the 30 layers' step products alone.

SmolLM2-135M's four per-layer products at one row (`[1, 576]` through fused q/k/v 960, out 576,
gate/up 3,072 and down 1,536 -> 576, each an `[out, in]` row-major matrix as in the CPU layout),
chained as in a decode step, jitted; the same products split into two output halves (two
independent products per projection); and a numpy loop over the same matrices. Each XLA:CPU
flag set runs in its own process (flags are read at backend start).

    python -m benchmarks.experiments.cpu_matvec        # -> benchmarks/results/cpu_matvec.json
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
FLAG_SETS = ("", "--xla_cpu_use_xnnpack=true", "--xla_cpu_use_onednn=true",
             "--xla_cpu_multi_thread_eigen=false",
             "--xla_cpu_enable_concurrency_optimized_scheduler=true")
E, Q, F, LAYERS = 576, 960, 1536, 30


def measure(reps: int = 30) -> dict:
  """This process's numbers (its XLA_FLAGS)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from cpu_forward import best_of  # this file runs as a script (`main` re-runs it per flag set)
  rng = np.random.default_rng(0)
  shapes = {"qkv": (Q, E), "o": (E, E), "gu": (2 * F, E), "d": (E, F)}
  host = [{k: (rng.standard_normal(s, np.float32) * 0.02) for k, s in shapes.items()}
          for _ in range(LAYERS)]
  layers = jax.tree.map(jnp.asarray, host)
  halves = jax.tree.map(lambda w: (w[:w.shape[0] // 2], w[w.shape[0] // 2:]), layers)

  def one(x, w):
    return jnp.einsum("ti,oi->to", x, w)

  def two(x, ws):
    return jnp.concatenate([jnp.einsum("ti,oi->to", x, w) for w in ws], -1)

  def chain(layers, x, product):
    for lp in layers:
      qkv = product(x, lp["qkv"])
      x = x + product(qkv[:, :E] + qkv[:, E:].sum(), lp["o"])
      gate_up = product(x, lp["gu"])
      x = x + product(jax.nn.silu(gate_up[:, :F]) * gate_up[:, F:], lp["d"])
    return x

  x = jnp.ones((1, E), jnp.float32)
  nbytes = sum(w.nbytes for lp in host for w in lp.values())
  out = {"flags": os.environ.get("XLA_FLAGS", ""), "weight_bytes": nbytes}
  for name, product, weights in (("jax_step_products", one, layers),
                                 ("jax_two_halves", two, halves)):
    fn = jax.jit(lambda w, x, product=product: chain(w, x, product))
    jax.block_until_ready(fn(weights, x))
    seconds = best_of(lambda: jax.block_until_ready(fn(weights, x)), reps)
    out[name] = {"ms": 1e3 * seconds, "gb_per_s": nbytes / seconds / 1e9}

  def numpy_chain():
    v = np.ones(E, np.float32)
    for lp in host:
      qkv = lp["qkv"] @ v
      v = v + lp["o"] @ (qkv[:E] + qkv[E:].sum())
      gate_up = lp["gu"] @ v
      v = v + lp["d"] @ (np.tanh(gate_up[:F]) * gate_up[F:])  # bounded: no overflow
    return v

  seconds = best_of(numpy_chain, reps)
  out["numpy_loop"] = {"ms": 1e3 * seconds, "gb_per_s": nbytes / seconds / 1e9}
  return out


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--one":
    print(json.dumps(measure()), flush=True)
    return
  runs = []
  for flags in FLAG_SETS:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    line = subprocess.run([sys.executable, __file__, "--one"], env=env, check=True,
                          capture_output=True, text=True).stdout.strip().splitlines()[-1]
    runs.append(json.loads(line))
    print(runs[-1], flush=True)
  RESULTS.mkdir(exist_ok=True)
  record = {"cpu_count": os.cpu_count(), "timing": "minimum over 30 calls", "runs": runs}
  (RESULTS / "cpu_matvec.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
  main()
