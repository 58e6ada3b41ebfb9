"""Exact speculative decoding under a grammar: `GrammarDrafter`, and the verify's masking.

`specjax.decode(..., constraint=c)` samples exactly what `specjax.generate(..., constraint=c)`
samples: at every position, the constrained law of `specjax.constrain.law` (the target's warped
distribution restricted to the tokens the row's automaton state allows). Two pieces make it so.

**The drafts** (`GrammarDrafter`, wrapped around any chain drafter by `decode`). The wrapped
drafter proposes as usual; the wrapper walks each row's automaton along the proposal, from the
row's state, and at draft `i` in state `s_i`:

  * a draft the drafter drew from logits `q_i` is kept when `s_i` allows it and redrawn otherwise
    from `q'_i = constrained_logits(q_i, mask(s_i))` (fresh noise, its own stream). Keeping an
    allowed draw of `q_i` and redrawing the rest from `q_i` restricted to the allowed set gives a
    draw of exactly that restriction, so `q'_i` is the distribution the draft came from, and the
    proposal carries it (with its fallback where the restriction is empty, as the law has);
  * a point-mass draft (n-gram, suffix, a greedy draft model) is kept when allowed;
  * where `s_i` allows exactly one token (a forced `{`, a key name, a closing quote), that token
    is the draft, with a point mass, also past the point where the wrapped drafter stopped
    (its confidence stop, no n-gram match): the target's constrained law is a point mass there
    too, so it is accepted with probability 1 -- a free token;
  * otherwise the round's drafting ends at `i` (`num_drafted = i`): after a redraw, a model
    drafter's later drafts were conditioned on a token the proposal no longer holds, so only
    forced tokens follow it.

A draft model (`ModelDrafter`, the self-draft included) is *guided*: it draws every draft from
`q'_i` inside its own loop (`Guide`), advancing a scratch copy of the row's state along its
drafts, so its chain stays in the grammar and each draft is conditioned on drafts the proposal
keeps; the walk then finds every draft allowed (nothing redrawn, no cache cut) and only adds the
forced tokens past its stop. An unguided drafter (n-gram, suffix, feature heads, adaptive and
hybrid wrappers) is walked as above.

The proposal carries `grammar_states [B, k + 1]`: the state before each block position.

**The verify** (`constrain_verify`, called by `specjax.loop.round`): the target's logits at block
position `i` become `constrained_logits(p_i, mask(s_i))`, the same function `generate` samples
from, and the rule runs with the identity warp (`temperature=1`, no top-k / top-p) on these and on
the drafts' `q'` (already warped and restricted), or greedily. The rule is exact for any `q` given
with its draw, so the emitted tokens follow the constrained law. A row whose state at the position
it would emit from allows nothing (`stuck`) emits nothing more and stops, flagged in
`stats.constraint_dead`, as in `generate`.

Each row's automaton state lives in the wrapper's draft state; `observe` advances it along the
tokens the row kept, so a rejected suffix rolls it back with the sequence's length. A draft
model's own cache is cut back to the first redrawn draft, which its next catch-up re-reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.constrain.law import constrained_logits, stuck
from specjax.constrain.tables import ConstraintTables, advance, allowed_mask, token_allowed
from specjax.core.cache import KVCache
from specjax.core.sampling import GREEDY, Sampling, first_argmax, sample_race
from specjax.drafters.base import DrafterWrapper
from specjax.drafters.proposal import Proposal

__all__ = ["PURPOSE_GRAMMAR_DRAFT", "GrammarDrafter", "GrammarState", "GrammarWrapper", "Guide",
           "constrain_verify", "verify_sampling"]

# The noise of a redrawn draft: its own stream, independent of the drafter's draws and of the
# verify's uniforms and residual draws (`specjax.core.sampling`'s purposes).
PURPOSE_GRAMMAR_DRAFT = 21


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarState:
  """The wrapper's draft state.

  Attributes:
    inner: the wrapped drafter's state.
    state: `[B]` int32 each row's automaton state after its accepted tokens.
    redrawn: `[B]` int32 the first draft of the last proposal that is not the wrapped drafter's
      own (`k`: none); `observe` cuts a draft model's cache back to it.
    forced: `[B]` int32 bit `i` set where the last proposal's draft `i` was forced (the only
      token its state allows).
    free: `[B]` int32 forced drafts the last verified round emitted.
  """

  inner: Any
  state: jax.Array
  redrawn: jax.Array
  forced: jax.Array
  free: jax.Array


def _restricted(logits, mask, sampling: Sampling):
  """`q'`: `constrained_logits`, or, where no allowed token has weight (a drafter that gives
  every allowed token `-inf`), uniform over the allowed tokens."""
  scores = constrained_logits(logits, mask, sampling)
  empty = stuck(scores, mask)
  return jnp.where(empty[..., None], jnp.where(mask, 0.0, -jnp.inf), scores)


class GrammarWrapper(DrafterWrapper):
  """What the chain's `GrammarDrafter` and the tree's `GrammarTreeDrafter` share: the wrapped
  drafter's costs, each row's grammar (`tables`, `schema`: the subclass's fields) and the
  target's constrained law."""

  def forwards_per_round(self, num_draft: int) -> int:
    return self.drafter.forwards_per_round(num_draft)

  def forwards_in_round(self, state, num_draft: int):
    return self.drafter.forwards_in_round(state.inner, num_draft)

  def extra_slots(self, num_draft: int) -> int:
    return self.drafter.extra_slots(num_draft)

  def initial_states(self, batch: int) -> jax.Array:
    """`[B]` int32 each row's initial automaton state."""
    start = jnp.asarray(self.tables.initial)[self.schema]
    return jnp.broadcast_to(start, (batch,)).astype(jnp.int32)

  def _schema(self, state):
    return self.schema.reshape(self.schema.shape + (1,) * (jnp.ndim(state) - 1))

  def mask(self, state):
    """`[B, ..., V]` bool: what `state` (`[B, ...]`) allows, each row in its own grammar."""
    return allowed_mask(self.tables, state, self._schema(state))

  def advance(self, state, token):
    """`[B, ...]` int32 the states after `token` from `state` (both `[B, ...]`)."""
    return advance(self.tables, state, token, self._schema(state))

  def target_law(self, logits, states, sampling: Sampling):
    """`(constrained [B, W, V], stuck [B, W])`: the target's constrained logits at each block
    position (or extended tree node), from the state before it, and where nothing allowed has
    weight."""
    mask = self.mask(states)
    return constrained_logits(logits, mask, sampling), stuck(logits, mask)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarDrafter(GrammarWrapper):
  """A chain drafter whose proposals follow a grammar (see the module docstring).

  Attributes:
    drafter: the wrapped chain drafter (any: a draft model, a self-draft, n-gram, suffix, a
      feature head, adaptive).
    tables: stacked `ConstraintTables` (`specjax.constrain.compile.constraint_inputs`).
    schema: `[B]` int32 each row's index into `tables`.
  """

  drafter: Any
  tables: ConstraintTables
  schema: jax.Array

  def init(self, tokens, lengths, buffer_len, prefill):
    inner = self.drafter.init(tokens, lengths, buffer_len, prefill)
    zeros = jnp.zeros((tokens.shape[0],), jnp.int32)
    return GrammarState(inner, self.initial_states(tokens.shape[0]), zeros, zeros, zeros)

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, **kwargs):
    guided = getattr(type(self.drafter), "guided", False)
    if guided:
      kwargs = dict(kwargs, guide=Guide(self, state.state, sampling))
    inner, proposal = self.drafter.propose(state.inner, sequence, lengths, num_draft=num_draft,
                                           sampling=sampling, seeds=seeds, **kwargs)
    if not isinstance(proposal, Proposal):
      raise ValueError("GrammarDrafter wraps a chain drafter; a tree drafter under a constraint "
                       "is a specjax.drafters.grammar_tree.GrammarTreeDrafter")
    k = proposal.tokens.shape[1]
    batch = lengths.shape[0]
    drafted = (jnp.full((batch,), k, jnp.int32) if proposal.num_drafted is None
               else jnp.clip(proposal.num_drafted.astype(jnp.int32), 0, k))
    s = state.state
    going = jnp.ones((batch,), bool)  # still drafting
    own = jnp.ones((batch,), bool)  # every draft so far is the wrapped drafter's
    redrawn = jnp.full((batch,), k, jnp.int32)
    count = jnp.zeros((batch,), jnp.int32)
    forced_bits = jnp.zeros((batch,), jnp.int32)
    states, tokens, logits = [s], [], []
    for i in range(k):
      mask = self.mask(s)  # [B, V]
      forced = jnp.sum(mask, axis=-1, dtype=jnp.int32) == 1
      only = first_argmax(mask.astype(jnp.float32))
      x = proposal.tokens[:, i].astype(jnp.int32)
      offered = own & (i < drafted)  # the wrapped drafter proposes this slot
      if proposal.logits is None:  # point masses
        keep = offered & token_allowed(self.tables, s, x, self.schema)
        token = jnp.where(keep, x, only)
        ok = keep | forced
        q = None
      else:
        # A guided drafter drew from the restriction itself (`Guide`); the walk keeps its draws.
        q = (proposal.logits[:, i] if guided
             else _restricted(proposal.logits[:, i], mask, sampling))
        kept = jnp.take_along_axis(q, x[:, None], axis=1)[:, 0] > -jnp.inf
        keep = offered & kept
        if sampling.greedy:
          fresh = first_argmax(q)
        else:
          fresh = sample_race(q, seeds, lengths + i, PURPOSE_GRAMMAR_DRAFT)
        token = jnp.where(keep, x, jnp.where(offered, fresh, only))
        ok = offered | forced
        # Past the wrapped drafter's proposal only forced tokens follow: a point mass there.
        point = jnp.where(jax.nn.one_hot(only, q.shape[-1], dtype=bool), 0.0, -jnp.inf)
        if not guided:
          q = self.reported_q(q, proposal.logits[:, i], sampling)
        q = jnp.where(offered[:, None], q, point)
      going = going & ok & (s >= 0)
      token = jnp.where(going, token, proposal.tokens[:, i])
      # From the first draft that is not the wrapped drafter's own, only forced tokens follow.
      other = going & ~keep
      redrawn = jnp.where(other & (redrawn == k), i, redrawn)
      own = own & ~other
      count = count + going.astype(jnp.int32)
      forced_bits = forced_bits | jnp.where(going & forced, 1 << i, 0)
      tokens.append(token)
      if q is not None:
        logits.append(q)
      s = jnp.where(going, advance(self.tables, s, token, self.schema), s)
      states.append(s)
    new = Proposal(tokens=jnp.stack(tokens, axis=1),
                   logits=None if proposal.logits is None else jnp.stack(logits, axis=1),
                   num_drafted=count, confidence=proposal.confidence,
                   grammar_states=jnp.stack(states, axis=1))
    return GrammarState(inner, state.state, redrawn, forced_bits, state.free), new

  def reported_q(self, restricted, raw, sampling: Sampling):
    """The `q` a redrawn-or-kept draft came from, as the proposal carries it: `restricted`
    (`specjax.testing.grammar` overrides it to build broken variants)."""
    del raw, sampling
    return restricted


  def observe(self, state, scored, block, emitted, count, lengths):
    inner = state.inner
    if isinstance(inner, KVCache):  # a draft model's own cache: re-read from the first redraw
      inner = inner.with_lengths(jnp.minimum(inner.lengths, lengths + state.redrawn))
    inner = self.drafter.observe(inner, scored, block, emitted, count, lengths)
    s = state.state
    free = jnp.zeros_like(count)
    for j in range(emitted.shape[1]):
      s = jnp.where(j < count, advance(self.tables, s, emitted[:, j], self.schema), s)
      free = free + ((j < count) & ((state.forced >> j) & 1 == 1)).astype(jnp.int32)
    return GrammarState(inner, s, state.redrawn, state.forced, free)


@dataclasses.dataclass(frozen=True)
class Guide:
  """What a guided drafter (a class with `guided = True`: `specjax.drafters.model.ModelDrafter`)
  drafts with inside its own loop, so its chain follows the grammar: `restrict(state, logits)`
  gives `q'` (drawn with `draw_sampling`, the identity warp or greedy, and reported as the
  draft's `q`) and `advance(state, token)` the state after a draft.

  Attributes:
    drafter: the `GrammarDrafter` (its tables and each row's schema).
    state: `[B]` int32 each row's automaton state before the round's first draft.
    sampling: the call's sampling settings.
  """

  drafter: Any
  state: jax.Array
  sampling: Sampling

  @property
  def draw_sampling(self) -> Sampling:
    return verify_sampling(self.sampling)

  def restrict(self, state, logits):
    """`(q' [B, V], reported [B, V])`: the law to draw from and the `q` the proposal carries
    (`GrammarDrafter.reported_q`: `q'` itself)."""
    restricted = _restricted(logits, self.drafter.mask(state), self.sampling)
    return restricted, self.drafter.reported_q(restricted, logits, self.sampling)

  def advance(self, state, token):
    return advance(self.drafter.tables, state, token.astype(jnp.int32), self.drafter.schema)


def verify_sampling(sampling: Sampling) -> Sampling:
  """The settings the rule runs with on constrained (already warped) logits."""
  return GREEDY if sampling.greedy else Sampling(temperature=1.0)


def constrain_verify(drafter, logits, states, sampling: Sampling):
  """The target's constrained logits at each block position and where a position allows nothing.

  Args:
    drafter: the round's `GrammarDrafter` (or, for a tree, its
      `specjax.drafters.grammar_tree.GrammarTreeDrafter`).
    logits: `[B, W, V]` the target's raw logits over the block's first `W` positions (a tree's
      `W = N + 1` extended nodes).
    states: `[B, W]` int32 the automaton state before each of them (after each extended node).
    sampling: the call's sampling settings.

  Returns:
    `(constrained [B, W, V], stuck [B, W])`.
  """
  return drafter.target_law(logits, states, sampling)
