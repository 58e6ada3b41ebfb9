"""What the verify costs in collectives and passes over the vocabulary, by mesh, from the HLO.

    python -m benchmarks.experiments.verify_sharded_hlo [--vocab 151936] [--batch 8] [--k 5]

Exports `specjax.verify.dispatch.verify_tokens` (the rule `decode` runs each round, `impl="auto"`)
for TPU with `jax.export` on this host's CPU devices, over Auto-axis meshes (data, model) of (1, 8),
(8, 1) and (2, 4), for greedy, for T = 0.7 alone, with top-p 0.9, and with top-k 50 and top-p 0.9,
and counts in the exported StableHLO, per verify call:

  * collectives (`all_reduce`, `all_gather`, ...): each is one round trip over the mesh;
  * Mosaic kernels (`tpu_custom_call`): the fused verify kernel where the vocabulary is whole on
    each device, else one `specjax.kernels.vocab_reduce` reduction per statistic, each
    streaming the device's `[rows, V / shards]` slice of logits from HBM once;
  * `pad` ops on the logits (a vocabulary that does not divide the shards is padded: a copy).

Counts are of executed ops: while counting, `jax.lax.fori_loop` is unrolled (the threshold
search's `RADIX_ROUNDS` rounds each run one reduction and one collective), so every loop
iteration appears in the text. Sampling with top-k, or with top-p alone, under a vocabulary split
runs the one-round candidate verify (`specjax.verify.candidates`) and, under `lax.cond`, falls
back to one reduction per statistic when a shard may hold tokens at the threshold that it did not
send: the two branches are
counted apart (`candidates`: the fallback replaced by a rule without collectives; `fallback`:
the candidate verify switched off). Sampling without top-k or top-p runs the two-round verify
(`specjax.verify.two_rounds`). Nothing here is timed; any host can run it (no TPU needed).
Writes `benchmarks/results/verify_sharded_hlo.json`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import json
import os
import pathlib
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
MESHES = ((1, 8), (8, 1), (2, 4))
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")


@contextlib.contextmanager
def unrolled_fori_loops():
  """`jax.lax.fori_loop` as a Python loop while tracing: each iteration's ops appear once each."""
  original = jax.lax.fori_loop

  def fori_loop(lower, upper, body, init, **_):
    return functools.reduce(lambda carry, i: body(i, carry), range(int(lower), int(upper)), init)

  jax.lax.fori_loop = fori_loop
  try:
    yield
  finally:
    jax.lax.fori_loop = original


def count(text: str) -> dict:
  """Executed collectives, Mosaic kernels and logits pads in exported StableHLO text."""
  ops = collections.Counter(re.findall(r"stablehlo\.(" + "|".join(COLLECTIVES) + r")\b", text))
  pads = [m for m in re.findall(r"stablehlo\.pad .*?-> tensor<([0-9x]+)xf32>", text)
          if len(m.split("x")) >= 2]
  return {"collectives": sum(ops.values()), "by_kind": dict(ops),
          "mosaic_kernels": len(re.findall(r"tpu_custom_call", text)),
          "logits_pads": len(pads)}


@contextlib.contextmanager
def branch(name: str | None):
  """Count one branch of the candidate verify: "candidates" or "fallback" (None: as exported)."""
  from specjax.core.sampling import VerifyResult
  from specjax.verify import sharded
  original_rule, original_uses = sharded._candidate_rule, sharded.uses_candidates

  def no_collectives(target, draft, tokens, **kwargs):
    del target, draft, kwargs
    return VerifyResult(jnp.zeros(tokens.shape[:1], jnp.int32),
                        jnp.zeros((tokens.shape[0], tokens.shape[1] + 1), jnp.int32))

  if name == "candidates":
    sharded._candidate_rule = lambda *a, fallback, **kw: original_rule(*a, fallback=no_collectives,
                                                                       **kw)
  elif name == "fallback":
    sharded.uses_candidates = lambda sampling, vocab: False
  try:
    yield
  finally:
    sharded._candidate_rule, sharded.uses_candidates = original_rule, original_uses


def measure(vocab: int, batch: int, k: int, mesh_shape, sampling, which=None) -> dict:
  from jax.sharding import AbstractMesh, AxisType
  from specjax.verify import dispatch
  mesh = AbstractMesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)

  def verify(target, draft, tokens, seeds, positions):
    out = dispatch.verify_tokens(target, draft, tokens, sampling=sampling, seeds=seeds,
                                 positions=positions, mesh=mesh)
    return out.num_accepted, out.tokens

  args = (jax.ShapeDtypeStruct((batch, k + 1, vocab), jnp.float32),
          jax.ShapeDtypeStruct((batch, k, vocab), jnp.float32),
          jax.ShapeDtypeStruct((batch, k), jnp.int32),
          jax.ShapeDtypeStruct((batch,), jnp.uint32), jax.ShapeDtypeStruct((batch,), jnp.int32))
  with unrolled_fori_loops(), branch(which):
    text = jax.export.export(jax.jit(verify), platforms=["tpu"])(*args).mlir_module()
  return count(text)


def main():
  import specjax as sj
  from specjax.verify.candidates import uses_candidates
  parser = argparse.ArgumentParser()
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--k", type=int, default=5)
  parser.add_argument("--out", default=str(RESULTS / "verify_sharded_hlo.json"))
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", 8)
  settings = {"greedy": sj.Sampling(temperature=0.0),
              "t0.7": sj.Sampling(temperature=0.7),
              "t0.7_topp0.9": sj.Sampling(temperature=0.7, top_p=0.9),
              "t0.7_topk50_topp0.9": sj.Sampling(temperature=0.7, top_k=50, top_p=0.9)}
  record = {"benchmark": "verify_sharded_hlo", "vocab": args.vocab, "batch": args.batch,
            "k": args.k, "impl": "auto", "platform": "tpu (jax.export from CPU)",
            "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "counts": "executed per verify call (fori_loop unrolled while counting)",
            "meshes": {}}
  for shape in MESHES:
    name = f"({shape[0]}, {shape[1]})"
    record["meshes"][name] = {}
    for label, sampling in settings.items():
      counts = measure(args.vocab, args.batch, args.k, shape, sampling)
      if shape[1] > 1 and uses_candidates(sampling, args.vocab):  # split vocabulary: two branches
        counts = {"candidates": measure(args.vocab, args.batch, args.k, shape, sampling,
                                        "candidates"),
                  "fallback": measure(args.vocab, args.batch, args.k, shape, sampling,
                                      "fallback")}
      record["meshes"][name][label] = counts
      print(name, label, counts, flush=True)
  pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  main()
