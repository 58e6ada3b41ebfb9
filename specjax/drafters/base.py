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

and these members, which `Drafter` declares with defaults (every built-in drafter subclasses it;
the loop reads them directly, so a drafter that does not subclass `Drafter` defines them all):

* `max_len`: the longest sequence it can hold (None: no limit of its own, e.g. prompt lookup).
* `max_draft`: the most drafts one round can propose (None: any `k`; Medusa: its heads).
* `confidence`: its confidence stop (None: off; `specjax.drafters.model`).
* `catches_up`: it drafts correctly after rounds in which it was not run, feeding the tokens it
  missed (a draft model); `AdaptiveDrafter` may then skip it in rounds no row drafts.
* `plain`: drafting cannot pay, so `decode` runs the target alone (`specjax.generate`; set by
  `specjax.adaptive_drafter` from a calibration).
* `extra_slots(num_draft)`: the scratch slots past a row's length that one round writes (a
  chain: its last token and `k` drafts, `k + 1`).
* `forwards_in_round(state, num_draft)`: the forward passes of the round whose `propose`
  returned `state` (`forwards_per_round(num_draft)`, or `[B]` where a round may skip the drafter).

A tree drafter (`specjax.drafters.tree`) follows the same protocol with a `Tree` for a
proposal: it also has a static `spec` (its `TreeSpec`) and its own `extra_slots` (the tree block).
Its `observe` is the chain's: the loop hands it the accepted path `[root, path nodes]` as the
block, with the target's features there.

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
  """See the module docstring. Subclass it for the defaults of the optional members."""

  vocab_size: int | None
  taps: tuple[int, ...]
  needs_hidden: bool

  max_len: int | None = None
  max_draft: int | None = None
  confidence: float | None = None
  catches_up: bool = False
  plain: bool = False

  def forwards_per_round(self, num_draft: int) -> int:
    ...

  def forwards_in_round(self, state: Any, num_draft: int) -> int | jax.Array:
    del state
    return self.forwards_per_round(num_draft)

  def extra_slots(self, num_draft: int) -> int:
    return num_draft + 1

  def init(self, tokens: jax.Array, lengths: jax.Array, buffer_len: int, prefill: Any) -> Any:
    ...

  def propose(self, state: Any, sequence: jax.Array, lengths: jax.Array, *, num_draft: int,
              sampling: Sampling, seeds: jax.Array) -> tuple[Any, Proposal]:
    ...

  def observe(self, state: Any, scored: Any, block: jax.Array, emitted: jax.Array,
              count: jax.Array, lengths: jax.Array) -> Any:
    ...


# The members a drafter must define itself, and those `Drafter` gives defaults to.
REQUIRED_MEMBERS = ("vocab_size", "taps", "needs_hidden", "forwards_per_round", "init", "propose",
                    "observe")
DEFAULT_MEMBERS = ("max_len", "max_draft", "confidence", "catches_up", "plain",
                   "forwards_in_round", "extra_slots")


class _Forwarded:
  """A `DrafterWrapper` attribute that reads the wrapped drafter's attribute of the same name.

  A non-data descriptor: a wrapper's own dataclass field of that name (`AdaptiveDrafter.max_draft`,
  `AdaptiveDrafter.plain`) is stored on the instance and wins over it.
  """

  def __set_name__(self, owner, name):
    self.name = name

  def __get__(self, wrapper, owner=None):
    if wrapper is None:
      return self
    return getattr(wrapper.drafter, self.name)


class DrafterWrapper(Drafter):
  """Mixin for a drafter that wraps another one in a field named `drafter`: the protocol's
  attributes, and any other attribute (`head`, `full_logits`, ...), are the wrapped drafter's.
  `extra_slots` and `forwards_in_round` are the wrapper's own (the protocol's defaults: its
  rounds, its state)."""

  vocab_size = _Forwarded()
  taps = _Forwarded()
  needs_hidden = _Forwarded()
  max_len = _Forwarded()
  max_draft = _Forwarded()
  confidence = _Forwarded()
  catches_up = _Forwarded()
  plain = _Forwarded()

  def __getattr__(self, name):
    if name.startswith("__") or name == "drafter":
      raise AttributeError(name)
    return getattr(self.drafter, name)

  def forwards_per_round(self, num_draft: int) -> int:
    return self.drafter.forwards_per_round(num_draft)


class OwnModelDrafter(Drafter):
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


class TextOnlyDrafter(Drafter):
  """Mixin for a drafter that reads only the token buffer (prompt lookup, suffix drafting): no
  target features, no forward passes, and an empty state that observing a round leaves alone."""

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



def with_confidence(drafter, confidence: float | None):
  """`drafter` with its confidence stop set to `confidence` (None: off), through wrappers."""
  if isinstance(drafter, DrafterWrapper):
    return dataclasses.replace(drafter, drafter=with_confidence(drafter.drafter, confidence))
  return dataclasses.replace(drafter, confidence=confidence)
