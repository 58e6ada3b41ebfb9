"""DDTree (`specjax.trees.builders.ddtree`): the fixed-shape build returns exactly the node set a
best-first heap over summed log q pops, checked against a brute-force enumeration of every path
of top-k tokens; parents precede children; the spec validates its budget."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.trees.builders import ddtree
from specjax.trees.structure import TreeSpec


def _paths(tree, row):
  """Each node's token path from the root, as a tuple."""
  tokens, parents = np.asarray(tree.tokens[row]), np.asarray(tree.parents[row])
  paths = []
  for i in range(len(tokens)):
    parent = parents[i]
    paths.append((paths[parent] if parent >= 0 else ()) + (int(tokens[i]),))
  return paths


def _brute_force(marginals, width, budget):
  """The `budget` best paths over each depth's top-`width` tokens by summed log q."""
  logq = np.asarray(jax.nn.log_softmax(marginals, axis=-1), np.float64)
  top = np.argsort(-logq, axis=-1, kind="stable")[:, :width]
  scored = []
  for depth in range(1, logq.shape[0] + 1):
    for ranks in itertools.product(range(width), repeat=depth):
      path = tuple(int(top[d, r]) for d, r in enumerate(ranks))
      scored.append((sum(logq[d, t] for d, t in enumerate(path)), path))
  scored.sort(key=lambda item: -item[0])
  return {path for _, path in scored[:budget]}


@pytest.mark.parametrize("width,budget", [(3, 7), (2, 14), (4, 5)])
def test_ddtree_is_the_best_paths(width, budget):
  marginals = 1.5 * jax.random.normal(jax.random.key(width), (3, 3, 9))  # 3 rows, depth 3
  tree = ddtree(marginals, width=width, num_nodes=budget)
  assert tree.tokens.shape == (3, budget)
  for row in range(3):
    paths = _paths(tree, row)
    assert set(paths) == _brute_force(marginals[row], width, budget)
    assert len(set(paths)) == budget  # no duplicate nodes
    parents = np.asarray(tree.parents[row])
    assert np.all(parents < np.arange(budget))  # parents precede children
    assert np.all(np.asarray(tree.depths[row]) == [len(p) for p in paths])
  assert bool(jnp.all(tree.valid))


def test_ddtree_spec_budget():
  spec = TreeSpec(builder="ddtree", depth=3, width=2)
  assert spec.size == min(2 + 4 + 8, 12) and spec.rule == "match" and spec.max_children == 2
  with pytest.raises(ValueError, match="num_nodes must be in 1..14 for a ddtree"):
    TreeSpec(builder="ddtree", depth=3, width=2, num_nodes=15)
