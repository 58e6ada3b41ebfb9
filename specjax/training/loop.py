"""The training loop of `lm` and `distill` runs: resumable, with rich progress and JSON logs.

The batch of a step is a pure function of the step (`corpus.batch_at`), so a run resumed from an
Orbax checkpoint reaches bitwise the same state as an uninterrupted one."""

from __future__ import annotations

import functools
import json
import os
import time

import jax.numpy as jnp
import numpy as np

from specjax.training import corpus
from specjax.models.config import ModelConfig
from specjax.models.transformer import Model
from specjax.training.distill import distill_step
from specjax.training.lm import lm_step
from specjax.training.state import TrainConfig, init_state, restore_state, save_state


def train(model_config: ModelConfig, config: TrainConfig, stream: np.ndarray, *,
          target: Model | None = None, checkpoint_dir: str | os.PathLike | None = None,
          checkpoint_every_s: float = 300.0, stop_at: int | None = None, progress: bool = True,
          log_path: str | os.PathLike | None = None) -> dict:
  """Runs (or resumes) training until `config.steps` (or `stop_at`) steps are done.

  Args:
    model_config: the architecture being trained.
    config: hyperparameters; `config.steps` fixes the schedule.
    stream: `[N]` int32 training tokens (`corpus.token_stream`).
    target: the frozen target, for `task="distill"`.
    checkpoint_dir: where to save and resume the train state; None = no checkpoints.
    checkpoint_every_s: wall-clock seconds between checkpoints (and one at the end).
    stop_at: stop after this many steps (a partial run, e.g. to test resuming).
    progress: show a rich progress bar with loss and tokens/s.
    log_path: append one JSON line of metrics per logged step.

  Returns:
    The final train state.
  """
  if config.task == "distill":
    if target is None:
      raise ValueError("task='distill' needs the target model")
    if target.vocab_size != model_config.vocab_size:
      raise ValueError("draft and target vocabularies differ")
    target = target.astype(jnp.float32)
  state = restore_state(checkpoint_dir, model_config, config) if checkpoint_dir else None
  if state is None:
    state = init_state(model_config, config)
  end = config.steps if stop_at is None else min(stop_at, config.steps)
  first = int(state["step"])
  tokens_per_step = config.batch_size * config.seq_len

  if config.task == "lm":
    step_fn = functools.partial(lm_step, model_config=model_config, config=config)
  else:
    step_fn = functools.partial(distill_step, target=target, model_config=model_config,
                                config=config)

  log = open(log_path, "a") if log_path else None
  bar = _Progress(first, end, enabled=progress)
  last_save = time.monotonic()
  start_time = time.monotonic()
  try:
    for step in range(first, end):
      batch = jnp.asarray(corpus.batch_at(stream, step, config.batch_size, config.seq_len,
                                          config.seed))
      state, metrics = step_fn(state, batch)
      done = step + 1
      if done % 10 == 0 or done == end:
        metrics = {k: float(v) for k, v in metrics.items()}
        elapsed = time.monotonic() - start_time
        rate = (done - first) * tokens_per_step / max(elapsed, 1e-9)
        bar.update(done, metrics["loss"], rate)
        if log:
          log.write(json.dumps({"step": done, "time": round(elapsed, 1),
                                "tokens_per_s": round(rate, 1), **metrics}) + "\n")
          log.flush()
      if checkpoint_dir and (time.monotonic() - last_save > checkpoint_every_s or done == end):
        save_state(checkpoint_dir, state, model_config, config)
        last_save = time.monotonic()
  finally:
    bar.close()
    if log:
      log.close()
  return state

class _Progress:
  """A rich progress bar showing loss and tokens/s (a no-op when disabled)."""

  def __init__(self, first: int, total: int, enabled: bool):
    self._bar = None
    if not enabled:
      return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                         TextColumn("loss {task.fields[loss]:.4f}"),
                         TextColumn("{task.fields[rate]:,.0f} tok/s"), TimeElapsedColumn(),
                         TimeRemainingColumn())
    self._bar.start()
    self._task = self._bar.add_task("train", total=total, completed=first, loss=float("nan"),
                                    rate=0.0)

  def update(self, step: int, loss: float, rate: float):
    if self._bar is not None:
      self._bar.update(self._task, completed=step, loss=loss, rate=rate)

  def close(self):
    if self._bar is not None:
      self._bar.stop()
