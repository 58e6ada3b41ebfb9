"""Draft trees as data, and the builders that grow them.

A tree holds a fixed budget of `N` nodes per row (static), so every round has the same shapes. The
*root* is the row's last verified token (it is not one of the `N` nodes); node `i` has

* `tokens[b, i]`: the drafted token,
* `parents[b, i]`: the index of its parent node, `-1` when its parent is the root; parents always
  precede their children (`parents[b, i] < i`),
* `depths[b, i]`: 1 for a child of the root; the node's token sits at absolute position
  `L - 1 + depth` when the row holds `L` tokens,
* `valid[b, i]`: False for padding (an n-gram tree with few matches, a sampled sibling whose draft
  distribution had no support left),
* `logits[b, i]`: the raw draft logits at its parent, i.e. the distribution `q` the node was drawn
  from (sampled trees) or ranked by (top-m trees). None when the tree has no draft model (n-gram).
  Under a grammar constraint, the restricted `q` the builder saw (see "Guides" below);
* `grammar_states[b, n]`: under a grammar constraint only (else None), the automaton state after
  extended node `n` (the root's is the row's state), whose allowed set restricts the target's
  distribution there (`specjax.drafters.grammar_tree`).

The "extended" view adds the root at index 0 and shifts the nodes to `1..N` (`ext_parents`,
`ext_depths`, `ext_tokens`); the target scores the extended block `[root, nodes]` in one pass with
`ancestor_mask`, an `[N + 1, N + 1]` mask per row (never a mask over the context).

Builders (`specjax.trees.builders`; all jnp, fixed shapes, usable inside `jit` / `lax.while_loop`):

* `static_tree`: Medusa-style choice lists over per-depth candidates (`candidates[b, d, r]` is the
  rank-`r` candidate at depth `d + 1`), deterministic.
* `ngram_tree`: several earlier matches of the row's suffix, merged into a trie, deterministic.
* `sampled_tree`: children drawn from the draft `q` at temperature > 0, i.i.d. (SpecInfer) or
  without replacement (Gumbel top-k), with a fixed branching per depth; top-b of `q` when greedy.
* `dynamic_tree`: EAGLE-2: expand the top-m children of the best frontier nodes by path
  probability, keep the top `N` nodes of all candidates (adaptive depth inside a fixed shape).
* `ddtree`: DDTree, from a block drafter's per-depth marginals (`marginals [B, D, V]`, one
  forward for every depth): the `N` best paths by summed log q over the top-k tokens of each
  depth, best-first (a heap on the summed log q with a node budget, in fixed shapes), deterministic.

The draft side is a generic `expand(tokens [B, P + 1], parents [B, P + 1], depths [B, P + 1]) ->
logits [B, P + 1, V]` over an extended tree (root at 0; unbuilt nodes are placeholders whose
outputs are ignored): a draft model runs it as one tree-masked forward; feature heads supply their
own (`specjax.drafters.tree_heads`). The builders call it once per depth, after setting the tokens
of one more depth (depth-major node order), so an `expand` with a true `incremental` attribute is
also passed `built=slice(start, stop)`, the (static) node indices set since its previous call
(empty on the first call), and may evaluate only those: their ancestors were evaluated before.

Guides: under a grammar constraint the builders take a `guide`
(`specjax.drafters.grammar_tree.TreeGuide`): `guide.root` `[B]` is the root's automaton state,
`guide.advance(states, tokens)` the states after `tokens`, and `guide.restrict(states, logits)`
the draft logits at nodes in `states` as the constrained law sees them (warped, then restricted
to what the state allows). The builders then track every node's state (a child's is its
parent's advanced by its token), draw or rank children from `restrict(parent's state, logits
at the parent)` and record those logits in `Tree.logits`; a static tree's greedy chain ranks its
candidates the same way along the chain's states.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp


# Random-stream purposes of the tree machinery (disjoint from `specjax.core.sampling.PURPOSE_*`).
# Every tree random number is keyed by (seed, position, parent node, sibling rank, [vocab],
# purpose):
# `position` is the absolute position of the token being chosen, `parent node` the extended index
# of the node whose children (or successor) are being decided.
PURPOSE_TREE_DRAFT = 11  # drawing sampled children from q
PURPOSE_TREE_SAMPLE = 12  # sample-then-match: the target's sample at a node
PURPOSE_TREE_ACCEPT = 13  # the uniform of a sibling's ratio test
PURPOSE_TREE_RESIDUAL = 14  # the correction (residual) or bonus token

BUILDERS = ("static", "ngram", "sampled", "dynamic", "ddtree")

Expand = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """How to draft a tree each round (static: part of the compiled program).

  Attributes:
    builder: "static" | "ngram" | "sampled" | "dynamic" | "ddtree".
    depth: the deepest node's depth (`D`); the accepted path has at most `D` nodes.
    width: static: candidates per depth; ngram: matches merged; dynamic: `m` (children per
      expanded node and frontier nodes kept per depth); sampled: default branching; ddtree: the
      top-k tokens of each depth's marginal that a node may take.
    num_nodes: dynamic and ddtree: the node budget `N` (default `min(pool, 4 * depth)`; a
      ddtree's pool is every path of top-k tokens, `sum_d k^d`); derived otherwise.
    choices: static: paths of candidate ranks, e.g. `((0,), (1,), (0, 0))`; default: a top-1
      spine with `width` alternatives at every depth.
    branching: sampled: children per node at each depth, e.g. `(3, 2, 1)`; default
      `(width, width, 1, ...)`.
    replacement: sampled: True = children i.i.d. from q (SpecInfer rule), False = without
      replacement (recursive rule with q renormalised after each rejected sibling).
    max_ngram, min_ngram: ngram: the longest / shortest suffix matched.
    min_prob: dynamic: nodes whose draft path probability is below it are dropped (a per-row
      confidence stop: unsure rows get shallow trees); 0 keeps all.
    widths: node counts the target may be run on, chosen per round on device (`lax.switch`) as the
      smallest that holds every row's valid nodes; `N` is always added. None = always `N`.
  """

  builder: str = "dynamic"
  depth: int = 4
  width: int = 2
  num_nodes: int | None = None
  choices: tuple | None = None
  branching: tuple | None = None
  replacement: bool = True
  max_ngram: int = 3
  min_ngram: int = 1
  min_prob: float = 0.0
  widths: tuple | None = None

  def __post_init__(self):
    if self.builder not in BUILDERS:
      raise ValueError(f"TreeSpec.builder must be one of {BUILDERS}, got {self.builder!r}")
    for name in ("depth", "width"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TreeSpec.{name} must be a positive int, got {value!r}")
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"TreeSpec needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                       f"{self.max_ngram}")
    if self.choices is not None:
      choices = tuple(tuple(int(r) for r in c) for c in self.choices)
      if not choices or any(len(c) == 0 or min(c) < 0 for c in choices):
        raise ValueError("TreeSpec.choices must be non-empty paths of ranks >= 0")
      if len(set(choices)) != len(choices):
        raise ValueError("TreeSpec.choices has duplicate paths")
      if any(len(c) > 1 and c[:-1] not in choices for c in choices):
        raise ValueError("TreeSpec.choices must contain every prefix of every path")
      object.__setattr__(self, "choices", tuple(sorted(choices, key=lambda c: (len(c), c))))
      object.__setattr__(self, "depth", max(len(c) for c in choices))
    if self.branching is not None:
      branching = tuple(int(b) for b in self.branching)
      if not branching or min(branching) < 1:
        raise ValueError(f"TreeSpec.branching must be positive ints, got {self.branching!r}")
      object.__setattr__(self, "branching", branching)
      object.__setattr__(self, "depth", len(branching))
    if not 0.0 <= float(self.min_prob) < 1.0:
      raise ValueError(f"TreeSpec.min_prob must be in [0, 1), got {self.min_prob!r}")
    if self.min_prob and self.builder != "dynamic":
      raise ValueError("TreeSpec.min_prob applies to dynamic trees only")
    if self.builder in ("dynamic", "ddtree"):
      pool = (dynamic_pool_size(self.depth, self.width) if self.builder == "dynamic"
              else ddtree_pool_size(self.depth, self.width))
      n = self.num_nodes if self.num_nodes is not None else min(pool, 4 * self.depth)
      if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= pool:
        raise ValueError(f"TreeSpec.num_nodes must be in 1..{pool} for a {self.builder} tree of "
                         f"depth {self.depth} and width {self.width}, got {self.num_nodes!r}")
      object.__setattr__(self, "num_nodes", n)
    elif self.num_nodes is not None and self.num_nodes != self.size:
      raise ValueError(f"TreeSpec.num_nodes is derived for a {self.builder} tree ({self.size})")
    if self.widths is not None:
      widths = tuple(sorted({int(w) for w in self.widths} | {self.size}))
      if min(widths) < 0 or max(widths) > self.size:
        raise ValueError(f"TreeSpec.widths must lie in 0..{self.size}, got {self.widths!r}")
      object.__setattr__(self, "widths", widths)

  @property
  def resolved_choices(self) -> tuple:
    if self.choices is not None:
      return self.choices
    spine = [(0,) * d for d in range(1, self.depth + 1)]
    alternatives = [(0,) * (d - 1) + (r,) for d in range(1, self.depth + 1)
                    for r in range(1, self.width)]
    return tuple(sorted(spine + alternatives, key=lambda c: (len(c), c)))

  @property
  def resolved_branching(self) -> tuple:
    if self.branching is not None:
      return self.branching
    return tuple(self.width if d < 2 else 1 for d in range(self.depth))

  @property
  def size(self) -> int:
    """The static node budget `N`."""
    if self.builder == "static":
      return len(self.resolved_choices)
    if self.builder == "ngram":
      return self.width * self.depth
    if self.builder == "sampled":
      return sum(math.prod(self.resolved_branching[:d + 1]) for d in range(self.depth))
    return self.num_nodes

  @property
  def max_children(self) -> int:
    """The most children any node can have (bounds the sibling loop of the sampled rules)."""
    if self.builder == "sampled":
      return max(self.resolved_branching)
    if self.builder == "static":
      return max(sum(1 for c in self.resolved_choices if c[:-1] == p)
                 for p in [()] + list(self.resolved_choices))
    return self.width

  @property
  def rule(self) -> str:
    """The exact verification rule its children need (`specjax.verify.tree_rule.verify_tree`)."""
    if self.builder == "sampled":
      return "iid" if self.replacement else "without_replacement"
    return "match"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
  """One round's draft tree per row (see the module docstring)."""

  tokens: jax.Array  # [B, N] int32
  parents: jax.Array  # [B, N] int32 in -1 .. i - 1
  depths: jax.Array  # [B, N] int32 >= 1
  valid: jax.Array  # [B, N] bool
  logits: jax.Array | None = None  # [B, N, V] raw draft logits the node was drawn from
  grammar_states: jax.Array | None = None  # [B, N + 1] int32 automaton state after each ext node

  @property
  def num_nodes(self) -> int:
    return self.tokens.shape[1]

  def ext_parents(self) -> jax.Array:
    """`[B, N + 1]` extended parent index (root = 0 is its own parent)."""
    return jnp.concatenate([jnp.zeros_like(self.parents[:, :1]), self.parents + 1], axis=1)

  def ext_depths(self) -> jax.Array:
    """`[B, N + 1]` depth with the root (depth 0) at index 0."""
    return jnp.concatenate([jnp.zeros_like(self.depths[:, :1]), self.depths], axis=1)

  def ext_tokens(self, root: jax.Array) -> jax.Array:
    """`[B, N + 1]` the block the target scores: the root token `[B]`, then the nodes."""
    return jnp.concatenate([root.astype(jnp.int32)[:, None], self.tokens], axis=1)

  def ancestor_mask(self) -> jax.Array:
    """`[B, N + 1, N + 1]` bool: `[b, i, j]` iff extended node `j` is `i` or an ancestor of it."""
    return ancestor_mask(self.ext_parents())


def ancestor_mask(ext_parents: jax.Array) -> jax.Array:
  """Ancestor-or-self mask `[B, P, P]` from extended parents `[B, P]` (root 0 its own parent).

  Pointer doubling: after `ceil(log2 P)` squarings every ancestor is reached.
  """
  size = ext_parents.shape[1]
  eye = jnp.eye(size, dtype=bool)[None]
  mask = eye | jax.nn.one_hot(ext_parents, size, dtype=bool)
  for _ in range(max(1, math.ceil(math.log2(size)))):
    m = mask.astype(jnp.float32)
    mask = mask | (jnp.einsum("bij,bjk->bik", m, m) > 0)
  return mask


def sibling_ranks(tree: Tree) -> jax.Array:
  """`[B, N]` how many valid earlier siblings each node has (its order among its siblings)."""
  n = tree.num_nodes
  same = tree.parents[:, :, None] == tree.parents[:, None, :]  # [B, i, j]
  earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [i, j]: j < i
  return jnp.sum(same & earlier[None] & tree.valid[:, None, :], axis=-1).astype(jnp.int32)


def ddtree_pool_size(depth: int, width: int) -> int:
  """Distinct paths of a DDTree: `sum_{d=1..D} k^d` (capped, to stay an int32-sized count)."""
  return min(sum(width ** d for d in range(1, depth + 1)), 2 ** 20)


def dynamic_pool_size(depth: int, width: int) -> int:
  """Candidates an EAGLE-2 expansion scores: `m` at depth 1, `m * m` at every later depth."""
  return width + (depth - 1) * width * width


def valid_first(tree: Tree) -> Tree:
  """The same tree with its valid nodes moved to the front (stable, so parents still precede
  children); invalid nodes follow, re-parented to the root. `sum(valid)` nodes then suffice."""
  n = tree.num_nodes
  order = jnp.argsort(~tree.valid, axis=1, stable=True).astype(jnp.int32)  # [B, N] old index
  inverse = jax.vmap(lambda o: jnp.zeros((n,), jnp.int32).at[o].set(
      jnp.arange(n, dtype=jnp.int32)))(order)
  take = lambda x: jnp.take_along_axis(x, order, axis=1)
  valid = take(tree.valid)
  old_parents = take(tree.parents)
  parents = jnp.where(old_parents < 0, -1,
                      jnp.take_along_axis(inverse, jnp.maximum(old_parents, 0), axis=1))
  parents = jnp.where(valid, parents, -1)
  depths = jnp.where(valid, take(tree.depths), 1)
  logits = None if tree.logits is None else jnp.take_along_axis(tree.logits, order[..., None],
                                                                 axis=1)
  return Tree(take(tree.tokens), parents, depths, valid, logits)
