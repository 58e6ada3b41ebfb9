"""Streaming speculative decoding: the same rounds as `specjax.decode`, one host step per round.

`decode` runs every round inside one `lax.while_loop`, so nothing is visible until the call ends.
`decode_stream` runs the same building blocks (`init_state`, `draft_step`, `verify_block`) with the
same per-round keys from Python, one jitted round per step, and yields each row's tokens as soon
as a round accepts them. The tokens are exactly `decode`'s for the same arguments; the price is one
device-to-host transfer per round.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from specjax import validation
from specjax.decode import NEW_TOKEN_BUCKET, draft_step, init_state
from specjax.draft import as_drafter
from specjax.sampling import GREEDY, Sampling
from specjax.verify import verify_block


@functools.partial(jax.jit, static_argnames=("num_draft", "capacity"))
def _start(target, drafter, tokens, lengths, max_new_tokens, eos, *, num_draft, capacity):
  return init_state(target, drafter, tokens, lengths, max_new_tokens, eos, num_draft=num_draft,
                    capacity=capacity)


@functools.partial(jax.jit, static_argnames=("num_draft", "sampling", "verify_impl"))
def _round(target, drafter, state, rng, *, num_draft, sampling, verify_impl):
  key = jax.random.fold_in(rng, state.round)  # the key `decode` uses for this round
  state, proposal = draft_step(drafter, state, key, num_draft=num_draft, sampling=sampling)
  state = verify_block(target, state, proposal, key, sampling=sampling, impl=verify_impl)
  return dataclasses.replace(state, round=state.round + 1)


def decode_stream(target, draft, tokens, rng, *, lengths=None, max_new_tokens: int = 64,
                  num_draft: int = 4, sampling: Sampling = GREEDY, eos_id: int | None = None,
                  verify_impl: str = "auto") -> Iterator[tuple[list[np.ndarray], object]]:
  """Speculative decoding that yields after every round.

  Args:
    Same as `specjax.decode` (without `pad_id`).

  Yields:
    `(new_tokens, state)` after each round: `new_tokens[b]` is the int32 array of tokens row `b`
    gained in that round (possibly empty); `state` is the `DecodeState` (its `stats` are the
    running counters). The concatenation of a row's yields equals `decode(...).tokens[b]` up to
    `num_tokens[b]`.
  """
  drafter = as_drafter(draft)
  tokens, lengths = validation.check_tokens(tokens, lengths, target.vocab_size)
  num_draft = validation.check_count(num_draft, "num_draft")
  max_new_tokens = validation.check_count(max_new_tokens, "max_new_tokens")
  validation.check_context(lengths, tokens.shape[1], max_new_tokens, target.max_len, "target")
  rng = validation.check_rng(rng)
  eos = -1 if eos_id is None else validation.check_eos(eos_id, target.vocab_size)
  capacity = validation.round_up(max_new_tokens, NEW_TOKEN_BUCKET)
  state = _start(target, drafter, tokens, lengths, jnp.int32(max_new_tokens),
                 jnp.asarray(eos, jnp.int32), num_draft=num_draft, capacity=capacity)
  seen = np.asarray(lengths)
  while not bool(np.all(np.asarray(state.done))):
    state = _round(target, drafter, state, rng, num_draft=num_draft, sampling=sampling,
                   verify_impl=verify_impl)
    now = np.asarray(state.lengths)
    sequence = np.asarray(state.tokens)
    yield [sequence[b, seen[b]:now[b]] for b in range(len(now))], state
    seen = now
