"""Prompt lookup where the text repeats, a feature head everywhere else.

A chat answer often copies: a summary reuses the passage's phrases, an answer quotes its question,
a translation keeps names, numbers and the quoted sentence, code repeats identifiers. Prompt lookup
(`NGramDrafter`) drafts those stretches almost for free and often whole; a feature head
(`EagleDrafter`, `MedusaDrafter`) drafts new text far better. `HybridDrafter` runs the head every
round and, in each row whose last `ngram` tokens occurred earlier in its own text (prompt or
answer), replaces the head's drafts by the tokens that followed that occurrence.

Why this stays exact. Which drafter a row uses is a function of the row's accepted tokens only
(never of the head's samples, the target's logits or the verify's random numbers), and the
proposal carries the `q` each draft was really drawn from: the head's warped logits in head rows,
a point mass (logit 0 at the copied token, `-inf` elsewhere) in lookup rows. The verify rule is
exact for every `q` given with its draw, so the mixture is too. Greedy output equals
`specjax.generate`.

Why only feature heads. Their `observe` rebuilds their state from the target's verified block
(the accepted tokens with the target's features), whatever was drafted; a `ModelDrafter` keeps the
keys and values of its own drafts and would go on from tokens that were never accepted.

Measured on SmolLM2-135M-Instruct with its shipped EAGLE-3 head, greedy, k = 4, 24 held-out chat
prompts (`benchmarks/prompts/real.json`, 4 per category): tokens per round head alone / hybrid
(`ngram=2`): multi-turn 1.55 / 1.57, translation 1.29 / 2.32, summarization 1.46 / 2.10, QA 1.49 /
2.03 (the rest: `benchmarks/results/`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.drafters.base import DrafterWrapper
from specjax.drafters.eagle.drafter import EagleDrafter
from specjax.drafters.medusa.drafter import MedusaDrafter
from specjax.drafters.ngram import lookup

__all__ = ["HybridDrafter"]


def _point_mass_logits(tokens: jax.Array, vocab_size: int) -> jax.Array:
  """`[B, k]` tokens -> `[B, k, V]` float32 logits: 0 at the token, `-inf` elsewhere."""
  hot = jax.nn.one_hot(tokens, vocab_size, dtype=jnp.bool_)
  return jnp.where(hot, 0.0, -jnp.inf).astype(jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridDrafter(DrafterWrapper):
  """Prompt lookup in rows whose recent text occurred before, `drafter` in the others.

  Attributes:
    drafter: an `EagleDrafter` or `MedusaDrafter` (see the module docstring for why only these).
    ngram: a row uses lookup when its last `ngram` tokens occurred earlier in its own text
      (prompt and answer so far); the latest occurrence is copied on from (static).
    max_ngram: longer matches are preferred, up to this many tokens (static, >= `ngram`).

  Wrap it in nothing but `specjax.adaptive_drafter` (the `AdaptiveDrafter` goes around it).
  """

  drafter: Any
  ngram: int = dataclasses.field(default=2, metadata=dict(static=True))
  max_ngram: int = dataclasses.field(default=4, metadata=dict(static=True))

  def __post_init__(self):
    if not isinstance(self.drafter, (EagleDrafter, MedusaDrafter)):
      raise ValueError("HybridDrafter wraps a feature head (EagleDrafter or MedusaDrafter), got "
                       f"{type(self.drafter).__name__}: a draft model would keep the cache of "
                       "drafts it did not make")
    for name, value in (("ngram", self.ngram), ("max_ngram", self.max_ngram)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"HybridDrafter.{name} must be an int >= 1, got {value!r}")
    if self.max_ngram < self.ngram:
      raise ValueError(f"HybridDrafter needs max_ngram >= ngram, got {self.max_ngram} < "
                       f"{self.ngram}")

  def init(self, tokens, lengths, buffer_len, prefill):
    return self.drafter.init(tokens, lengths, buffer_len, prefill)

  def observe(self, state, scored, block, emitted, count, lengths):
    return self.drafter.observe(state, scored, block, emitted, count, lengths)

  def lookup(self, sequence: jax.Array, lengths: jax.Array, num_draft: int):
    """`(tokens [B, k], found [B])`: each row's lookup drafts and whether it has a match."""
    return jax.vmap(lambda row, length: lookup(row, length, num_draft, self.max_ngram,
                                               self.ngram))(sequence, lengths)

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, limits=None,
              stop=None, copy=None):
    """The head's proposal, with the copy in the rows that take it.

    `copy`: `(tokens [B, k], rows [B] bool)`, a copy made by `lookup` and the rows that propose
    it (the `AdaptiveDrafter` passes the rows whose copies it expects to do better than the
    head; their `num_drafted` it sets itself); default: every row with a match copies.
    """
    state, proposal = self.drafter.propose(state, sequence, lengths, num_draft=num_draft,
                                           sampling=sampling, seeds=seeds, limits=limits,
                                           stop=stop)
    copied, found = self.lookup(sequence, lengths, num_draft) if copy is None else copy
    tokens = jnp.where(found[:, None], copied, proposal.tokens)
    logits = proposal.logits
    if logits is not None:
      logits = jnp.where(found[:, None, None], _point_mass_logits(copied, logits.shape[-1]),
                         logits)
    drafted = proposal.num_drafted
    if drafted is not None:  # a lookup row proposes all it may (its planned k, or all k)
      full = jnp.full_like(drafted, num_draft) if limits is None else limits.astype(drafted.dtype)
      drafted = jnp.where(found, full, drafted)
    return state, dataclasses.replace(proposal, tokens=tokens, logits=logits, num_drafted=drafted)
