"""Streaming speculative decoding: the same rounds as `specjax.decode`, one host step per
round.

`decode` runs every round inside one `lax.while_loop`, so nothing is visible until the call ends.
`decode_stream` runs the same loop body (`specjax.loop.round.round_step`) from Python, one jitted
call per round with the state donated (the caches are updated in place, not copied), and yields each
row's tokens as soon as a round accepts them. The tokens are exactly `decode`'s for the same
arguments; the price is one device-to-host transfer per round. Where `decode` runs
`specjax.generate` (an `AdaptiveDrafter` that plans plain steps, `Drafter.plain`), so does the
stream: `generate`'s own start and step (`specjax.loop.generate.generate_step`), one per token.
"""

from __future__ import annotations

import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core import validation
from specjax.constrain.compile import constraint_inputs
from specjax.drafters.ssd import SSDDrafter
from specjax.loop.arguments import check_decode_arguments
from specjax.loop.generate import GenerateState, generate_start, generate_step
from specjax.parallel.mesh import call_context
from specjax.parallel.rules import rules_scope
from specjax.loop.round import round_step
from specjax.core.sampling import GREEDY, Sampling, row_seeds
from specjax.loop.state import DecodeState, init_state

__all__ = ["decode_stream"]


@functools.partial(jax.jit, static_argnames=("num_draft", "capacity", "rules", "classes"))
def _start(target, drafter, tokens, lengths, max_new_tokens, eos, rng, *, num_draft, capacity,
           rules=None, classes=()) -> DecodeState:
  del classes  # a cache key only (`validation.pytree_classes`)
  with rules_scope(rules):
    return init_state(target, drafter, tokens, lengths, max_new_tokens, eos,
                      row_seeds(rng, tokens.shape[0]), num_draft=num_draft, capacity=capacity)


@functools.partial(jax.jit, static_argnames=("num_draft", "sampling", "verify_impl", "widths",
                                             "rules", "classes"),
                   donate_argnames=("state",))
def _round(target, drafter, state, *, num_draft, sampling, verify_impl, widths=None, rules=None,
           classes=()):
  del classes  # a cache key only (`validation.pytree_classes`)
  with rules_scope(rules):
    return round_step(target, drafter, state, num_draft=num_draft, sampling=sampling,
                      verify_impl=verify_impl, widths=widths)


@functools.partial(jax.jit, static_argnames=("sampling", "capacity", "pad_id", "rules",
                                             "classes"))
def _start_plain(model, tokens, lengths, rng, eos_ids, max_new_tokens, tables=None, schema=None,
                 *, sampling, capacity, pad_id, rules=None, classes=()) -> GenerateState:
  del classes  # a cache key only (`validation.pytree_classes`)
  with rules_scope(rules):
    return generate_start(model, tokens, lengths, row_seeds(rng, tokens.shape[0]), eos_ids,
                          max_new_tokens, sampling=sampling, capacity=capacity, pad_id=pad_id,
                          tables=tables, schema=schema)


@functools.partial(jax.jit, static_argnames=("sampling", "pad_id", "rules", "classes"),
                   donate_argnames=("state",))
def _step_plain(model, state, *, sampling, pad_id, rules=None, classes=()) -> GenerateState:
  del classes  # a cache key only (`validation.pytree_classes`)
  with rules_scope(rules):
    return generate_step(model, state, sampling=sampling, pad_id=pad_id)


def _stream_plain(target, args, sampling: Sampling, constraint=None):
  """`decode_stream` where `decode` runs `specjax.generate`: its start and steps from the host,
  yielding each row's token of every step."""
  pad_id = validation.resolve_pad_id(target, None)
  tables = schema = None
  eos_ids = args.eos_ids
  if constraint is not None:
    grammar = constraint_inputs(constraint, args.tokens.shape[0], target.vocab_size)
    tables, schema = grammar.tables, grammar.schema
    eos = grammar.stop_ids(np.asarray(eos_ids).tolist())
    eos_ids = jnp.asarray(eos or (-1,), jnp.int32)
  inputs = (target, args.tokens, args.lengths, args.rng, eos_ids, tables, schema)
  with call_context(inputs) as call:
    target, tokens, lengths, rng, eos_ids, tables, schema = call.inputs
    rules = call.rules
    classes = validation.pytree_classes(target)
    state = _start_plain(target, tokens, lengths, rng, eos_ids, jnp.int32(args.max_new_tokens),
                         tables, schema, sampling=sampling, capacity=args.capacity,
                         pad_id=pad_id, rules=rules, classes=classes)
  seen = np.zeros(args.tokens.shape[0], np.int64)
  while True:
    now = np.asarray(state.num_tokens)
    new = np.asarray(state.tokens)
    yield [new[b, seen[b]:now[b]] for b in range(len(now))], state
    seen = now
    if bool(np.all(np.asarray(state.done))):
      return
    with call_context((target, state)):
      state = _step_plain(target, state, sampling=sampling, pad_id=pad_id, rules=rules,
                          classes=classes)


def decode_stream(target, draft, tokens, rng, *, lengths=None, max_new_tokens: int = 64,
                  num_draft: int | None = None, sampling: Sampling = GREEDY,
                  eos_id: int | tuple[int, ...] | None = None, verify_impl: str = "auto",
                  verify_widths: tuple[int, ...] | None = None, tree=None, constraint=None
                  ) -> Iterator[tuple[list[np.ndarray], DecodeState | GenerateState]]:
  """Speculative decoding that yields after every round.

  Args:
    Same as `specjax.decode` (without `pad_id`; `num_draft`, `verify_widths`, `tree` and
    `constraint` as there: an int `num_draft`, or a `specjax.adaptive_drafter(...)` as `draft`).

  Yields:
    `(new_tokens, state)` after each round: `new_tokens[b]` is the int32 array of tokens row `b`
    gained in that round (possibly empty); `state` is the `DecodeState` (its `stats` are the
    running counters). The concatenation of a row's yields equals `decode(...).tokens[b]` up to
    `num_tokens[b]`. The state's buffers are donated to the next round: read what you need from
    it before advancing the iterator. Where the drafter is `plain` (`decode` runs
    `specjax.generate`), each yield is one `generate` step and `state` its
    `specjax.loop.generate.GenerateState` (`stats` and `done` as well).
  """
  if isinstance(draft, SSDDrafter):
    raise ValueError("decode_stream does not run an SSDDrafter (its rounds are SSD's own loop): "
                     "call specjax.decode")
  args = check_decode_arguments(target, draft, tokens, rng, lengths=lengths,
                                max_new_tokens=max_new_tokens, num_draft=num_draft,
                                sampling=sampling, eos_id=eos_id, verify_impl=verify_impl,
                                verify_widths=verify_widths, tree=tree, constraint=constraint)
  if args.drafter.plain:
    yield from _stream_plain(target, args, sampling, constraint)
    return
  inputs = (target, args.drafter, args.tokens, args.lengths, args.rng, args.eos_ids)
  with call_context(inputs) as call:
    target, drafter, tokens, lengths, rng, eos_ids = call.inputs
    rules = call.rules
    classes = validation.pytree_classes(target, drafter)
    state = _start(target, drafter, tokens, lengths, jnp.int32(args.max_new_tokens), eos_ids, rng,
                   num_draft=args.num_draft, capacity=args.capacity, rules=rules,
                   classes=classes)
  seen = np.asarray(args.lengths)
  while not bool(np.all(np.asarray(state.done))):
    with call_context((target, drafter, state)):
      state = _round(target, drafter, state, num_draft=args.num_draft, sampling=sampling,
                     verify_impl=verify_impl, widths=args.widths, rules=rules, classes=classes)
    now = np.asarray(state.lengths)
    sequence = np.asarray(state.tokens)
    yield [sequence[b, seen[b]:now[b]] for b in range(len(now))], state
    seen = now
