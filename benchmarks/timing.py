"""Timing harness: calls timed alternately in one process, single-forward costs, stream compare.

Every number the suites report is a ratio taken in one process: the calls being compared run
alternately (the order flips every repeat) after a warm-up call of each whose extra time is
reported as compile time, and each call ends with `jax.block_until_ready`.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


def time_alternately(calls: dict[str, Callable[[], Any]], repeats: int,
                     statistic: str = "min", warmup: bool = True) -> dict[str, dict]:
  """Times zero-argument calls alternately, after one warm-up call of each.

  The order flips every repeat (A B, B A, ...) so slow drift of a shared machine hits all calls
  alike.

  Args:
    calls: name -> zero-argument callable.
    repeats: timed calls of each.
    statistic: "min" or "median" of the timed calls, reported as `seconds`. On a shared machine
      "min" is the robust choice: other load only ever adds time.
    warmup: run each call once untimed first (False: the caller has compiled them already).

  Returns:
    `{name: {"seconds", "median_s", "min_s", "times_s", "first_call_s", "compile_s", "result"}}`
    where `compile_s` = first call - median (compilation and first-run costs; 0 without warm-up)
    and `result` is the output of the last call.
  """
  out: dict[str, dict] = {}
  for name, call in calls.items():
    out[name] = {"first_call_s": None, "times_s": [], "result": None}
    if warmup:
      start = time.perf_counter()
      out[name]["result"] = jax.block_until_ready(call())
      out[name]["first_call_s"] = time.perf_counter() - start
  names = list(calls)
  for repeat in range(repeats):
    for name in (names if repeat % 2 == 0 else names[::-1]):
      start = time.perf_counter()
      out[name]["result"] = jax.block_until_ready(calls[name]())
      out[name]["times_s"].append(time.perf_counter() - start)
  for entry in out.values():
    first = entry["first_call_s"]
    entry["median_s"] = statistics.median(entry["times_s"]) if entry["times_s"] else first
    entry["min_s"] = min(entry["times_s"], default=first)
    entry["compile_s"] = max(first - entry["median_s"], 0.0) if first is not None else 0.0
    entry["seconds"] = entry["min_s"] if statistic == "min" else entry["median_s"]
  return out


@functools.partial(jax.jit, static_argnames=("steps",), donate_argnames=("cache",))
def _forward_steps(model, tokens, starts, cache, *, steps: int):
  """`steps` forwards of one block in a device loop (the cache carried, as in decode's loop), so
  that per-call dispatch is amortised like it is inside `decode`'s `while_loop`."""

  def body(_, carry):
    logits, cache = carry
    out = model(tokens + (logits[:, :1, 0] > 1e30).astype(jnp.int32), starts, cache)
    return out.logits, out.cache

  # The logits' shape from the forward itself: a restricted output projection (a draft vocabulary)
  # has fewer columns than `model.vocab_size`.
  shape = jax.eval_shape(lambda: model(tokens, starts, cache).logits)
  logits = jnp.zeros(shape.shape, jnp.float32)
  return jax.lax.fori_loop(0, steps, body, (logits, cache))


def measure_costs(target, draft, *, batch: int, buffer_len: int, position: int,
                  num_drafts: tuple[int, ...], repeats: int = 10, steps: int = 8,
                  statistic: str = "min") -> dict:
  """Wall time of the single forwards a speculative round is made of.

  Each is a forward on a KV cache of the decode's size (`buffer_len` slots, `position` of them
  filled), run `steps` times in one jitted device loop with the cache carried (as in the decode
  loop; a Python dispatch per forward would dominate small models), timed alternately; the cost is
  a call's time over `steps`.

  Args:
    target: the target model.
    draft: a draft model, or None (a drafter without a forward of its own, e.g. n-gram lookup).
    batch: rows.
    buffer_len: KV cache slots.
    position: filled slots (where the timed block is written).
    num_drafts: the `k` values whose `(k + 1)`-token verify is timed.
    repeats: timed calls of each.
    steps: forwards per timed call.
    statistic: see `time_alternately`.

  Returns:
    `{"target_step_s", "draft_step_s" (None without a draft model), "verify_s": {k: seconds}}`.
  """
  models = {"target_step": (target, 1)}
  if draft is not None:
    models["draft_step"] = (draft, 1)
  for k in num_drafts:
    models[f"verify_{k}"] = (target, k + 1)
  state = {name: model.init_cache(batch, buffer_len) for name, (model, _) in models.items()}

  def call(name):
    model, width = models[name]
    tokens = jnp.ones((batch, width), jnp.int32)
    starts = jnp.full((batch,), position, jnp.int32)

    def run():
      logits, state[name] = _forward_steps(model, tokens, starts, state[name], steps=steps)
      return logits
    return run

  timed = time_alternately({name: call(name) for name in models}, repeats, statistic)
  per_step = {name: entry["seconds"] / steps for name, entry in timed.items()}
  return {
      "target_step_s": per_step["target_step"],
      "draft_step_s": per_step["draft_step"] if draft is not None else None,
      "verify_s": {k: per_step[f"verify_{k}"] for k in num_drafts},
  }


def tokens_per_s(entry: dict, tokens: int) -> float:
  """`tokens` over a `time_alternately` entry's `seconds`."""
  return tokens / entry["seconds"] if entry["seconds"] > 0 else float("nan")


def paired_speedup(record: dict) -> float:
  """Median over repeats of generate time / decode time of the two calls timed back to back.

  Adjacent calls see nearly the same background load, so on a shared machine this ratio is
  steadier than a ratio of two separately taken statistics.
  """
  pairs = [g / d for g, d in zip(record["generate"]["times_s"], record["decode"]["times_s"])]
  return statistics.median(pairs) if pairs else record["speedup"]


def first_divergence(a, b) -> int | None:
  """Index of the first differing token of two streams (length difference counts); None if equal."""
  a, b = list(map(int, a)), list(map(int, b))
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))
