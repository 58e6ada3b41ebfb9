"""Speculative decoding: one jit, one `lax.while_loop` over draft/verify rounds, fixed shapes.

Each round every live row drafts `k` tokens (`draft_step`), the target verifies them in one forward
pass over `k + 1` positions (`verify_block`), and the row appends its accepted drafts plus one
target token. Rows accept different numbers of tokens per round and each advances by its own
count: nothing advances a batch by its minimum acceptance.

Invariants at the start of a round, per row `b` with `L = lengths[b]`:
  * `tokens[b, :L]` is the prompt plus everything generated so far;
  * the target cache holds keys/values for `tokens[b, :L - 1]` (the last token is fed together with
    the drafts, which gives the target's distribution at all `k + 1` positions);
  * the drafter's state holds some prefix of `tokens[b, :L - 1]` and catches up by itself.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax import validation
from specjax.cache import KVCache
from specjax.draft import Proposal, as_drafter
from specjax.generate import NEW_TOKEN_BUCKET, check_model, check_sampling, resolve_pad_id
from specjax.outputs import DecodeOutput, DecodeStats
from specjax.sampling import GREEDY, Sampling, seed_from_key
from specjax.tracing import TRACE_COUNTS
from specjax.verify import check_verify_impl, verify_block

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
  round: jax.Array  # [] int32
  target_cache: KVCache  # [L, B, S, KVH, D] keys/values for tokens[:, :lengths - 1]
  draft_state: Any  # the drafter's own state (e.g. its KV cache)
  stats: DecodeStats


def init_state(target, drafter, tokens, lengths, max_new_tokens, eos_ids, *, num_draft: int,
               capacity: int) -> DecodeState:
  """Prefills the target and the drafter on the prompts and builds the loop state.

  Args:
    target: the target model.
    drafter: a `Drafter`.
    tokens: `[B, T]` int32 right-padded prompts; `lengths` `[B]` their lengths.
    max_new_tokens: `[]` int32 (traced) number of new tokens per row at most.
    eos_ids: `[E]` int32 stop ids, `[-1]` for none.
    num_draft: `k`.
    capacity: static upper bound on `max_new_tokens` (the buffers' size).
  """
  batch, width = tokens.shape
  buffer_len = width + capacity + num_draft + 1  # verification writes k+1 past a row's length
  sequence = jnp.zeros((batch, buffer_len), jnp.int32).at[:, :width].set(tokens)
  cache = target.init_cache(batch, buffer_len)
  cache = target(tokens, jnp.zeros((batch,), jnp.int32), cache).cache.with_lengths(lengths - 1)
  zeros = jnp.zeros((batch,), jnp.int32)
  stats = DecodeStats(rounds=zeros, drafted=zeros, accepted=zeros,
                      accepted_per_position=jnp.zeros((batch, num_draft), jnp.int32),
                      target_calls=zeros + 1, draft_calls=zeros)
  return DecodeState(tokens=sequence, lengths=lengths, prompt_lengths=lengths,
                     limits=lengths + max_new_tokens,
                     eos_ids=jnp.atleast_1d(jnp.asarray(eos_ids, jnp.int32)),
                     done=jnp.zeros((batch,), bool), round=jnp.int32(0), target_cache=cache,
                     draft_state=drafter.init(tokens, lengths, buffer_len), stats=stats)


def draft_step(drafter, state: DecodeState, key: jax.Array, *, num_draft: int,
               sampling: Sampling) -> tuple[DecodeState, Proposal]:
  """Proposes `num_draft` tokens per row after each row's current sequence.

  Args:
    drafter: a `Drafter` (wrap a draft model with `specjax.draft.as_drafter`).
    state: the decode state.
    key: this round's PRNG key (`verify_block` gets the same one).
    num_draft: `k`.
    sampling: the sampling settings (identical to the target's).

  Returns:
    `(state with the drafter's new state, Proposal(tokens [B, k], logits [B, k, V] or None))`.
  """
  batch = state.tokens.shape[0]
  draft_state, proposal = drafter.propose(
      state.draft_state, state.tokens, state.lengths, num_draft=num_draft, sampling=sampling,
      seed=seed_from_key(key), rows=jnp.arange(batch, dtype=jnp.int32))
  calls = num_draft if getattr(drafter, "model", None) is not None else 0  # model forwards
  live = (~state.done).astype(jnp.int32)
  stats = dataclasses.replace(state.stats, draft_calls=state.stats.draft_calls + calls * live)
  return dataclasses.replace(state, draft_state=draft_state, stats=stats), proposal


class DecodeArguments(NamedTuple):
  """`decode`'s arguments after validation."""

  drafter: Any
  tokens: jax.Array  # [B, T] int32
  lengths: jax.Array  # [B] int32
  rng: jax.Array
  max_new_tokens: int
  num_draft: int
  eos_ids: jax.Array  # [E] int32
  capacity: int  # max_new_tokens rounded up to the bucket


def check_decode_arguments(target, draft, tokens, rng, *, lengths, max_new_tokens, num_draft,
                           sampling, eos_id, verify_impl) -> DecodeArguments:
  """Validates `decode`'s arguments before anything is traced (also used by `decode_stream`).

  Raises:
    ValueError: naming the problem (see `decode`).
  """
  check_model(target, "target")
  drafter = as_drafter(draft)
  tokens, lengths = validation.check_tokens(tokens, lengths, target.vocab_size)
  num_draft = validation.check_count(num_draft, "num_draft")
  max_new_tokens = validation.check_count(max_new_tokens, "max_new_tokens")
  if drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
    raise ValueError(f"draft vocabulary ({drafter.vocab_size}) does not match the target's "
                     f"({target.vocab_size}): speculative decoding needs one shared tokenizer")
  validation.check_context(lengths, tokens.shape[1], max_new_tokens, target.max_len, "target")
  if hasattr(drafter, "max_len"):
    validation.check_context(lengths, tokens.shape[1], max_new_tokens, drafter.max_len, "draft")
  rng = validation.check_rng(rng)
  eos_ids = jnp.array(validation.check_eos(eos_id, target.vocab_size), jnp.int32)
  check_sampling(sampling)
  check_verify_impl(verify_impl)
  capacity = validation.round_up(max_new_tokens, NEW_TOKEN_BUCKET)
  return DecodeArguments(drafter, tokens, lengths, rng, max_new_tokens, num_draft, eos_ids,
                         capacity)


def decode(target, draft, tokens, rng, *, lengths=None, max_new_tokens: int = 64,
           num_draft: int = 4, sampling: Sampling = GREEDY,
           eos_id: int | tuple[int, ...] | None = None,
           pad_id: int | None = None, verify_impl: str = "auto") -> DecodeOutput:
  """Speculative decoding: the target's exact output distribution in fewer target passes.

  Args:
    target: the target `specjax.Model` (p).
    draft: the drafter (q): a smaller `specjax.Model`, or any `Drafter` such as
      `specjax.NGramDrafter()`.
    tokens: `[B, T]` int prompt ids, right-padded.
    rng: a JAX PRNG key.
    lengths: `[B]` prompt lengths; None = every row is `T` long.
    max_new_tokens: new tokens per row at most.
    num_draft: draft tokens per round (`k`).
    sampling: applied identically to target and draft; temperature 0 is greedy and returns exactly
      `specjax.generate`'s tokens.
    eos_id: a row stops after emitting it (or any id of a sequence of them); the stop token is
      included in the output; None = never.
    pad_id: fills the output after each row's end; defaults to the target config's `pad_id`.
    verify_impl: "auto", "reference", "kernel" or "interpret" (see `specjax.verify.verify_tokens`).

  Returns:
    `DecodeOutput(tokens [B, max_new_tokens], num_tokens [B], stats)`.
  """
  args = check_decode_arguments(target, draft, tokens, rng, lengths=lengths,
                                max_new_tokens=max_new_tokens, num_draft=num_draft,
                                sampling=sampling, eos_id=eos_id, verify_impl=verify_impl)
  out = _decode(target, args.drafter, args.tokens, args.lengths, args.rng,
                jnp.int32(args.max_new_tokens), args.eos_ids, sampling=sampling,
                num_draft=args.num_draft, capacity=args.capacity,
                pad_id=resolve_pad_id(target, pad_id), verify_impl=verify_impl)
  return DecodeOutput(out.tokens[:, :args.max_new_tokens], out.num_tokens, out.stats)


@functools.partial(jax.jit, static_argnames=("sampling", "num_draft", "capacity", "pad_id",
                                             "verify_impl"))
def _decode(target, drafter, tokens, lengths, rng, max_new_tokens, eos_ids, *, sampling,
            num_draft, capacity, pad_id, verify_impl) -> DecodeOutput:
  TRACE_COUNTS["decode"] += 1
  state = init_state(target, drafter, tokens, lengths, max_new_tokens, eos_ids,
                     num_draft=num_draft, capacity=capacity)

  def cond(state):
    return ~jnp.all(state.done)

  def body(state):
    key = jax.random.fold_in(rng, state.round)
    state, proposal = draft_step(drafter, state, key, num_draft=num_draft, sampling=sampling)
    state = verify_block(target, state, proposal, key, sampling=sampling, impl=verify_impl)
    return dataclasses.replace(state, round=state.round + 1)

  state = jax.lax.while_loop(cond, body, state)
  return finish(state, capacity, pad_id)


def finish(state: DecodeState, capacity: int, pad_id: int) -> DecodeOutput:
  """Cuts each row's new tokens out of the sequence buffer: `DecodeOutput` with `capacity` columns."""
  num_tokens = state.lengths - state.prompt_lengths
  index = jnp.arange(capacity, dtype=jnp.int32)
  new = jnp.take_along_axis(state.tokens, state.prompt_lengths[:, None] + index, axis=1,
                            mode="clip")
  new = jnp.where(index[None] < num_tokens[:, None], new, pad_id)
  return DecodeOutput(new, num_tokens, state.stats)
