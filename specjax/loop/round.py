"""One draft/verify round: `draft_step`, `verify_block` and `round_step`, the one loop body.

`specjax.decode` runs `round_step` inside a `lax.while_loop`;
`specjax.loop.stream.decode_stream` runs the same function from the host, one jitted (and donated)
call per round. A round:

1. `draft_step`: the drafter proposes `k` tokens per row after each row's sequence (a drafter
   with a confidence stop proposes only each row's first `Proposal.num_drafted[b]`).
2. `verify_block`: the target scores `[last token, d_1 .. d_k]` at each row's own offset in one
   forward pass, which gives its distributions at the `k` draft positions and one past them; the
   exact accept/reject rule keeps a prefix of the drafts plus one target token (the correction,
   or the bonus when every proposed draft is accepted), cut at EOS and at the row's length limit.
   Rejected drafts are rolled back by setting the target cache's length, never by copying. The
   drafter then observes the target's outputs over the block (`Drafter.observe`).

Both the chain and the tree round end in `_advance`: the kept tokens are appended, rows stop at EOS
or at their limit, and the stats count what was emitted (`DecodeStats`: a draft accepted by the
rule but cut at EOS or at the limit is not counted).

A tree drafter (`specjax.drafters.tree`, `decode(..., tree=TreeSpec(...))`) runs the same round with
a tree proposal: `draft_step` returns a `specjax.trees.structure.Tree` of continuations below each
row's last token, and `verify_block` scores `[last token, nodes]` in one forward with an ancestor
mask, walks the exact tree rule (`specjax.verify.tree_rule`), moves the accepted path's keys/values
to contiguous slots (`specjax.core.cache.compact`) and lets the drafter observe the path as a
chain's block (`path_output`): one `Drafter.observe` for both shapes.

Verify widths: with `widths=(w_1, .., k + 1)` the target's forward is compiled once per width and
each round runs the smallest one that holds every live row's `num_drafted + 1` positions, picked
on device with `lax.switch` (one program, fixed shapes per branch, no host sync).

Random numbers are keyed by each row's seed and the token's absolute position, so a round needs
no key and no round counter: a row's tokens depend on its own seed and prompt only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax.drafters.grammar import constrain_verify, verify_sampling
from specjax.models.cache_write import compact, write_kv_block
from specjax.verify.dispatch import verify_tokens, verify_tree
from specjax.parallel.rules import CACHE_AXES, constrain
from specjax.core.sampling import Sampling, no_distribution, token_logprobs
from specjax.loop.state import DecodeState, DecodeStats, target_features
from specjax.drafters.proposal import Proposal
from specjax.core.sequence import gather_tokens
from specjax.trees.structure import Tree, TreeSpec
from specjax.core.validation import is_eos as is_eos_token

__all__ = ["check_verify_widths", "draft_step", "path_output", "round_step", "score_tree",
           "verify_block"]


def check_verify_widths(widths, num_draft: int) -> tuple[int, ...]:
  """The sorted compiled verify widths: `widths` plus `num_draft + 1`, each in [1, k + 1].

  Raises:
    ValueError: a width that is not an int or lies outside [1, num_draft + 1].
  """
  if widths is None:
    return (num_draft + 1,)
  if isinstance(widths, (int, str)) or not hasattr(widths, "__iter__"):
    raise ValueError(f"verify_widths must be a sequence of ints, got {widths!r}")
  widths = tuple(widths)
  for width in widths:
    if isinstance(width, bool) or not isinstance(width, int):
      raise ValueError(f"verify_widths must hold ints, got {width!r} in {widths}")
    if not 1 <= width <= num_draft + 1:
      raise ValueError(f"verify width {width} is outside [1, num_draft + 1 = {num_draft + 1}]: "
                       "a round verifies its last token plus at most num_draft drafts")
  return tuple(sorted(set(widths) | {num_draft + 1}))


def draft_step(drafter, state: DecodeState, *, num_draft: int,
               sampling: Sampling) -> tuple[DecodeState, Proposal]:
  """Proposes `num_draft` tokens per row after each row's current sequence.

  Args:
    drafter: a `specjax.drafters.Drafter` (wrap a draft model with `specjax.drafters.as_drafter`).
    state: the decode state.
    num_draft: `k`.
    sampling: the sampling settings (identical to the target's).

  Returns:
    `(state with the drafter's new state, Proposal(tokens [B, k], logits [B, k, V] or None,
    num_drafted [B] or None))`; a tree drafter's proposal is a `specjax.trees.structure.Tree`.
  """
  draft_state, proposal = drafter.propose(
      state.draft_state, state.tokens, state.lengths, num_draft=num_draft, sampling=sampling,
      seeds=state.seeds)
  calls = drafter.forwards_in_round(draft_state, num_draft)  # [B] or one count for every row
  live = (~state.done).astype(jnp.int32)
  stats = dataclasses.replace(state.stats, draft_calls=state.stats.draft_calls + calls * live)
  return dataclasses.replace(state, draft_state=draft_state, stats=stats), proposal


def _keep(tokens, accepted, state: DecodeState):
  """How many of a round's candidate tokens each row keeps.

  Args:
    tokens: `[B, W]` the rule's output: `accepted [B]` drafts (or path nodes), then the
      correction or bonus, then padding.
    accepted: `[B]` drafts the rule accepted, `accepted < W`.
    state: the state before the round (`lengths`, `limits`, `eos_ids`, `done`).

  Returns:
    `(count [B], hit_eos [B])`: a live row keeps its tokens up to the correction, cut after its
    first stop token (inclusive) and at its limit (`limits - lengths`); a done row keeps none.
    `hit_eos`: the kept tokens end with a stop token.
  """
  width = tokens.shape[1]
  index = jnp.arange(width, dtype=jnp.int32)
  is_eos = is_eos_token(tokens, state.eos_ids) & (index[None] <= accepted[:, None])
  first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), width)
  count = jnp.minimum(jnp.minimum(accepted + 1, first_eos + 1), state.limits - state.lengths)
  count = jnp.where(state.done, 0, count)
  return count, first_eos < count


def _nonfinite_emitted(bad, count):
  """`bad [B, W]` at the positions a row emitted from (`index < count`), any per row: `[B]`."""
  index = jnp.arange(bad.shape[1], dtype=jnp.int32)
  return jnp.any(bad & (index[None] < count[:, None]), axis=1)


def _count_round(stats: DecodeStats, live, drafted, accepted, count, nonfinite) -> DecodeStats:
  """The stats after one round: `drafted [B]` proposed, `accepted [B]` accepted by the rule,
  `count [B]` tokens emitted (0 for done rows) and `nonfinite [B]` from `_nonfinite_emitted`.

  Only emitted drafts count as accepted: a round emits its accepted drafts plus the correction,
  unless it is cut (at EOS or at the limit) before the correction, when it emits `count`
  drafts. So the kept drafts are `min(accepted, count)`.
  """
  kept = jnp.minimum(accepted, count)
  live_i = live.astype(jnp.int32)
  positions = jnp.arange(stats.accepted_per_position.shape[1], dtype=jnp.int32)
  return dataclasses.replace(
      stats,
      rounds=stats.rounds + live_i,
      drafted=stats.drafted + drafted * live_i,
      accepted=stats.accepted + kept,
      accepted_per_position=stats.accepted_per_position
      + (positions[None] < kept[:, None]).astype(jnp.int32),
      target_calls=stats.target_calls + live_i,
      emitted=stats.emitted + count,
      nonfinite=stats.nonfinite | nonfinite)


def _advance(state: DecodeState, tokens, *, accepted, count, hit_eos, drafted, nonfinite,
             logprobs=None, **fields) -> DecodeState:
  """Appends each live row's `count` kept tokens of `tokens [B, W]` (and, where the state keeps
  them, their target log-probabilities `logprobs [B, W]`) at its length, stops rows at EOS
  (`hit_eos`) or at their limit, counts the round (`_count_round`) and replaces `fields` (the
  caches). Done rows keep their tokens, length and stats."""
  live = ~state.done
  new_lengths = state.lengths + count
  write = lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,))
  written = jax.vmap(write)(state.tokens, tokens, state.lengths)  # past new_lengths: scratch
  written = jnp.where(live[:, None], written, state.tokens)
  if state.logprobs is not None:
    kept = jax.vmap(write)(state.logprobs, logprobs.astype(jnp.float32), state.lengths)
    fields["logprobs"] = jnp.where(live[:, None], kept, state.logprobs)
  done = state.done | hit_eos | (new_lengths >= state.limits)
  stats = _count_round(state.stats, live, drafted, accepted, count, nonfinite)
  return dataclasses.replace(state, tokens=written, lengths=new_lengths, done=done, stats=stats,
                             **fields)


def _verify_at_width(target, drafter, state: DecodeState, proposal: Proposal, block, num_drafted,
                     width: int, *, sampling: Sampling, impl, defer: bool = False):
  """The target's forward over the first `width` positions of `block [B, k + 1]`, the rule, the
  kept counts and the drafter's `observe`, all at that width; tokens padded back to `k + 1`.

  Returns `(tokens [B, k + 1], accepted [B], count [B], hit_eos [B], nonfinite [B], cache or
  KVBlock, draft state, dead [B], logprobs [B, k + 1] or None)`: `count` and `hit_eos` from
  `_keep`, `nonfinite` from `_nonfinite_emitted`, `dead` where a grammar allowed nothing, and,
  where the state keeps them, each token's target log-probability from the forward's own logits
  (`token_logprobs`).

  Every live row needs at most `width` positions (`num_drafted + 1 <= width`), so this is the
  full-width result: the rule keys its random numbers by position, the forward is causal, and
  the drafter observes only what the row keeps. Running the drafter's catch-up at the same width
  keeps rounds that draft little cheap (a round with no drafts is a plain target step plus the
  drafter's catch-up on one token). With `defer`, the target cache is only read and the block's
  keys/values come back zero-padded to `k + 1` entries (a `KVBlock`) for the caller to write.
  """
  k = proposal.tokens.shape[1]
  lengths = state.lengths
  kwargs = target_features(drafter)
  if defer:
    kwargs["write_cache"] = False
  narrow = block[:, :width]
  scored = target(narrow, lengths - 1, state.target_cache, **kwargs)
  drafted = None if num_drafted is None else jnp.minimum(num_drafted, width - 1)
  logits, slots = scored.logits, max(width - 1, 1)
  bad = no_distribution(logits)  # [B, width]
  rule_sampling, stuck_at = sampling, None
  if proposal.grammar_states is not None:  # the constrained law (specjax.drafters.grammar)
    logits, stuck_at = constrain_verify(drafter, logits, proposal.grammar_states[:, :width],
                                        sampling)
    rule_sampling = verify_sampling(sampling)
  if width == 1:  # no drafts: the rule with one unproposed slot gives the bonus from p
    logits = jnp.concatenate([logits, logits], axis=1)
    drafted = jnp.zeros_like(lengths)
  draft_logits = None if proposal.logits is None else proposal.logits[:, :slots]
  result = verify_tokens(logits, draft_logits, proposal.tokens[:, :slots],
                         sampling=rule_sampling, seeds=state.seeds, positions=lengths,
                         num_drafted=drafted, impl=impl)
  result = result._replace(tokens=result.tokens[:, :width])
  accepted = result.num_accepted
  count, hit_eos = _keep(result.tokens, accepted, state)
  dead = jnp.zeros_like(hit_eos)
  if stuck_at is not None:
    # Nothing allowed has weight at a position the row emits from: `generate` stops there, so
    # the row stops there, keeping what came before. Usually the correction's position; an
    # earlier one only where a greedy argmax over nothing matched the draft.
    first = jnp.where(jnp.any(stuck_at, axis=1), jnp.argmax(stuck_at, axis=1), width)
    dead = (first <= accepted) & (count > first)
    count = jnp.where(dead, first, count)
    hit_eos = hit_eos & ~dead
  draft_state = drafter.observe(state.draft_state, scored, narrow, result.tokens, count, lengths)
  tokens = jnp.pad(result.tokens, ((0, 0), (0, k + 1 - width)))
  written = scored.block_kv.padded(k + 1) if defer else scored.cache
  logprobs = None
  if state.logprobs is not None:  # the target's raw logits at the `width` emitted slots
    logprobs = token_logprobs(scored.logits, result.tokens, sampling)
    logprobs = jnp.pad(logprobs, ((0, 0), (0, k + 1 - width)))
  return (tokens, accepted, count, hit_eos, _nonfinite_emitted(bad, count), written,
          draft_state, dead, logprobs)


def verify_block(target, drafter, state: DecodeState, proposal: Proposal, *,
                 sampling: Sampling, impl="auto",
                 widths: tuple[int, ...] | None = None) -> DecodeState:
  """Verifies one round of drafts for every row and advances the state.

  Args:
    target: the target model.
    drafter: the drafter that made `proposal` (its taps are asked of the target, and it observes
      the target's outputs).
    state: the decode state before verification (its target cache holds all but the last token).
    proposal: the round's drafts from `draft_step`.
    sampling: the sampling settings (identical to the drafter's).
    impl: which verify implementation to run (see `specjax.verify.dispatch.verify_tokens`).
    widths: sorted compiled verify widths ending in `k + 1` (`check_verify_widths`); the forward,
      the rule and the drafter's `observe` run at the smallest that holds every live row's
      `num_drafted + 1`. None or a proposal without `num_drafted`: always `k + 1`.

  Returns:
    The advanced state. Rows already done are left unchanged.
  """
  if isinstance(proposal, Tree):
    return _verify_tree_block(target, drafter, state, proposal, sampling=sampling, impl=impl)
  _, k = proposal.tokens.shape
  lengths = state.lengths
  live = ~state.done
  num_drafted = proposal.num_drafted
  if num_drafted is not None:
    num_drafted = jnp.clip(num_drafted.astype(jnp.int32), 0, k)
  last = gather_tokens(state.tokens, lengths - 1, 1)
  block = jnp.concatenate([last, proposal.tokens.astype(jnp.int32)], axis=1)  # [B, k+1]
  switch = not (widths is None or len(widths) == 1 or num_drafted is None)
  # A cache updated inside a switch branch is copied there, every layer, every round: a model that
  # can defer its write (`write_cache=False`) only reads it there, and the block is written after.
  defer = switch and getattr(target, "defers_cache_writes", False)
  run = functools.partial(_verify_at_width, target, drafter, state, proposal, block, num_drafted,
                          sampling=sampling, impl=impl, defer=defer)
  if not switch:
    out = run(k + 1)
  else:  # the smallest compiled width that holds every live row's drafts plus one
    needed = jnp.max(jnp.where(live, num_drafted + 1, 1))
    branch = jnp.sum(jnp.asarray(widths, jnp.int32) < needed).astype(jnp.int32)
    out = jax.lax.switch(branch, [functools.partial(run, w) for w in widths])
  emitted, accepted, count, hit_eos, nonfinite, target_cache, draft_state, dead, logprobs = out
  if defer:
    target_cache = write_kv_block(state.target_cache, target_cache, lengths - 1)
    axes = CACHE_AXES[1:] if target_cache.per_layer else CACHE_AXES  # as the forward's own write
    target_cache = dataclasses.replace(
        target_cache, k=jax.tree.map(lambda x: constrain(x, axes), target_cache.k),
        v=jax.tree.map(lambda x: constrain(x, axes), target_cache.v))
  target_cache = target_cache.with_lengths(lengths + count - 1)
  if proposal.grammar_states is not None:
    forced = draft_state.free  # the round's emitted drafts the grammar forced
    state = dataclasses.replace(state, stats=dataclasses.replace(
        state.stats, constraint_dead=state.stats.constraint_dead | (dead & live),
        forced=state.stats.forced + jnp.where(live, forced, 0)))
  return _advance(state, emitted, accepted=accepted, count=count, hit_eos=hit_eos | dead,
                  drafted=k if num_drafted is None else num_drafted, nonfinite=nonfinite,
                  logprobs=logprobs, target_cache=target_cache, draft_state=draft_state)


def score_tree(target, tree: Tree, root, starts, cache, done, spec: TreeSpec, **features):
  """The target's forward over `[root, nodes]` with the ancestor mask, at `starts + depth`: its
  `ForwardOutput` (logits `[B, N + 1, V]`, the cache, and the `features` asked for: `taps`,
  `return_hidden`).

  With `spec.widths`, valid nodes come first (the tree drafters order them so) and the forward
  runs on the smallest compiled width that holds every live row's valid nodes (`lax.switch`, one
  program); outputs past that width are zeros, at nodes that are invalid and never reached.
  """
  n = tree.num_nodes
  ext_tokens = tree.ext_tokens(root)
  positions = starts[:, None] + tree.ext_depths()
  mask = tree.ancestor_mask()
  if spec.widths is None:
    return target(ext_tokens, starts, cache, positions=positions, block_mask=mask, **features)

  def branch(width):
    def run(cache):
      out = target(ext_tokens[:, :width + 1], starts, cache, positions=positions[:, :width + 1],
                   block_mask=mask[:, :width + 1, :width + 1], **features)
      pad = lambda x, axis: None if x is None else jnp.pad(
          x, [(0, n - width if a == axis else 0) for a in range(x.ndim)])
      return out._replace(logits=pad(out.logits, 1), hidden=pad(out.hidden, 1),
                          taps=pad(out.taps, 2))
    return run

  needed = jnp.max(jnp.where(done, 0, jnp.sum(tree.valid, axis=1)))
  widths = jnp.asarray(spec.widths, jnp.int32)
  choice = jnp.argmax(widths >= needed)  # the smallest width that holds every row
  return jax.lax.switch(choice, [branch(w) for w in spec.widths], cache)


def path_output(scored, index: jax.Array):
  """The target's features at extended tree nodes `index [B, W]` (the root is node 0): `scored`
  with hidden `[B, W, E]` and taps `[n, B, W, E]` gathered there, logits and cache None. Along the
  accepted path (the root, then the path nodes) these are the target's features of positions
  `L - 1 ..`, as a chain's verify forward gives them for its block."""
  hidden = taps = None
  if scored.hidden is not None:
    hidden = jnp.take_along_axis(scored.hidden, index[..., None], axis=1)
  if scored.taps is not None:
    taps = jnp.take_along_axis(scored.taps, index[None, ..., None], axis=2)
  return scored._replace(logits=None, hidden=hidden, taps=taps, cache=None)


def _verify_tree_block(target, drafter, state: DecodeState, tree: Tree, *, sampling: Sampling,
                       impl) -> DecodeState:
  """`verify_block` for a tree proposal: the target scores `[root, nodes]` in one forward with an
  ancestor mask, the exact tree rule walks down the tree and emits the accepted path plus one
  target token (cut at EOS and at the row's limit), the path's keys/values move to contiguous
  slots `[L, L + a)` (`specjax.core.cache.compact`), and the drafter observes the path as a
  chain's block: `[root, path nodes]` with the target's features there (`path_output`).

  Under a grammar constraint (`tree.grammar_states`, `specjax.drafters.grammar_tree`) the rule
  runs on the target's constrained logits at every extended node, from that node's state, with
  the identity warp (or greedily); a stuck node's children are not offered, and a row whose walk
  ends at a stuck node stops there, as the chain's does."""
  spec = drafter.spec
  lengths = state.lengths
  live = ~state.done
  root = gather_tokens(state.tokens, lengths - 1, 1)[:, 0]
  scored = score_tree(target, tree, root, lengths - 1, state.target_cache, state.done, spec,
                      **target_features(drafter))
  logits, rule_sampling, stuck_at, walked = scored.logits, sampling, None, tree
  states = tree.grammar_states
  if states is not None:  # the constrained law at every node (specjax.drafters.grammar_tree)
    logits, stuck_at = constrain_verify(drafter, logits, states, sampling)
    rule_sampling = verify_sampling(sampling)
    offered = tree.valid & ~jnp.take_along_axis(stuck_at, tree.parents + 1, axis=1)
    walked = dataclasses.replace(tree, valid=offered, grammar_states=None)
  result = verify_tree(logits, walked, spec=spec, sampling=rule_sampling, seeds=state.seeds,
                       positions=lengths, impl=impl)
  accepted = result.num_accepted
  count, hit_eos = _keep(result.tokens, accepted, state)
  # Emitted token j comes from the logits of the root (j = 0) or of path node j - 1 (extended
  # node rows[j]), at position L - 1 + j.
  rows = jnp.concatenate([jnp.zeros_like(result.path[:, :1]), result.path + 1], axis=1)
  dead = jnp.zeros_like(hit_eos)
  if states is not None:  # nothing allowed where the row would emit its correction: stop there
    at = jnp.take_along_axis(rows, accepted[:, None], axis=1)
    dead = jnp.take_along_axis(stuck_at, at, axis=1)[:, 0] & (count > accepted)
    count = jnp.where(dead, accepted, count)
    hit_eos = hit_eos & ~dead
    # Emitted path node i (i < count) was forced when its parent, extended node rows[i], allowed
    # only its token.
    depth_index = jnp.arange(spec.depth, dtype=jnp.int32)[None]
    forced = jnp.take_along_axis(drafter.forced(states), rows[:, :-1], axis=1)
    forced = jnp.sum(forced & (depth_index < jnp.minimum(accepted, count)[:, None]), axis=1,
                     dtype=jnp.int32)
    state = dataclasses.replace(state, stats=dataclasses.replace(
        state.stats, constraint_dead=state.stats.constraint_dead | (dead & live),
        forced=state.stats.forced + jnp.where(live, forced, 0)))
  bad = jnp.take_along_axis(no_distribution(scored.logits), rows, axis=1)  # [B, D + 1]
  # Path node i sits at slot starts + 1 + i; its depth-d entry moves to slot starts + d.
  moved = jnp.maximum(count - 1, 0)
  cache = compact(scored.cache, lengths[:, None] + result.path, lengths, moved)
  cache = cache.with_lengths(lengths + count - 1)  # a done row (count 0) keeps its length
  block = jnp.take_along_axis(tree.ext_tokens(root), rows, axis=1)  # [B, D + 1]
  draft_state = drafter.observe(state.draft_state, path_output(scored, rows), block,
                                result.tokens.astype(jnp.int32), count, lengths)
  logprobs = None
  if state.logprobs is not None:  # emitted token j from the logits of extended node rows[j]
    path_logits = jnp.take_along_axis(scored.logits, rows[..., None], axis=1)
    logprobs = token_logprobs(path_logits, result.tokens, sampling)
  return _advance(state, result.tokens, accepted=accepted, count=count, hit_eos=hit_eos | dead,
                  drafted=jnp.sum(tree.valid, axis=1).astype(jnp.int32),
                  nonfinite=_nonfinite_emitted(bad, count), logprobs=logprobs, target_cache=cache,
                  draft_state=draft_state)


def round_step(target, drafter, state: DecodeState, *, num_draft: int, sampling: Sampling,
               verify_impl="auto", widths: tuple[int, ...] | None = None) -> DecodeState:
  """One round: `draft_step` then `verify_block`. The body of `decode`'s loop and of the stream."""
  state, proposal = draft_step(drafter, state, num_draft=num_draft, sampling=sampling)
  return verify_block(target, drafter, state, proposal, sampling=sampling, impl=verify_impl,
                      widths=widths)
