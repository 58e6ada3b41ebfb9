"""Draft trees from feature heads: `EagleDrafter` (EAGLE-3, MTP) and `MedusaDrafter`.

The decode loop (with `specjax.drafters.tree.HeadTreeDrafter`) keeps the head's own state between
rounds, with the chain invariant of `specjax.drafters.eagle.drafter`: per row with `L` tokens, the
head's cache holds the pairs `(target feature_t, token_{t+1})` of slots `0 .. L - 2`, and
`hidden`/`logits` are the head's output at slot `L - 2`. A round:

* **Drafting** (`draft_tree`). An `EagleDrafter` grows the tree through `EagleTreeExpand`, the
  generic `expand` of `specjax.trees.structure`: the root's children come from the stored `logits`;
  a depth-`d` node is the pair (its parent's head output, its token) at slot/position `L - 2 + d` (a
  depth-1 node pairs the stored `hidden` with its token), attending to the committed slots `0 .. L -
  2` of the head's cache and to its tree ancestors only (an ancestor mask over the tree block, kept
  in a small per-round key/value buffer; the committed cache is read, never written). Nodes are
  evaluated depth by depth, each once: the builders tell an incremental `expand` which nodes were
  added since its last call. Dynamic (EAGLE-2) and sampled trees use it directly; static trees take
  the head's greedy chain with its top-`K` candidates per depth. A parallel EAGLE head
  (`HeadConfig.parallel > 0`) runs one forward for the whole tree instead (`ParallelTreeExpand`):
  each depth-1 node opens a group of placeholder slots, and a depth-`d` node's children come
  from slot `d - 1` of its depth-1 ancestor's group; static trees rank the top-`K` of each slot
  of the greedy first draft's group (top-`K` per parallel position). A `MedusaDrafter` gives static
  trees (head `i`'s top-`K` are the depth-`i + 1` candidates) and sampled trees (every depth-`d`
  node draws its children from head `d`); its heads never see the tree's tokens, so EAGLE-2's
  dynamic trees are refused.
* **Drafts over the full vocabulary.** Head logits live on the reduced draft vocabulary and are
  mapped with `to_target_logits` (`-inf` outside), so a sampled child is drawn from, and verified
  against, the very `q` it came from.
* **Catching up** (the head's own `observe`). The target's tree forward returns the head's taps
  (or final hidden state) for every node; along the accepted path (the root, then the path nodes)
  they are exactly the target's features of positions `L - 1 ..`, and the loop hands them to the
  drafter's chain `observe` with the emitted tokens (`specjax.loop.round.path_output`). Rejected
  branches never touched the head's cache, done rows keep their state (`count == 0`), and the
  next round starts from the invariant again.

Per round an `EagleDrafter` runs `D - 1` head forwards to draft (depth `D` nodes are never
expanded) plus one to catch up: `D`, as its chain of `D` drafts; with a parallel head, two (one
for `D = 1`). A `MedusaDrafter` runs one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.eagle.drafter import EagleDrafter
from specjax.drafters.eagle.tree import (EagleTreeExpand, ParallelTreeExpand,
                                         eagle_chain_candidates, guided_chain,
                                         parallel_chain_candidates)
from specjax.drafters.medusa.drafter import MedusaDrafter
from specjax.drafters.medusa.tree import medusa_logits
from specjax.models.transformer import check_taps
from specjax.trees import builders as tree_builders, structure as trees
from specjax.trees.structure import Tree, TreeSpec

__all__ = ["check_tree_drafter", "draft_tree", "forwards_per_round", "is_head_drafter"]


def is_head_drafter(drafter) -> bool:
  """Whether `drafter` drafts trees through this module."""
  return isinstance(drafter, (EagleDrafter, MedusaDrafter))


def _draft_vocab_size(drafter) -> int:
  config = drafter.heads.config if isinstance(drafter, MedusaDrafter) else drafter.head.config
  return int(config.draft_vocab_size)


def check_tree_drafter(target, drafter, spec: TreeSpec) -> None:
  """Raises a clear `ValueError` (before tracing) for a head/tree combination that cannot run."""
  name = type(drafter).__name__
  if drafter.confidence is not None:
    raise ValueError(f"{name}(confidence=...) stops a chain early; a tree ignores it: leave it "
                     "None and use TreeSpec(builder='dynamic', min_prob=...) for a per-row stop")
  if drafter.vocab_size != target.vocab_size:
    raise ValueError(f"draft vocabulary ({drafter.vocab_size}) does not match the target's "
                     f"({target.vocab_size})")
  config = getattr(target, "config", None)
  if isinstance(drafter, EagleDrafter) and config is not None:
    check_taps(drafter.taps, config.num_layers)
    if drafter.head.config.embed_dim != config.embed_dim:
      raise ValueError(f"the head's width ({drafter.head.config.embed_dim}) does not match the "
                       f"target's embed_dim ({config.embed_dim})")
  if isinstance(drafter, EagleDrafter) and drafter.max_draft is not None:
    if spec.depth > drafter.max_draft:
      raise ValueError(f"a tree of depth {spec.depth} exceeds what this parallel head drafts in "
                       f"one forward ({drafter.max_draft}: from {drafter.head.config.parallel} "
                       "placeholder slots)")
  if isinstance(drafter, MedusaDrafter):
    if spec.builder == "dynamic":
      raise ValueError("a dynamic (EAGLE-2) tree expands each node from its own token, but "
                       "Medusa heads predict every depth from one hidden state and never see the "
                       "tree's tokens: use TreeSpec(builder='static') (or 'sampled') with a "
                       "MedusaDrafter")
    if spec.depth > drafter.num_heads:
      raise ValueError(f"a tree of depth {spec.depth} needs {spec.depth} Medusa heads, the "
                       f"drafter has {drafter.num_heads}")
  vocab = _draft_vocab_size(drafter)
  if spec.builder == "static":
    k = max(c[-1] for c in spec.resolved_choices) + 1
    if k > vocab:
      raise ValueError(f"the static tree ranks {k} candidates per depth, more than {name}'s "
                       f"draft vocabulary ({vocab})")
  if spec.builder == "dynamic" and spec.width > vocab:
    raise ValueError(f"TreeSpec.width ({spec.width}) exceeds {name}'s draft vocabulary ({vocab})")


def forwards_per_round(drafter, spec: TreeSpec) -> int:
  """Head forward passes per round (`DecodeStats.draft_calls`), as the chain counts them."""
  return drafter.forwards_per_round(spec.depth)


def draft_tree(drafter, state, *, spec: TreeSpec, root, sequence, lengths, sampling, seeds,
               incremental: bool = True, guide=None) -> Tree:
  """This round's tree from a head drafter (see the module docstring).

  Args:
    drafter: an `EagleDrafter` or a `MedusaDrafter`; state: its state.
    spec: the tree spec ("static", "sampled", or "dynamic" for an `EagleDrafter`).
    root: `[B]` each row's last token; sequence: `[B, S]` tokens; lengths: `[B]` (`L`).
    sampling, seeds: as for `specjax.trees.builders.build_tree`.
    incremental: `EagleTreeExpand`'s evaluation mode (a parallel head's is always incremental).
    guide: under a grammar constraint, the `TreeGuide` (`specjax.trees.structure`): the builders
      restrict the head's full-vocabulary logits with it, and a static tree's greedy chain ranks
      its top-`K` among the tokens each chain state allows.

  Returns:
    The `Tree`; `logits` (sampled and dynamic trees) are full-vocabulary.
  """
  depth = spec.depth
  if isinstance(drafter, MedusaDrafter):
    head_logits = medusa_logits(drafter, state, depth)  # [B, D, N]
    full = drafter.full_logits(head_logits)  # [B, D, V]

    def expand(ext_tokens, ext_parents, ext_depths):
      del ext_tokens, ext_parents
      rows = jnp.arange(full.shape[0])[:, None]
      return full[rows, jnp.minimum(ext_depths, depth - 1)]  # a depth-d node: head d

    def chain_candidates():
      k = max(c[-1] for c in spec.resolved_choices) + 1
      if guide is not None:
        return guided_chain(lambda d, tokens: full[:, d], guide, depth, k)
      top = jax.lax.top_k(head_logits, k)[1]  # [B, D, K]
      return jnp.take(drafter.heads.draft_ids, top).astype(jnp.int32)
  elif drafter.head.config.parallel:
    pool = trees.dynamic_pool_size(depth, spec.width) if spec.builder == "dynamic" else spec.size
    expand = ParallelTreeExpand(drafter, state, lengths, pool, depth)

    def chain_candidates():
      k = max(c[-1] for c in spec.resolved_choices) + 1
      return parallel_chain_candidates(drafter, state, lengths, depth, k, guide=guide)
  else:
    pool = trees.dynamic_pool_size(depth, spec.width) if spec.builder == "dynamic" else spec.size
    expand = EagleTreeExpand(drafter, state, lengths, pool, incremental=incremental)

    def chain_candidates():
      k = max(c[-1] for c in spec.resolved_choices) + 1
      return eagle_chain_candidates(drafter, state, lengths, root, depth, k, guide=guide)
  return tree_builders.build_tree(spec, expand=expand, root=root, sequence=sequence,
                                  lengths=lengths, sampling=sampling, seeds=seeds,
                                  chain_candidates=chain_candidates, guide=guide)
