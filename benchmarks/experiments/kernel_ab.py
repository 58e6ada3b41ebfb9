"""Two builds of the CPU kernel on one model in one process: a git revision's sources against the
working tree's, on the target step and verify blocks of every width asked for.

    python -m benchmarks.experiments.kernel_ab --model smollm2-135m --base HEAD~1 \\
        --widths 1,3,5,7,8 --repeats 15 --steps 8 --out benchmarks/results/kernel_ab_smollm2.json

Why one process: on a shared host the memory bandwidth can move a large model's step by tens of
percent within a minute (docs/benchmarks.md), so two builds timed in two processes, or even one
after the other in one, compare the host's moods. Here the revision's sources (`git show
BASE:path` of every kernel source and header) are built (`kernel.build(source_dir)`) and
registered as FFI targets with a suffix (`kernel.register`); each width's forward is jitted once
against each build (`kernel.targets`, JAX's caches cleared between the builds, the lowered text
checked to name the right targets); then `time_alternately` runs the two builds of a width next
to each other, `--steps` forwards per call in one device loop (`timing._forward_steps`), and each
width reports the median over repeats of the per-pair ratio (new / base), with the min and max
of those ratios and each side's min and median time. The logits of both builds are compared
(float32 summation order may differ, nothing else).

`--model` is a real model (`benchmarks.real_models.REAL_MODELS`) or `tiny` (a random 2-layer
model, for the tests). `--copy` times the model's quantized copy instead, as a self-drafter runs
it (`benchmarks.drafters.SELF_DRAFTS`: `self-int8`, `self-int4`, `self-q4`), with `--vocab N` its
output projection restricted to N ids (the draft vocabulary's size; which ids does not change
the cost, so the first N are kept). Writes the JSON (and a `.png` of the ratios beside it
unless `--no-plot`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from specjax.kernels.cpu import kernel

REPO = pathlib.Path(__file__).resolve().parents[2]
SUFFIX = "_base"
FORMER_SOURCE_DIR = "specjax/models/cpu"  # where the sources were before kernels/cpu/


def base_sources(revision: str, directory: pathlib.Path) -> pathlib.Path:
  """Writes the kernel's sources and headers as they are at `revision` into `directory` (from
  `kernels/cpu/`, or from their former folder at a revision older than it)."""
  for path in kernel.SOURCES + kernel.HEADERS:
    relative = path.resolve().relative_to(REPO)
    for where in (relative, pathlib.PurePosixPath(FORMER_SOURCE_DIR, path.name)):
      done = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{where}"],
                            capture_output=True, text=True)
      if done.returncode == 0:
        break
    else:
      raise ValueError(f"git cannot show {relative} at {revision!r}: {done.stderr.strip()}")
    (directory / path.name).write_text(done.stdout)
  return directory


def tiny_model():
  import specjax as sj
  from specjax.testing.models import tiny_config
  return sj.init_params(tiny_config(), jax.random.key(0)).for_platform()


def load(name: str):
  if name == "tiny":
    return tiny_model()
  from benchmarks import real_models
  model, _ = real_models.load_specjax(real_models.gguf_path(name))
  return model


def quantized_copy(model, name: str, vocab: int | None = None):
  """`model`'s quantized copy `name` (`SELF_DRAFTS`), over `vocab` ids if given: the model of
  the `specjax.self_drafter` the suite builds under that name."""
  import numpy as np

  import specjax as sj
  from benchmarks.drafters import SELF_DRAFTS
  if name not in SELF_DRAFTS:
    raise ValueError(f"unknown copy {name!r}; known: {', '.join(SELF_DRAFTS)}")
  ids = None if vocab is None else np.arange(vocab)
  return sj.self_drafter(model, **SELF_DRAFTS[name], vocab=ids).model


def compare(model, base_names: dict[str, str], widths, *, repeats: int, steps: int,
            position: int = 64, buffer_len: int = 256) -> dict:
  """The paired timing of `model`'s forwards of each width under the base build (`base_names`,
  from `kernel.register`) and this module's build."""
  calls, states = {}, {}
  step = jax.jit(timing._forward_steps.__wrapped__, static_argnames=("steps",),
                 donate_argnames=("cache",))
  for build, names in (("base", base_names), ("new", None)):
    jax.clear_caches()  # a trace of the other build would be reused
    for width in widths:
      key = f"{build}_{width}"
      tokens = jnp.ones((1, width), jnp.int32)
      starts = jnp.full((1,), position, jnp.int32)
      states[key] = model.init_cache(1, buffer_len)
      if names is None:
        lowered = step.lower(model, tokens, starts, states[key], steps=steps)
      else:
        with kernel.targets(names):
          lowered = step.lower(model, tokens, starts, states[key], steps=steps)
      text = lowered.as_text()
      calls_kernel = any(target in text for target in (
          kernel.TARGET, kernel.PANEL_TARGET, kernel.QUANT_TARGET, kernel.QUANT_OFFSETS_TARGET))
      if not calls_kernel or ((SUFFIX in text) != (build == "base")):
        raise RuntimeError(f"the {build} build's forward of {width} rows does not call its kernel")
      compiled = lowered.compile()

      def call(compiled=compiled, tokens=tokens, starts=starts, key=key):
        logits, states[key] = compiled(model, tokens, starts, states[key])
        return logits
      calls[key] = call
  ordered = {f"{build}_{w}": calls[f"{build}_{w}"] for w in widths for build in ("base", "new")}
  load_before = os.getloadavg()
  timed = timing.time_alternately(ordered, repeats, "min")
  rows = []
  for width in widths:
    base, new = timed[f"base_{width}"], timed[f"new_{width}"]
    ratios = np.asarray(new["times_s"]) / np.asarray(base["times_s"])
    np.testing.assert_allclose(np.asarray(new["result"]), np.asarray(base["result"]),
                               rtol=1e-3, atol=1e-3 * float(np.abs(base["result"]).max()))
    rows.append({"width": width, "ratio_median": float(np.median(ratios)),
                 "ratio_min": float(ratios.min()), "ratio_max": float(ratios.max()),
                 "base_ms_min": 1e3 * base["min_s"] / steps,
                 "base_ms_median": 1e3 * base["median_s"] / steps,
                 "new_ms_min": 1e3 * new["min_s"] / steps,
                 "new_ms_median": 1e3 * new["median_s"] / steps,
                 "ratios": ratios.tolist()})
  return {"rows": rows, "load_before": load_before, "load_after": os.getloadavg()}


def plot(record: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = record["rows"]
  widths = [r["width"] for r in rows]
  median = np.asarray([r["ratio_median"] for r in rows])
  low = median - np.asarray([r["ratio_min"] for r in rows])
  high = np.asarray([r["ratio_max"] for r in rows]) - median
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.errorbar(widths, median, yerr=[low, high], fmt="o", capsize=4)
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xlabel("rows in the forward (1 = step, k + 1 = verify block)")
  ax.set_ylabel("time: working tree / base")
  what = record["model"] + (f" ({record['copy']} copy)" if record.get("copy") else "")
  ax.set_title(f"{what}: kernel at {record['base']} vs working tree\n"
               f"median of {record['repeats']} adjacent pairs (bars: min-max)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="smollm2-135m")
  parser.add_argument("--base", default="HEAD", help="git revision of the base build")
  parser.add_argument("--widths", default="1,3,4,5,6,7,8")
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--copy", default=None,
                      help="time the model's quantized copy (self-int8, self-int4, self-q4)")
  parser.add_argument("--vocab", type=int, default=None,
                      help="with --copy: its output projection restricted to this many ids")
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--no-plot", action="store_true")
  args = parser.parse_args(argv)
  widths = [int(w) for w in args.widths.split(",")]
  if not widths or min(widths) < 1 or max(widths) > 8:
    parser.error("--widths: rows from 1 to 8 (the kernel's block)")
  if not kernel.available():
    raise SystemExit(f"the CPU kernel is not available here: {kernel.status()[1]}")
  with tempfile.TemporaryDirectory(prefix="specjax_kernel_ab_") as directory:
    library = kernel.build(base_sources(args.base, pathlib.Path(directory)))
    names = kernel.register(library, SUFFIX)
  if args.vocab is not None and args.copy is None:
    parser.error("--vocab needs --copy")
  model = load(args.model)
  if args.copy is not None:
    model = quantized_copy(model, args.copy, args.vocab)
  record = {"model": args.model, "copy": args.copy, "vocab": args.vocab, "base": args.base,
            "widths": widths, "repeats": args.repeats, "steps": args.steps,
            "machine": os.uname().machine}
  record.update(compare(model, names, widths, repeats=args.repeats, steps=args.steps))
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(record, indent=1) + "\n")
  if not args.no_plot:
    plot(record, args.out.with_suffix(".png"))
  for row in record["rows"]:
    print(f"{row['width']} rows: new / base {row['ratio_median']:.3f} "
          f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f}); base {row['base_ms_min']:.2f} ms, "
          f"new {row['new_ms_min']:.2f} ms (min)")
  print("load", record["load_before"], "->", record["load_after"])
  return record


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
