"""The cost of a drafter's own work per round (propose + observe), for the analytic bound.

A round of speculative decoding costs one `(k + 1)`-token verify plus whatever the drafter does:
`propose` (a lookup, or `forwards_per_round` head/model forwards) and `observe` (e.g. an EAGLE
head re-running over the verified block). Both are timed here through the `Drafter` protocol
itself, in a jitted device loop of `steps` rounds (as `timing.measure_costs` does for the
target), on the state the drafter builds from a real prefill of the prompt.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks.timing import time_alternately


@functools.partial(jax.jit, static_argnames=("num_draft", "sampling", "steps"))
def _draft_rounds(drafter, state, sequence, lengths, scored, block, emitted, count, seeds, *,
                  num_draft, sampling, steps):
  def body(_, carry):
    state, total = carry
    # The sequence depends on the carry so nothing is hoisted out of the loop.
    shifted = sequence + (total > 2**30).astype(sequence.dtype)  # [B, S]
    state, proposal = drafter.propose(state, shifted, lengths, num_draft=num_draft,
                                      sampling=sampling, seeds=seeds)
    state = drafter.observe(state, scored, block, emitted, count, lengths)
    return state, total + jnp.sum(proposal.tokens)

  return jax.lax.fori_loop(0, steps, body, (state, jnp.int32(0)))[1]


def draft_round_call(target, drafter, tokens, lengths, *, buffer_len: int, num_draft: int,
                     sampling, steps: int = 8):
  """A zero-argument call that runs `steps` rounds of a drafter's work (`propose` + `observe`)
  for a batch of prompts, on the state it builds from a real prefill and one verify forward.

  Args:
    target: the target model (its prefill and one verify forward feed the drafter).
    drafter: a `Drafter`.
    tokens, lengths: `[B, T]` right-padded prompts and `[B]` lengths.
    buffer_len: the decode's token buffer / cache length.
    num_draft: `k`.
    sampling: the sampling settings the drafter proposes under.
    steps: rounds per call.
  """
  batch, width = tokens.shape
  taps, hidden = tuple(drafter.taps), bool(drafter.needs_hidden)
  cache = target.init_cache(batch, buffer_len)
  prefill = target(tokens, jnp.zeros((batch,), jnp.int32), cache, taps=taps,
                   return_hidden=hidden)
  sequence = jnp.zeros((batch, buffer_len), jnp.int32).at[:, :width].set(tokens)  # [B, S]
  state = drafter.init(tokens, lengths, buffer_len, prefill)
  starts = lengths - 1
  block = jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (num_draft + 1,)))(
      sequence, starts)  # [B, k+1]: the last token and k stand-in drafts
  scored = target(block, starts, prefill.cache, taps=taps, return_hidden=hidden)
  count = jnp.full((batch,), num_draft // 2 + 1, jnp.int32)  # a typical partial acceptance
  seeds = jnp.arange(batch, dtype=jnp.uint32) + 1
  return lambda: _draft_rounds(drafter, state, sequence, lengths, scored, block, block, count,
                               seeds, num_draft=num_draft, sampling=sampling, steps=steps)


def draft_round_seconds(target, drafter, tokens, lengths, *, buffer_len: int, num_draft: int,
                        sampling, repeats: int = 5, steps: int = 8,
                        statistic: str = "min") -> float:
  """Seconds of one round's drafting (`propose` + `observe`) for a batch of prompts.

  Args: as `draft_round_call`; repeats, statistic: see `timing.measure_costs`.
  """
  call = draft_round_call(target, drafter, tokens, lengths, buffer_len=buffer_len,
                          num_draft=num_draft, sampling=sampling, steps=steps)
  timed = time_alternately({"draft": call}, repeats, statistic)
  return timed["draft"]["seconds"] / steps
