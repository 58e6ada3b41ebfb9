"""The tree verify with the vocabulary split over a mesh, against the single-device reference.

On 8 simulated CPU devices, `specjax.verify.tree_sharded.sharded_verify_tree` (each device
deciding every node on its vocabulary slice, slices combined with collectives) must return exactly
`specjax.verify.tree_rule.verify_tree`'s `path`, `num_accepted` and `tokens` for every rule
("match", "iid", "without_replacement"), greedy, at temperature 1 and at 0.7 with top-k and top-p,
on random trees (`random_case`: random parents, invalid nodes, a row with no valid node), with
vocabularies that do and do not divide the shard count. The front door (`dispatch.verify_tree`)
takes that path under a vocabulary-split mesh; the compiled program holds no array with the whole
vocabulary; and broken variants (races combined by taking one shard's winner, masses not summed
over the shards) fail the same equality.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import specjax as sj
from specjax.core.sampling import JnpReductions, Sampling, first_argmax
from specjax.trees.structure import Tree, TreeSpec
from specjax.verify import dispatch, tree_rule, tree_sharded
from specjax.verify.tree_sharded import FusedLocalVocab, ShardedTreeVocab
from tests.verify.test_tree_verify import assert_same, random_case

RULES = ("match", "iid", "without_replacement")
SAMPLINGS = {
    "greedy": Sampling(),
    "t1": Sampling(temperature=1.0),
    "t0.7_topk_topp": Sampling(temperature=0.7, top_k=20, top_p=0.9),
}


def _reference(target, tree, kwargs):
  return jax.jit(lambda target, tree: tree_rule.verify_tree(target, tree, **kwargs))(target, tree)


def _sharded(target, tree, kwargs, mesh, **extra):
  return jax.jit(lambda target, tree: tree_sharded.sharded_verify_tree(
      target, tree, mesh=mesh, **kwargs, **extra))(target, tree)


@pytest.mark.parametrize("setting", SAMPLINGS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape, vocab", [
    ((2, 4), 90), pytest.param((1, 8), 128, marks=pytest.mark.costly)], ids=str)
def test_sharded_tree_verify_equals_reference(shape, vocab, rule, setting):
  """(2, 4): rows over data, 90 = 4 * 22 + 2 entries over model (padded with -inf); (1, 8): all
  eight devices on the vocabulary, 16 entries each."""
  target, tree, kwargs = random_case(7 + vocab, 8, 9, vocab, max_children=3, rule=rule,
                                     sampling=SAMPLINGS[setting])
  want = _reference(target, tree, kwargs)
  got = _sharded(target, tree, kwargs, sj.make_mesh(shape))
  assert_same(got, want)
  assert int(np.sum(want.num_accepted)) > 0  # the walks go down the trees


@pytest.mark.costly
def test_wide_trees_equal_reference():
  """Six children at the root and flatter targets: many rejected siblings, so the replayed
  residuals and the renormalised `s` after removals are what decide."""
  sampling = SAMPLINGS["t0.7_topk_topp"]
  for rule in ("iid", "without_replacement"):
    target, tree, kwargs = random_case(3, 16, 12, 150, max_children=6, rule=rule,
                                       sampling=sampling)
    want = _reference(target, tree, kwargs)
    assert_same(_sharded(target, tree, kwargs, sj.make_mesh((2, 4))), want)


def test_rows_only_mesh_runs_the_same_rule_on_whole_rows():
  """(8, 1): nothing to split in the vocabulary; the same per-node decisions over whole rows."""
  target, tree, kwargs = random_case(5, 8, 9, 100, max_children=3, rule="without_replacement",
                                     sampling=SAMPLINGS["t1"])
  assert_same(_sharded(target, tree, kwargs, sj.make_mesh((8, 1))),
              _reference(target, tree, kwargs))


@pytest.mark.parametrize("rule", ["match", "iid"])
def test_front_door_under_a_vocab_split_mesh(rule, monkeypatch):
  """`dispatch.verify_tree` under a (2, 4) mesh runs the vocabulary-sharded rule (for every
  named impl) and returns the reference's tokens, rows still split over data."""
  sampling = SAMPLINGS["t0.7_topk_topp"]
  target, tree, kwargs = random_case(11, 8, 9, 128, max_children=3, rule=rule,
                                     sampling=sampling)
  depth = kwargs["max_depth"]
  spec = (TreeSpec("dynamic", depth=depth, width=3) if rule == "match"
          else TreeSpec("sampled", branching=(3,) * depth))
  assert (spec.rule, spec.depth, spec.max_children) == (rule, depth, 3)
  calls = []
  original = tree_sharded.sharded_verify_tree
  monkeypatch.setattr(tree_sharded, "sharded_verify_tree",
                      lambda *a, **k: calls.append(1) or original(*a, **k))
  mesh = sj.make_mesh((2, 4))
  got = jax.jit(lambda target, tree: dispatch.verify_tree(
      target, tree, spec=spec, sampling=sampling, seeds=kwargs["seeds"],
      positions=kwargs["positions"], impl="auto", mesh=mesh))(target, tree)
  assert calls
  assert_same(got, _reference(target, tree, kwargs))
  assert got.tokens.sharding.spec[0] == "data"


@pytest.mark.parametrize("rule, setting", [("iid", "t0.7_topk_topp"), ("match", "t1"),
                                           ("match", "greedy")])
def test_compiled_program_never_holds_the_whole_vocabulary(rule, setting):
  """No device holds a `[B_local, N + 1, V]` or `[B_local, N, V]` float array (nor any other
  with the whole V = 128 on its last axis): only `[4, 10, 32]` slices."""
  mesh = sj.make_mesh((2, 4))
  target, tree, kwargs = random_case(2, 8, 9, 128, max_children=3, rule=rule,
                                     sampling=SAMPLINGS[setting])
  split = NamedSharding(mesh, P("data", None, "model"))
  target = jax.device_put(target, split)
  if rule != "match":
    tree = Tree(tree.tokens, tree.parents, tree.depths, tree.valid,
                jax.device_put(tree.logits, split))
  text = jax.jit(lambda target, tree: tree_sharded.sharded_verify_tree(
      target, tree, mesh=mesh, **kwargs)).lower(target, tree).compile().as_text()
  assert "f32[4,10,32]" in text  # the local slice: 8 / 2 rows, N + 1 = 10 nodes, 128 / 4 ids
  assert not re.search(r"f32\[[\d,]*128\]", text)
  assert not re.search(r"f32\[\d+,(9|10),128\]", text)


class _FirstShardWins(ShardedTreeVocab):
  """Broken: each race's winner is shard 0's local winner."""

  def combine_races(self, values, ids):
    return tuple(ids[..., k, 0] for k in range(ids.shape[-2]))


class _LocalMasses(ShardedTreeVocab):
  """Broken: the sibling loop's masses are this shard's only (never summed over the shards)."""

  def combine_sums(self, partial):
    return partial


@pytest.mark.parametrize("broken, rule, setting", [
    (_FirstShardWins, "match", "greedy"), (_FirstShardWins, "match", "t1"),
    (_FirstShardWins, "iid", "t0.7_topk_topp"), (_LocalMasses, "iid", "t1"),
    (_LocalMasses, "without_replacement", "t0.7_topk_topp")],
    ids=lambda x: getattr(x, "__name__", str(x)))
def test_broken_combinations_fail_the_check(broken, rule, setting):
  target, tree, kwargs = random_case(13, 8, 9, 128, max_children=3, rule=rule,
                                     sampling=SAMPLINGS[setting])
  want = _reference(target, tree, kwargs)
  got = _sharded(target, tree, kwargs, sj.make_mesh((2, 4)), sharded_vocab=broken)
  with pytest.raises(AssertionError):
    assert_same(got, want)


def test_fused_local_statistics_equal_the_plain_ones():
  """`FusedLocalVocab`'s one-reduction races and threshold sums give `first_argmax`'s and
  `JnpReductions.sum_at_least`'s answers, ties (the first wins) and NaNs (a NaN wins) included."""
  x = jnp.round(2.0 * jax.random.normal(jax.random.key(0), (6, 5, 40)))  # many exact ties
  x = x.at[1, 2, 7].set(jnp.nan).at[1, 2, 3].set(jnp.nan).at[2, 0].set(-jnp.inf)
  ops = FusedLocalVocab()
  got_x, got_neg = ops.races(x, -x)
  np.testing.assert_array_equal(got_x, first_argmax(x))
  np.testing.assert_array_equal(got_neg, first_argmax(-x))
  _, arg = ops.max_and_argmax(x)
  np.testing.assert_array_equal(arg, first_argmax(x))
  assert int(arg[1, 2]) == 3 and int(arg[2, 0]) == 0
  y = jnp.nan_to_num(x, nan=0.0)
  thresholds = jnp.stack([jnp.full((6, 5), t) for t in (-jnp.inf, -1.0, 0.0, 2.0)], axis=-1)
  weights = jnp.exp(y / 4)
  np.testing.assert_array_equal(ops.sum_at_least(y, None, thresholds),
                                JnpReductions().sum_at_least(y, None, thresholds))
  np.testing.assert_allclose(ops.sum_at_least(y, weights, thresholds),
                             JnpReductions().sum_at_least(y, weights, thresholds), rtol=1e-6)
