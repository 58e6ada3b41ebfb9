"""Tree speculative decoding: one jit, one `lax.while_loop`, a draft tree per row per round.

Each round, per row with `L` tokens (the target cache holds `tokens[:L - 1]`):

1. the drafter grows a tree of `N` nodes below the row's last token (`specjax.trees`);
2. the target scores `[root, node_1 .. node_N]` in one forward at positions `L - 1 + depth`, each
   node attending to the cache and to its ancestors only (an `[N + 1, N + 1]` ancestor mask);
3. the exact rule (`specjax.tree_rule.verify_tree`) walks the tree and emits the accepted path
   plus one target token, cut at EOS and at the row's limit;
4. the accepted path's keys/values move to contiguous slots `[L, L + a)` (`specjax.cache.compact`)
   and the cache length becomes `L + a` (the emitted token is the next round's root).

A draft model keeps its own cache of the committed text: each round it first catches up on the
last round's emitted tokens (one forward of `D + 1` tokens), then expands the tree with
tree-masked forwards that write only scratch slots past the committed length.

A feature head (`EagleDrafter`: EAGLE-3 or MTP; `MedusaDrafter`) drafts through
`specjax.drafters.tree_heads`: the target's tree forward also returns the features the head reads,
and after verification the head catches up on the accepted path with the target's features (the
chain `observe`), so its state keeps the chain invariant of `specjax.drafters.heads`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from specjax import tree_builders, tree_rule, trees, validation
from specjax.cache import KVCache, compact
from specjax.drafters import tree_heads
from specjax.drafters.hybrid import HybridDrafter
from specjax.outputs import DecodeOutput, DecodeStats
from specjax.sampling import GREEDY, Sampling, row_seeds
from specjax.state import clear_padding, prefill
from specjax.tracing import TRACE_COUNTS
from specjax.trees import TreeSpec

NEW_TOKEN_BUCKET = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeDecodeState:
  """Everything the tree loop carries from one round to the next."""

  tokens: jax.Array  # [B, S] int32 prompt, generated tokens, scratch past `lengths`
  lengths: jax.Array  # [B] int32
  prompt_lengths: jax.Array  # [B] int32
  limits: jax.Array  # [B] int32 prompt length + max_new_tokens
  eos_ids: jax.Array  # [E] int32
  done: jax.Array  # [B] bool
  seeds: jax.Array  # [B] uint32
  target_cache: KVCache  # keys/values of tokens[:, :lengths - 1]
  draft_cache: Any  # draft model: KVCache of a prefix of tokens[:, :lengths - 1]; head: its
  #                   state (`EagleState`, `MedusaState`); () without a drafter
  stats: DecodeStats


def _draft_model(drafter):
  """The draft `Model` behind `drafter` (a model, or a wrapper with `.model`), or None."""
  if drafter is None:
    return None
  if hasattr(drafter, "init_cache"):
    return drafter
  model = getattr(drafter, "model", None)
  return model if hasattr(model, "init_cache") else None


def extra_slots(spec: TreeSpec) -> int:
  """Scratch slots past a row's length that a round writes (tree block, expansion pool)."""
  pool = trees.dynamic_pool_size(spec.depth, spec.width) if spec.builder == "dynamic" else 0
  return max(spec.size, pool, spec.depth) + 2


def decode_tree(target, drafter, tokens, rng, *, tree: TreeSpec, lengths=None,
                max_new_tokens: int = 64, sampling: Sampling = GREEDY,
                eos_id: int | tuple[int, ...] | None = None,
                pad_id: int | None = None, verify_impl: str = "auto") -> DecodeOutput:
  """Speculative decoding with a draft tree per round; the target's exact distribution.

  Args:
    target: the target `specjax.Model` (it must accept `positions` and `block_mask`).
    drafter: a draft `specjax.Model` (or an object with a `.model`), or a feature head
      (`EagleDrafter` for static, sampled and dynamic trees; `MedusaDrafter` for static and
      sampled ones); unused (may be None) for `TreeSpec(builder="ngram")`.
    tokens: `[B, T]` int prompt ids, right-padded; lengths: `[B]` or None.
    rng: a PRNG key, or `[B]` keys (one per request).
    tree: the `TreeSpec`.
    max_new_tokens, sampling, eos_id, pad_id: as in `specjax.decode`.
    verify_impl: who does the verify's vocabulary-sized work (`specjax.tree_rule.verify_tree`'s
      `impl`): "auto" (the fused Pallas kernel on TPU/GPU, the jnp rule on CPU), "reference",
      "pallas", "kernel" or "interpret"; identical tokens whichever.

  Returns:
    `DecodeOutput(tokens [B, max_new_tokens], num_tokens [B], stats)`; `stats.accepted_per_position`
    is `[B, D]` (accepted nodes per depth).
  """
  validation.check_model(target, "target")
  if not isinstance(tree, TreeSpec):
    raise ValueError(f"tree must be a specjax.TreeSpec, got {type(tree).__name__}")
  if isinstance(drafter, HybridDrafter) and tree.builder != "ngram":
    raise ValueError("a HybridDrafter drafts chains (prompt lookup or its head); a tree drafts "
                     "with the head alone: pass its `.drafter` (e.g. `pair.draft.drafter`)")
  draft = _draft_model(drafter)
  if tree.builder == "ngram":
    draft = None
  elif tree_heads.is_head_drafter(drafter):
    tree_heads.check_tree_drafter(target, drafter, tree)
    draft = drafter
  elif draft is None:
    raise ValueError(f"a {tree.builder!r} tree needs a draft model or a draft head "
                     f"(EagleDrafter, MedusaDrafter), got {type(drafter).__name__}")
  elif draft.vocab_size != target.vocab_size:
    raise ValueError(f"draft vocabulary ({draft.vocab_size}) does not match the target's "
                     f"({target.vocab_size})")
  tokens, lengths = validation.check_tokens(tokens, lengths, target.vocab_size)
  max_new_tokens = validation.check_count(max_new_tokens, "max_new_tokens")
  extra = extra_slots(tree)
  validation.check_context(lengths, tokens.shape[1], max_new_tokens + extra, target.max_len,
                           "target")
  if draft is not None and not tree_heads.is_head_drafter(draft):
    validation.check_context(lengths, tokens.shape[1], max_new_tokens + extra, draft.max_len,
                             "draft")
  rng = validation.check_rng(rng, tokens.shape[0])
  eos_ids = jnp.array(validation.check_eos(eos_id, target.vocab_size), jnp.int32)
  validation.check_sampling(sampling)
  capacity = validation.round_up(max_new_tokens, NEW_TOKEN_BUCKET)
  out = _decode_tree(target, draft, tokens, lengths, rng, jnp.int32(max_new_tokens), eos_ids,
                     spec=tree, sampling=sampling, capacity=capacity,
                     pad_id=validation.resolve_pad_id(target, pad_id), verify_impl=verify_impl,
                     classes=validation.pytree_classes(target, draft))
  return DecodeOutput(out.tokens[:, :max_new_tokens], out.num_tokens, out.stats)


@functools.partial(jax.jit, static_argnames=("spec", "sampling", "capacity", "pad_id",
                                             "verify_impl", "classes"))
def _decode_tree(target, draft, tokens, lengths, rng, max_new_tokens, eos_ids, *, spec, sampling,
                 capacity, pad_id, verify_impl, classes=()) -> DecodeOutput:
  del classes  # a cache key only (`validation.pytree_classes`)
  TRACE_COUNTS["decode_tree"] += 1
  state = init_tree_state(target, draft, tokens, lengths, max_new_tokens, eos_ids,
                          row_seeds(rng, tokens.shape[0]), spec=spec, capacity=capacity)
  body = functools.partial(tree_round, target, draft, spec=spec, sampling=sampling,
                           verify_impl=verify_impl)
  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  num_tokens = state.lengths - state.prompt_lengths
  index = jnp.arange(capacity, dtype=jnp.int32)
  new = jnp.take_along_axis(state.tokens, state.prompt_lengths[:, None] + index, axis=1,
                            mode="clip")
  return DecodeOutput(jnp.where(index[None] < num_tokens[:, None], new, pad_id), num_tokens,
                      state.stats)


def init_tree_state(target, draft, tokens, lengths, max_new_tokens, eos_ids, seeds, *,
                    spec: TreeSpec, capacity: int) -> TreeDecodeState:
  """Prefills the target and the drafter on the prompts: caches hold `tokens[:L - 1]` (a head's
  state its invariant, from the target's prefill features)."""
  batch, width = tokens.shape
  tokens = clear_padding(tokens, lengths)
  buffer_len = width + capacity + extra_slots(spec)
  sequence = jnp.zeros((batch, buffer_len), jnp.int32).at[:, :width].set(tokens)
  zeros = jnp.zeros((batch,), jnp.int32)
  head = tree_heads.is_head_drafter(draft)
  out = prefill(target, tokens, target.init_cache(batch, buffer_len),
                **(tree_heads.target_features(draft) if head else {}))
  target_cache = out.cache
  draft_cache = ()
  if head:
    draft_cache = draft.init(tokens, lengths, buffer_len, out)
  elif draft is not None:
    draft_cache = draft(tokens, zeros, draft.init_cache(batch, buffer_len)).cache
    draft_cache = draft_cache.with_lengths(lengths - 1)
  stats = DecodeStats(rounds=zeros, drafted=zeros, accepted=zeros,
                      accepted_per_position=jnp.zeros((batch, spec.depth), jnp.int32),
                      target_calls=zeros + 1,
                      draft_calls=zeros + (draft is not None and not head))
  return TreeDecodeState(sequence, lengths, lengths, lengths + max_new_tokens,
                         jnp.atleast_1d(eos_ids), jnp.zeros((batch,), bool),
                         jnp.asarray(seeds, jnp.uint32), target_cache.with_lengths(lengths - 1),
                         draft_cache, stats)


def _gather(sequence, starts, width):
  index = starts[:, None] + jnp.arange(width, dtype=jnp.int32)
  return jnp.take_along_axis(sequence, index, axis=1, mode="clip")


def draft_tree(draft, state: TreeDecodeState, *, spec: TreeSpec, sampling: Sampling):
  """Builds this round's tree; returns `(draft cache caught up to lengths - 1, tree, calls)` (a
  head's state is returned as it was: it catches up after verification)."""
  lengths = state.lengths
  root = _gather(state.tokens, lengths - 1, 1)[:, 0]
  if tree_heads.is_head_drafter(draft):
    tree = tree_heads.draft_tree(draft, state.draft_cache, spec=spec, root=root,
                                 sequence=state.tokens, lengths=lengths, sampling=sampling,
                                 seeds=state.seeds)
    return state.draft_cache, tree, tree_heads.forwards_per_round(draft, spec)
  if draft is None:
    tree = tree_builders.build_tree(spec, expand=None, root=root, sequence=state.tokens,
                                    lengths=lengths, sampling=sampling, seeds=state.seeds)
    return state.draft_cache, tree, 0
  # Catch up on the tokens committed since the draft cache was last extended (<= D + 1 of them).
  cache = state.draft_cache
  caught_up = draft(_gather(state.tokens, cache.lengths, spec.depth + 1), cache.lengths, cache)
  cache = caught_up.cache.with_lengths(lengths - 1)
  starts = lengths - 1

  def expand(ext_tokens, ext_parents, ext_depths):
    out = draft(ext_tokens, starts, cache, positions=starts[:, None] + ext_depths,
                block_mask=trees.ancestor_mask(ext_parents))
    return out.logits

  def chain_candidates():
    """Static trees: the draft's greedy chain from the root, top-`K` candidates per depth."""
    k = max(c[-1] for c in spec.resolved_choices) + 1
    token, chain_cache, ranked = root, cache, []
    for d in range(spec.depth):
      out = draft(token[:, None], starts + d, chain_cache)
      chain_cache = out.cache
      top = jax.lax.top_k(out.logits[:, 0], k)[1]
      ranked.append(top)
      token = top[:, 0]
    return jnp.stack(ranked, axis=1)  # [B, D, K]

  tree = tree_builders.build_tree(spec, expand=expand, root=root, sequence=state.tokens,
                                  lengths=lengths, sampling=sampling, seeds=state.seeds,
                                  chain_candidates=chain_candidates)
  return cache, tree, 1 + spec.depth


def score_tree(target, tree, root, starts, cache, done, spec: TreeSpec, **features):
  """The target's forward over `[root, nodes]` with the ancestor mask, at `starts + depth`: its
  `ForwardOutput` (logits `[B, N + 1, V]`, the cache, and the `features` asked for: `taps`,
  `return_hidden`).

  With `spec.widths`, valid nodes are moved to the front and the forward runs on the smallest
  compiled width that holds every live row's valid nodes (`lax.switch`, one program); outputs past
  that width are zeros, at nodes that are invalid and never reached.
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


def tree_round(target, draft, state: TreeDecodeState, *, spec: TreeSpec,
               sampling: Sampling, verify_impl: str = "auto") -> TreeDecodeState:
  """One draft / score / verify / compact round for every row (done rows are left unchanged)."""
  lengths = state.lengths
  draft_cache, tree, draft_calls = draft_tree(draft, state, spec=spec, sampling=sampling)
  if spec.widths is not None:
    tree = trees.valid_first(tree)
  root = _gather(state.tokens, lengths - 1, 1)[:, 0]
  head = tree_heads.is_head_drafter(draft)
  scored = score_tree(target, tree, root, lengths - 1, state.target_cache, state.done, spec,
                      **(tree_heads.target_features(draft) if head else {}))
  result = tree_rule.verify_tree(scored.logits, tree, rule=spec.rule, sampling=sampling,
                                 seeds=state.seeds, positions=lengths, max_depth=spec.depth,
                                 max_children=spec.max_children, impl=verify_impl)
  accepted = result.num_accepted
  depth = spec.depth
  index = jnp.arange(depth + 1, dtype=jnp.int32)
  is_eos = validation.is_eos(result.tokens, state.eos_ids) & (index[None] <= accepted[:, None])
  first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), depth + 1)
  live = ~state.done
  count = jnp.minimum(jnp.minimum(accepted + 1, first_eos + 1), state.limits - lengths)
  count = jnp.where(live, count, 0)
  new_lengths = lengths + count
  write = lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,))
  sequence = jax.vmap(write)(state.tokens, result.tokens, lengths)  # past new_lengths: scratch
  sequence = jnp.where(live[:, None], sequence, state.tokens)
  # Path node i sits at slot starts + 1 + i; its depth-d entry moves to slot starts + d.
  moved = jnp.maximum(count - 1, 0)
  cache = compact(scored.cache, lengths[:, None] + result.path, lengths, moved)
  cache = cache.with_lengths(jnp.where(live, new_lengths - 1, lengths - 1))
  done = state.done | (new_lengths >= state.limits) | (live & (first_eos <= accepted))
  stats = state.stats
  used = jnp.minimum(accepted, moved)  # accepted nodes that were kept
  per_depth = (jnp.arange(depth)[None] < used[:, None]).astype(jnp.int32)
  live_i = live.astype(jnp.int32)
  stats = DecodeStats(
      rounds=stats.rounds + live_i,
      drafted=stats.drafted + live_i * jnp.sum(tree.valid, axis=1).astype(jnp.int32),
      accepted=stats.accepted + used,
      accepted_per_position=stats.accepted_per_position + per_depth,
      target_calls=stats.target_calls + live_i,
      draft_calls=stats.draft_calls + live_i * draft_calls)
  if head:
    draft_cache = tree_heads.observe_path(draft, state.draft_cache, scored, tree, root,
                                          result.path, result.tokens, count, lengths)
  elif draft is None:
    draft_cache = state.draft_cache
  return TreeDecodeState(sequence, new_lengths, state.prompt_lengths, state.limits,
                         state.eos_ids, done, state.seeds, cache, draft_cache, stats)
