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

from specjax.decode import check_decode_arguments, draft_step, init_state
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
                  num_draft: int = 4, sampling: Sampling = GREEDY,
                  eos_id: int | tuple[int, ...] | None = None,
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
  args = check_decode_arguments(target, draft, tokens, rng, lengths=lengths,
                                max_new_tokens=max_new_tokens, num_draft=num_draft,
                                sampling=sampling, eos_id=eos_id, verify_impl=verify_impl)
  drafter, rng, num_draft = args.drafter, args.rng, args.num_draft
  state = _start(target, drafter, args.tokens, args.lengths, jnp.int32(args.max_new_tokens),
                 args.eos_ids, num_draft=num_draft, capacity=args.capacity)
  seen = np.asarray(args.lengths)
  while not bool(np.all(np.asarray(state.done))):
    state = _round(target, drafter, state, rng, num_draft=num_draft, sampling=sampling,
                   verify_impl=verify_impl)
    now = np.asarray(state.lengths)
    sequence = np.asarray(state.tokens)
    yield [sequence[b, seen[b]:now[b]] for b in range(len(now))], state
    seen = now
