"""HBM per device of `sj.generate` and `sj.decode` at the real models' depths and contexts on TPU,
from the TPU compiler (no TPU needed).

    python -m benchmarks.tpu_memory [--only SUBSTRING ...] [--redo]

Compiles, with libtpu's compiler ahead of time (`specjax.testing.tpu`: abstract bfloat16 weights
at the public `config.json` shapes, nothing allocated or run), each case's `sj.generate` (target
alone) and `sj.decode` (k = 4), both at `Sampling(temperature=0.7, top_k=50, top_p=0.9)`:

  * Qwen2.5-Coder-1.5B drafted by Qwen2.5-Coder-0.5B on one v5e chip: batch 1 at the model's
    32k context (32,000 prompt + 64 new) and batch 64 at 4k (3,584 + 512);
  * Llama-3.1-8B drafted by Llama-3.2-1B on four v5e chips and on four v6e chips (a 2x2 slice,
    mesh (data 1, model 4): heads, MLP, vocabulary and the caches' key/value heads split four
    ways), batch 32 at 8k (7,680 + 512);
  * Gemma 3 1B drafting with its own int8 copy (`sj.self_drafter(target, bits=8)`, built once
    outside the compiled decode, abstractly with `jax.eval_shape`) on one v5e chip: batch 1 at its
    32k context (32,000 + 64) and batch 32 at 4k (3,584 + 512; the copy drafts from its own
    copy of the target's cache, so a batch of 64 would hold two 6.5 GiB caches);
  * `--programs decode-fp8`: `decode` with the draft's KV cache in float8_e4m3fn
    (`sj.ModelDrafter(draft, cache_dtype=...)`; for Gemma the int8 copy's own cache, which starts
    as the target's prompt cache cast to 8 bits), recorded beside the bfloat16 one;
  * `--only brief`: the Qwen pair at the shapes of the earlier measurements (512 + 512 batch 1,
    2,048 + 2,048 batch 64, 8,192 + 64 and 16,384 + 64 batch 1).

Per case and program it records `memory_analysis()` per device (arguments, temporaries, outputs,
aliased bytes, generated code), the total (arguments + outputs + temporaries - aliased + code:
what the program needs in HBM on one device), the chip's HBM, whether it fits (that total within
the chip's HBM: the compiler accepts some programs whose total is larger), and the KV
caches' bytes per device (target and draft model, inside the temporaries: `decode` and
`generate` build their caches inside the call). A program the compiler rejects is recorded with
the compiler's message: "hbm_oom" (RESOURCE_EXHAUSTED), "vmem_oom" (a Pallas kernel's VMEM), or
"error". Where the fused verify kernel exceeds its VMEM, the decode case is compiled again with
`verify_impl="reference"` and labelled so.

Compiles at real depth take minutes on a small CPU: results are written to
`benchmarks/results/tpu_memory.json` after every case (a rerun skips the cases it holds unless
`--redo`), then the plot `benchmarks/results/tpu_memory.png`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import re
import time
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
JSON_PATH = RESULTS / "tpu_memory.json"
PNG_PATH = RESULTS / "tpu_memory.png"
GIB = 1 << 30
NUM_DRAFT = 4
# `--programs decode-fp8`: `decode` with the draft model's KV cache in this dtype.
FP8 = "float8_e4m3fn"
# HBM per chip by `device_kind` (public specifications).
HBM_BYTES = {"TPU v5 lite": 16 * GIB, "TPU v6 lite": 32 * GIB, "TPU v5": 95 * GIB,
             "TPU v4": 32 * GIB}


@dataclasses.dataclass(frozen=True)
class Case:
  """One pair at one shape on one slice."""

  name: str
  target: str  # a `tpu.REAL_CONFIGS` name
  draft: str | None  # a `REAL_CONFIGS` name, or None: the target's own int8 copy
  topology: str  # a `tpu.TOPOLOGIES` name, or a raw topology with `mesh`
  mesh: tuple[int, ...] | None
  batch: int
  prompt: int
  new: int
  group: str = "main"


CASES = (
    Case("qwen-1.5b+0.5b v5e-1 B=1 32000+64", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b",
         "v5e-1", None, 1, 32_000, 64),
    Case("qwen-1.5b+0.5b v5e-1 B=64 3584+512", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b",
         "v5e-1", None, 64, 3_584, 512),
    Case("llama-8b+1b v5e-2x2 B=32 7680+512", "llama-3.1-8b", "llama-3.2-1b", "v5e:2x2",
         (1, 4), 32, 7_680, 512),
    Case("llama-8b+1b v6e-2x2 B=32 7680+512", "llama-3.1-8b", "llama-3.2-1b", "v6e:2x2",
         (1, 4), 32, 7_680, 512),
    Case("gemma-3-1b+int8 v5e-1 B=1 32000+64", "gemma-3-1b", None, "v5e-1", None, 1, 32_000, 64),
    Case("gemma-3-1b+int8 v5e-1 B=32 3584+512", "gemma-3-1b", None, "v5e-1", None, 32, 3_584,
         512),
    Case("brief: qwen v5e-1 B=1 512+512", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "v5e-1",
         None, 1, 512, 512, "brief"),
    Case("brief: qwen v5e-1 B=64 2048+2048", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "v5e-1",
         None, 64, 2_048, 2_048, "brief"),
    Case("brief: qwen v5e-1 B=1 8192+64", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "v5e-1",
         None, 1, 8_192, 64, "brief"),
    Case("brief: qwen v5e-1 B=1 16384+64", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "v5e-1",
         None, 1, 16_384, 64, "brief"),
)


def _classify(message: str) -> str:
  if "CompileTimeScopedVmemOom" in message or "vmem" in message.lower():
    return "vmem_oom"
  if "RESOURCE_EXHAUSTED" in message:
    return "hbm_oom"
  return "error"


def _cache_bytes(model, mesh, batch: int, length: int, dtype=None) -> int:
  """Bytes per device of `model`'s KV cache of `batch` rows and `length` slots (in `dtype`, default
  the model's), placed by the sharding rules (rows over "data", key/value heads over "model" where
  they divide)."""
  from specjax.parallel.rules import CACHE_AXES, DEFAULT_RULES
  cache = jax.eval_shape(lambda: model.init_cache(batch, length, dtype))
  mesh_shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
  total = 0
  for leaf in (cache.k, cache.v):
    spec = DEFAULT_RULES.spec(CACHE_AXES, leaf.shape, mesh_shape)
    shards = 1
    for entry in spec:
      for axis in (entry,) if isinstance(entry, str) else (entry or ()):
        shards *= mesh_shape[axis]
    total += leaf.size * leaf.dtype.itemsize // shards
  return total


def compile_case(case: Case, program: str, verify_impl: str = "auto") -> dict:
  """Compiles one program of `case`; the record (memory, fit, or the compiler's message)."""
  import specjax as sj
  from specjax.core.validation import NEW_TOKEN_BUCKET, round_up
  from specjax.testing import tpu

  mesh = tpu.topology_mesh(case.topology, case.mesh)
  sampling = sj.Sampling(temperature=0.7, top_k=50, top_p=0.9)
  target = tpu.abstract_model(tpu.REAL_CONFIGS[case.target], mesh, jnp.bfloat16)
  tokens, rng = tpu.abstract_tokens(mesh, case.batch, case.prompt)
  capacity = round_up(case.new, NEW_TOKEN_BUCKET)
  record = dict(case=case.name, group=case.group, program=program, target=case.target,
                draft=case.draft or f"{case.target} int8 (self_drafter)",
                topology=case.topology, mesh=list(mesh.axis_sizes), devices=mesh.size,
                batch=case.batch, prompt=case.prompt, new=case.new,
                verify_impl=verify_impl if program != "generate" else None)
  kind = mesh.devices.flat[0].device_kind
  record["chip"] = kind
  record["hbm_bytes"] = HBM_BYTES.get(kind)
  if program == "generate":
    record["kv_cache_bytes"] = _cache_bytes(target, mesh, case.batch, case.prompt + capacity)

    def run(target, tokens, rng):
      return sj.generate(target, tokens, rng, max_new_tokens=case.new, sampling=sampling)
    args = (target, tokens, rng)
  else:
    slots = case.prompt + capacity + NUM_DRAFT + 1
    cache_dtype = FP8 if program == "decode-fp8" else None
    if case.draft is not None:
      draft = tpu.abstract_model(tpu.REAL_CONFIGS[case.draft], mesh, jnp.bfloat16)
      # A raw model, or the same model in a `ModelDrafter` that sets its cache's dtype.
      drafter = draft if cache_dtype is None else sj.ModelDrafter(draft, cache_dtype=cache_dtype)
    else:
      # The int8 copy is built once, outside the decode (as a server would), here abstractly:
      # `jax.eval_shape` of `self_drafter`, its leaves replicated like the target's norms. Its
      # cache has the target's shape and starts as the target's prompt cache (cast, in 8 bits).
      draft = target
      drafter = tpu.abstract_like(jax.eval_shape(lambda t: sj.self_drafter(t, bits=8), target),
                                  NamedSharding(mesh, PartitionSpec()))
      if cache_dtype is not None:
        drafter = dataclasses.replace(drafter, cache_dtype=cache_dtype)
    record["kv_cache_bytes"] = (_cache_bytes(target, mesh, case.batch, slots)
                                + _cache_bytes(draft, mesh, case.batch, slots, cache_dtype))
    if cache_dtype is not None:
      record["draft"] += f" ({cache_dtype} cache)"

    def run(target, drafter, tokens, rng):
      return sj.decode(target, drafter, tokens, rng, max_new_tokens=case.new,
                       num_draft=NUM_DRAFT, sampling=sampling, verify_impl=verify_impl)
    args = (target, drafter, tokens, rng)
  start = time.perf_counter()
  try:
    compiled = tpu.compile_call(run, *args, mesh=mesh)
  except Exception as error:  # pylint: disable=broad-except  # recorded, with the message
    message = f"{type(error).__name__}: {error}"
    record.update(status=_classify(message) if isinstance(error, tpu.TpuCompileError)
                  else ("pending" if "TracerArrayConversionError" in message else "error"),
                  message=message[:2000], compile_s=round(time.perf_counter() - start, 1))
    return record
  m = compiled.memory
  record.update(status="ok", compile_s=round(time.perf_counter() - start, 1),
                argument_bytes=m.argument_size_in_bytes, temp_bytes=m.temp_size_in_bytes,
                output_bytes=m.output_size_in_bytes, alias_bytes=m.alias_size_in_bytes,
                code_bytes=m.generated_code_size_in_bytes, total_bytes=compiled.total_bytes)
  if record["hbm_bytes"] is not None:
    record["fits"] = compiled.total_bytes <= record["hbm_bytes"]
    record["headroom_bytes"] = record["hbm_bytes"] - compiled.total_bytes
  return record


def _load() -> dict:
  if JSON_PATH.exists():
    return json.loads(JSON_PATH.read_text())
  return {"records": []}


def _save(data: dict) -> None:
  RESULTS.mkdir(parents=True, exist_ok=True)
  data["updated"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  data["jax"] = jax.__version__
  JSON_PATH.write_text(json.dumps(data, indent=1) + "\n")


def _put(data: dict, record: dict) -> None:
  key = (record["case"], record["program"], record.get("verify_impl"))
  data["records"] = [r for r in data["records"]
                     if (r["case"], r["program"], r.get("verify_impl")) != key] + [record]


def plot(data: dict, path: pathlib.Path = PNG_PATH) -> None:
  """Per case and program: stacked arguments / temporaries / outputs (GiB per device), the
  chip's HBM as a tick, compiler rejections as a labelled empty row."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  records = [r for r in data["records"] if r["group"] == "main"] or data["records"]
  fig, ax = plt.subplots(figsize=(10, 0.45 * len(records) + 1.5))
  labels = []
  for i, r in enumerate(records):
    impl = f" [{r['verify_impl']}]" if r.get("verify_impl") not in (None, "auto") else ""
    program = ("decode, draft cache in float8_e4m3fn" if r["program"] == "decode-fp8"
               else r["program"])
    labels.append(f"{r['case']}  {program}{impl}")
    if r["status"] == "ok":
      left = 0.0
      for part, color in (("argument_bytes", "#4c72b0"), ("temp_bytes", "#dd8452"),
                          ("output_bytes", "#55a868")):
        width = r[part] / GIB
        ax.barh(i, width, left=left, color=color,
                label=part.split("_")[0] if i == 0 else None)
        left += width
      ax.text(left + 0.2, i, f"{r['total_bytes'] / GIB:.1f} GiB"
              + ("" if r.get("fits", True) else "  (does not fit)"), va="center", fontsize=8)
    else:
      wanted = re.search(r"HLO temporaries \(([0-9.]+G)\)", r.get("message", ""))
      ax.text(0.2, i, r["status"] + (f": {wanted.group(1)}iB of temporaries" if wanted else ""),
              va="center", fontsize=8, color="#c44e52")
    if r.get("hbm_bytes"):
      ax.plot([r["hbm_bytes"] / GIB] * 2, [i - 0.4, i + 0.4], color="black", lw=2,
              label="HBM per chip" if i == 0 else None)
  ax.set_yticks(range(len(records)), labels, fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel("GiB per device (memory_analysis)")
  ax.set_title("HBM per device, TPU compiler, bf16, k = 4, T = 0.7 top-k 50 top-p 0.9")
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--only", nargs="*", default=None,
                      help="run the cases whose name contains one of these substrings "
                           "(default: every main case; 'brief' selects the earlier shapes)")
  parser.add_argument("--programs", nargs="*", default=["generate", "decode"])
  parser.add_argument("--redo", action="store_true", help="recompile cases already recorded")
  args = parser.parse_args(argv)

  data = _load()
  done = {(r["case"], r["program"]) for r in data["records"]}
  cases = [c for c in CASES if (c.group == "main" if args.only is None
                                else any(s in c.name for s in args.only))]
  for case in cases:
    for program in args.programs:
      if (case.name, program) in done and not args.redo:
        continue
      print(f"{case.name} {program} ...", flush=True)
      try:
        record = compile_case(case, program)
      except Exception:  # pylint: disable=broad-except  # a broken case must not stop the rest
        record = dict(case=case.name, group=case.group, program=program, status="error",
                      message=traceback.format_exc()[-2000:])
      if program == "decode" and record["status"] == "vmem_oom":
        _put(data, record)  # the fused verify kernel's VMEM: kept, then the reference verify
        record = compile_case(case, program, verify_impl="reference")
      _put(data, record)
      _save(data)
      total = record.get("total_bytes")
      print(f"  {record['status']}" + (f": {total / GIB:.2f} GiB total, "
                                       f"{record['temp_bytes'] / GIB:.2f} GiB temporaries, "
                                       f"fits={record.get('fits')}" if total else "")
            + f" ({record.get('compile_s')} s)", flush=True)
      jax.clear_caches()
  plot(data)


if __name__ == "__main__":
  main()
