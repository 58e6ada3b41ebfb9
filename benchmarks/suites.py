"""The pair and synthetic suites (`readme`, `speedup`, `synthetic`, `peer`, `tiny`) and `run`.

Each suite writes `<out>/<suite>.json` and PNG plots; `readme` also writes `README_table.md`,
`real` (see `benchmarks.real`) writes `real.json`, its plots and `real_table.md`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

from benchmarks.cases import case_line, speedup_case
from benchmarks.models import describe, environment, load_pair, prompts_for
from benchmarks.peer import run_peer
from benchmarks.real import json_default, run_real
from benchmarks.synthetic import SYNTHETIC_LABEL, random_pair
from benchmarks.timing import measure_costs
from specjax.core.sampling import Sampling


@dataclasses.dataclass
class Settings:
  """What one `specjax bench` run measures (filled from the command line and the suite)."""

  suite: str = "readme"
  model: str = "default"
  num_drafts: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
  batches: tuple[int, ...] = (1, 4, 16, 64)
  temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
  max_new_tokens: int = 128
  prompt_tokens: int = 64
  repeats: int = 3
  synthetic_sizes: tuple[str, ...] = ("12M", "50M", "126M")
  acceptances: tuple[float, ...] = (0.5, 0.8, 0.9)
  peer_prompts: int = 3
  statistic: str = "min"
  seed: int = 0
  # The real-model suite (`benchmarks.real`).
  prompts_per_category: int = 6
  categories: tuple[str, ...] = ()  # () = every category of the prompt file
  prompt_set: str = "real"  # benchmarks/prompts/<prompt_set>.json: "real" (Spec-Bench) or "agent"
  drafters: tuple[str, ...] = ()  # () = every drafter the library has
  peer: bool = True  # also time `transformers` on the same weights
  heads: tuple[str, ...] = ()  # trained head checkpoints to add to the drafters
  calibration: str | None = None  # for `NAME+adaptive` drafters; None = measured in the run


def _buffer_len(tokens, settings: Settings, num_draft: int) -> int:
  from specjax.core.validation import round_up
  from specjax.loop.decode import NEW_TOKEN_BUCKET
  return tokens.shape[1] + round_up(settings.max_new_tokens, NEW_TOKEN_BUCKET) + num_draft + 1


def _costs_for(target, draft, tokens, settings: Settings, num_drafts) -> dict:
  """Single-forward costs at the mid-generation position, for this batch's cache size."""
  return measure_costs(target, draft, batch=tokens.shape[0],
                       buffer_len=_buffer_len(tokens, settings, max(num_drafts)),
                       position=tokens.shape[1] + settings.max_new_tokens // 2,
                       num_drafts=tuple(num_drafts), repeats=max(5, 2 * settings.repeats),
                       statistic=settings.statistic)


def run_speedup_grid(pair, settings: Settings, *, num_drafts, batches, temperatures,
                     synthetic_acceptance: float | None = None, log=print) -> list[dict]:
  """`speedup_case` over a grid; one cost measurement per batch size."""
  target, draft, _, description = pair
  records = []
  for batch in batches:
    tokens, lengths = prompts_for(pair, settings, batch)
    costs = _costs_for(target, draft, tokens, settings, num_drafts)
    for temperature in temperatures:
      for k in num_drafts:
        record = speedup_case(target, draft, tokens, lengths, num_draft=k,
                              sampling=Sampling(temperature=temperature),
                              max_new_tokens=settings.max_new_tokens, repeats=settings.repeats,
                              costs=costs, synthetic_acceptance=synthetic_acceptance,
                              seed=settings.seed, statistic=settings.statistic)
        record["pair"] = description
        records.append(record)
        log(case_line(record))
  return records


def run_synthetic(settings: Settings, *, sizes, acceptances, num_drafts, batches,
                  log=print) -> list[dict]:
  """Synthetic-acceptance speedups for random targets of each size (greedy)."""
  records = []
  for size in sizes:
    target, draft = random_pair(size, seed=settings.seed,
                                vocab_size=64 if size == "tiny" else 8192,
                                max_len=256 if size == "tiny" else 1024)
    pair = (target, draft, None, f"random weights ({size})")
    log(f"synthetic: target {size} ({target.config.num_params() / 1e6:.1f}M params), draft "
        f"{draft.config.num_params() / 1e6:.2f}M")
    for batch in batches:
      tokens, lengths = prompts_for(pair, settings, batch)
      costs = _costs_for(target, draft, tokens, settings, num_drafts)
      for a in acceptances:
        for k in num_drafts:
          record = speedup_case(target, draft, tokens, lengths, num_draft=k, sampling=Sampling(),
                                max_new_tokens=settings.max_new_tokens, repeats=settings.repeats,
                                costs=costs, synthetic_acceptance=a, seed=settings.seed,
                                statistic=settings.statistic)
          record.update(pair=pair[3], target_size=size, target=describe(target),
                        draft=describe(draft))
          records.append(record)
          log(case_line(record))
      del costs
  return records


def run(settings: Settings, out: pathlib.Path, *, plots: bool = True, log=print) -> dict:
  """Runs one suite, writes `<out>/<suite>.json` (+ plots, + a markdown table) and returns it."""
  if settings.suite == "real":
    return run_real(settings, out, plots=plots, log=log)
  out.mkdir(parents=True, exist_ok=True)
  result: dict = {"suite": settings.suite, "settings": dataclasses.asdict(settings),
                  "environment": environment(), "files": []}
  start, cpu_start = time.perf_counter(), time.process_time()
  suite = settings.suite
  stem = suite
  if suite in ("readme", "speedup", "peer", "tiny"):
    pair = load_pair(settings.model, seed=settings.seed)
    result["pair"] = {"description": pair[3], "target": describe(pair[0]),
                      "draft": describe(pair[1])}
    log(f"{pair[3]}: target {pair[0].config.num_params() / 1e6:.2f}M params, draft "
        f"{pair[1].config.num_params() / 1e6:.2f}M")
  if suite == "speedup":
    result["pair_records"] = run_speedup_grid(
        pair, settings, num_drafts=settings.num_drafts, batches=settings.batches,
        temperatures=settings.temperatures, log=log)
  if suite in ("readme", "tiny"):
    # Batch 1 greedy over every k; then the other temperatures and batches at the best k.
    records = run_speedup_grid(pair, settings, num_drafts=settings.num_drafts, batches=(1,),
                               temperatures=(0.0,), log=log)
    best_k = max(records, key=lambda r: r["speedup"])["num_draft"]
    result["best_k"] = best_k
    log(f"best k at batch 1, greedy: {best_k}")
    records += run_speedup_grid(pair, settings, num_drafts=(best_k,), batches=(1,),
                                temperatures=[t for t in settings.temperatures if t > 0], log=log)
    records += run_speedup_grid(pair, settings, num_drafts=(best_k,),
                                batches=[b for b in settings.batches if b > 1],
                                temperatures=(0.0,), log=log)  # the full grid: --suite speedup
    result["pair_records"] = records
  if suite in ("synthetic", "readme", "tiny"):
    batches = settings.batches if suite == "synthetic" else (1,)
    num_drafts = settings.num_drafts if suite == "synthetic" else (4, 6)
    if suite == "tiny":
      num_drafts = settings.num_drafts
    result["synthetic_label"] = SYNTHETIC_LABEL
    synthetic_settings = settings
    if suite == "readme":  # the big random target is slow on a CPU: fewer tokens and repeats
      synthetic_settings = dataclasses.replace(settings,
                                               max_new_tokens=min(settings.max_new_tokens, 64),
                                               repeats=min(settings.repeats, 2))
    result["synthetic_records"] = run_synthetic(
        synthetic_settings, sizes=settings.synthetic_sizes, acceptances=settings.acceptances,
        num_drafts=num_drafts, batches=batches, log=log)
  if suite in ("peer", "readme", "tiny"):
    k = result.get("best_k") or settings.num_drafts[0]
    result["peer"] = run_peer(pair, settings, num_draft=k, log=log)
  result["wall_s"] = time.perf_counter() - start
  result["process_cpu_s"] = time.process_time() - cpu_start  # all threads; < wall x cores if shared
  if plots:
    from benchmarks.plots import plot_records
    if result.get("pair_records"):
      result["files"] += plot_records(result["pair_records"], out, stem)
    if result.get("synthetic_records"):
      result["files"] += plot_records(result["synthetic_records"], out, f"{stem}_synthetic")
  (out / f"{suite}.json").write_text(json.dumps(result, indent=1, default=json_default) + "\n")
  result["files"].append(f"{suite}.json")
  if suite in ("readme", "tiny"):
    from benchmarks.report import readme_table
    name = "README_table.md" if suite == "readme" else "tiny_table.md"
    (out / name).write_text(readme_table(result))
    result["files"].append(name)
  log(f"wrote {', '.join(result['files'])} to {out} in {result['wall_s']:.0f}s")
  return result
