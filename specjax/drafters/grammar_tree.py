"""Exact speculative decoding of draft trees under a grammar: `GrammarTreeDrafter`, `TreeGuide`.

`specjax.decode(..., tree=TreeSpec(...), constraint=c)` samples exactly what
`specjax.generate(..., constraint=c)` samples (greedy: its tokens), for every tree builder and
tree drafter. The chain's argument (`specjax.drafters.grammar`) carries over node by node: every
extended node `n` of the tree (the root, then the drafted nodes) has an automaton state `s_n`,
the builders see the draft's `q` restricted by it, and the verify restricts the target's `p` at
that node by it.

**Node states.** The root's state is the row's state after its accepted tokens (the root token is
the last of them); a node's state is its parent's advanced by the node's token (`DEAD` when the
parent's state does not allow it, and `DEAD` stays `DEAD` below). Parents precede children in
every builder, and `D` vectorized steps (one per depth) reach every node.

**The drafts** (`TreeGuide`, handed to the wrapped tree drafter's builder, see
`specjax.trees.structure`). At every node a sampled or dynamic builder expands, it sees the draft
logits restricted as the target's law is: `q'_n = constrained_logits(q_n, mask(s_n))` (the
call's temperature / top-k / top-p, then the grammar's mask; uniform over the allowed tokens where
none of them has weight). The builder itself runs with the identity warp (`verify_sampling`), so
a sampled child is a draw of exactly `q'_n`, and the tree records `q'_n` in `Tree.logits`. A
static tree's greedy chain ranks its candidates the same way along the chain's states; n-gram and
suffix tries are built from the text as before.

**Disallowed nodes.** After the build the wrapper walks the tree once: a node whose token its
parent's state does not allow is invalid, and so is everything below it. Such nodes come from
tries, from a static tree's alternatives off its chain, and from a top-`k` of a restricted row
with fewer than `k` allowed tokens. Dropping them is exact:

  * a deterministic tree (static, dynamic, n-gram, the suffix trie, and every tree when greedy) is
    verified by sample-then-match, which emits at each step the target's own sample at the node
    it stands on, whatever the children are: fewer children only end some walks sooner, and a
    disallowed child could never be matched, since the constrained law gives it probability 0;
  * a sampled tree at temperature > 0 drew every child from `q'`, which has no mass outside the
    allowed set, so no drawn child is ever dropped (except below a state that allows nothing,
    where the target is stuck too). A tree whose children were drawn from the unrestricted `q`
    could not be repaired this way: dropping a rejected-anyway child skips its residual step,
    which biases the i.i.d. rule (`specjax.testing.grammar.TreeMasksPOnly` is that bug).

The proposal's `Tree.grammar_states [B, N + 1]` holds every extended node's state.

**The verify** (`specjax.loop.round`): the target's logits at extended node `n` become
`constrained_logits(p_n, mask(s_n))`, the function `generate` samples from at that node's prefix,
and the tree rule runs with the identity warp (or greedily) on these and on the recorded `q'`.
The tree rule emits at every step a token of the distribution at the node it stands on (exactly,
for any `q` given with its draws), so the emitted tokens follow the constrained law. A node where
nothing allowed has weight (`stuck`) ends every walk through it (its children are not offered),
and a row whose walk ends at such a node stops, emitting only its accepted path, flagged in
`stats.constraint_dead`, as in `generate`. `stats.forced` counts the emitted path nodes whose
parent's state allowed exactly one token.

Each row's automaton state lives in the wrapper's draft state; `observe` advances it along the
tokens the row kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.constrain.tables import ConstraintTables
from specjax.core.sampling import Sampling
from specjax.drafters.grammar import GrammarWrapper, _restricted, verify_sampling
from specjax.trees import structure as trees
from specjax.trees.structure import Tree, TreeSpec

__all__ = ["GrammarTreeDrafter", "GrammarTreeState", "TreeGuide"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarTreeState:
  """The wrapper's draft state.

  Attributes:
    inner: the wrapped tree drafter's state.
    state: `[B]` int32 each row's automaton state after its accepted tokens.
  """

  inner: Any
  state: jax.Array


class TreeGuide:
  """What a tree builder needs of the grammar (see `specjax.trees.structure`): trace-time only.

  Attributes:
    root: `[B]` int32 each row's state at the root.
  """

  def __init__(self, drafter: GrammarTreeDrafter, root: jax.Array, sampling: Sampling):
    self.drafter = drafter
    self.root = root
    self.sampling = sampling

  def advance(self, states, tokens) -> jax.Array:
    """`[B, ...]` the states after `tokens` (`[B, ...]`) from `states`."""
    return self.drafter.advance(states, tokens)

  def restrict(self, states, logits) -> jax.Array:
    """`[B, ..., V]` float32 the draft logits `logits` at nodes in `states` (`[B, ...]`) as the
    builder sees them: `q'`, the drafter's `draft_law` (the argument order of the chain's
    `specjax.drafters.grammar.Guide`)."""
    return self.drafter.draft_law(logits, self.drafter.mask(states), self.sampling)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarTreeDrafter(GrammarWrapper):
  """A tree drafter whose trees follow a grammar (see the module docstring).

  Attributes:
    drafter: the wrapped tree drafter (`specjax.drafters.tree.tree_drafter`'s: a draft model's,
      a feature head's, an n-gram or suffix trie's).
    tables: stacked `ConstraintTables` (`specjax.constrain.compile.constraint_inputs`).
    schema: `[B]` int32 each row's index into `tables`.
  """

  drafter: Any
  tables: ConstraintTables
  schema: jax.Array

  @property
  def spec(self) -> TreeSpec:
    return self.drafter.spec

  def init(self, tokens, lengths, buffer_len, prefill):
    inner = self.drafter.init(tokens, lengths, buffer_len, prefill)
    return GrammarTreeState(inner, self.initial_states(tokens.shape[0]))

  def draft_law(self, logits, mask, sampling: Sampling):
    """`q'`: the draft logits a builder sees at a node whose state allows `mask`: the
    constrained law's restriction (`_restricted`), and zeros (any finite row: its children are
    dropped) where the state allows nothing. `specjax.testing.grammar` overrides it to build
    broken variants."""
    q = _restricted(logits, mask, sampling)
    return jnp.where(jnp.any(mask, axis=-1, keepdims=True), q, 0.0)

  def node_states(self, tree: Tree, root) -> jax.Array:
    """`[B, N + 1]` int32 the state after every extended node of `tree` (the root's: `root`)."""
    parents, tokens = tree.ext_parents(), tree.ext_tokens(jnp.zeros_like(root))
    states = jnp.broadcast_to(root[:, None], parents.shape).astype(jnp.int32)
    for _ in range(self.spec.depth):  # one more depth is right after each step
      stepped = self.advance(jnp.take_along_axis(states, parents, axis=1), tokens)
      states = stepped.at[:, 0].set(root)
    return states

  def constrain_tree(self, tree: Tree, root) -> Tree:
    """`tree` without its disallowed nodes (and their subtrees), valid ones first where the spec
    has verify widths, with its `grammar_states`."""
    states = self.node_states(tree, root)
    tree = dataclasses.replace(tree, valid=tree.valid & (states[:, 1:] >= 0))
    if self.spec.widths is not None:  # the smallest width that holds the valid nodes
      tree = trees.valid_first(tree)
      states = self.node_states(tree, root)
    return dataclasses.replace(tree, grammar_states=states)

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds):
    guide = TreeGuide(self, state.state, sampling)
    inner, tree = self.drafter.propose(state.inner, sequence, lengths, num_draft=num_draft,
                                       sampling=verify_sampling(sampling), seeds=seeds,
                                       guide=guide)
    if not isinstance(tree, Tree):
      raise ValueError("GrammarTreeDrafter wraps a tree drafter (specjax.drafters.tree); a chain "
                       "drafter under a constraint is a GrammarDrafter")
    return GrammarTreeState(inner, state.state), self.constrain_tree(tree, state.state)

  def forced(self, states) -> jax.Array:
    """`[B, ...]` bool: `states` allow exactly one token."""
    return jnp.sum(self.mask(states), axis=-1, dtype=jnp.int32) == 1

  def observe(self, state, scored, block, emitted, count, lengths):
    inner = self.drafter.observe(state.inner, scored, block, emitted, count, lengths)
    s = state.state
    for j in range(emitted.shape[1]):
      s = jnp.where(j < count, self.advance(s, emitted[:, j]), s)
    return GrammarTreeState(inner, s)
