"""The `Drafter` protocol: whatever proposes `k` tokens per round for the target to verify.

A drafter is a pytree (it crosses `jax.jit` as an argument) with:

* `vocab_size`: the vocabulary its proposals live in (None: it copies tokens from the sequence,
  so it fits any vocabulary).
* `taps`: the target layers whose residual stream it reads (`()` = none), and `needs_hidden`:
  whether it reads the target's final normed hidden state. The loop asks the target's forward
  for exactly these, in the prefill and in every verify.
* `forwards_per_round(num_draft)`: its forward passes per round (for `DecodeStats.draft_calls`).
* `init(tokens, lengths, buffer_len, prefill) -> state`: its own per-call state (e.g. a KV
  cache), built from the right-padded prompt; `prefill` is the target's `ForwardOutput` over
  the prompt.
* `propose(state, sequence, lengths, *, num_draft, sampling, seeds) -> (state, Proposal)`: `k`
  tokens for positions `lengths .. lengths + k - 1`, given the whole token buffer. Random numbers
  come from the row's `seeds [B]` and absolute positions (purpose `PURPOSE_DRAFT`). Optionally
  `limits=[B]`: row `b` proposes at most `limits[b]` drafts (`Proposal.num_drafted`); a chain
  drafter stops drafting there (`specjax.drafters.adaptive.drafter` sets it per row each round).
  Every built-in drafter takes it; a drafter without it cannot be wrapped by `AdaptiveDrafter`.
* `observe(state, scored, block, emitted, count, lengths) -> state`: called after every verify
  with the target's `ForwardOutput` over `block [B, k + 1] = [last, d_1 .. d_k]` at positions
  `lengths - 1 .. lengths + k - 1`; `emitted [B, k + 1]` are the tokens the row keeps (the first
  `count[b]`), `lengths` the lengths before the round. Features at block index `j < count` are
  the target's features of accepted tokens.

A tree drafter (`specjax.drafters.tree`) follows the same protocol with a `Tree` for a
proposal: it also has a static `spec` (its `TreeSpec`), `extra_slots` (the scratch slots past a
row's length a round writes; a chain writes `k + 1`) and `observe_path` in place of `observe`.

A drafter that proposes deterministically returns `Proposal.logits = None`: a point mass `q`, for
which the verify rule is still exact. Rolling back after rejections is the drafter's own
business (`ModelDrafter` does it lazily at the start of the next round).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax

from specjax.core.sampling import Sampling
from specjax.drafters.proposal import Proposal

__all__ = ["Drafter", "DrafterWrapper", "OwnModelDrafter", "Proposal", "TextOnlyDrafter",
           "with_confidence"]


@runtime_checkable
class Drafter(Protocol):
  """See the module docstring."""

  vocab_size: int | None
  taps: tuple[int, ...]
  needs_hidden: bool

  def forwards_per_round(self, num_draft: int) -> int:
    ...

  def init(self, tokens: jax.Array, lengths: jax.Array, buffer_len: int, prefill: Any) -> Any:
    ...

  def propose(self, state: Any, sequence: jax.Array, lengths: jax.Array, *, num_draft: int,
              sampling: Sampling, seeds: jax.Array) -> tuple[Any, Proposal]:
    ...

  def observe(self, state: Any, scored: Any, block: jax.Array, emitted: jax.Array,
              count: jax.Array, lengths: jax.Array) -> Any:
    ...


class DrafterWrapper:
  """Mixin for a drafter that wraps another one in a field named `drafter`: the protocol's
  attributes, and any other attribute (`head`, `max_len`, `confidence`, `full_logits`, ...), are
  the wrapped drafter's."""

  @property
  def vocab_size(self):
    return self.drafter.vocab_size

  @property
  def taps(self):
    return self.drafter.taps

  @property
  def needs_hidden(self):
    return self.drafter.needs_hidden

  def __getattr__(self, name):
    if name.startswith("__") or name == "drafter":
      raise AttributeError(name)
    return getattr(self.drafter, name)

  def forwards_per_round(self, num_draft: int) -> int:
    return self.drafter.forwards_per_round(num_draft)


class OwnModelDrafter:
  """Mixin for a drafter that runs its own draft model, held in a field named `model`: the
  vocabulary and context length are the model's, and it reads no target features."""

  taps = ()
  needs_hidden = False

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  @property
  def max_len(self) -> int:
    return self.model.max_len


class TextOnlyDrafter:
  """Mixin for a drafter that reads only the token buffer (prompt lookup, suffix drafting): no
  target features, no forward passes, and an empty state that observing a round leaves alone
  (`observe` for a chain drafter, `observe_path` for a tree one)."""

  taps = ()
  needs_hidden = False

  def forwards_per_round(self, num_draft: int) -> int:
    del num_draft
    return 0

  def init(self, tokens, lengths, buffer_len, prefill=None):
    del tokens, lengths, buffer_len, prefill
    return ()

  def observe(self, state, scored, block, emitted, count, lengths):
    del scored, block, emitted, count, lengths
    return state

  def observe_path(self, state, scored, tree, root, path, emitted, count, lengths):
    del scored, tree, root, path, emitted, count, lengths
    return state


def with_confidence(drafter, confidence: float | None):
  """`drafter` with its confidence stop set to `confidence` (None: off), through wrappers."""
  if isinstance(drafter, DrafterWrapper):
    return dataclasses.replace(drafter, drafter=with_confidence(drafter.drafter, confidence))
  return dataclasses.replace(drafter, confidence=confidence)
