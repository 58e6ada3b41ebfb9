"""The suffix drafter's tree form: the most frequent continuations of the matched context, merged
into a trie.

`SuffixTreeDrafter` takes the candidates of `SuffixDrafter.candidates` (the continuations of the
row's longest matched context, in its own text and in the corpus, each weighted by the occurrences
it stands for) and, per row:

* scores every node of every candidate by its estimated probability `w_d / W`: the weight of the
  candidates that agree with it on its first `d + 1` tokens over the total weight (the chain's
  product of step shares telescopes to the same number, so the chain is this tree's best branch);
* keeps a node while that probability is at least `min_prob` and its depth is under the match's
  limit `ceil(spec_factor * m)` (a prefix-closed cut);
* ranks the distinct paths by the sum of their nodes' probabilities (the expected accepted length
  of the path alone, SuffixDecoding's score), drops paths that another path holds entirely, and
  merges the best `spec.width` into a trie (`specjax.trees.builders.trie`) of depth `spec.depth`.

Deterministic: a tree of point masses (`Tree.logits = None`), which the tree rule verifies exactly.
Per row and round: the chain drafter's match, then `O(N^2 D)` for `N` candidates of depth `D`.

Selected by `specjax.decode(..., draft=SuffixDrafter(...), tree=TreeSpec("ngram", depth=D,
width=M))` (`specjax.drafters.tree.tree_drafter`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.trees import builders as tree_builders, structure as trees
from specjax.drafters.base import TextOnlyDrafter
from specjax.drafters.suffix import SuffixDrafter
from specjax.trees.structure import TreeSpec

__all__ = ["SuffixTreeDrafter", "select_paths"]


def select_paths(tokens: jax.Array, valid: jax.Array, weight: jax.Array, *, width: int,
                 limit: jax.Array, min_prob: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The `width` best distinct paths among candidates `tokens [N, D]` (see the module docstring).

  Returns:
    `(paths [width, D] int32, ok [width, D] bool, prob [width, D] float32)`: the chosen
    continuations best first, which of their nodes are kept, and each node's probability.
  """
  num, depth = tokens.shape
  real = valid & (weight[:, None] > 0)  # [N, D]
  pair = (tokens[:, None, :] == tokens[None, :, :]) & real[:, None, :] & real[None, :, :]
  agree = jnp.cumprod(pair.astype(jnp.int32), axis=-1).astype(bool)  # [N, N', D] prefixes equal
  total = jnp.maximum(jnp.sum(weight), 1e-30)
  prob = jnp.sum(jnp.where(agree, weight[None, :, None], 0.0), axis=1) / total  # [N, D]
  steps = jnp.arange(depth, dtype=jnp.int32)[None, :]
  ok = real & (prob >= min_prob) & (steps < limit)
  ok = jnp.cumprod(ok.astype(jnp.int32), axis=1).astype(bool)
  size = jnp.sum(ok, axis=1)  # [N] kept nodes
  score = jnp.sum(jnp.where(ok, prob, 0.0), axis=1)
  # Path c is held by c' when c' keeps at least c's nodes with the same tokens; of equal paths
  # the first stays.
  last = jnp.maximum(size - 1, 0)
  same = jnp.take_along_axis(agree, jnp.broadcast_to(last[:, None, None], (num, num, 1)),
                             axis=2)[..., 0]  # [N, N']: c' agrees with c through c's last node
  index = jnp.arange(num)
  longer = (size[None, :] > size[:, None]) | ((size[None, :] == size[:, None])
                                                & (index[None, :] < index[:, None]))
  held = jnp.any(same & longer & (index[None, :] != index[:, None]), axis=1) | (size == 0)
  key = jnp.where(held, -1.0, score)
  best, chosen = jax.lax.top_k(key, min(width, num))
  if width > num:  # more branches than candidates: the rest stay empty
    pad = width - num
    best = jnp.concatenate([best, jnp.full((pad,), -1.0)])
    chosen = jnp.concatenate([chosen, jnp.zeros((pad,), chosen.dtype)])
  keep = (best >= 0)[:, None] & ok[chosen]
  return tokens[chosen].astype(jnp.int32), keep, jnp.where(keep, prob[chosen], 0.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SuffixTreeDrafter(TextOnlyDrafter):
  """A `SuffixDrafter`'s candidates as a trie of `spec.width` paths of depth `spec.depth`."""

  drafter: SuffixDrafter
  spec: TreeSpec = dataclasses.field(metadata=dict(static=True))

  vocab_size = None
  def __post_init__(self):
    if not isinstance(self.drafter, SuffixDrafter):
      raise ValueError(f"SuffixTreeDrafter wraps a SuffixDrafter, got "
                       f"{type(self.drafter).__name__}")
    if isinstance(self.spec, TreeSpec) and self.spec.builder != "ngram":
      raise ValueError(f"a SuffixDrafter drafts tries: use TreeSpec('ngram', depth=..., "
                       f"width=...), got builder {self.spec.builder!r}")

  def extra_slots(self, num_draft: int) -> int:
    """Scratch slots past a row's length that a round writes (as `tree.extra_slots`)."""
    del num_draft  # the tree's depth
    return max(self.spec.size, self.spec.depth) + 2

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, guide=None):
    del num_draft, sampling, seeds, guide  # a trie: the constraint drops its disallowed nodes
    spec, drafter = self.spec, self.drafter

    def one_row(row, length):
      matched, tokens, valid, weight = drafter.candidates(row, length, spec.depth)
      paths, ok, _ = select_paths(tokens, valid, weight, width=spec.width,
                                  limit=drafter.limit(matched), min_prob=drafter.min_prob)
      return paths, ok

    paths, ok = jax.vmap(one_row)(sequence, lengths.astype(jnp.int32))  # [B, M, D]
    tree = tree_builders.trie(paths, ok)
    return state, (tree if spec.widths is None else trees.valid_first(tree))

