"""`specjax bench`: speedup of speculative decoding, against the analytic bound and against a peer.

Every number here is a ratio taken in one process: `specjax.decode` and `specjax.generate` (or a
peer's two generation modes) are called alternately, after a warm-up call of each whose time is
reported as compile time, and each call ends with `jax.block_until_ready`. Speed is new tokens per
wall-clock second, median over the repeats.

Suites (`--suite`):

* `speedup`: a target/draft pair (the shipped pair, or random weights) over k, batch and
  temperature: tokens/s of both, acceptance rate, mean accepted length, and the analytic bound of
  DESIGN.md from the measured acceptance and the measured costs of one draft step, one target step
  and one `(k + 1)`-token verify (jitted single forwards on a cache of the decode's size).
  Efficiency = measured speedup / bound.
* `synthetic`: random-weight targets of growing size with a **synthetic-acceptance** verify rule
  (`synthetic_verify`): every draft is accepted with probability `a` from an on-device hash of the
  round seed. Benchmark only: the output is not the target's distribution (with a random draft
  greedy identity does not hold), and every record says so.
* `peer`: the same weights exported to a Hugging Face Llama directory (`specjax.io.export_hf`):
  `transformers` greedy `generate` and assisted generation (`assistant_model=`) against specjax
  `generate` and `decode`, with tokens/s, each one's speculative speedup and a token-by-token
  comparison of the greedy streams (first divergence reported).
* `readme`: the README table: the shipped pair at batch 1, greedy, k = 1..8; at the best k the
  other temperatures (batch 1) and the other batches (greedy); the synthetic 126M target at
  a = 0.8; and the peer comparison.
* `tiny`: all of the above with tiny random models and a few tokens (the tests run this).

Each suite writes `<out>/<suite>.json` and PNG plots; `readme` also writes `README_table.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import decode
from specjax.generate import generate
from specjax.models.config import ModelConfig
from specjax.models.transformer import Model, init_params
from specjax.sampling import (PURPOSE_RESIDUAL, Sampling, VerifyResult, _leading_true,
                              sample_token, uniform)

SYNTHETIC_LABEL = ("SYNTHETIC ACCEPTANCE (benchmark only): each draft is accepted with a fixed "
                   "probability, not by the exact rule; outputs are not the target's "
                   "distribution and greedy identity does not hold")
PURPOSE_SYNTHETIC = 101  # a random stream of its own, apart from the exact rule's purposes
DEFAULT_OUT = pathlib.Path("benchmarks/results")

# Random-weight targets for the synthetic mode (Llama layout; parameters with vocab 8192).
SYNTHETIC_SIZES = {
    "tiny": dict(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64),
    "12M": dict(embed_dim=256, num_layers=6, num_heads=4, num_kv_heads=4, head_dim=64,
                mlp_dim=1024),
    "50M": dict(embed_dim=512, num_layers=10, num_heads=8, num_kv_heads=8, head_dim=64,
                mlp_dim=2048),
    "126M": dict(embed_dim=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64,
                 mlp_dim=3072),
    "400M": dict(embed_dim=1024, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=64,
                 mlp_dim=4096),
}
SYNTHETIC_DRAFT = dict(embed_dim=128, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=64,
                       mlp_dim=256)


# ---------------------------------------------------------------------------------------------
# The synthetic-acceptance verify rule.


@functools.lru_cache(maxsize=None)  # one function object per rate: `decode` compiles it once
def synthetic_verify(acceptance: float) -> Callable[..., VerifyResult]:
  """A verify rule (signature of `specjax.sampling.verify_reference`) accepting at a fixed rate.

  Draft `j` of a row is accepted with probability `acceptance`, independently, decided by a
  counter-based hash of the round seed, the row and the position (on device, deterministic); the
  leading accepted drafts are kept and the target's own choice (argmax, or a sample at temperature
  > 0) at the first rejection (or the bonus position) follows. BENCHMARK ONLY: this is not exact.

  Args:
    acceptance: the per-draft acceptance probability, in [0, 1].

  Returns:
    The rule, for `specjax.decode(..., verify_impl=rule)`.
  """
  acceptance = float(acceptance)
  if not 0.0 <= acceptance <= 1.0:
    raise ValueError(f"synthetic acceptance must be in [0, 1], got {acceptance}")

  def rule(target_logits, draft_logits, draft_tokens, *, sampling: Sampling, seeds,
           positions) -> VerifyResult:
    del draft_logits
    batch, k = draft_tokens.shape
    seeds = jnp.asarray(seeds, jnp.uint32)
    index = jnp.arange(k + 1, dtype=jnp.int32)
    token_positions = positions.astype(jnp.int32)[:, None] + index  # [B, k+1]
    u = uniform(seeds[:, None], token_positions[:, :k], 0, PURPOSE_SYNTHETIC)  # [B, k]
    num_accepted = _leading_true(u < jnp.float32(acceptance))
    choice = sample_token(target_logits, sampling, seeds[:, None], token_positions,
                          PURPOSE_RESIDUAL)  # [B, k+1]
    final = jnp.take_along_axis(choice, num_accepted[:, None], axis=1)[:, 0]
    tokens = jnp.where(index[None, :k] < num_accepted[:, None], draft_tokens.astype(jnp.int32), 0)
    tokens = jnp.concatenate([tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    tokens = jnp.where(index[None] == num_accepted[:, None], final[:, None], tokens)
    return VerifyResult(num_accepted, tokens)

  rule.__name__ = f"synthetic_verify_{acceptance}"
  rule.synthetic_acceptance = acceptance
  return rule


# ---------------------------------------------------------------------------------------------
# Timing.


def time_alternately(calls: dict[str, Callable[[], Any]], repeats: int,
                     statistic: str = "min") -> dict[str, dict]:
  """Times zero-argument calls alternately after one warm-up call of each.

  The order flips every repeat (A B, B A, ...) so slow drift of a shared machine hits all calls
  alike.

  Returns:
    `{name: {"seconds", "median_s", "min_s", "times_s", "first_call_s", "compile_s", "result"}}`
    where `seconds` is the `statistic` ("min" or "median") of the timed calls, `compile_s` = first
    call - median (compilation and first-run costs) and `result` is the output of the last call.
    On a shared machine "min" is the robust choice: other load only ever adds time.
  """
  out: dict[str, dict] = {}
  for name, call in calls.items():
    start = time.perf_counter()
    result = jax.block_until_ready(call())
    out[name] = {"first_call_s": time.perf_counter() - start, "times_s": [], "result": result}
  names = list(calls)
  for repeat in range(repeats):
    for name in (names if repeat % 2 == 0 else names[::-1]):
      start = time.perf_counter()
      out[name]["result"] = jax.block_until_ready(calls[name]())
      out[name]["times_s"].append(time.perf_counter() - start)
  for entry in out.values():
    entry["median_s"] = statistics.median(entry["times_s"]) if entry["times_s"] else \
        entry["first_call_s"]
    entry["min_s"] = min(entry["times_s"], default=entry["first_call_s"])
    entry["compile_s"] = max(entry["first_call_s"] - entry["median_s"], 0.0)
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

  width = tokens.shape[1]
  logits = jnp.zeros((tokens.shape[0], width, model.vocab_size), jnp.float32)
  return jax.lax.fori_loop(0, steps, body, (logits, cache))


def measure_costs(target: Model, draft: Model | None, *, batch: int, buffer_len: int,
                  position: int, num_drafts: tuple[int, ...], repeats: int = 10,
                  steps: int = 8, statistic: str = "min") -> dict:
  """Wall time of the single forwards a speculative round is made of.

  Each is a forward on a KV cache of the decode's size (`buffer_len` slots, `position` of them
  filled), run `steps` times in one jitted device loop with the cache carried (as in the decode
  loop; a Python dispatch per forward would dominate small models), timed alternately; the cost is
  a call's time over `steps`.

  Returns:
    `{"target_step_s", "draft_step_s" (None without a draft model), "verify_s": {k: seconds}}`,
    medians of `repeats` calls each.
  """
  models = {"target_step": (target, 1)}
  if draft is not None:
    models["draft_step"] = (draft, 1)
  for k in num_drafts:
    models[f"verify_{k}"] = (target, k + 1)
  state = {}
  for name, (model, width) in models.items():
    state[name] = model.init_cache(batch, buffer_len)

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


def per_token_acceptance(accepted_per_position, rounds: int) -> float:
  """The conditional per-draft acceptance `a` of DESIGN.md's bound, from decode statistics.

  `accepted / drafted` is not that `a`: draft `j` is only tried when drafts `0 .. j-1` were
  accepted. With `n_j` acceptances at position `j` (summed over rows and rounds), draft `j` was
  reached `n_{j-1}` times (`rounds` times for `j = 0`), so the estimate is
  `sum_j n_j / (rounds + sum_{j < k-1} n_j)`.
  """
  counts = [int(n) for n in accepted_per_position]
  reached = rounds + sum(counts[:-1])
  return sum(counts) / reached if reached else 0.0


def expected_tokens_per_round(acceptance: float, num_draft: int) -> float:
  """`(1 - a^(k+1)) / (1 - a)`: tokens per round with i.i.d. per-draft acceptance `a`."""
  if acceptance >= 1.0:
    return float(num_draft + 1)
  return (1.0 - acceptance ** (num_draft + 1)) / (1.0 - acceptance)


def analytic_bound(acceptance: float, num_draft: int, draft_ratio: float,
                   verify_ratio: float) -> float:
  """DESIGN.md's ideal speedup: expected tokens per round / (k * c + verify / target step)."""
  return expected_tokens_per_round(acceptance, num_draft) / (num_draft * draft_ratio
                                                             + verify_ratio)


# ---------------------------------------------------------------------------------------------
# One speedup measurement.


def _tokens_per_s(entry: dict, tokens: int) -> float:
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


def speedup_case(target: Model, draft, tokens, lengths, *, num_draft: int, sampling: Sampling,
                 max_new_tokens: int, repeats: int, costs: dict | None,
                 synthetic_acceptance: float | None = None, seed: int = 0,
                 statistic: str = "min") -> dict:
  """Times `decode` against `generate` alternately on one batch and derives the bound.

  Args:
    target, draft: the pair (`draft` may be any drafter).
    tokens, lengths: `[B, T]` prompts and `[B]` lengths.
    num_draft: k.
    sampling: sampling settings for both calls.
    max_new_tokens: new tokens per row (no EOS stop: every call does the same work).
    repeats: timed calls of each after the warm-up.
    costs: `measure_costs` output for this batch (None: no bound).
    synthetic_acceptance: if set, decode with `synthetic_verify(a)` (labelled in the record).
    seed: PRNG seed of both calls.
    statistic: "min" or "median" of the timed calls (see `time_alternately`).

  Returns:
    A JSON-ready record.
  """
  rng = jax.random.key(seed)
  verify_impl = "auto" if synthetic_acceptance is None else synthetic_verify(synthetic_acceptance)
  calls = {
      "generate": lambda: generate(target, tokens, rng, lengths=lengths,
                                   max_new_tokens=max_new_tokens, sampling=sampling),
      "decode": lambda: decode(target, draft, tokens, rng, lengths=lengths,
                               max_new_tokens=max_new_tokens, num_draft=num_draft,
                               sampling=sampling, verify_impl=verify_impl),
  }
  timed = time_alternately(calls, repeats, statistic)
  plain, spec = timed["generate"]["result"], timed["decode"]["result"]
  produced = int(np.sum(np.asarray(spec.num_tokens)))
  stats = spec.stats.summary()
  record = {
      "num_draft": num_draft,
      "batch": int(tokens.shape[0]),
      "prompt_tokens": int(tokens.shape[1]),
      "temperature": sampling.temperature,
      "max_new_tokens": max_new_tokens,
      "synthetic_acceptance": synthetic_acceptance,
      "label": SYNTHETIC_LABEL if synthetic_acceptance is not None else "exact",
      "repeats": repeats,
      "statistic": statistic,
  }
  for name in ("generate", "decode"):
    entry = timed[name]
    record[name] = {"tokens_per_s": _tokens_per_s(entry, produced), "seconds": entry["seconds"],
                    "median_s": entry["median_s"],
                    "min_s": entry["min_s"], "compile_s": entry["compile_s"],
                    "times_s": entry["times_s"]}
  record["speedup"] = timed["generate"]["seconds"] / timed["decode"]["seconds"]
  record["speedup_median"] = timed["generate"]["median_s"] / timed["decode"]["median_s"]
  record["speedup_paired"] = paired_speedup(record)
  record["acceptance_rate"] = stats["acceptance_rate"]  # accepted / drafted
  record["acceptance_per_token"] = per_token_acceptance(stats["accepted_per_position"],
                                                        stats["rounds"])
  record["mean_accepted_length"] = stats["tokens_per_round"]
  record["accepted_per_position"] = stats["accepted_per_position"]
  record["rounds"] = stats["rounds"]
  if sampling.greedy and synthetic_acceptance is None:
    mismatch = [row for row in range(tokens.shape[0])
                if first_divergence(np.asarray(plain.tokens[row]), np.asarray(spec.tokens[row]))
                is not None]
    record["greedy_identical"] = not mismatch
    record["greedy_mismatch_rows"] = mismatch
  if costs is not None:
    target_s = costs["target_step_s"]
    draft_ratio = 0.0 if costs["draft_step_s"] is None else costs["draft_step_s"] / target_s
    verify_ratio = costs["verify_s"][num_draft] / target_s
    a = record["acceptance_per_token"]
    record["costs"] = {"target_step_s": target_s, "draft_step_s": costs["draft_step_s"],
                       "verify_s": costs["verify_s"][num_draft], "draft_ratio": draft_ratio,
                       "verify_ratio": verify_ratio}
    record["bound"] = analytic_bound(a, num_draft, draft_ratio, verify_ratio)
    # The same bound with the measured tokens per round in place of the i.i.d. formula.
    record["bound_measured_length"] = stats["tokens_per_round"] / (num_draft * draft_ratio
                                                                   + verify_ratio)
    record["efficiency"] = record["speedup"] / record["bound"]
    # Per-round wall time the single-forward costs predict vs what the loop took.
    # Where decode's time goes: the rounds the slowest row took, priced at the single-forward
    # costs, against the measured call; likewise generate's steps against one target step.
    rounds = int(np.max(np.asarray(spec.stats.rounds)))
    predicted = rounds * (num_draft * (costs["draft_step_s"] or 0.0)
                          + costs["verify_s"][num_draft])
    record["decode_rounds"] = rounds
    record["decode_predicted_s"] = predicted
    record["decode_overhead_fraction"] = 1.0 - predicted / record["decode"]["seconds"]
    record["generate_step_s"] = record["generate"]["seconds"] / max_new_tokens
    record["generate_overhead_fraction"] = 1.0 - target_s / record["generate_step_s"]
  return record


# ---------------------------------------------------------------------------------------------
# Models and prompts.


def random_pair(target_size: str, *, vocab_size: int = 8192, max_len: int = 1024,
                draft: dict | None = None, seed: int = 0) -> tuple[Model, Model]:
  """A random-weight target of a `SYNTHETIC_SIZES` size and a small random draft."""
  common = dict(vocab_size=vocab_size, max_len=max_len, bos_id=1, eos_id=2, pad_id=0)
  target_config = ModelConfig(**common, **SYNTHETIC_SIZES[target_size])
  draft_fields = SYNTHETIC_SIZES["tiny"] if target_size == "tiny" else (draft or SYNTHETIC_DRAFT)
  draft_config = ModelConfig(**common, **draft_fields)
  keys = jax.random.split(jax.random.key(seed))
  return init_params(target_config, keys[0]), init_params(draft_config, keys[1])


def random_prompts(batch: int, prompt_tokens: int, vocab_size: int, seed: int = 0):
  ids = np.random.default_rng(seed).integers(3, vocab_size, (batch, prompt_tokens))
  return jnp.asarray(ids, jnp.int32), jnp.full((batch,), prompt_tokens, jnp.int32)


def heldout_prompt_texts(count: int, prompt_chars: int = 600) -> list[str]:
  """Prompts cut from the held-out corpus split: the text before a `def ` (ending with it)."""
  from specjax import corpus
  documents = corpus.load("heldout")
  texts = []
  for document in documents:
    text = document.text
    starts = [i for i in range(len(text)) if text.startswith("\n    def ", i)
              or text.startswith("\ndef ", i)]
    starts = [i for i in starts if i >= prompt_chars // 2]
    if not starts:
      continue
    cut = starts[len(starts) // 2]
    end = text.index("def ", cut) + len("def ")
    texts.append(text[max(0, end - prompt_chars):end])
    if len(texts) >= count:
      break
  return texts


def encode_prompts(tokenizer, texts: list[str], prompt_tokens: int, batch: int):
  """`[batch, prompt_tokens]` prompts (each keeps its last `prompt_tokens` tokens; rows cycle)."""
  rows = []
  for i in range(batch):
    ids = tokenizer.encode(texts[i % len(texts)])
    rows.append(ids[-prompt_tokens:])
  width = min(len(r) for r in rows)
  rows = [r[-width:] for r in rows]
  return jnp.asarray(rows, jnp.int32), jnp.full((batch,), width, jnp.int32)


def load_pair(kind: str, *, seed: int = 0):
  """(`target`, `draft`, `tokenizer` or None, description) for a `--model` value.

  `kind` is "default" (the shipped pair), a random size of `SYNTHETIC_SIZES`,
  "ckpt:TARGET_DIR,DRAFT_DIR,TOKENIZER_JSON" (specjax checkpoints) or
  "runs:TARGET_RUN,DRAFT_RUN[,TOKENIZER_JSON]" (the latest states of `specjax train` runs; the
  tokenizer defaults to the shipped one).
  """
  if kind == "default":
    import specjax as sj
    pair = sj.load_default()
    return pair.target, pair.draft, pair.tokenizer, "shipped pair (specjax.load_default())"
  if kind.startswith(("ckpt:", "runs:")):
    from specjax.io.orbax import load
    from specjax.io.tokenizer import load_tokenizer
    paths = kind[5:].split(",")
    if len(paths) == 2 and kind.startswith("runs:"):
      from specjax.default import TOKENIZER_FILE, default_dir
      try:
        paths.append(str(default_dir() / TOKENIZER_FILE))
      except FileNotFoundError:
        paths.append(str(pathlib.Path(__file__).resolve().parent.parent / "checkpoints"
                         / TOKENIZER_FILE))
    if len(paths) != 3:
      raise ValueError(f"--model {kind}: expected {kind[:5]}TARGET,DRAFT,TOKENIZER")
    if kind.startswith("runs:"):
      from specjax.train import load_run
      target, draft = load_run(paths[0])[0], load_run(paths[1])[0]
    else:
      target, draft = load(paths[0], dtype=jnp.float32), load(paths[1], dtype=jnp.float32)
    return (target.astype(jnp.float32), draft.astype(jnp.float32), load_tokenizer(paths[2]),
            f"pair from {kind}")
  target, draft = random_pair(kind, seed=seed, vocab_size=64 if kind == "tiny" else 8192,
                              max_len=256 if kind == "tiny" else 1024)
  return target, draft, None, f"random weights ({kind})"


def default_pair_available() -> bool:
  try:
    from specjax.default import default_dir
    default_dir()
    return True
  except (FileNotFoundError, ImportError):
    return False


def _describe(model: Model) -> dict:
  c = model.config
  return {"params": c.num_params(), "embed_dim": c.embed_dim, "num_layers": c.num_layers,
          "vocab_size": c.vocab_size, "dtype": str(model.dtype)}


def environment() -> dict:
  device = jax.devices()[0]
  return {
      "platform": device.platform,
      "device": getattr(device, "device_kind", str(device)),
      "num_devices": jax.device_count(),
      "cpu_count": os.cpu_count(),
      "machine": platform.machine(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }


# ---------------------------------------------------------------------------------------------
# Suites.


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


def _prompts_for(pair, settings: Settings, batch: int):
  target, _, tokenizer, _ = pair
  if tokenizer is None:
    return random_prompts(batch, settings.prompt_tokens, target.vocab_size, settings.seed)
  texts = heldout_prompt_texts(max(batch, settings.peer_prompts))
  return encode_prompts(tokenizer, texts, settings.prompt_tokens, batch)


def _buffer_len(tokens, settings: Settings, num_draft: int) -> int:
  from specjax.validation import round_up
  from specjax.decode import NEW_TOKEN_BUCKET
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
    tokens, lengths = _prompts_for(pair, settings, batch)
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
        log(_case_line(record))
  return records


def _case_line(r: dict) -> str:
  bound = f" bound {r['bound']:.2f}x eff {r['efficiency']:.2f}" if "bound" in r else ""
  synthetic = f" SYNTHETIC a={r['synthetic_acceptance']}" if r["synthetic_acceptance"] else ""
  return (f"  B={r['batch']:<3d} T={r['temperature']:<4} k={r['num_draft']}{synthetic}: "
          f"generate {r['generate']['tokens_per_s']:8.1f} tok/s, decode "
          f"{r['decode']['tokens_per_s']:8.1f} tok/s, speedup {r['speedup']:.2f}x{bound}, "
          f"accept {r['acceptance_rate']:.2f} (per token {r['acceptance_per_token']:.2f}), "
          f"len {r['mean_accepted_length']:.2f}")


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
      tokens, lengths = _prompts_for(pair, settings, batch)
      costs = _costs_for(target, draft, tokens, settings, num_drafts)
      for a in acceptances:
        for k in num_drafts:
          record = speedup_case(target, draft, tokens, lengths, num_draft=k, sampling=Sampling(),
                                max_new_tokens=settings.max_new_tokens, repeats=settings.repeats,
                                costs=costs, synthetic_acceptance=a, seed=settings.seed,
                                statistic=settings.statistic)
          record.update(pair=pair[3], target_size=size, target=_describe(target),
                        draft=_describe(draft))
          records.append(record)
          log(_case_line(record))
      del costs
  return records


def _fastest_torch_threads(model) -> tuple[int, dict]:
  """Sets torch's intra-op threads to whichever of (its default, 1) generates faster here.

  On a shared or oversubscribed CPU torch's spinning thread pool can be several times slower with
  all cores than with one; the peer gets its better setting.
  """
  import torch

  ids = torch.ones((1, 8), dtype=torch.long)
  probe = {}
  for threads in dict.fromkeys((torch.get_num_threads(), 1)):
    torch.set_num_threads(threads)
    best = float("inf")
    with torch.no_grad():
      for _ in range(3):
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                       do_sample=False)
        best = min(best, time.perf_counter() - start)
    probe[threads] = 16 / best
  chosen = max(probe, key=probe.get)
  torch.set_num_threads(chosen)
  return chosen, {str(k): v for k, v in probe.items()}


def run_peer(pair, settings: Settings, *, num_draft: int, workdir: str | None = None,
             log=print) -> dict:
  """specjax vs `transformers` on the same weights, batch 1, greedy, prompt by prompt.

  The pair is exported with `specjax.io.export_hf` and loaded with
  `LlamaForCausalLM.from_pretrained` in float32. Four calls per prompt are timed alternately:
  `transformers` greedy `generate`, its assisted generation (`assistant_model=` with
  `num_assistant_tokens=k` and a constant schedule, so both sides draft `k` per round), specjax
  `generate` and specjax `decode`. No EOS stop: each produces exactly `max_new_tokens` tokens.

  Returns:
    A record with tokens/s of each, each side's speculative speedup, the specjax/`transformers`
    ratio, and per prompt whether the four greedy streams are identical (first divergence).
  """
  import torch
  from transformers import LlamaForCausalLM

  from specjax.io.export_hf import export_hf

  target, draft, _, description = pair
  own_dir = workdir is None
  workdir = workdir or tempfile.mkdtemp(prefix="specjax_peer_")
  target_dir = export_hf(target.astype(jnp.float32), pathlib.Path(workdir) / "target",
                         overwrite=True)
  draft_dir = export_hf(draft.astype(jnp.float32), pathlib.Path(workdir) / "draft",
                        overwrite=True)
  hf_target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
  hf_draft = LlamaForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
  for model in (hf_target, hf_draft):
    model.generation_config.eos_token_id = None  # no EOS stop, as on the specjax side
    model.generation_config.pad_token_id = target.config.pad_id
  new = settings.max_new_tokens
  greedy = Sampling()
  threads, thread_probe = _fastest_torch_threads(hf_target)
  rng = jax.random.key(settings.seed)

  tokens, lengths = _prompts_for(pair, dataclasses.replace(settings, peer_prompts=max(
      settings.peer_prompts, 1)), settings.peer_prompts)
  totals = {name: 0.0 for name in ("hf_generate", "hf_assisted", "specjax_generate",
                                   "specjax_decode")}
  compile_s = dict.fromkeys(totals, 0.0)
  prompts = []
  for row in range(tokens.shape[0]):
    ids, length = tokens[row:row + 1], lengths[row:row + 1]
    input_ids = torch.tensor(np.asarray(ids), dtype=torch.long)
    mask = torch.ones_like(input_ids)

    def hf_call(assisted):
      def call():
        kwargs = dict(assistant_model=hf_draft, num_assistant_tokens=num_draft,
                      num_assistant_tokens_schedule="constant") if assisted else {}
        with torch.no_grad():
          out = hf_target.generate(input_ids, attention_mask=mask, max_new_tokens=new,
                                   do_sample=False, **kwargs)
        return np.asarray(out[0, input_ids.shape[1]:])
      return call

    calls = {
        "hf_generate": hf_call(False),
        "hf_assisted": hf_call(True),
        "specjax_generate": lambda: generate(target, ids, rng, lengths=length,
                                             max_new_tokens=new, sampling=greedy).tokens,
        "specjax_decode": lambda: decode(target, draft, ids, rng, lengths=length,
                                         max_new_tokens=new, num_draft=num_draft,
                                         sampling=greedy).tokens,
    }
    timed = time_alternately(calls, settings.repeats, settings.statistic)
    streams = {name: np.asarray(entry["result"]).reshape(-1) for name, entry in timed.items()}
    for name, entry in timed.items():
      totals[name] += entry["seconds"]
      compile_s[name] += entry["compile_s"]
    reference = streams["specjax_generate"]
    prompts.append({
        "row": row,
        "new_tokens": {name: int(s.size) for name, s in streams.items()},
        "first_divergence_from_specjax_generate": {
            name: first_divergence(reference, s) for name, s in streams.items()
            if name != "specjax_generate"},
    })
    log(f"  peer prompt {row}: " + ", ".join(
        f"{name} {new / timed[name]['seconds']:.1f} tok/s" for name in calls))
  produced = new * tokens.shape[0]
  speed = {name: produced / seconds for name, seconds in totals.items()}
  identical = all(all(d is None for d in p["first_divergence_from_specjax_generate"].values())
                  for p in prompts)
  if own_dir:
    import shutil
    shutil.rmtree(workdir, ignore_errors=True)
  return {
      "pair": description,
      "num_draft": num_draft,
      "batch": 1,
      "prompts": int(tokens.shape[0]),
      "prompt_tokens": int(tokens.shape[1]),
      "max_new_tokens": new,
      "torch_threads": threads,
      "torch_threads_probe_tokens_per_s": thread_probe,
      "tokens_per_s": speed,
      "compile_s": compile_s,
      "hf_speculative_speedup": speed["hf_assisted"] / speed["hf_generate"],
      "specjax_speculative_speedup": speed["specjax_decode"] / speed["specjax_generate"],
      "specjax_decode_over_hf_assisted": speed["specjax_decode"] / speed["hf_assisted"],
      "specjax_generate_over_hf_generate": speed["specjax_generate"] / speed["hf_generate"],
      "greedy_streams_identical": identical,
      "per_prompt": prompts,
  }


# ---------------------------------------------------------------------------------------------
# Plots and the README table.


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


def readme_table(result: dict) -> str:
  """The markdown table the README quotes, from a `readme` suite result."""
  env = result["environment"]
  lines = [f"<!-- written by `specjax bench --suite readme` on {env['date']} -->",
           f"Measured on {env['device']} ({env['platform']}, {env['cpu_count']} cores, "
           f"jax {env['jax']}), float32, {result['settings']['max_new_tokens']} new tokens per "
           f"row, ratios of calls timed alternately in one process ({result['settings']['statistic']}"
           f" of {result['settings']['repeats']} timed calls each after a warm-up). speedup = "
           "generate time / decode time; paired = median of that ratio over back-to-back call "
           "pairs; bound = DESIGN.md's analytic speedup from the measured per-token acceptance a "
           "and measured draft-step, target-step and (k+1)-verify costs; efficiency = speedup / "
           "bound.", ""]
  pair = result.get("pair_records") or []
  if pair:
    lines += [f"**{pair[0]['pair']}**: `decode` vs `generate` (best k per row)", "",
              "| batch | temperature | k | generate tok/s | decode tok/s | speedup | paired | "
              "bound | efficiency | a (per token) | tokens/round |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    best: dict = {}
    for r in pair:
      key = (r["batch"], r["temperature"])
      if key not in best or r["speedup"] > best[key]["speedup"]:
        best[key] = r
    for (batch, temperature), r in sorted(best.items()):
      lines.append(f"| {batch} | {temperature} | {r['num_draft']} | "
                   f"{r['generate']['tokens_per_s']:.0f} | {r['decode']['tokens_per_s']:.0f} | "
                   f"**{r['speedup']:.2f}x** | {paired_speedup(r):.2f}x | {r['bound']:.2f}x | "
                   f"{r['efficiency']:.2f} | {r['acceptance_per_token']:.2f} | {r['mean_accepted_length']:.2f} |")
    lines.append("")
  synthetic = result.get("synthetic_records") or []
  if synthetic:
    lines += ["**Synthetic acceptance** (benchmark-only rule: each draft accepted with probability "
              f"a; random weights; not exact; greedy; {synthetic[0]['max_new_tokens']} new tokens)",
              "",
              "| target | params | batch | a (set / measured) | k | generate tok/s | decode tok/s | "
              "speedup | paired | bound | efficiency |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in synthetic:
      lines.append(f"| {r['target_size']} | {r['target']['params'] / 1e6:.0f}M | {r['batch']} | "
                   f"{r['synthetic_acceptance']} / {r['acceptance_per_token']:.2f} | {r['num_draft']} | "
                   f"{r['generate']['tokens_per_s']:.1f} | {r['decode']['tokens_per_s']:.1f} | "
                   f"**{r['speedup']:.2f}x** | {paired_speedup(r):.2f}x | {r['bound']:.2f}x | "
                   f"{r['efficiency']:.2f} |")
    lines.append("")
  peer = result.get("peer")
  if peer:
    s = peer["tokens_per_s"]
    lines += [f"**Same weights, transformers vs specjax** ({peer['pair']}, batch 1, greedy, "
              f"k={peer['num_draft']}, CPU float32)", "",
              "| | plain tok/s | speculative tok/s | speculative speedup |", "|---|---|---|---|",
              f"| transformers (`generate`, `assistant_model=`) | {s['hf_generate']:.1f} | "
              f"{s['hf_assisted']:.1f} | {peer['hf_speculative_speedup']:.2f}x |",
              f"| specjax (`generate`, `decode`) | {s['specjax_generate']:.1f} | "
              f"{s['specjax_decode']:.1f} | {peer['specjax_speculative_speedup']:.2f}x |", "",
              f"specjax `decode` / transformers assisted: "
              f"**{peer['specjax_decode_over_hf_assisted']:.2f}x**; greedy token streams "
              f"identical: **{'yes' if peer['greedy_streams_identical'] else 'NO'}**", ""]
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line.


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
  return tuple(float(x) for x in text.split(",") if x.strip())


def _strings(text: str) -> tuple[str, ...]:
  return tuple(x.strip() for x in text.split(",") if x.strip())


SUITES = ("readme", "speedup", "synthetic", "peer", "tiny")

# Per-suite defaults; command-line flags override them.
SUITE_DEFAULTS = {
    "readme": dict(num_drafts=(1, 2, 3, 4, 5, 6, 7, 8), batches=(1, 4, 16),
                   temperatures=(0.0, 0.7, 1.0), max_new_tokens=128,
                   synthetic_sizes=("126M",), acceptances=(0.8,), peer_prompts=3, repeats=5),
    "speedup": dict(num_drafts=(1, 2, 3, 4, 5, 6, 7, 8), batches=(1, 4, 16, 64),
                    temperatures=(0.0, 0.7, 1.0), max_new_tokens=128, repeats=3),
    "synthetic": dict(num_drafts=(2, 4, 6, 8), batches=(1, 4), max_new_tokens=64, repeats=2,
                      synthetic_sizes=("12M", "50M", "126M", "400M"),
                      acceptances=(0.5, 0.8, 0.9)),
    "peer": dict(num_drafts=(4,), max_new_tokens=128, repeats=3, peer_prompts=3),
    "tiny": dict(model="tiny", num_drafts=(1, 2), batches=(1, 2), temperatures=(0.0, 1.0),
                 max_new_tokens=8, prompt_tokens=8, repeats=1, synthetic_sizes=("tiny",),
                 acceptances=(0.8,), peer_prompts=1),
}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
  """Declares the `specjax bench` arguments (on `parser` if given, e.g. a CLI subparser)."""
  parser = parser or argparse.ArgumentParser(prog="specjax bench", description=__doc__.split(
      "\n")[0])
  parser.add_argument("--suite", choices=SUITES, default="readme",
                      help="what to measure (default: readme, the README table)")
  parser.add_argument("--model", default=None,
                      help="'default' (the shipped pair) or a random size: "
                      + ", ".join(SYNTHETIC_SIZES))
  parser.add_argument("--k", dest="num_drafts", type=_ints, default=None,
                      help="comma-separated draft lengths, e.g. 1,2,4")
  parser.add_argument("--batch", dest="batches", type=_ints, default=None, help="e.g. 1,4,16,64")
  parser.add_argument("--temperature", dest="temperatures", type=_floats, default=None,
                      help="e.g. 0,0.7,1")
  parser.add_argument("--max-new-tokens", type=int, default=None)
  parser.add_argument("--prompt-tokens", type=int, default=None)
  parser.add_argument("--repeats", type=int, default=None, help="timed calls of each after warm-up")
  parser.add_argument("--sizes", dest="synthetic_sizes", type=_strings, default=None,
                      help="synthetic target sizes, e.g. 50M,126M")
  parser.add_argument("--acceptance", dest="acceptances", type=_floats, default=None,
                      help="synthetic acceptance rates, e.g. 0.5,0.8")
  parser.add_argument("--peer-prompts", type=int, default=None)
  parser.add_argument("--statistic", choices=("min", "median"), default=None,
                      help="per-call time over the repeats (default min: robust on a shared "
                      "machine, where other load only adds time)")
  parser.add_argument("--out", default=str(DEFAULT_OUT), help="results directory")
  parser.add_argument("--no-plots", action="store_true")
  return parser


def settings_from_args(args) -> Settings:
  fields = dict(SUITE_DEFAULTS[args.suite])
  for field in dataclasses.fields(Settings):
    value = getattr(args, field.name, None)
    if value is not None and field.name != "suite":
      fields[field.name] = value
  fields["suite"] = args.suite
  if "model" not in fields:
    fields["model"] = "default" if default_pair_available() else "12M"
  return Settings(**fields)


def run(settings: Settings, out: pathlib.Path, *, plots: bool = True, log=print) -> dict:
  """Runs one suite, writes `<out>/<suite>.json` (+ plots, + README_table.md) and returns it."""
  out.mkdir(parents=True, exist_ok=True)
  result: dict = {"suite": settings.suite, "settings": dataclasses.asdict(settings),
                  "environment": environment(), "files": []}
  start, cpu_start = time.perf_counter(), time.process_time()
  suite = settings.suite
  stem = suite
  if suite in ("readme", "speedup", "peer", "tiny"):
    pair = load_pair(settings.model, seed=settings.seed)
    result["pair"] = {"description": pair[3], "target": _describe(pair[0]),
                      "draft": _describe(pair[1])}
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
    if result.get("pair_records"):
      result["files"] += plot_records(result["pair_records"], out, stem)
    if result.get("synthetic_records"):
      result["files"] += plot_records(result["synthetic_records"], out, f"{stem}_synthetic")
  (out / f"{suite}.json").write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
  result["files"].append(f"{suite}.json")
  if suite in ("readme", "tiny"):
    name = "README_table.md" if suite == "readme" else "tiny_table.md"
    (out / name).write_text(readme_table(result))
    result["files"].append(name)
  log(f"wrote {', '.join(result['files'])} to {out} in {result['wall_s']:.0f}s")
  return result


def _json_default(value):
  if isinstance(value, (np.integer,)):
    return int(value)
  if isinstance(value, (np.floating,)):
    return float(value)
  if isinstance(value, np.ndarray):
    return value.tolist()
  raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def main(argv: list[str] | None = None) -> int:
  """`specjax bench` entry point: parses `argv` and runs the suite."""
  args = build_parser().parse_args(argv)
  return run_args(args)


def run_args(args) -> int:
  """Runs a suite from parsed arguments (shared by `main` and the `specjax` CLI)."""
  settings = settings_from_args(args)
  run(settings, pathlib.Path(args.out), plots=not args.no_plots,
      log=lambda line: print(line, flush=True))
  return 0


if __name__ == "__main__":
  sys.exit(main())
