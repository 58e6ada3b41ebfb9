"""Drafters: whatever proposes `k` tokens per round for the target to verify.

A drafter is a pytree (so it crosses `jax.jit` as an argument) with three methods:

* `init(tokens, lengths, buffer_len) -> state`: its own per-call state (e.g. a KV cache), built from
  the right-padded prompt.
* `propose(state, sequence, lengths, *, num_draft, sampling, seed, rows) -> (state, Proposal)`:
  `k` tokens for positions `lengths .. lengths + k - 1`, given the whole token buffer.
* `vocab_size`: the vocabulary its proposals live in (None: it copies tokens from the sequence, so
  it fits any vocabulary).

A drafter that proposes deterministically returns `Proposal.logits = None`: it is a point mass `q`,
for which the verify rule is still exact. Rolling a drafter back after rejections is its own
business: `ModelDrafter` does it lazily at the start of the next round, by comparing how far its
cache got with how long the accepted sequence is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from specjax.sampling import PURPOSE_DRAFT, Sampling, sample_token


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
  tokens: jax.Array  # [B, k] int32 draft tokens
  logits: jax.Array | None  # [B, k, V] float32 raw draft logits; None = point mass


@runtime_checkable
class Drafter(Protocol):
  vocab_size: int | None

  def init(self, tokens: jax.Array, lengths: jax.Array, buffer_len: int) -> Any:
    ...

  def propose(self, state: Any, sequence: jax.Array, lengths: jax.Array, *, num_draft: int,
              sampling: Sampling, seed: jax.Array, rows: jax.Array) -> tuple[Any, Proposal]:
    ...


def gather_tokens(sequence: jax.Array, starts: jax.Array, width: int) -> jax.Array:
  """`sequence[b, starts[b] : starts[b] + width]` for every row: `[B, S]` -> `[B, width]`."""
  return jax.vmap(lambda row, start: jax.lax.dynamic_slice(row, (start,), (width,)))(
      sequence, starts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """A small language model as the drafter: stochastic `q` at temperature > 0, argmax at 0.

  Each round it first catches up on the tokens it has not seen: the last round's correction or
  bonus token (and, when every draft was accepted, its own last draft, which it proposed but never
  fed). It does that in one block forward of two tokens, then `k - 1` single-token steps.
  """

  model: Any

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  @property
  def max_len(self) -> int:
    return self.model.max_len

  def init(self, tokens, lengths, buffer_len):
    batch = tokens.shape[0]
    cache = self.model.init_cache(batch, buffer_len)
    cache = self.model(tokens, jnp.zeros((batch,), jnp.int32), cache).cache
    return cache.with_lengths(lengths - 1)  # the last prompt token is fed with the first draft

  def propose(self, cache, sequence, lengths, *, num_draft, sampling, seed, rows):
    # Valid draft cache: what it has seen that is still in the sequence (rollback).
    start = jnp.minimum(cache.lengths, lengths - 1)  # lengths - 2 or lengths - 1
    block = gather_tokens(sequence, start, 2)
    out = self.model(block, start, cache)
    pick = (lengths - 1 - start)[:, None, None]  # the logits after the last known token
    logits = jnp.take_along_axis(out.logits, pick, axis=1)[:, 0]
    cache = out.cache.with_lengths(lengths)
    first = sample_token(logits, sampling, seed, rows, lengths, PURPOSE_DRAFT)

    def step(carry, i):
      cache, token, logits = carry
      out = self.model(token[:, None], lengths + i - 1, cache)
      next_logits = out.logits[:, 0]
      next_token = sample_token(next_logits, sampling, seed, rows, lengths + i, PURPOSE_DRAFT)
      return (out.cache, next_token, next_logits), (token, logits)

    (cache, last, last_logits), (tokens, all_logits) = jax.lax.scan(
        step, (cache, first, logits), jnp.arange(1, num_draft, dtype=jnp.int32))
    tokens = jnp.concatenate([tokens, last[None]], axis=0).T  # [B, k]
    all_logits = jnp.concatenate([all_logits, last_logits[None]], axis=0).transpose(1, 0, 2)
    return cache, Proposal(tokens, None if sampling.greedy else all_logits)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NGramDrafter:
  """Prompt lookup: propose the tokens that followed the latest earlier match of the last `n`
  tokens (longest `n` from `max_ngram` down to `min_ngram`), searched over the prompt and the
  generated text on device. No weights, a point-mass `q`, so sampling stays exact.

  When nothing matches it proposes the last token repeated (a valid, if rarely accepted, guess).
  """

  max_ngram: int = dataclasses.field(default=3, metadata=dict(static=True))
  min_ngram: int = dataclasses.field(default=1, metadata=dict(static=True))
  vocab_size: None = dataclasses.field(default=None, metadata=dict(static=True))

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"NGramDrafter needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                       f"{self.max_ngram}")

  def init(self, tokens, lengths, buffer_len):
    return ()

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seed, rows):
    del sampling, seed, rows
    proposals = jax.vmap(lambda row, length: self._lookup(row, length, num_draft))(sequence,
                                                                                   lengths)
    return state, Proposal(proposals, None)

  def _lookup(self, row: jax.Array, length: jax.Array, num_draft: int) -> jax.Array:
    """Draft tokens for one row `[S]` whose first `length` tokens are valid."""
    size = row.shape[0]
    j = jnp.arange(size, dtype=jnp.int32)  # candidate: the match ends just before slot j
    best = jnp.int32(-1)
    for n in range(self.max_ngram, self.min_ngram - 1, -1):  # longest match wins
      match = (j >= n) & (j < length) & (length >= n + 1)
      for i in range(n):
        suffix_token = row[jnp.maximum(length - n + i, 0)]
        match &= jnp.take(row, jnp.maximum(j - n + i, 0)) == suffix_token
      latest = jnp.max(jnp.where(match, j, -1))
      best = jnp.where(best >= 0, best, latest)
    offsets = jnp.arange(num_draft, dtype=jnp.int32)
    # Copy what followed the match; past the known text, keep repeating the last copied token.
    source = jnp.minimum(best + offsets, length - 1)
    fallback = jnp.full((num_draft,), row[length - 1])
    return jnp.where(best >= 0, jnp.take(row, source), fallback).astype(jnp.int32)


def as_drafter(draft) -> Drafter:
  """A `specjax.Model` (or protocol-following model) becomes a `ModelDrafter`; drafters pass."""
  if isinstance(draft, (ModelDrafter, NGramDrafter)) or (
      hasattr(draft, "propose") and hasattr(draft, "init")):
    return draft
  if hasattr(draft, "init_cache") and hasattr(draft, "vocab_size"):
    return ModelDrafter(draft)
  raise ValueError(f"draft must be a specjax.Model, a model following the specjax protocol, or a "
                   f"Drafter (e.g. specjax.NGramDrafter()), got {type(draft).__name__}")
