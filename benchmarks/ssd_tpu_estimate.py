"""AN ESTIMATE, not a measurement: SSD on a v5e 2x2 slice split 2 + 2 (Llama-3.1-8B target on
two chips, Llama-3.2-1B draft on the other two) against ordinary speculation with the target and
the draft 4-way tensor parallel, from the TPU compiler's cost model.

    python -m benchmarks.ssd_tpu_estimate [--k 4] [--budget 8] [--acceptance 0.8] [--hit 0.8]

Nothing runs on a TPU. Each program below is compiled by libtpu for abstract v5e devices
(`specjax.testing.tpu`) in the loop-free (unstacked) layout at 1 and 2 layers, real widths and
vocabulary (128,256), bfloat16, batch 1, and its HBM bytes (`benchmarks.tpu_traffic.hbm_traffic`,
the compiled HLO walked instruction by instruction) and XLA's flops are extrapolated linearly to
the real depth, `f(L) = f(1) + (L - 1) (f(2) - f(1))`. A program's time is the roofline `max(HBM
bytes / bandwidth, flops / peak)` per chip (`pltpu.get_tpu_info_for_chip`):

  * `verify_tp2` / `verify_tp4`: the 8B's forward over `k + 1` tokens and the greedy rule, on a
    (1, 2) / (1, 4) `(data, model)` mesh;
  * `draft_step_tp4`: the 1B's one-token forward on the (1, 4) mesh;
  * `prespec_tp2`: SSD's draft half (`specjax.drafters.ssd.pre_speculate`: the chain forward of
    `k + 1` tokens, the candidates and `k` branch forwards of `k + 1 + j NB` tokens) on the
    (1, 2) mesh. The split program replicates within a role today; this assumes the role's two
    chips share the work as tensor parallelism would (future work).

Then, with per-token acceptance `a` and outcome-cache hit rate `h` (assumptions, flags):
  * ordinary speculation: `tau = (1 - a^(k+1)) / (1 - a)` per round of `k t(draft_step_tp4) +
    t(verify_tp4)`;
  * SSD: a round takes `max(t(verify_tp2), t(prespec_tp2))` plus the exchange (greedy: a few
    hundred bytes; sampled: the branches' q, `NB k V` float32, over ICI at `ICI_BYTES_PER_S`); a
    round after a hit emits `tau`, a round after a miss 1 (a plain target step), so `tau_ssd = h
    tau + (1 - h)`.

Assumptions left out: launch and per-op latency, the collectives of tensor parallelism inside
each program (the roofline has no ICI term there), the loop's bookkeeping. Writes
`benchmarks/results/ssd_tpu_estimate.json` and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from benchmarks import tpu_traffic as traffic  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TARGET, DRAFT = "llama-3.1-8b", "llama-3.2-1b"
ICI_BYTES_PER_S = 45e9  # one v5e ICI link, one direction (an assumption)
CAPACITY, LIVE = 1024, 512


def _mesh(chips: int):
  from specjax.testing import tpu
  devices = tpu.topology_devices("v5e:2x2")[:chips]
  from specjax.parallel.mesh import make_mesh
  return make_mesh((1, chips), ("data", "model"), devices=devices)


def _program(name: str, *, layers: int, k: int, budget: int):
  """`(fn, args, mesh)` of one program at `layers` layers (unstacked layout)."""
  from specjax.drafters.ssd import SSDDrafter, pre_speculate
  from specjax.core.sampling import GREEDY
  from specjax.testing import tpu
  chips = 2 if name.endswith("tp2") else 4
  mesh = _mesh(chips)
  model_name = DRAFT if name.startswith(("draft", "prespec")) else TARGET
  config = tpu.with_layers(tpu.REAL_CONFIGS[model_name], layers)
  length = 1 if name.startswith("draft") else k + 1
  model, tokens, starts, cache, seeds = traffic.abstract_setup(
      config, mesh, 1, length, capacity=CAPACITY, unstacked=True)
  if name.startswith("verify"):
    return traffic.verify, (model, tokens, starts, cache, seeds), mesh
  if name.startswith("draft"):
    return traffic.target_step, (model, tokens, starts, cache), mesh
  replicated = NamedSharding(mesh, P())
  sequence = jax.ShapeDtypeStruct((1, CAPACITY), jnp.int32, sharding=replicated)
  drafts = jax.ShapeDtypeStruct((1, k), jnp.int32, sharding=replicated)
  count = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=replicated)

  def prespec(model, cache, sequence, starts, drafts, count, seeds):
    out = pre_speculate(SSDDrafter(model, budget=budget), cache, sequence, starts + 1, drafts,
                        count, num_draft=k, sampling=GREEDY, seeds=seeds)
    return out[1:]

  return prespec, (model, cache, sequence, starts, drafts, count, seeds), mesh


def measure(name: str, *, k: int, budget: int, log=print) -> dict:
  from specjax.testing import tpu
  per = {}
  for layers in (1, 2):
    fn, args, mesh = _program(name, layers=layers, k=k, budget=budget)
    start = time.perf_counter()
    compiled = traffic.compile_program(fn, *args, mesh=mesh)
    seconds = time.perf_counter() - start
    cost = compiled.cost()
    per[layers] = {"hbm_bytes": traffic.hbm_traffic(compiled.text(), LIVE).hbm_bytes,
                   "flops": float(cost.get("flops", 0.0)), "compile_s": round(seconds, 1)}
    log(f"  {name} at {layers} layer(s): {per[layers]}")
  depth = tpu.REAL_CONFIGS[DRAFT if name.startswith(("draft", "prespec")) else TARGET].num_layers
  full = {key: per[1][key] + (depth - 1) * (per[2][key] - per[1][key])
          for key in ("hbm_bytes", "flops")}
  return {"program": name, "layers": depth, "at_1": per[1], "at_2": per[2], **full}


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--budget", type=int, default=8)
  parser.add_argument("--acceptance", type=float, default=0.8)
  parser.add_argument("--hit", type=float, default=0.8)
  args = parser.parse_args(argv)
  k, budget, a, h = args.k, args.budget, args.acceptance, args.hit
  info = traffic.chip_info("v5e")
  records = {}
  for name in ("verify_tp2", "prespec_tp2", "verify_tp4", "draft_step_tp4"):
    record = measure(name, k=k, budget=budget)
    record["roofline"] = traffic.roofline(dict(record, floor=record["hbm_bytes"]), info)
    records[name] = record
  t = {name: r["roofline"]["t_s"] for name, r in records.items()}
  tau = (1 - a ** (k + 1)) / (1 - a)
  spec_round = k * t["draft_step_tp4"] + t["verify_tp4"]
  exchange = {"greedy": 64.0 / ICI_BYTES_PER_S,
              "sampled": budget * k * 128_256 * 4 / ICI_BYTES_PER_S}
  tau_ssd = h * tau + (1 - h)
  estimate = {"label": "ESTIMATE from the TPU compiler's cost model (roofline), not measured",
              "k": k, "budget": budget, "acceptance": a, "hit_rate": h, "tau_spec": tau,
              "tau_ssd": tau_ssd, "chip": info, "times_s": t,
              "spec_tp4_round_s": spec_round, "spec_tp4_tokens_per_s": tau / spec_round}
  for mode, extra in exchange.items():
    ssd_round = max(t["verify_tp2"], t["prespec_tp2"]) + extra
    estimate[f"ssd_2+2_{mode}"] = {"round_s": ssd_round, "tokens_per_s": tau_ssd / ssd_round,
                                   "speedup_vs_spec_tp4": (tau_ssd / ssd_round)
                                   / (tau / spec_round)}
  out = {"estimate": estimate, "programs": records}
  path = RESULTS / "ssd_tpu_estimate.json"
  path.write_text(json.dumps(out, indent=1, default=float))
  print(json.dumps(estimate, indent=1, default=float))


if __name__ == "__main__":
  main()
