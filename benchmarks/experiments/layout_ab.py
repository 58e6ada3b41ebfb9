"""The CPU layout's two float32 weight layouts on one model in one process: row-major `[out, in]`
(the kernel's dot-product tiles for up to 8 rows, XLA's dot beyond) against panels
(`specjax.models.cpu.panels`, the kernel at every block size; a tied embedding and an untied output
projection too), on the step, the verify blocks and a prompt.

    python -m benchmarks.experiments.layout_ab --model qwen2.5-coder-1.5b \\
        --widths 1,2,3,4,5,6,7,8,64 --repeats 8 --steps 2 \\
        --out benchmarks/results/layout_ab_qwen.json

As in `benchmarks/experiments/kernel_ab.py` (one process, because the host's memory bandwidth can
move a large model's step by tens of percent within a minute): the model is loaded once in panels, a
row-major copy of its projections is built layer by layer (the embedding is shared), each width's
forward is compiled for both, and `time_alternately` runs the two layouts of a width next to each
other, `--steps` forwards per call in one device loop. Each width reports the median of the per-pair
ratios (panels / row-major) and, per layout, the block's time over the one-row step's measured in
the same repeat (the verify block's cost in target steps). The logits of both are compared.

`--model` is a real model (`benchmarks.real_models.REAL_MODELS`) or `tiny` (for the tests).
Writes the JSON and a `.png` beside it unless `--no-plot`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from benchmarks.experiments import kernel_ab
from specjax.models.cpu import host_memory
from specjax.kernels.cpu import kernel
from specjax.models.cpu import layout as cpu_layout
from specjax.models.cpu import panels as panel_layout

LAYOUTS = ("rows", "panels")


def row_major(model, layers: bool = True):
  """The same model with a tied embedding `[V, E]` (kernel on: the row-major kernel up to 8 rows),
  an untied output projection `[E, V]` (XLA's dot) and, with `layers`, its projections row-major
  `[out, in]`, built layer by layer so that only one layer's extra copy is alive at a time."""
  layers = [cpu_layout.fuse_layer(cpu_layout.split_layer(lp, model.config), panels=False)
            if layers else lp for lp in model.params["layers"]]
  embed = model.params["embed"]
  if panel_layout.is_panels(embed):
    embed = host_memory.on_huge_pages(embed.dense())
  params = dict(model.params, layers=tuple(layers), embed=embed)
  if panel_layout.is_panels(params.get("lm_head")):
    params["lm_head"] = host_memory.on_huge_pages(params["lm_head"].T)
  return dataclasses.replace(model, params=params)


def compare(models: dict, widths, *, repeats: int, steps: int, position: int = 64,
            buffer_len: int = 320) -> dict:
  calls, states = {}, {}
  for name, model in models.items():
    for width in widths:
      key = f"{name}_{width}"
      tokens = jnp.ones((1, width), jnp.int32)
      starts = jnp.full((1,), position, jnp.int32)
      states[key] = model.init_cache(1, buffer_len)
      compiled = timing._forward_steps.lower(model, tokens, starts, states[key],
                                             steps=steps).compile()

      def call(compiled=compiled, model=model, tokens=tokens, starts=starts, key=key):
        logits, states[key] = compiled(model, tokens, starts, states[key])
        return logits

      calls[key] = call
  ordered = {f"{name}_{w}": calls[f"{name}_{w}"] for w in widths for name in LAYOUTS}
  load_before = os.getloadavg()
  timed = timing.time_alternately(ordered, repeats, "min")
  rows = []
  one = {name: np.asarray(timed[f"{name}_{widths[0]}"]["times_s"]) for name in LAYOUTS}
  for width in widths:
    t = {name: np.asarray(timed[f"{name}_{width}"]["times_s"]) for name in LAYOUTS}
    base, new = timed[f"rows_{width}"], timed[f"panels_{width}"]
    np.testing.assert_allclose(np.asarray(new["result"]), np.asarray(base["result"]),
                               rtol=1e-3, atol=1e-3 * float(np.abs(base["result"]).max()))
    ratios = t["panels"] / t["rows"]
    row = {"width": width, "ratio_median": float(np.median(ratios)),
           "ratio_min": float(ratios.min()), "ratio_max": float(ratios.max()),
           "ratios": ratios.tolist()}
    for name in LAYOUTS:
      row[f"{name}_ms_min"] = 1e3 * float(t[name].min()) / steps
      row[f"{name}_ms_median"] = 1e3 * float(np.median(t[name])) / steps
      row[f"{name}_steps_median"] = float(np.median(t[name] / one[name]))
    rows.append(row)
  return {"rows": rows, "load_before": load_before, "load_after": os.getloadavg()}


def plot(record: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [r for r in record["rows"] if r["width"] <= 8]
  widths = [r["width"] for r in rows]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  base = ("row-major (dot tiles)" if record.get("base", "rows") == "rows" else
          "panels, embedding / output head row-major")
  for name, label in (("rows", base), ("panels", "panels")):
    ax.plot(widths, [r[f"{name}_steps_median"] for r in rows], "o-", label=label)
  ax.axhline(1.25, color="gray", lw=0.8, ls="--", label="1.25 steps")
  ax.set_xlabel("rows in the forward (k + 1 = verify block)")
  ax.set_ylabel("time / one-row step (same repeat)")
  ax.set_title(f"{record['model']}: verify block cost by weight layout\n"
               f"median of {record['repeats']} alternated repeats", fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="smollm2-135m")
  parser.add_argument("--widths", default="1,2,3,4,5,6,7,8")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--base", choices=("rows", "embedding"), default="rows",
                      help="the other side: every weight row-major (rows), or only the "
                      "embedding and output projection (embedding: a tied embedding `[V, E]`, an "
                      "untied head `[E, V]` for XLA's dot; the layers in panels too)")
  parser.add_argument("--no-plot", action="store_true")
  args = parser.parse_args(argv)
  widths = [int(w) for w in args.widths.split(",")]
  if not widths or widths[0] != 1 or min(widths) < 1:
    parser.error("--widths: positive row counts, starting with 1 (the step)")
  if not kernel.available():
    raise SystemExit(f"the CPU kernel is not available here: {kernel.status()[1]}")
  panels = kernel_ab.load(args.model)
  if not panel_layout.is_panels(panels.params["layers"][0]["wqkv_t"]):
    raise SystemExit("the model did not load in panels")
  models = {"rows": row_major(panels, layers=args.base == "rows"), "panels": panels}
  record = {"model": args.model, "base": args.base, "widths": widths, "repeats": args.repeats,
            "steps": args.steps,
            "machine": os.uname().machine}
  record.update(compare(models, widths, repeats=args.repeats, steps=args.steps))
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(record, indent=1) + "\n")
  if not args.no_plot:
    plot(record, args.out.with_suffix(".png"))
  for row in record["rows"]:
    print(f"{row['width']} rows: panels / rows {row['ratio_median']:.3f} "
          f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f}); rows {row['rows_ms_min']:.2f} ms "
          f"= {row['rows_steps_median']:.2f} steps, panels {row['panels_ms_min']:.2f} ms = "
          f"{row['panels_steps_median']:.2f} steps")
  print("load", record["load_before"], "->", record["load_after"])
  return record


if __name__ == "__main__":
  main()
