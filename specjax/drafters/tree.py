"""Tree drafters: the `Drafter` protocol for a proposal that is a tree of continuations.

A tree is a proposal shape, not a second decoder: `specjax.decode(..., tree=TreeSpec(...))`
runs the same loop, state and round (`specjax.loop.round`) as a chain, with a tree drafter built
here by `tree_drafter`. Beside the chain protocol's `vocab_size`, `taps`, `needs_hidden`,
`forwards_per_round` and `init` (`specjax.drafters.base`), a tree drafter has

* `spec`: its `specjax.TreeSpec` (static);
* `extra_slots(num_draft)`: the scratch slots past a row's length that one round writes (the tree
  block and, for a dynamic tree, its expansion pool);
* `propose(state, sequence, lengths, *, num_draft, sampling, seeds, guide=None) -> (state, Tree)`:
  this round's `specjax.trees.structure.Tree` below each row's last token (`num_draft` is the
  tree's depth); `guide` is a grammar constraint's `TreeGuide`, which the model and head drafters
  hand their builder (`specjax.trees.structure`, `specjax.drafters.grammar_tree`) and the tries
  ignore;
* `observe(state, scored, block, emitted, count, lengths) -> state`: the chain's `observe`. The
  loop hands it the accepted path as a chain's block: `block [B, D + 1] = [root, path nodes]` at
  positions `lengths - 1 ..`, with the target's features there (`specjax.loop.round.path_output`).

Three drafters cover every builder:

* `ModelTreeDrafter`: a draft model keeps its own cache of the committed text. Each round it
  catches up on the last round's emitted tokens (one forward of `D + 1` tokens), then grows the
  tree with tree-masked forwards that write only scratch slots past the committed length. Static
  trees take its greedy chain with the top-`K` candidates at every depth.
* `HeadTreeDrafter`: a feature head (`EagleDrafter`: EAGLE-3 or MTP; `MedusaDrafter`) drafts
  through `specjax.drafters.tree_heads`; after the verify the head's own `observe` catches up on
  the accepted path with the target's features, so its state keeps the chain invariant.
* `NGramTreeDrafter`: several earlier matches of the row's suffix merged into a trie; no model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.trees import builders as tree_builders, structure as trees
from specjax.drafters import tree_heads
from specjax.drafters.base import Drafter, DrafterWrapper, OwnModelDrafter, TextOnlyDrafter
from specjax.drafters.hybrid import HybridDrafter
from specjax.drafters.suffix import SuffixDrafter
from specjax.drafters.suffix_tree import SuffixTreeDrafter
from specjax.core.cache import check_cache_dtype
from specjax.core.sampling import top_k
from specjax.core.sequence import gather_tokens
from specjax.trees.structure import Tree, TreeSpec

__all__ = ["HeadTreeDrafter", "ModelTreeDrafter", "NGramTreeDrafter", "extra_slots",
           "tree_drafter"]

_STATIC = dict(static=True)


def extra_slots(spec: TreeSpec) -> int:
  """Scratch slots past a row's length that a round writes (tree block, expansion pool)."""
  pool = trees.dynamic_pool_size(spec.depth, spec.width) if spec.builder == "dynamic" else 0
  return max(spec.size, pool, spec.depth) + 2


class _TreeDrafterBase(Drafter):
  """What every tree drafter shares: the static spec and its derived sizes."""

  spec: TreeSpec

  def extra_slots(self, num_draft: int) -> int:
    del num_draft  # the tree's depth
    return extra_slots(self.spec)

  def observe(self, state, scored, block, emitted, count, lengths):
    """Nothing to learn from the verify: a draft model rolls back lazily (the next round's
    catch-up starts at its cache's length), an n-gram trie has no state."""
    del scored, block, emitted, count, lengths
    return state

  def _finish(self, tree: Tree) -> Tree:
    # With verify widths, valid nodes go first so the smallest width holding them suffices.
    return tree if self.spec.widths is None else trees.valid_first(tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelTreeDrafter(OwnModelDrafter, _TreeDrafterBase):
  """A draft `specjax.Model` growing a tree each round (see the module docstring). `cache_dtype`:
  the draft cache's dtype, as `ModelDrafter`'s (None: the model's)."""

  model: Any
  spec: TreeSpec = dataclasses.field(metadata=_STATIC)
  cache_dtype: str | None = dataclasses.field(default=None, metadata=_STATIC)

  def __post_init__(self):
    object.__setattr__(self, "cache_dtype", check_cache_dtype(self.cache_dtype))

  def forwards_per_round(self, num_draft: int) -> int:
    del num_draft
    return 1 + self.spec.depth  # the catch-up, then one tree-masked forward per depth

  def init(self, tokens, lengths, buffer_len, prefill):
    del prefill
    model = self.model
    cache = model(tokens, jnp.zeros_like(lengths),
                  model.init_cache(tokens.shape[0], buffer_len, self.cache_dtype))
    return cache.cache.with_lengths(lengths - 1)

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, guide=None):
    del num_draft
    spec, model = self.spec, self.model
    root = gather_tokens(sequence, lengths - 1, 1)[:, 0]
    # Catch up on the tokens committed since the cache was last extended (<= D + 1 of them).
    caught_up = model(gather_tokens(sequence, state.lengths, spec.depth + 1), state.lengths,
                      state)
    cache = caught_up.cache.with_lengths(lengths - 1)
    starts = lengths - 1

    def expand(ext_tokens, ext_parents, ext_depths):
      out = model(ext_tokens, starts, cache, positions=starts[:, None] + ext_depths,
                  block_mask=trees.ancestor_mask(ext_parents))
      return out.logits

    def chain_candidates():
      """Static trees: the draft's greedy chain from the root, top-`K` candidates per depth
      (with a guide: of the logits restricted along the chain's states)."""
      k = max(c[-1] for c in spec.resolved_choices) + 1
      token, chain_cache, ranked = root, cache, []
      chain_state = None if guide is None else guide.root
      for d in range(spec.depth):
        out = model(token[:, None], starts + d, chain_cache)
        chain_cache = out.cache
        logits = out.logits[:, 0]
        if guide is not None:
          logits = guide.restrict(chain_state, logits)
        top = top_k(logits, k)[1]
        ranked.append(top)
        token = top[:, 0]
        if guide is not None:
          chain_state = guide.advance(chain_state, token)
      return jnp.stack(ranked, axis=1)  # [B, D, K]

    tree = tree_builders.build_tree(spec, expand=expand, root=root, sequence=sequence,
                                    lengths=lengths, sampling=sampling, seeds=seeds,
                                    chain_candidates=chain_candidates, guide=guide)
    return cache, self._finish(tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadTreeDrafter(DrafterWrapper, _TreeDrafterBase):
  """A feature head (`EagleDrafter`, `MedusaDrafter`) drafting trees (see the module docstring)."""

  drafter: Any
  spec: TreeSpec = dataclasses.field(metadata=_STATIC)

  def forwards_per_round(self, num_draft: int) -> int:
    del num_draft
    return tree_heads.forwards_per_round(self.drafter, self.spec)

  def init(self, tokens, lengths, buffer_len, prefill):
    return self.drafter.init(tokens, lengths, buffer_len, prefill)

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, guide=None):
    del num_draft
    root = gather_tokens(sequence, lengths - 1, 1)[:, 0]
    tree = tree_heads.draft_tree(self.drafter, state, spec=self.spec, root=root,
                                 sequence=sequence, lengths=lengths, sampling=sampling,
                                 seeds=seeds, guide=guide)
    return state, self._finish(tree)  # the head catches up after the verify (`observe`)

  def observe(self, state, scored, block, emitted, count, lengths):
    return self.drafter.observe(state, scored, block, emitted, count, lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NGramTreeDrafter(TextOnlyDrafter, _TreeDrafterBase):
  """Earlier matches of each row's suffix merged into a trie (deterministic: a point-mass q)."""

  spec: TreeSpec = dataclasses.field(metadata=_STATIC)

  vocab_size = None

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, guide=None):
    del num_draft, guide  # a trie of earlier text: the constraint drops its disallowed nodes
    root = gather_tokens(sequence, lengths - 1, 1)[:, 0]
    tree = tree_builders.build_tree(self.spec, expand=None, root=root, sequence=sequence,
                                    lengths=lengths, sampling=sampling, seeds=seeds)
    return state, self._finish(tree)


def _draft_model(drafter):
  """The draft `Model` behind `drafter` (a model, or a wrapper with `.model`), or None."""
  if drafter is None:
    return None
  if hasattr(drafter, "init_cache"):
    return drafter
  model = getattr(drafter, "model", None)
  return model if hasattr(model, "init_cache") else None


def tree_drafter(target, drafter, spec: TreeSpec):
  """The tree drafter for `spec` from what the user passed as `draft` (validated before tracing).

  Args:
    target: the target model (its vocabulary, taps and width are checked against the drafter).
    drafter: a draft `specjax.Model` (or a drafter with a `.model`, e.g. `ModelDrafter`), a
      feature head (`EagleDrafter` for static, sampled and dynamic trees; `MedusaDrafter` for
      static and sampled ones), a drafter with its own `tree_drafter(target, spec)` method
      (`DFlashDrafter`: ddtree, static and sampled trees from its block's marginals), or
      anything (None included) for `TreeSpec(builder="ngram")`
      (a `SuffixDrafter` there drafts its suffix trie, `specjax.drafters.suffix_tree`).
    spec: the `TreeSpec`.

  Raises:
    ValueError: naming the problem (not a TreeSpec, no draft model for a model tree, a hybrid
      drafter, mismatched vocabularies, a head/tree combination that cannot run).
  """
  if not isinstance(spec, TreeSpec):
    raise ValueError(f"tree must be a specjax.TreeSpec, got {type(spec).__name__}")
  if spec.builder == "ngram" and isinstance(drafter, SuffixDrafter):
    return SuffixTreeDrafter(drafter, spec)
  if spec.builder == "ngram":
    return NGramTreeDrafter(spec)
  own = getattr(drafter, "tree_drafter", None)
  if callable(own):  # a drafter with its own tree drafter (a DFlash block: ddtree)
    return own(target, spec)
  if spec.builder == "ddtree":
    raise ValueError(f"a 'ddtree' tree is built from a block drafter's per-depth marginals (a "
                     f"specjax.drafters.DFlashDrafter), got {type(drafter).__name__}")
  if isinstance(drafter, HybridDrafter):
    raise ValueError("a HybridDrafter drafts chains (prompt lookup or its head); a tree drafts "
                     "with the head alone: pass its `.drafter` (e.g. `pair.draft.drafter`)")
  if tree_heads.is_head_drafter(drafter):
    tree_heads.check_tree_drafter(target, drafter, spec)
    return HeadTreeDrafter(drafter, spec)
  model = _draft_model(drafter)
  if model is None:
    raise ValueError(f"a {spec.builder!r} tree needs a draft model or a draft head "
                     f"(EagleDrafter, MedusaDrafter), got {type(drafter).__name__}")
  if model.vocab_size != target.vocab_size:
    raise ValueError(f"draft vocabulary ({model.vocab_size}) does not match the target's "
                     f"({target.vocab_size})")
  return ModelTreeDrafter(model, spec, getattr(drafter, "cache_dtype", None))
