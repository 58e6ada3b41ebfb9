"""Draft trees from a DFlash block: DDTree (and static / sampled trees over the same marginals).

One drafter forward gives the marginals `q_1 .. q_D` of the next `D` positions
(`DFlashDrafter.block_logits`); they do not depend on the tokens drafted before them, so every
node at depth `d` draws or ranks its children from `q_{d+1}` whatever its path:

* `"ddtree"` (DDTree): the `N` best paths by summed log q over each depth's top-`k` tokens
  (`specjax.trees.builders.ddtree`); deterministic, verified by sample-then-match: exact at any
  temperature with no q at all.
* `"static"`: a Medusa-style choice list over each depth's top-`K` tokens; sample-then-match.
* `"sampled"`: children i.i.d. (or without replacement) from `q_{d+1}` itself, which is the law
  they were drawn from: the SpecInfer / recursive rules are exact.

EAGLE-2's dynamic trees expand each node from its own token, which a block's marginals do not
see: refused. The drafter's state keeps the chain invariant (`specjax.drafters.dflash.drafter`):
after the verify the loop hands the accepted path to the chain's `observe`, whose context entries
are the target's features along that path. One drafter forward per round.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.core.sampling import top_k
from specjax.core.sequence import gather_tokens
from specjax.drafters.base import DrafterWrapper
from specjax.drafters.tree import extra_slots
from specjax.trees import builders as tree_builders, structure as trees
from specjax.trees.structure import TreeSpec

__all__ = ["DFlashTreeDrafter", "TREE_BUILDERS", "check_tree_spec"]

TREE_BUILDERS = ("ddtree", "static", "sampled")


def check_tree_spec(drafter, spec: TreeSpec) -> None:
  """Raises a clear `ValueError` (before tracing) for a tree this drafter cannot draft."""
  if spec.builder not in TREE_BUILDERS:
    raise ValueError(f"a DFlashDrafter drafts {TREE_BUILDERS} trees from its block's marginals, "
                     f"not {spec.builder!r} (EAGLE-2 dynamic trees expand each node from its own "
                     "token; use TreeSpec(builder='ddtree'))")
  if spec.depth > drafter.max_draft:
    raise ValueError(f"a tree of depth {spec.depth} exceeds the DFlash block's {drafter.max_draft} "
                     "drafts (block_size - 1)")
  if drafter.confidence is not None:
    raise ValueError("DFlashDrafter(confidence=...) stops a chain early; a tree ignores it: "
                     "leave it None")
  vocab = drafter.vocab_size
  if spec.builder == "static":
    k = max(c[-1] for c in spec.resolved_choices) + 1
    if k > vocab:
      raise ValueError(f"the static tree ranks {k} candidates per depth, more than the vocabulary "
                       f"({vocab})")
  if spec.builder == "ddtree" and spec.width > vocab:
    raise ValueError(f"TreeSpec.width ({spec.width}) exceeds the vocabulary ({vocab})")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashTreeDrafter(DrafterWrapper):
  """A `DFlashDrafter` drafting trees (see the module docstring)."""

  drafter: Any
  spec: TreeSpec = dataclasses.field(metadata=dict(static=True))

  def forwards_per_round(self, num_draft: int) -> int:
    del num_draft
    return 1

  def extra_slots(self, num_draft: int) -> int:
    del num_draft
    return extra_slots(self.spec)

  def init(self, tokens, lengths, buffer_len, prefill):
    return self.drafter.init(tokens, lengths, buffer_len, prefill)

  def observe(self, state, scored, block, emitted, count, lengths):
    return self.drafter.observe(state, scored, block, emitted, count, lengths)

  def marginals(self, state, sequence, lengths) -> jax.Array:
    """`[B, D, V]` the block's draft logits of depths `1 .. D`."""
    return self.drafter.block_logits(state, sequence, lengths, self.spec.depth)

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, guide=None):
    del num_draft
    spec = self.spec
    root = gather_tokens(sequence, lengths - 1, 1)[:, 0]
    full = self.marginals(state, sequence, lengths)  # [B, D, V]

    def expand(ext_tokens, ext_parents, ext_depths):
      del ext_tokens, ext_parents
      rows = jnp.arange(full.shape[0])[:, None]
      return full[rows, jnp.minimum(ext_depths, spec.depth - 1)]  # a depth-d node: q_{d+1}

    def chain_candidates():
      k = max(c[-1] for c in spec.resolved_choices) + 1
      return top_k(full, k)[1].astype(jnp.int32)  # [B, D, K]

    tree = tree_builders.build_tree(spec, expand=expand, root=root, sequence=sequence,
                                    lengths=lengths, sampling=sampling, seeds=seeds,
                                    chain_candidates=chain_candidates, guide=guide,
                                    marginals=lambda: full)
    return state, tree if spec.widths is None else trees.valid_first(tree)
