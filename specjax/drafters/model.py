"""A small language model as the drafter."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.sampling import PURPOSE_DRAFT, sample_token
from specjax.state import Proposal, gather_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """A small language model as the drafter: stochastic `q` at temperature > 0, argmax at 0.

  Each round it first catches up on the tokens it has not seen: the last round's correction or
  bonus token (and, when every draft was accepted, its own last draft, which it proposed but never
  fed). It does that in one block forward of two tokens, then `k - 1` single-token steps. It
  reads no target features (`observe` is the identity).
  """

  model: Any

  taps = ()
  needs_hidden = False

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  @property
  def max_len(self) -> int:
    return self.model.max_len

  def forwards_per_round(self, num_draft: int) -> int:
    return num_draft

  def init(self, tokens, lengths, buffer_len, prefill=None):
    del prefill
    batch = tokens.shape[0]
    cache = self.model.init_cache(batch, buffer_len)
    cache = self.model(tokens, jnp.zeros((batch,), jnp.int32), cache).cache
    return cache.with_lengths(lengths - 1)  # the last prompt token is fed with the first draft

  def propose(self, cache, sequence, lengths, *, num_draft, sampling, seeds):
    # Valid draft cache: what it has seen that is still in the sequence (rollback).
    start = jnp.minimum(cache.lengths, lengths - 1)  # lengths - 2 or lengths - 1
    block = gather_tokens(sequence, start, 2)
    out = self.model(block, start, cache)
    pick = (lengths - 1 - start)[:, None, None]  # the logits after the last known token
    logits = jnp.take_along_axis(out.logits, pick, axis=1)[:, 0]  # [B, V]
    cache = out.cache.with_lengths(lengths)
    first = sample_token(logits, sampling, seeds, lengths, PURPOSE_DRAFT)

    def step(carry, i):
      cache, token, logits = carry
      out = self.model(token[:, None], lengths + i - 1, cache)
      next_logits = out.logits[:, 0]
      next_token = sample_token(next_logits, sampling, seeds, lengths + i, PURPOSE_DRAFT)
      return (out.cache, next_token, next_logits), (token, logits)

    (cache, last, last_logits), (tokens, all_logits) = jax.lax.scan(
        step, (cache, first, logits), jnp.arange(1, num_draft, dtype=jnp.int32))
    tokens = jnp.concatenate([tokens, last[None]], axis=0).T  # [B, k]
    all_logits = jnp.concatenate([all_logits, last_logits[None]], axis=0).transpose(1, 0, 2)
    return cache, Proposal(tokens, None if sampling.greedy else all_logits)

  def observe(self, state, scored, block, emitted, count, lengths):
    del scored, block, emitted, count, lengths
    return state
