"""Prompt lookup: a drafter with no weights that copies what followed an earlier match."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import TextOnlyDrafter
from specjax.drafters.proposal import Proposal


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NGramDrafter(TextOnlyDrafter):
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

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, limits=None):
    del sampling, seeds
    proposals = jax.vmap(lambda row, length: self._lookup(row, length, num_draft))(sequence,
                                                                                   lengths)
    return state, Proposal(proposals, None, limits)


  def _lookup(self, row: jax.Array, length: jax.Array, num_draft: int) -> jax.Array:
    return lookup(row, length, num_draft, self.max_ngram, self.min_ngram)[0]


def lookup(row: jax.Array, length: jax.Array, num_draft: int, max_ngram: int, min_ngram: int
           ) -> tuple[jax.Array, jax.Array]:
  """Prompt lookup for one row `[S]` whose first `length` tokens are valid.

  Returns:
    `(tokens [num_draft] int32, found)`: what followed the latest earlier occurrence of the row's
    last `n` tokens (the longest `n` from `max_ngram` down to `min_ngram` that occurs), and
    whether any did; with no match the last token repeated. A match that ends `p` tokens before
    the row's end copies with period `p` past the known text (an overlapping copy: after
    `a b a b` the match of `a b` two tokens back continues `a b a b ...`, not `a b b b`).
  """
  size = row.shape[0]
  j = jnp.arange(size, dtype=jnp.int32)  # candidate: the match ends just before slot j
  best = jnp.int32(-1)
  for n in range(max_ngram, min_ngram - 1, -1):  # longest match wins
    match = (j >= n) & (j < length) & (length >= n + 1)
    for i in range(n):
      suffix_token = row[jnp.maximum(length - n + i, 0)]
      match &= jnp.take(row, jnp.maximum(j - n + i, 0)) == suffix_token
    latest = jnp.max(jnp.where(match, j, -1))
    best = jnp.where(best >= 0, best, latest)
  offsets = jnp.arange(num_draft, dtype=jnp.int32)
  period = jnp.maximum(length - best, 1)
  source = best + offsets % period
  fallback = jnp.full((num_draft,), row[length - 1])
  found = best >= 0
  return jnp.where(found, jnp.take(row, source), fallback).astype(jnp.int32), found
