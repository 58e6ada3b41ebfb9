"""The decode loop's state: `DecodeState`, the prefill that builds it and the output it becomes.

Everything here sits below both the driver (`specjax.decode`, `specjax.loop.stream`) and the
round (`specjax.loop.round`), so neither imports the other for a type. What a drafter returns each
round is `specjax.drafters.proposal.Proposal`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.core.cache import KVCache
from specjax.core.sequence import clear_padding
from specjax.core.outputs import DecodeOutput, DecodeStats
from specjax.models.prefill import prefill as model_prefill

__all__ = ["DecodeOutput", "DecodeState", "DecodeStats", "init_state", "prefill", "finish",
           "target_features"]


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
  # [B, S] float32 with `return_logprobs` (else None): at each generated token's slot of `tokens`,
  # its log-probability under the target (`specjax.core.sampling.token_logprobs`)
  logprobs: jax.Array | None = None


def target_features(drafter) -> dict:
  """The keyword arguments that make the target's forward return what `drafter` reads: its
  `taps` and its final normed hidden state (`needs_hidden`). Only what it reads is passed, so
  models whose forward has no `taps` argument work with drafters that read none."""
  kwargs = dict(return_hidden=True) if drafter.needs_hidden else {}
  if drafter.taps:
    kwargs["taps"] = tuple(drafter.taps)
  return kwargs


def prefill(model, tokens, cache, lengths=None, **features):
  """The model's forward over right-padded prompts from position 0, with the `features` asked
  for (`target_features`): `specjax.models.prefill.prefill` (from a model that
  `selects_logit_rows`, the logits of each row's last prompt token only, `[B, 1, V]`; off CPU, a
  large prompt batch in chunks)."""
  return model_prefill(model, tokens, cache, lengths, **features)


def init_state(target, drafter, tokens, lengths, max_new_tokens, eos_ids, seeds, *,
               num_draft: int, capacity: int, logprobs: bool = False) -> DecodeState:
  """Prefills the target and the drafter on the prompts and builds the loop state.

  Args:
    target: the target model.
    drafter: a `specjax.drafters.Drafter`.
    tokens: `[B, T]` int32 right-padded prompts; `lengths` `[B]` their lengths.
    max_new_tokens: `[]` int32 (traced) number of new tokens per row at most.
    eos_ids: `[E]` int32 stop ids, `[-1]` for none.
    seeds: `[B]` uint32 per-row seeds (`specjax.core.sampling.row_seeds`).
    num_draft: `k` (a tree drafter: the tree's depth).
    capacity: static upper bound on `max_new_tokens` (the buffers' size).
    logprobs: keep each generated token's log-probability under the target (`DecodeState.logprobs`,
      written by the verify from the logits it scored the token with; no extra forward).

  Returns:
    The state before the first round. The drafter's `init` gets the target's prefill output
    (`prefill`: the taps and hidden state the drafter asks for; from a model that
    `selects_logit_rows`, the logits of each row's last prompt token only, `[B, 1, V]`).
  """
  batch, width = tokens.shape
  tokens = clear_padding(tokens, lengths)
  # Verification writes k + 1 slots past a row's length (a tree drafter: its tree block).
  buffer_len = width + capacity + drafter.extra_slots(num_draft)
  sequence = jnp.zeros((batch, buffer_len), jnp.int32).at[:, :width].set(tokens)
  out = prefill(target, tokens, target.init_cache(batch, buffer_len), lengths,
                **target_features(drafter))
  # The drafter's prefill (a draft model's own cache) starts after the target's has finished:
  # without the order XLA:TPU may build the draft cache first, and then the target's prefill
  # runs with both caches and its own chunk temporaries live at once (the program's peak).
  # `optimization_barrier` is the identity; it only fixes the order.
  out_cache, draft_tokens = jax.lax.optimization_barrier((out.cache, tokens))
  out = out._replace(cache=out_cache)  # a `ForwardOutput` (the model protocol)
  cache = out_cache.with_lengths(lengths - 1)  # the last prompt token is fed with the drafts
  zeros = jnp.zeros((batch,), jnp.int32)
  stats = DecodeStats(rounds=zeros, drafted=zeros, accepted=zeros,
                      accepted_per_position=jnp.zeros((batch, num_draft), jnp.int32),
                      target_calls=zeros + 1, draft_calls=zeros, emitted=zeros,
                      nonfinite=jnp.zeros((batch,), bool),
                      constraint_dead=jnp.zeros((batch,), bool), forced=zeros)
  return DecodeState(tokens=sequence, lengths=lengths, prompt_lengths=lengths,
                     limits=lengths + max_new_tokens,
                     eos_ids=jnp.atleast_1d(jnp.asarray(eos_ids, jnp.int32)),
                     done=jnp.zeros((batch,), bool), seeds=jnp.asarray(seeds, jnp.uint32),
                     target_cache=cache,
                     draft_state=drafter.init(draft_tokens, lengths, buffer_len, out), stats=stats,
                     logprobs=jnp.zeros((batch, buffer_len), jnp.float32) if logprobs else None)


def finish(state: DecodeState, capacity: int, pad_id: int) -> DecodeOutput:
  """Cuts each row's new tokens out of the sequence buffer: `DecodeOutput` with `capacity`
  columns."""
  num_tokens = state.lengths - state.prompt_lengths
  index = jnp.arange(capacity, dtype=jnp.int32)
  new = jnp.take_along_axis(state.tokens, state.prompt_lengths[:, None] + index, axis=1,
                            mode="clip")
  new = jnp.where(index[None] < num_tokens[:, None], new, pad_id)
  logprobs = None
  if state.logprobs is not None:
    logprobs = jnp.take_along_axis(state.logprobs, state.prompt_lengths[:, None] + index, axis=1,
                                   mode="clip")
    logprobs = jnp.where(index[None] < num_tokens[:, None], logprobs, 0.0)
  return DecodeOutput(new, num_tokens, state.stats, logprobs)

