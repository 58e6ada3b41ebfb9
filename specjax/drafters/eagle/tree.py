"""An EAGLE head's draft trees: `EagleTreeExpand` (the generic `expand` of
`specjax.trees.structure`, evaluated depth by depth with an ancestor mask) and
`eagle_chain_candidates` (the head's greedy chain with its top-`K` per depth, for static trees);
for a parallel head (`HeadConfig.parallel > 0`), `ParallelTreeExpand` and
`parallel_chain_candidates`, which run one head forward a round whatever the depth.
`specjax.drafters.tree_heads` runs them each round."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.core.sampling import top_k
from specjax.drafters.eagle import network as eagle
from specjax.drafters.eagle.drafter import EagleDrafter
from specjax.drafters.eagle.parallel import committed_segment, group_logits
from specjax.models.transformer import attention
from specjax.trees import structure as trees

__all__ = ["EagleTreeExpand", "ParallelTreeExpand", "eagle_chain_candidates", "guided_chain",
           "parallel_chain_candidates"]


class EagleTreeExpand:
  """An `EagleDrafter`'s `expand` (`specjax.trees.structure`) below each row's root, for one round.

  Trace-time helper (not a pytree): it keeps every evaluated node's head output, draft logits
  and keys/values between the builder's calls. With `incremental` (the default) each call
  evaluates only the nodes built since the previous call; without it every call re-evaluates the
  whole pool from the previous call's outputs (a node is right once its parent was), which costs
  `D` times more and is kept to measure against.

  Args:
    drafter: the `EagleDrafter`.
    state: its `EagleState` (the invariant of `specjax.drafters.heads`).
    lengths: `[B]` int32 tokens per row (`L`).
    pool: the node budget `P` of the builder's extended tree (`P + 1` with the root).
  """

  def __init__(self, drafter: EagleDrafter, state, lengths: jax.Array, pool: int, *,
               incremental: bool = True):
    head = drafter.head
    c = head.config
    batch = lengths.shape[0]
    self.drafter = drafter
    self.state = state
    self.incremental = incremental
    self.pool = pool
    self.base = lengths.astype(jnp.int32) - 2  # the root's slot; a depth-d node sits at base + d
    dtype = state.hidden.dtype
    self.hidden = jnp.zeros((batch, pool + 1, c.embed_dim), dtype).at[:, 0].set(state.hidden)
    self.logits = jnp.zeros((batch, pool + 1, c.draft_vocab_size), jnp.float32).at[:, 0].set(
        state.logits.astype(jnp.float32))  # [B, P + 1, N] draft-vocabulary logits
    root = drafter.full_logits(state.logits.astype(jnp.float32))  # [B, V]
    self.full = jnp.zeros((batch, pool + 1, c.vocab_size), jnp.float32).at[:, 0].set(root)
    cache_dtype = state.cache.k[0].dtype
    kv_shape = (batch, c.num_kv_heads, pool, c.head_dim)
    self.keys = jnp.zeros(kv_shape, cache_dtype)  # [B, KVH, P, D] the tree block's entries
    self.values = jnp.zeros(kv_shape, cache_dtype)

  def __call__(self, ext_tokens, ext_parents, ext_depths, built: slice | None = None):
    """Full-vocabulary draft logits `[B, P + 1, V]` after the root and every evaluated node."""
    if built is None:
      built = slice(0, self.pool)
    if built.stop > built.start:
      self.evaluate(ext_tokens, ext_parents, ext_depths, built)
    return self.full

  def evaluate(self, ext_tokens, ext_parents, ext_depths, nodes: slice) -> None:
    """Runs the head on pool nodes `nodes` (static), whose parents were evaluated before."""
    head = self.drafter.head
    c = head.config
    ext = slice(nodes.start + 1, nodes.stop + 1)
    tokens = ext_tokens[:, ext].astype(jnp.int32)  # [B, T]
    parents = ext_parents[:, ext].astype(jnp.int32)  # [B, T] extended index of each parent
    features = jnp.take_along_axis(self.hidden, parents[..., None], axis=1)  # [B, T, E]
    positions = self.base[:, None] + ext_depths[:, ext].astype(jnp.int32)  # [B, T]
    q, k, v = eagle.head_qkv(head, self.drafter.target_embed, tokens, features, positions)
    self.keys = self.keys.at[:, :, nodes].set(k.swapaxes(1, 2).astype(self.keys.dtype))
    self.values = self.values.at[:, :, nodes].set(v.swapaxes(1, 2).astype(self.values.dtype))
    mask = trees.ancestor_mask(ext_parents)[:, ext, 1:]  # [B, T, P] ancestors and itself
    tree_positions = self.base[:, None] + ext_depths[:, 1:].astype(jnp.int32)  # [B, P]
    segments = [committed_segment(self.state.cache, self.base),  # slots 0 .. L - 2
                (self.keys, self.values, tree_positions, mask)]
    attn = attention(q, segments, positions, jnp.int32(0), c.layer_config)
    logits, hidden = eagle.head_finish(head, features, attn)
    self.hidden = self.hidden.at[:, ext].set(hidden.astype(self.hidden.dtype))
    self.logits = self.logits.at[:, ext].set(logits)
    self.full = self.full.at[:, ext].set(self.drafter.full_logits(logits))


def guided_chain(logits_at, guide, depth: int, k: int) -> jax.Array:
  """A greedy chain under a grammar constraint's `TreeGuide`: at each depth `d` the top-`k` of
  `logits_at(d, tokens)` (full-vocabulary logits after the chain's first `d` tokens `[B, d]`)
  restricted to what the chain's state allows, the first of them extending the chain:
  `[B, D, K]` token ids."""
  chain_state, tokens, ranked = guide.root, [], []
  for d in range(depth):
    chain = jnp.stack(tokens, axis=1) if tokens else None
    top = top_k(guide.restrict(chain_state, logits_at(d, chain)), k)[1]
    ranked.append(top.astype(jnp.int32))
    tokens.append(top[:, 0].astype(jnp.int32))
    chain_state = guide.advance(chain_state, tokens[-1])
  return jnp.stack(ranked, axis=1)


def eagle_chain_candidates(drafter: EagleDrafter, state, lengths, root, depth: int,
                           k: int, guide=None) -> jax.Array:
  """The head's greedy chain below the root, its top-`k` candidates at each depth: `[B, D, K]`
  (with a grammar constraint's `guide`: among the tokens each chain state allows,
  `guided_chain`)."""
  batch = root.shape[0]
  expand = EagleTreeExpand(drafter, state, lengths, depth)
  ext_parents = jnp.broadcast_to(jnp.asarray([0] + list(range(depth)), jnp.int32),
                                 (batch, depth + 1))
  ext_depths = jnp.broadcast_to(jnp.arange(depth + 1, dtype=jnp.int32), (batch, depth + 1))
  ext_tokens = jnp.zeros((batch, depth + 1), jnp.int32).at[:, 0].set(root)
  if guide is not None:
    def logits_at(d, chain):
      if d:
        chain_tokens = ext_tokens.at[:, 1:d + 1].set(chain)
        expand.evaluate(chain_tokens, ext_parents, ext_depths, slice(d - 1, d))
      return expand.full[:, d]
    return guided_chain(logits_at, guide, depth, k)
  ranked = []
  for d in range(depth):
    if d:
      expand.evaluate(ext_tokens, ext_parents, ext_depths, slice(d - 1, d))
    top = jax.lax.top_k(expand.logits[:, d], k)[1]  # [B, K] draft ids, best first
    top = jnp.take(drafter.head.draft_ids, top).astype(jnp.int32)
    ranked.append(top)
    ext_tokens = ext_tokens.at[:, d + 1].set(top[:, 0])
  return jnp.stack(ranked, axis=1)


class ParallelTreeExpand:
  """A parallel head's `expand` (`specjax.trees.structure`) below each row's root, for one round.

  The root's children come from the stored logits. A depth-1 node `a` opens a group: the head's
  drafting forward with `a`'s token as the first draft (`parallel.group_logits`). A depth-`d`
  node below `a` gets its children from slot `d - 1` of `a`'s group: as in the chain, where the
  drafts after the second depend on the first but not on the drafts between, a node's draft
  distribution depends on its depth-1 ancestor and its depth, and not on the tokens between.
  The children are drawn from (or ranked by) that distribution, and it is the `q` the verify
  receives: exact like every tree of `specjax.trees`. A head in vLLM's P-EAGLE layout
  (`parallel_reads_first=False`) reads no draft at all: one group serves every depth-1 node.

  The builders of `specjax.trees.builders` evaluate the root, then all of depth 1 in one call
  (the root's children are the pool's first nodes): that call runs the round's one head forward,
  over every depth-1 node; later calls gather from it. Incremental only (`built` is required).

  Args:
    drafter: the `EagleDrafter` (parallel head); state: its `EagleState`.
    lengths: `[B]` int32 tokens per row (`L`).
    pool: the builder's node budget `P`.
    depth: the tree's depth `D` (`D - 1` slots per group: depth-`D` nodes are never expanded).
  """

  incremental = True

  def __init__(self, drafter: EagleDrafter, state, lengths: jax.Array, pool: int, depth: int):
    c = drafter.head.config
    if not 1 <= depth <= drafter.max_draft:
      raise ValueError(f"a tree of depth {depth} is deeper than this parallel head drafts in "
                       f"one forward ({drafter.max_draft})")
    self.drafter = drafter
    self.state = state
    self.lengths = lengths
    self.depth = depth
    self.slots = max(depth - 1, 1)
    self.groups = None  # [B, G, S, N] once depth 1 is evaluated
    root = drafter.full_logits(state.logits.astype(jnp.float32))  # [B, V]
    self.full = jnp.zeros((lengths.shape[0], pool + 1, c.vocab_size), jnp.float32).at[
        :, 0].set(root)

  def __call__(self, ext_tokens, ext_parents, ext_depths, built: slice | None = None):
    """Full-vocabulary draft logits `[B, P + 1, V]` after the root and every evaluated node."""
    if built is None:
      raise ValueError("a parallel head's tree is expanded incrementally (built=...)")
    if built.stop <= built.start:
      return self.full
    ext = slice(built.start + 1, built.stop + 1)
    reads_first = self.drafter.head.config.parallel_reads_first
    if self.groups is None:  # the first level: the depth-1 nodes, pool nodes 0 .. G - 1
      if built.start != 0:
        raise ValueError("the depth-1 nodes must be the first nodes a builder evaluates")
      first_drafts = ext_tokens[:, ext].astype(jnp.int32)
      # vLLM's P-EAGLE layout: no slot reads the first draft, so one group serves every node.
      self.groups = group_logits(self.drafter.head, self.drafter.target_embed, self.state,
                                 self.lengths, first_drafts if reads_first else first_drafts[:, :1],
                                 self.slots)
    first = jnp.broadcast_to(jnp.arange(ext.start, ext.stop, dtype=jnp.int32)[None],
                             ext_tokens[:, ext].shape)  # [B, T] extended indices
    take = lambda x, i: jnp.take_along_axis(x, i, axis=1)
    for _ in range(self.depth - 1):  # up to the depth-1 ancestor
      first = jnp.where(take(ext_depths, first) > 1, take(ext_parents, first), first)
    slot = jnp.clip(ext_depths[:, ext] - 1, 0, self.slots - 1)
    rows = jnp.arange(first.shape[0])[:, None]
    group = jnp.clip(first - 1, 0, self.groups.shape[1] - 1) if reads_first else 0
    logits = self.groups[rows, group, slot]
    self.full = self.full.at[:, ext].set(self.drafter.full_logits(logits))
    return self.full


def parallel_chain_candidates(drafter: EagleDrafter, state, lengths, depth: int,
                              k: int, guide=None) -> jax.Array:
  """A parallel head's greedy first draft and its one forward: the top-`k` candidates at each
  depth, `[B, D, K]` (depth 1 from the stored logits, depth `d >= 2` from slot `d - 2`; with a
  grammar constraint's `guide`, among the tokens each chain state allows, `guided_chain`)."""
  if guide is not None:
    root = drafter.full_logits(state.logits.astype(jnp.float32))  # [B, V]
    groups = []  # the one forward, run once the first draft is known

    def logits_at(d, chain):
      if d == 0:
        return root
      if not groups:
        groups.append(group_logits(drafter.head, drafter.target_embed, state, lengths,
                                   chain[:, :1], depth - 1)[:, 0])  # [B, D - 1, N]
      return drafter.full_logits(groups[0][:, d - 1])
    return guided_chain(logits_at, guide, depth, k)
  ranked = [top_k(state.logits, k)[1]]  # [B, K] draft ids, best first
  if depth > 1:
    first = jnp.take(drafter.head.draft_ids, ranked[0][:, :1]).astype(jnp.int32)  # [B, 1]
    groups = group_logits(drafter.head, drafter.target_embed, state, lengths, first,
                          depth - 1)[:, 0]
    ranked += list(top_k(groups, k)[1].swapaxes(0, 1))
  return jnp.take(drafter.head.draft_ids, jnp.stack(ranked, axis=1)).astype(jnp.int32)
