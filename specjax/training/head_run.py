"""A resumable head-training run: `train_head` (also `specjax train head`).

A run directory holds `run.json` (the configs, the data chunks, the draft vocabulary's source),
`draft_ids.npy`, Orbax train states under `state/step_NNNNNN` (the newest two are kept),
`log.jsonl` (one record per logged step and per evaluation) and, at the end, the trained network
under `head/`. Calling `train_head` again on the same directory resumes from the newest complete
state; because batches are a pure function of the step, the result equals an uninterrupted run
bitwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import time
from typing import Callable, Sequence

import jax
import numpy as np

from specjax.drafters.eagle import network as eagle
from specjax.drafters.medusa import network as medusa
from specjax.models.transformer import Model
from specjax.training import heads as heads_lib
from specjax.training import selfdistill

STATE_DIR = "state"
HEAD_DIR = "head"


def _save_state(run_dir: pathlib.Path, state: dict, keep: int = 2):
  from specjax.io.orbax import save_tree
  step = int(state["step"])
  path = run_dir / STATE_DIR / f"step_{step:06d}"
  save_tree(path, state, {"step": step}, overwrite=True)
  done = sorted(p for p in (run_dir / STATE_DIR).iterdir() if p.name.startswith("step_"))
  for old in done[:-keep]:
    shutil.rmtree(old, ignore_errors=True)


def _latest_state(run_dir: pathlib.Path, abstract: dict):
  """The newest restorable state, or None; an unreadable newest one falls back to the previous."""
  from specjax.io.orbax import restore_tree
  root = run_dir / STATE_DIR
  if not root.is_dir():
    return None
  for path in sorted((p for p in root.iterdir() if p.name.startswith("step_")), reverse=True):
    try:
      return restore_tree(path, abstract)[0]
    except (ValueError, FileNotFoundError):
      continue
  return None


def _load_network(path):
  from specjax.io.orbax import read_tree_metadata
  kind = read_tree_metadata(path).get("kind")
  return medusa.load_medusa(path) if kind == medusa.MEDUSA_KIND else eagle.load_head(path)


def _initial_network(network, target: Model, draft_ids: np.ndarray,
                     config: heads_lib.HeadTrainConfig):
  """The saved network to start from, its draft vocabulary grown to `draft_ids` if larger; a
  sequential EAGLE-3/MTP head that starts a parallel run gets fresh placeholder slots
  (`network.init_placeholders` with the run's seed), its other weights kept."""
  network = _with_slots(network, config)
  own = np.asarray(network.draft_ids)
  if own.shape == draft_ids.shape:
    return network
  if isinstance(network, medusa.MedusaHeads) or own.shape[0] > draft_ids.shape[0]:
    raise ValueError(f"the saved head has a draft vocabulary of {own.shape[0]} ids; a run can "
                     f"only grow an EAGLE-3/MTP head's vocabulary (asked for {draft_ids.shape[0]})")
  return heads_lib.extend_draft_vocab(network, target, draft_ids)


def _with_slots(network, config: heads_lib.HeadTrainConfig):
  """`network` with the placeholder slots the run trains (`config.parallel`: ttt_steps - 2)."""
  if isinstance(network, medusa.MedusaHeads):
    return network
  have = int(network.config.parallel)
  want = config.ttt_steps - 2 if config.parallel else 0
  if have == want:
    return network
  if have:
    raise ValueError(f"the saved head has {have} placeholder slots; this run trains "
                     + (f"{want} (--ttt-steps {config.ttt_steps})" if want else
                        "a sequential head (no --parallel)")
                     + ": start from a sequential head or match --ttt-steps")
  slots = eagle.init_placeholders(jax.random.PRNGKey(config.seed), want,
                                  network.config.embed_dim)
  return eagle.EagleHead(dict(network.params, **slots),
                         dataclasses.replace(network.config, parallel=want))


def save_network(network, path, *, dtype=None, overwrite=True):
  """Saves an EagleHead or MedusaHeads (Orbax)."""
  if isinstance(network, medusa.MedusaHeads):
    network = network if dtype is None else network.astype(dtype)
    return medusa.save_medusa(network, path, overwrite=overwrite)
  return eagle.save_head(network, path, overwrite=overwrite, dtype=dtype)


def _evaluate(state, data: selfdistill.HeadData | None, target, d2t, static, config, batches):
  if data is None:
    return {}
  sums: dict[str, float] = {}
  for i in range(batches):
    batch = data.batch_at(i)
    metrics = heads_lib.eval_step(state["params"], batch, target.params["embed"], d2t,
                                  static=static, config=config)
    for key, value in metrics.items():
      sums[key] = sums.get(key, 0.0) + float(value) / batches
  chains = [sums[k] for k in sorted(sums) if k.startswith("chain")]
  sums["tau_proxy"] = 1.0 + float(sum(chains))
  return {f"eval_{k}": round(v, 5) for k, v in sums.items()}


def train_head(target: Model, data_dir: str | os.PathLike, run_dir: str | os.PathLike,
               config: heads_lib.HeadTrainConfig, *, chunks: Sequence[int],
               eval_chunks: Sequence[int] = (), vocab_chunks: Sequence[int] | None = None,
               rows_per_chunk: int = 64, log_every: int = 10, eval_every: int = 200,
               eval_batches: int = 4, checkpoint_every: int = 100, max_steps: int | None = None,
               progress: bool = True, train_on_prompts: bool = False, context: int | None = None,
               init_from: str | os.PathLike | None = None, log: Callable[[str], None] = print):
  """Trains (or resumes) a head on self-distillation chunks; returns the trained network.

  Args:
    target: the frozen target.
    data_dir: folder of `chunk_NNNN.npz` (see `selfdistill.generate_chunks`).
    run_dir: the run's folder (created; an existing run with the same config resumes).
    config: hyperparameters.
    chunks: chunk indices used for training (the first epoch waits for missing ones).
    eval_chunks: held-out chunk indices (greedy ones give a faithful acceptance proxy).
    vocab_chunks: chunks whose answer-token counts pick the draft vocabulary (default: the first
      eight of `chunks`).
    rows_per_chunk: rows per chunk (the generator's batch size).
    log_every / eval_every / checkpoint_every: in steps.
    eval_batches: batches of held-out evaluation.
    max_steps: stop (with a checkpoint) after this step, e.g. to test resumption; the schedule
      still spans `config.steps`.
    progress: show a rich progress bar.
    train_on_prompts: also train on prompt positions (evaluation stays on answers).
    context: windows start this many tokens before the answer (None: at the conversation start).
    init_from: start from this saved network instead of a fresh one; its draft vocabulary is kept,
      or grown with the most frequent other ids of `vocab_chunks` when `config.draft_vocab_size`
      is larger (EAGLE-3/MTP heads; `heads.extend_draft_vocab`).
    log: sink for one-line JSON records (also appended to `log.jsonl`).

  Returns:
    The trained `EagleHead` or `MedusaHeads` (float32), also saved under `run_dir/head` when the
    run reaches `config.steps`.
  """
  run_dir = pathlib.Path(run_dir)
  run_dir.mkdir(parents=True, exist_ok=True)
  chunks = [int(i) for i in chunks]
  vocab_chunks = [int(i) for i in (vocab_chunks if vocab_chunks is not None else chunks[:8])]
  record = {"config": dataclasses.asdict(config), "chunks": chunks,
            "eval_chunks": [int(i) for i in eval_chunks], "vocab_chunks": vocab_chunks,
            "rows_per_chunk": rows_per_chunk, "train_on_prompts": bool(train_on_prompts),
            "context": context, "init_from": str(init_from) if init_from else None,
            "data_dir": str(pathlib.Path(data_dir).resolve())}
  start = _load_network(init_from) if init_from is not None else None  # read once
  own = np.zeros((0,), np.int32) if start is None else np.asarray(start.draft_ids)
  run_file = run_dir / "run.json"
  if run_file.exists():
    stored = json.loads(run_file.read_text())
    if stored != record:
      raise ValueError(f"{run_dir} holds a different run (run.json differs); use a new folder")
    draft_ids = np.load(run_dir / "draft_ids.npy")
  else:
    if start is not None and config.draft_vocab_size <= own.shape[0]:
      draft_ids, entry = own, None  # the saved head's own vocabulary
    else:  # the most frequent answer ids (keeping a saved head's own ids when it grows)
      for i in vocab_chunks:
        selfdistill.wait_for_chunk(data_dir, i)
      counts = selfdistill.token_counts(data_dir, vocab_chunks, target.config.vocab_size)
      draft_ids = selfdistill.frequent_ids(counts, config.draft_vocab_size, keep=own)
      share = lambda ids: round(float(counts[ids].sum() / max(counts.sum(), 1)), 4)
      entry = {"draft_vocab": int(len(draft_ids)), "coverage_of_vocab_chunks": share(draft_ids),
               "vocab_tokens": int(counts.sum())}
      if start is not None:
        entry.update(grown_from=int(own.shape[0]), coverage_before=share(own))
    np.save(run_dir / "draft_ids.npy", draft_ids)
    run_file.write_text(json.dumps(record, indent=1))
    if entry is not None:
      log(json.dumps(entry))

  network = (heads_lib.init_network(config, target, draft_ids) if start is None
             else _initial_network(start, target, draft_ids, config))
  params, d2t, static = heads_lib.split_network(network)
  state = heads_lib.init_state(config, params)
  restored = _latest_state(run_dir, state)
  if restored is not None:
    state = restored
    log(json.dumps({"resumed_at": int(state["step"])}))
  pad = target.config.pad_id
  data = selfdistill.HeadData(data_dir, chunks, batch_size=config.batch_size,
                              seq_len=config.seq_len, rows_per_chunk=rows_per_chunk,
                              seed=config.seed, pad_id=pad, answers_only=not train_on_prompts,
                              context=context)
  eval_data = (selfdistill.HeadData(data_dir, list(eval_chunks), batch_size=config.batch_size,
                                    seq_len=config.seq_len, rows_per_chunk=rows_per_chunk,
                                    seed=config.seed + 1, pad_id=pad, context=context)
               if eval_chunks else None)
  stop = min(config.steps, max_steps) if max_steps is not None else config.steps
  log_file = (run_dir / "log.jsonl").open("a")

  def emit(entry: dict):
    line = json.dumps(entry)
    log_file.write(line + "\n")
    log_file.flush()
    log(line)

  bar = None
  if progress:
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn)
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
    task = bar.add_task(f"train {config.kind}", total=stop, completed=int(state["step"]),
                        info="")
    bar.start()
  began, tokens_seen = time.perf_counter(), 0
  try:
    while int(state["step"]) < stop:
      step = int(state["step"])
      batch = data.batch_at(step)
      state, metrics = heads_lib.train_step(state, batch, target.params["embed"], d2t,
                                            static=static, config=config)
      tokens_seen += int(batch["mask"].sum())
      step += 1
      if step % log_every == 0 or step == stop:
        entry = {"step": step, **{k: round(float(v), 5) for k, v in metrics.items()},
                 "answer_tokens_per_s": round(tokens_seen / (time.perf_counter() - began), 1)}
        emit(entry)
        if bar is not None:
          bar.update(task, completed=step, info=f"loss {entry['loss']:.3f} acc0 "
                     f"{entry['acc0']:.3f}")
      elif bar is not None:
        bar.update(task, completed=step)
      if step % eval_every == 0 or step == stop:
        emit({"step": step, **_evaluate(state, eval_data, target, d2t, static, config,
                                        eval_batches)})
      if step % checkpoint_every == 0 or step == stop:
        _save_state(run_dir, state)
  finally:
    if bar is not None:
      bar.stop()
    log_file.close()
  network = heads_lib.join_network(state["params"], d2t, static)
  if int(state["step"]) >= config.steps:
    save_network(network, run_dir / HEAD_DIR)
  return network


def export_head(target: Model, run_dir: str | os.PathLike, path: str | os.PathLike, *,
                dtype=None):
  """Saves the network of a run's newest train state (finished or not) to `path`.

  Returns:
    `(network, step)`.
  """
  run_dir = pathlib.Path(run_dir)
  record = json.loads((run_dir / "run.json").read_text())
  config = heads_lib.HeadTrainConfig(**record["config"])
  draft_ids = np.load(run_dir / "draft_ids.npy")
  params, d2t, static = heads_lib.split_network(
      heads_lib.init_network(config, target, draft_ids))
  state = _latest_state(run_dir, heads_lib.init_state(config, params))
  if state is None:
    raise FileNotFoundError(f"no train state in {run_dir}")
  network = heads_lib.join_network(state["params"], d2t, static)
  save_network(network, path, dtype=dtype)
  return network, int(state["step"])
