"""The decode loop's state and the values that cross a round: `DecodeState`, `Proposal`.

Everything here sits below both the driver (`specjax.decode`, `specjax.stream`) and the round
(`specjax.round`), so neither imports the other for a type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache import KVCache
from specjax.outputs import DecodeOutput, DecodeStats

__all__ = ["DecodeOutput", "DecodeState", "DecodeStats", "Proposal", "check_confidence",
           "confident_count", "gather_tokens", "init_state", "prefill", "finish", "stopped_count",
           "target_features", "top_probability"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
  """One round of drafts.

  Attributes:
    tokens: `[B, k]` int32 draft tokens.
    logits: `[B, k, V]` float32 raw logits of the distribution each draft was sampled from, over
      the full vocabulary (`-inf` outside a reduced draft vocabulary); None = point mass (the
      drafter proposed deterministically: n-gram lookup, argmax).
    num_drafted: `[B]` int32 in `[0, k]`: row `b` proposes only `tokens[b, :num_drafted[b]]`
      (a confidence stop); later entries are not drafts, and the verify samples the token at
      slot `num_drafted[b]` from the target (the bonus). None = every row proposes all `k`.
    confidence: `[B, k]` float32 the drafter's top probability at each slot it decided (its
      stop rule's input; 0 past the slot where every row had stopped), or None.
  """

  tokens: jax.Array
  logits: jax.Array | None
  num_drafted: jax.Array | None = None
  confidence: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Everything the decode loop carries from one round to the next."""

  tokens: jax.Array  # [B, S] int32: prompt, generated tokens, scratch past `lengths`
  lengths: jax.Array  # [B] int32 valid tokens per row
  prompt_lengths: jax.Array  # [B] int32
  limits: jax.Array  # [B] int32: prompt length + max_new_tokens
  eos_ids: jax.Array  # [E] int32 stop ids, -1 = none
  done: jax.Array  # [B] bool
  seeds: jax.Array  # [B] uint32 per-row random-stream seeds (`sampling.row_seeds`)
  target_cache: KVCache  # [L, B, KVH, S, D] keys/values for tokens[:, :lengths - 1]
  draft_state: Any  # the drafter's own state (e.g. its KV cache)
  stats: DecodeStats


def check_confidence(confidence) -> float | None:
  """A drafter's confidence threshold: None (no stop) or a number in (0, 1]; else a ValueError."""
  if confidence is None:
    return None
  if isinstance(confidence, bool) or not isinstance(confidence, (int, float, np.floating)):
    raise ValueError(f"confidence must be None or a number in (0, 1], got {confidence!r}")
  if not 0.0 < float(confidence) <= 1.0:  # also rejects NaN
    raise ValueError(f"confidence must be in (0, 1] (the top probability below which a row stops "
                     f"drafting), got {confidence}")
  return float(confidence)


def top_probability(logits: jax.Array) -> jax.Array:
  """`max(softmax(logits))` over the last axis (temperature 1, no top-k / top-p): `[..., N]` ->
  `[...]` float32. A drafter's confidence in its next draft."""
  x = logits.astype(jnp.float32)
  return 1.0 / jnp.sum(jnp.exp(x - jnp.max(x, axis=-1, keepdims=True)), axis=-1)


def confident_count(confidences: jax.Array, threshold: float) -> jax.Array:
  """`[B, k]` top probabilities -> `[B]` int32 leading drafts whose confidence is >= threshold:
  a row stops at its first draft below the threshold (that one and later ones are not proposed)."""
  keep = (confidences >= threshold).astype(jnp.int32)
  return jnp.sum(jnp.cumprod(keep, axis=-1), axis=-1).astype(jnp.int32)


def stopped_count(confidences: jax.Array, stop) -> jax.Array:
  """`[B, k]` top probabilities -> `[B]` int32 leading drafts a stop rule keeps (the rule of
  `specjax.drafters.model.draft_chain`'s `stop`, applied draft by draft)."""
  batch, num_draft = confidences.shape
  stats, alive = stop.init(batch), jnp.ones((batch,), bool)
  count = jnp.zeros((batch,), jnp.int32)
  for index in range(num_draft):
    keep, stats = stop(index, confidences[:, index], stats)
    alive = alive & keep
    count = count + alive.astype(jnp.int32)
  return count


def gather_tokens(sequence: jax.Array, starts: jax.Array, width: int) -> jax.Array:
  """`sequence[b, starts[b] : starts[b] + width]` for every row: `[B, S]` -> `[B, width]`."""
  index = starts.astype(jnp.int32)[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, width]
  return jnp.take_along_axis(sequence, index, axis=1, mode="clip")


def clear_padding(tokens: jax.Array, lengths: jax.Array) -> jax.Array:
  """`tokens` with every id at or past its row's length set to 0: what pads a prompt (-1, an id
  outside the vocabulary) never reaches an embedding. Called at the top of the jitted loops."""
  width = tokens.shape[1]
  return jnp.where(jnp.arange(width, dtype=jnp.int32)[None] < lengths[:, None], tokens, 0)


def target_features(drafter) -> dict:
  """The keyword arguments that make the target's forward return what `drafter` reads: its
  `taps` and its final normed hidden state (`needs_hidden`). Only what it reads is passed, so
  models whose forward has no `taps` argument work with drafters that read none."""
  kwargs = dict(return_hidden=True) if drafter.needs_hidden else {}
  if drafter.taps:
    kwargs["taps"] = tuple(drafter.taps)
  return kwargs


def prefill(model, tokens, cache, **features):
  """The model's forward over right-padded prompts from position 0, with the `features` asked
  for (`target_features`)."""
  return model(tokens, jnp.zeros((tokens.shape[0],), jnp.int32), cache, **features)


def init_state(target, drafter, tokens, lengths, max_new_tokens, eos_ids, seeds, *,
               num_draft: int, capacity: int) -> DecodeState:
  """Prefills the target and the drafter on the prompts and builds the loop state.

  Args:
    target: the target model.
    drafter: a `specjax.Drafter`.
    tokens: `[B, T]` int32 right-padded prompts; `lengths` `[B]` their lengths.
    max_new_tokens: `[]` int32 (traced) number of new tokens per row at most.
    eos_ids: `[E]` int32 stop ids, `[-1]` for none.
    seeds: `[B]` uint32 per-row seeds (`specjax.sampling.row_seeds`).
    num_draft: `k` (a tree drafter: the tree's depth).
    capacity: static upper bound on `max_new_tokens` (the buffers' size).

  Returns:
    The state before the first round. The drafter's `init` gets the target's prefill output
    (with the taps and hidden state the drafter asks for).
  """
  batch, width = tokens.shape
  tokens = clear_padding(tokens, lengths)
  # Verification writes k + 1 slots past a row's length (a tree drafter: its `extra_slots`).
  buffer_len = width + capacity + getattr(drafter, "extra_slots", num_draft + 1)
  sequence = jnp.zeros((batch, buffer_len), jnp.int32).at[:, :width].set(tokens)
  out = prefill(target, tokens, target.init_cache(batch, buffer_len),
                **target_features(drafter))
  cache = out.cache.with_lengths(lengths - 1)  # the last prompt token is fed with the drafts
  zeros = jnp.zeros((batch,), jnp.int32)
  stats = DecodeStats(rounds=zeros, drafted=zeros, accepted=zeros,
                      accepted_per_position=jnp.zeros((batch, num_draft), jnp.int32),
                      target_calls=zeros + 1, draft_calls=zeros)
  return DecodeState(tokens=sequence, lengths=lengths, prompt_lengths=lengths,
                     limits=lengths + max_new_tokens,
                     eos_ids=jnp.atleast_1d(jnp.asarray(eos_ids, jnp.int32)),
                     done=jnp.zeros((batch,), bool), seeds=jnp.asarray(seeds, jnp.uint32),
                     target_cache=cache,
                     draft_state=drafter.init(tokens, lengths, buffer_len, out), stats=stats)


def finish(state: DecodeState, capacity: int, pad_id: int) -> DecodeOutput:
  """Cuts each row's new tokens out of the sequence buffer: `DecodeOutput` with `capacity` columns."""
  num_tokens = state.lengths - state.prompt_lengths
  index = jnp.arange(capacity, dtype=jnp.int32)
  new = jnp.take_along_axis(state.tokens, state.prompt_lengths[:, None] + index, axis=1,
                            mode="clip")
  new = jnp.where(index[None] < num_tokens[:, None], new, pad_id)
  return DecodeOutput(new, num_tokens, state.stats)

