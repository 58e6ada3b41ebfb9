"""Tree builders: static choice lists, n-gram tries, sampled trees, EAGLE-2 dynamic trees and
DDTree trees over a block drafter's marginals.

See `specjax.trees.structure` for the data layout, the `expand` interface and the grammar
`guide` the model builders take under a constraint. Every builder returns a `Tree` of a static node
budget, parents before children.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from specjax.core.sampling import Sampling, first_argmax, gumbel, top_k, warp_logits
from specjax.trees.structure import PURPOSE_TREE_DRAFT, Expand, Tree, TreeSpec, dynamic_pool_size


def call_expand(expand: Expand, ext_tokens, ext_parents, ext_depths, built: slice) -> jax.Array:
  """Calls `expand`; an incremental one (`expand.incremental`) also gets `built`, the static slice
  of nodes whose tokens were set since its previous call (see `specjax.trees.structure`)."""
  if getattr(expand, "incremental", False):
    return expand(ext_tokens, ext_parents, ext_depths, built=built)
  return expand(ext_tokens, ext_parents, ext_depths)


def static_structure(choices) -> tuple[list[int], list[int], list[int]]:
  """Host-side parents, depths and candidate ranks of a sorted choice list."""
  index = {c: i for i, c in enumerate(choices)}
  parents = [index[c[:-1]] if len(c) > 1 else -1 for c in choices]
  return parents, [len(c) for c in choices], [c[-1] for c in choices]


def static_tree(candidates: jax.Array, choices) -> Tree:
  """A Medusa-style tree: node `(r_1, .., r_d)` holds `candidates[:, d - 1, r_d]`.

  Args:
    candidates: `[B, D, K]` int32 ranked candidates per depth (distinct within a depth).
    choices: sorted choice paths (`TreeSpec.resolved_choices`); ranks must be `< K`.

  Returns:
    A deterministic `Tree` (no logits).
  """
  parents, depths, ranks = static_structure(choices)
  batch = candidates.shape[0]
  depth_index = jnp.asarray(depths, jnp.int32) - 1
  tokens = candidates[:, depth_index, jnp.asarray(ranks, jnp.int32)].astype(jnp.int32)
  shape = (batch, len(choices))
  return Tree(tokens, jnp.broadcast_to(jnp.asarray(parents, jnp.int32), shape),
              jnp.broadcast_to(jnp.asarray(depths, jnp.int32), shape),
              jnp.ones(shape, bool))


def ngram_tree(sequence: jax.Array, lengths: jax.Array, *, num_matches: int, depth: int,
               max_ngram: int = 3, min_ngram: int = 1) -> Tree:
  """Prompt lookup with several matches merged into a trie.

  The `num_matches` best earlier occurrences of the row's suffix (longest match first, then most
  recent) each propose the `depth` tokens that followed them; equal prefixes share nodes.

  Args:
    sequence: `[B, S]` int32 tokens; `lengths` `[B]` how many are valid.
    num_matches, depth: `M` and `D`; the tree has `N = M * D` nodes, node `(d, m)` at `d * M + m`.

  Returns:
    A deterministic `Tree`; continuations past the known text and duplicates are invalid.
  """
  def one_row(row, length):
    size = row.shape[0]
    j = jnp.arange(size, dtype=jnp.int32)  # a match ends just before slot j
    score = jnp.zeros((size,), jnp.int32)
    for n in range(min_ngram, max_ngram + 1):
      match = (j >= n) & (j < length) & (length >= n + 1)
      for i in range(n):
        match &= jnp.take(row, jnp.maximum(j - n + i, 0)) == row[jnp.maximum(length - n + i, 0)]
      score = jnp.where(match, n, score)  # longer matches overwrite shorter ones
    # Rank by (match length, recency): the key fits in int32 for S < 2**24.
    key = jnp.where(score > 0, score * size + j, -1)
    best, starts = jax.lax.top_k(key, num_matches)  # [M]
    found = best >= 0
    offsets = jnp.arange(depth, dtype=jnp.int32)
    source = starts[:, None] + offsets[None, :]  # [M, D]
    ok = found[:, None] & (source < length)
    ok = jnp.cumprod(ok.astype(jnp.int32), axis=1).astype(bool)
    conts = jnp.where(ok, jnp.take(row, jnp.minimum(source, size - 1)), -1)  # [M, D]
    return conts, ok

  conts, ok = jax.vmap(one_row)(sequence, lengths.astype(jnp.int32))  # [B, M, D]
  return trie(conts, ok)


def trie(conts: jax.Array, ok: jax.Array) -> Tree:
  """Continuations `conts [B, M, D]` (`ok [B, M, D]`: real, prefix-closed along D) merged into a
  deterministic trie: node `(d, m)` at `d * M + m`; a node whose prefix an earlier continuation
  already holds is invalid, and its children hang below that one."""
  conts = jnp.where(ok, conts, -1)
  batch, m, d = conts.shape
  # same[b, d, m, m2]: continuations m and m2 agree on their first d + 1 tokens.
  eq = conts[:, :, None, :] == conts[:, None, :, :]  # [B, M, M, D]
  same = jnp.cumprod(eq.astype(jnp.int32), axis=-1).astype(bool)
  same = jnp.moveaxis(same, -1, 1)  # [B, D, M, M]
  earlier = jnp.arange(m)[None, :] < jnp.arange(m)[:, None]  # [m, m2]: m2 < m
  duplicate = jnp.any(same & earlier[None, None], axis=-1)  # [B, D, M]
  canonical = jnp.argmax(same, axis=-1).astype(jnp.int32)  # [B, D, M] first m2 with that prefix
  valid = jnp.moveaxis(ok, 2, 1) & ~duplicate  # [B, D, M]
  depth_ids = jnp.arange(d, dtype=jnp.int32)[None, :, None]
  parent_of = jnp.where(depth_ids == 0, -1,
                        (depth_ids - 1) * m + jnp.concatenate(
                            [jnp.zeros_like(canonical[:, :1]), canonical[:, :-1]], axis=1))
  tokens = jnp.maximum(jnp.moveaxis(conts, 2, 1), 0)
  n = d * m
  depths = jnp.broadcast_to(depth_ids + 1, (batch, d, m))
  return Tree(tokens.reshape(batch, n).astype(jnp.int32),
              parent_of.reshape(batch, n).astype(jnp.int32),
              depths.reshape(batch, n).astype(jnp.int32), valid.reshape(batch, n))


def sampled_structure(branching) -> tuple[list[int], list[int], list[int]]:
  """Host-side parents, depths and sibling ranks of a fixed-branching tree (depth-major)."""
  parents, depths, ranks = [], [], []
  previous = [-1]
  for d, b in enumerate(branching):
    level = []
    for p in previous:
      for r in range(b):
        level.append(len(parents))
        parents.append(p)
        depths.append(d + 1)
        ranks.append(r)
    previous = level
  return parents, depths, ranks


def sampled_tree(expand: Expand, root: jax.Array, *, branching, sampling: Sampling,
                 seeds: jax.Array, positions: jax.Array, replacement: bool = True,
                 guide=None) -> Tree:
  """Children drawn from the draft distribution, `branching[d]` per node at depth `d`.

  Args:
    expand: draft logits over an extended tree (module docstring).
    root: `[B]` int32 each row's last verified token.
    branching: children per node at each depth.
    sampling: warps q exactly as the verifier warps it; greedy takes the top-b of the raw logits.
    seeds: `[B]` uint32 row seeds; positions: `[B]` int32 position of a child of the root.
    replacement: i.i.d. children (each its own Gumbel race) or without replacement (one Gumbel
      perturbation per parent, its top-b in order = sequential draws without replacement).
    guide: under a grammar constraint, the `TreeGuide` (`specjax.trees.structure`): children
      come from the parent's logits restricted to what its state allows.

  Returns:
    `Tree` with `logits[b, i]` = the raw draft logits at node `i`'s parent (with a guide: the
    restricted logits the children were drawn from).
  """
  parents_host, depths_host, ranks_host = sampled_structure(branching)
  n = len(parents_host)
  batch = root.shape[0]
  parents = jnp.broadcast_to(jnp.asarray(parents_host, jnp.int32), (batch, n))
  depths = jnp.broadcast_to(jnp.asarray(depths_host, jnp.int32), (batch, n))
  ext_parents = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), parents + 1], axis=1)
  ext_depths = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), depths], axis=1)
  tokens = jnp.zeros((batch, n), jnp.int32)
  valid = jnp.ones((batch, n), bool)
  logits = None
  start = 0
  built = slice(0, 0)
  if guide is not None:  # the automaton state after every extended node
    states = jnp.broadcast_to(guide.root[:, None], (batch, n + 1)).astype(jnp.int32)
  for d, b in enumerate(branching):
    count = len([x for x in depths_host if x == d + 1])
    level = slice(start, start + count)
    ext_tokens = jnp.concatenate([root[:, None].astype(jnp.int32), tokens], axis=1)
    draft = call_expand(expand, ext_tokens, ext_parents, ext_depths, built)  # [B, N + 1, V]
    if logits is None:
      logits = jnp.zeros((batch, n, draft.shape[-1]), jnp.float32)
    parent_ext = jnp.asarray(parents_host[level], jnp.int32) + 1  # [count]
    q_logits = draft[:, parent_ext].astype(jnp.float32)  # [B, count, V]
    if guide is not None:
      parent_states = states[:, parent_ext]  # [B, count]
      q_logits = guide.restrict(parent_states, q_logits)
    vocab_ids = jnp.arange(draft.shape[-1], dtype=jnp.int32)
    pos = (positions.astype(jnp.int32) + d)[:, None, None]  # [B, 1, 1] position of the child
    ranks = jnp.asarray(ranks_host[level], jnp.int32)[None, :, None]
    if sampling.greedy:
      top = jax.lax.top_k(q_logits[:, ::b], b)[1]  # [B, parents, b]
      level_tokens = top.reshape(batch, count)
      level_valid = jnp.ones((batch, count), bool)
    elif replacement:
      noise = gumbel(seeds[:, None, None], pos, parent_ext[None, :, None], ranks, vocab_ids,
                     PURPOSE_TREE_DRAFT)
      level_tokens = first_argmax(warp_logits(q_logits, sampling) + noise)
      level_valid = jnp.ones((batch, count), bool)
    else:
      per_parent = warp_logits(q_logits[:, ::b], sampling)  # [B, parents, V]
      noise = gumbel(seeds[:, None, None], pos, parent_ext[None, ::b, None], 0, vocab_ids,
                     PURPOSE_TREE_DRAFT)
      scores, top = jax.lax.top_k(per_parent + noise, b)  # [B, parents, b] in draw order
      level_tokens = top.reshape(batch, count)
      level_valid = (scores > -jnp.inf).reshape(batch, count)
    tokens = tokens.at[:, level].set(level_tokens.astype(jnp.int32))
    valid = valid.at[:, level].set(level_valid)
    logits = logits.at[:, level].set(q_logits)
    if guide is not None:
      ext_level = slice(level.start + 1, level.stop + 1)
      states = states.at[:, ext_level].set(guide.advance(parent_states, tokens[:, level]))
    start += count
    built = level
  # A child of an invalid node is invalid.
  for i, p in enumerate(parents_host):
    if p >= 0:
      valid = valid.at[:, i].set(valid[:, i] & valid[:, p])
  return Tree(tokens, parents, depths, valid, logits)


def dynamic_tree(expand: Expand, root: jax.Array, *, depth: int, width: int,
                 num_nodes: int, min_prob: float = 0.0, guide=None) -> Tree:
  """EAGLE-2's dynamic tree over a generic draft `expand`.

  Depth 1 holds the root's top-m children. At every later depth the `m` best candidates of the
  previous depth (by path log-probability, the frontier) each get their top-m children. Of all
  candidates, the `num_nodes` best by path probability are kept: a child never scores above its
  parent and ties go to the earlier (shallower) candidate, so the kept set contains every kept
  node's ancestors. Deterministic children: verify with sample-then-match.

  Args:
    expand: draft logits over an extended tree (module docstring).
    root: `[B]` int32.
    depth, width, num_nodes: `D`, `m`, `N`.
    min_prob: nodes whose path probability is below it are invalid (their subtrees too, since a
      child never scores above its parent).
    guide: under a grammar constraint, the `TreeGuide` (`specjax.trees.structure`): a frontier
      node's children are ranked by its logits restricted to what its state allows (a node with
      fewer allowed tokens than `m` also ranks disallowed ones, at probability 0: the caller
      drops them).

  Returns:
    `Tree` with `N` nodes in candidate order (parents first); `logits` = the parent's draft logits.
  """
  batch = root.shape[0]
  pool = dynamic_pool_size(depth, width)
  depths_host = [1] * width + [d for d in range(2, depth + 1) for _ in range(width * width)]
  depths = jnp.broadcast_to(jnp.asarray(depths_host, jnp.int32), (batch, pool))
  ext_depths = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), depths], axis=1)
  tokens = jnp.zeros((batch, pool), jnp.int32)
  parents = jnp.full((batch, pool), -1, jnp.int32)
  scores = jnp.full((batch, pool), -jnp.inf, jnp.float32)
  node_logits = None
  frontier = jnp.full((batch, 1), -1, jnp.int32)  # node indices (-1 = root) to expand
  frontier_score = jnp.zeros((batch, 1), jnp.float32)
  if guide is not None:
    frontier_state = guide.root[:, None].astype(jnp.int32)  # [B, F]
  start = 0
  built = slice(0, 0)
  for d in range(depth):
    ext_parents = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), parents + 1], axis=1)
    ext_tokens = jnp.concatenate([root[:, None].astype(jnp.int32), tokens], axis=1)
    draft = call_expand(expand, ext_tokens, ext_parents, ext_depths, built)  # [B, P + 1, V]
    draft = draft.astype(jnp.float32)
    if node_logits is None:
      node_logits = jnp.zeros((batch, pool, draft.shape[-1]), jnp.float32)
    q_logits = jnp.take_along_axis(draft, (frontier + 1)[..., None], axis=1)  # [B, F, V]
    if guide is not None:
      q_logits = guide.restrict(frontier_state, q_logits)
    logp = jax.nn.log_softmax(q_logits, axis=-1)
    top_logp, top_tokens = jax.lax.top_k(logp, width)  # [B, F, m]
    f = frontier.shape[1]
    count = f * width
    level = slice(start, start + count)
    level_scores = (frontier_score[..., None] + top_logp).reshape(batch, count)
    tokens = tokens.at[:, level].set(top_tokens.reshape(batch, count).astype(jnp.int32))
    parents = parents.at[:, level].set(jnp.repeat(frontier, width, axis=1))
    scores = scores.at[:, level].set(level_scores)
    node_logits = node_logits.at[:, level].set(jnp.repeat(q_logits, width, axis=1))
    frontier_score, best = jax.lax.top_k(level_scores, min(width, count))
    frontier = (start + best).astype(jnp.int32)
    if guide is not None:
      level_states = guide.advance(jnp.repeat(frontier_state, width, axis=1),
                                   top_tokens.reshape(batch, count))
      frontier_state = jnp.take_along_axis(level_states, best, axis=1)
    built = level
    start += count
  # Top N overall; ties prefer the earlier candidate (lax.top_k is stable), then restore order.
  _, keep = jax.lax.top_k(scores, num_nodes)
  keep = jnp.sort(keep, axis=1)  # [B, N] ascending pool index: parents precede children
  kept_parents = jnp.take_along_axis(parents, keep, axis=1)
  inverse = jax.vmap(lambda k: jnp.zeros((pool,), jnp.int32).at[k].set(
      jnp.arange(num_nodes, dtype=jnp.int32)))(keep)
  new_parents = jnp.where(kept_parents < 0, -1,
                          jnp.take_along_axis(inverse, jnp.maximum(kept_parents, 0), axis=1))
  kept_scores = jnp.take_along_axis(scores, keep, axis=1)
  valid = kept_scores >= jnp.log(jnp.float32(min_prob)) if min_prob > 0 else \
      jnp.ones((batch, num_nodes), bool)
  return Tree(jnp.take_along_axis(tokens, keep, axis=1), new_parents,
              jnp.take_along_axis(depths, keep, axis=1), valid,
              jnp.take_along_axis(node_logits, keep[..., None], axis=1))


def ddtree(marginals: jax.Array, *, width: int, num_nodes: int) -> Tree:
  """DDTree: the `num_nodes` best paths over the per-depth marginals of one drafted block.

  A path `(t_1, .., t_d)` takes at each depth one of the top-`width` tokens of that depth's
  marginal `q_j` and scores `sum_j log q_j(t_j)`. DDTree grows the tree best-first (a heap on that
  score, popping until the node budget is spent); since a child never scores above its parent the
  popped set is the top `N` paths, which this computes in fixed shapes: at every depth keep the
  `N` best children of the previous depth's kept nodes (a node of the overall top `N` has its
  parent there too), then the top `N` of all kept candidates. Ties go to the earlier candidate
  (shallower, then better-ranked), so parents precede children. Deterministic children: verify
  with sample-then-match (exact at any temperature, no q needed).

  Args:
    marginals: `[B, D, V]` draft logits of depths `1 .. D` (each a marginal over the block).
    width: `k`, the top tokens per depth.
    num_nodes: the node budget `N`.

  Returns:
    `Tree` with `N` nodes, parents first, no logits.
  """
  batch, depth, _ = marginals.shape
  logq = jax.nn.log_softmax(marginals.astype(jnp.float32), axis=-1)
  top_logq, top_tokens = top_k(logq, width)  # [B, D, k]
  level_scores = top_logq[:, 0]  # [B, k] depth-1 candidates
  level_tokens = top_tokens[:, 0].astype(jnp.int32)
  level_parents = jnp.full((batch, width), -1, jnp.int32)
  scores, tokens, parents, depths = [], [], [], []
  start = 0
  for d in range(depth):
    if d > 0:  # the children of the previous depth's kept nodes
      prev = scores[-1]  # [B, M]
      count = prev.shape[1]
      level_scores = (prev[:, :, None] + top_logq[:, d, None, :]).reshape(batch, count * width)
      level_tokens = jnp.broadcast_to(top_tokens[:, d, None, :],
                                      (batch, count, width)).reshape(batch, count * width)
      level_parents = jnp.broadcast_to(
          (start - count + jnp.arange(count, dtype=jnp.int32))[None, :, None],
          (batch, count, width)).reshape(batch, count * width)
    keep = min(num_nodes, level_scores.shape[1])
    kept_scores, best = jax.lax.top_k(level_scores, keep)  # sorted: best first, stable on ties
    scores.append(kept_scores)
    tokens.append(jnp.take_along_axis(level_tokens, best, axis=1).astype(jnp.int32))
    parents.append(jnp.take_along_axis(level_parents, best, axis=1))
    depths.append(jnp.full((batch, keep), d + 1, jnp.int32))
    start += keep
  scores, tokens = jnp.concatenate(scores, 1), jnp.concatenate(tokens, 1)
  parents, depths = jnp.concatenate(parents, 1), jnp.concatenate(depths, 1)
  pool = scores.shape[1]
  _, chosen = jax.lax.top_k(scores, num_nodes)
  chosen = jnp.sort(chosen, axis=1)  # ascending pool index: parents precede children
  kept_parents = jnp.take_along_axis(parents, chosen, axis=1)
  inverse = jax.vmap(lambda k: jnp.zeros((pool,), jnp.int32).at[k].set(
      jnp.arange(num_nodes, dtype=jnp.int32)))(chosen)
  new_parents = jnp.where(kept_parents < 0, -1,
                          jnp.take_along_axis(inverse, jnp.maximum(kept_parents, 0), axis=1))
  valid = jnp.take_along_axis(scores, chosen, axis=1) > -jnp.inf
  return Tree(jnp.take_along_axis(tokens, chosen, axis=1), new_parents,
              jnp.take_along_axis(depths, chosen, axis=1), valid)


def build_tree(spec: TreeSpec, *, expand: Expand | None, root: jax.Array, sequence: jax.Array,
               lengths: jax.Array, sampling: Sampling, seeds: jax.Array,
               chain_candidates: Callable[[], jax.Array] | None = None, guide=None,
               marginals: Callable[[], jax.Array] | None = None) -> Tree:
  """Builds `spec`'s tree for one round.

  Args:
    spec: the tree spec.
    expand: the draft expansion (sampled, dynamic); unused by ngram.
    root: `[B]` each row's last verified token (`sequence[b, lengths[b] - 1]`).
    sequence: `[B, S]` tokens; `lengths` `[B]` valid tokens per row.
    sampling: the sampling settings; seeds: `[B]` uint32 row seeds.
    chain_candidates: static trees: returns `[B, D, K]` ranked candidates per depth.
    marginals: ddtree: returns the block drafter's `[B, D, V]` per-depth draft logits.
    guide: under a grammar constraint, the `TreeGuide` the sampled and dynamic builders restrict
      the draft logits with (`specjax.trees.structure`); a static tree's `chain_candidates`
      takes it from its caller, and an n-gram trie ignores it.
  """
  if spec.builder == "ngram":
    return ngram_tree(sequence, lengths, num_matches=spec.width, depth=spec.depth,
                      max_ngram=spec.max_ngram, min_ngram=spec.min_ngram)
  if spec.builder == "static":
    return static_tree(chain_candidates(), spec.resolved_choices)
  if spec.builder == "ddtree":
    if marginals is None:
      raise ValueError("a ddtree is built from a block drafter's per-depth marginals (a "
                       "DFlashDrafter)")
    if guide is not None:
      raise ValueError("ddtree trees do not take a grammar constraint")
    return ddtree(marginals(), width=spec.width, num_nodes=spec.size)
  if spec.builder == "sampled":
    return sampled_tree(expand, root, branching=spec.resolved_branching, sampling=sampling,
                        seeds=seeds, positions=lengths, replacement=spec.replacement,
                        guide=guide)
  return dynamic_tree(expand, root, depth=spec.depth, width=spec.width, num_nodes=spec.size,
                      min_prob=spec.min_prob, guide=guide)
