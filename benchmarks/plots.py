"""PNG plots of speedup records (matplotlib, imported only here)."""

from __future__ import annotations

import pathlib
from typing import Any


def plot_records(records: list[dict], out: pathlib.Path, stem: str) -> list[str]:
  """Writes the PNG plots a record list supports; returns their file names."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  written = []
  if not records:
    return written
  synthetic = any(r.get("synthetic_acceptance") is not None for r in records)
  tag = " [SYNTHETIC ACCEPTANCE]" if synthetic else ""

  def series(key_fn):
    groups: dict[Any, list[dict]] = {}
    for r in records:
      groups.setdefault(key_fn(r), []).append(r)
    return groups

  def save(fig, name):
    fig.tight_layout()
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    written.append(name)

  # Speedup vs k: one line per (size, batch, temperature, acceptance).
  label = lambda r: ", ".join(filter(None, [
      r.get("target_size"), f"B={r['batch']}", f"T={r['temperature']}",
      f"a={r['synthetic_acceptance']}" if r.get("synthetic_acceptance") is not None else None]))
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, group in series(label).items():
    group = sorted(group, key=lambda r: r["num_draft"])
    ax.plot([r["num_draft"] for r in group], [r["speedup"] for r in group], "o-", label=name)
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set(xlabel="k (draft tokens per round)", ylabel="speedup over generate",
         title=f"speedup vs k{tag}")
  ax.legend(fontsize=7)
  save(fig, f"{stem}_speedup_vs_k.png")

  batches = {r["batch"] for r in records}
  if len(batches) > 1:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    key = lambda r: ", ".join(filter(None, [r.get("target_size"), f"k={r['num_draft']}",
                                            f"T={r['temperature']}"]))
    for name, group in series(key).items():
      group = sorted(group, key=lambda r: r["batch"])
      if len(group) > 1:
        ax.plot([r["batch"] for r in group], [r["speedup"] for r in group], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xlabel="batch", ylabel="speedup over generate", title=f"speedup vs batch{tag}")
    ax.legend(fontsize=6)
    save(fig, f"{stem}_speedup_vs_batch.png")

  fig, ax = plt.subplots(figsize=(6, 4.5))
  ax.scatter([r["acceptance_per_token"] for r in records], [r["speedup"] for r in records],
             c=[r["num_draft"] for r in records], cmap="viridis")
  ax.set(xlabel="measured per-token acceptance a", ylabel="speedup over generate",
         title=f"speedup vs acceptance (colour = k){tag}")
  save(fig, f"{stem}_speedup_vs_acceptance.png")

  bounded = [r for r in records if "bound" in r]
  if bounded:
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.scatter([r["bound"] for r in bounded], [r["speedup"] for r in bounded],
               c=[r["num_draft"] for r in bounded], cmap="viridis")
    top = max(max(r["bound"] for r in bounded), max(r["speedup"] for r in bounded)) * 1.05
    ax.plot([0, top], [0, top], "k--", lw=0.8, label="measured = bound")
    ax.set(xlabel="analytic bound", ylabel="measured speedup",
           title=f"measured vs bound (colour = k){tag}")
    ax.legend(fontsize=7)
    save(fig, f"{stem}_measured_vs_bound.png")
  return written


def plot_tau_and_speedup(names: list[str], taus: list[float], speedups: list[float],
                         path: pathlib.Path, *, title: str,
                         speedup_label: str = "wall speedup vs generate",
                         figsize=(10, 4), rotation: int = 45) -> None:
  """Two bar charts side by side, one bar per configuration: tau and wall speedup over
  `generate` (a line at 1). Does nothing without matplotlib."""
  try:
    import matplotlib
  except ImportError:
    return
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=figsize)
  axes[0].bar(names, taus)
  axes[0].set_ylabel("tokens per round (tau)")
  axes[1].bar(names, speedups)
  axes[1].axhline(1.0, color="k", lw=0.5)
  axes[1].set_ylabel(speedup_label)
  for ax in axes:
    ax.tick_params(axis="x", rotation=rotation)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_real(result: dict, out: pathlib.Path, stem: str) -> list[str]:
  """Speedup per category (bars) with the bound (markers), and the peer's tokens/s."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  written = []
  summary = result["summary"]
  categories = list(dict.fromkeys(r["category"] for r in summary))
  series = list(dict.fromkeys((r["sampling"], r["drafter"]) for r in summary))
  x = np.arange(len(categories))
  width = 0.8 / max(len(series), 1)
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for i, (sampling, drafter) in enumerate(series):
    rows = {r["category"]: r for r in summary if (r["sampling"], r["drafter"]) == (sampling,
                                                                                  drafter)}
    offset = x - 0.4 + width * (i + 0.5)
    ax.bar(offset, [rows[c]["speedup"] for c in categories], width,
           label=f"{drafter}, {sampling}")
    ax.plot(offset, [rows[c]["bound"] for c in categories], "k_", markersize=12)
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xticks(x, categories, rotation=20)
  ax.set(ylabel="speedup over generate (bars); bound (black)",
         title=f"{result['model']}: speculative speedup by category")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / f"{stem}_speedup.png", dpi=90)
  plt.close(fig)
  written.append(f"{stem}_speedup.png")

  peer = [r for r in summary if "hf_generate_tokens_per_s" in r]
  if peer:
    drafter = peer[0]["drafter"]
    rows = {r["category"]: r for r in peer if r["drafter"] == drafter}
    keys = [("hf_generate_tokens_per_s", "transformers generate"),
            ("hf_prompt_lookup_tokens_per_s", "transformers prompt lookup"),
            ("generate_tokens_per_s", "specjax generate"),
            ("decode_tokens_per_s", f"specjax decode ({drafter})")]
    width = 0.8 / len(keys)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (key, label) in enumerate(keys):
      ax.bar(x - 0.4 + width * (i + 0.5), [rows[c][key] for c in categories], width, label=label)
    ax.set_xticks(x, categories, rotation=20)
    ax.set(ylabel="new tokens / s (greedy, batch 1)",
           title=f"{result['model']}: transformers vs specjax, same weights")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{stem}_peer.png", dpi=90)
    plt.close(fig)
    written.append(f"{stem}_peer.png")
  return written
