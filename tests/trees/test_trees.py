"""Draft trees: builders, tree attention, accepted-branch compaction and the tree decode loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.trees import builders as tree_builders, structure as trees
from specjax.core.cache import KVCache, compact
from specjax.testing.models import tiny_config
from specjax.core.tracing import TRACE_COUNTS
from specjax.trees.structure import Tree, TreeSpec

VOCAB = 61
ATOL = 2e-5  # float32 logits of the tree forward vs a plain causal forward over the same path


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=VOCAB), jax.random.key(0))


@pytest.fixture(scope="module")
def draft():
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=1, embed_dim=16, mlp_dim=32),
                        jax.random.key(1))


@pytest.fixture(scope="module")
def batch():
  tokens = jnp.array([[5, 9, 2, 7, 1, 3], [3, 8, 0, 0, 0, 0], [11, 4, 6, 4, 0, 0]], jnp.int32)
  return tokens, jnp.array([6, 2, 4], jnp.int32)


def model_expand(model, tokens, lengths):
  """A draft model's `expand` below each row's last prompt token (cache holds the rest)."""
  batch, width = tokens.shape
  cache = model(tokens, jnp.zeros((batch,), jnp.int32), model.init_cache(batch, width + 80)).cache
  cache = cache.with_lengths(lengths - 1)
  starts = lengths - 1

  def expand(ext_tokens, ext_parents, ext_depths):
    return model(ext_tokens, starts, cache, positions=starts[:, None] + ext_depths,
                 block_mask=trees.ancestor_mask(ext_parents)).logits

  return expand


def check_structure(tree: Tree, deterministic: bool):
  parents, depths = np.asarray(tree.parents), np.asarray(tree.depths)
  tokens, valid = np.asarray(tree.tokens), np.asarray(tree.valid)
  for b in range(parents.shape[0]):
    for i in range(parents.shape[1]):
      p = parents[b, i]
      assert -1 <= p < i  # parents precede children
      assert depths[b, i] == (1 if p < 0 else depths[b, p] + 1)
      if valid[b, i] and p >= 0:
        assert valid[b, p]
    if deterministic:  # distinct tokens among valid siblings
      for p in set(parents[b].tolist()):
        sibling_tokens = tokens[b][(parents[b] == p) & valid[b]]
        assert len(set(sibling_tokens.tolist())) == len(sibling_tokens)


def test_tree_spec_validates():
  with pytest.raises(ValueError, match="builder"):
    TreeSpec("beam")
  with pytest.raises(ValueError, match="prefix"):
    TreeSpec("static", choices=((0,), (1, 0)))
  with pytest.raises(ValueError, match="num_nodes"):
    TreeSpec("dynamic", depth=2, width=2, num_nodes=7)  # pool holds 2 + 4
  assert TreeSpec("sampled", branching=(3, 2, 1)).size == 3 + 6 + 6
  assert TreeSpec("static", depth=3, width=2).size == 6


def test_ngram_tree_merges_matches_into_a_trie():
  # Suffix [1, 2] occurred at 0 (-> 3, 4), at 4 (-> 3, 5) and at 8 (-> 9, ...).
  row = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 9, 7, 1, 2]
  sequence = jnp.asarray([row + [0, 0]], jnp.int32)
  tree = tree_builders.ngram_tree(sequence, jnp.array([len(row)]), num_matches=3, depth=2,
                                  max_ngram=2)
  check_structure(tree, deterministic=True)
  valid = np.asarray(tree.valid[0])
  nodes = {(int(d), int(t)) for d, t, v in zip(tree.depths[0], tree.tokens[0], valid) if v}
  assert nodes == {(1, 9), (1, 3), (2, 7), (2, 5), (2, 4)}
  assert valid.sum() == 5  # the shared prefix [3] appears once


@pytest.mark.parametrize("spec", [
    TreeSpec("dynamic", depth=3, width=3, num_nodes=10),
    TreeSpec("sampled", branching=(3, 2, 1), replacement=False),
    pytest.param(TreeSpec("sampled", branching=(2, 2), replacement=True), marks=pytest.mark.slow),
], ids=["dynamic", "sampled_wor", "sampled_iid"])
def test_model_builders_give_well_formed_trees(draft, batch, spec):
  tokens, lengths = batch
  # Built jitted, as decode builds it (eagerly each expansion's forward runs op by op).
  build = jax.jit(lambda draft, tokens, lengths: tree_builders.build_tree(
      spec, expand=model_expand(draft, tokens, lengths), root=tokens[jnp.arange(3), lengths - 1],
      sequence=tokens, lengths=lengths, sampling=sj.Sampling(temperature=1.0),
      seeds=jnp.arange(3, dtype=jnp.uint32)))
  tree = build(draft, tokens, lengths)
  assert tree.tokens.shape == (3, spec.size)
  check_structure(tree, deterministic=spec.builder == "dynamic" or not spec.replacement)


def test_dynamic_tree_keeps_the_best_paths(draft, batch):
  """EAGLE-2: every kept node's path score is >= every dropped candidate's expanded score."""
  tokens, lengths = batch
  expand = model_expand(draft, tokens, lengths)
  root = tokens[jnp.arange(3), lengths - 1]
  tree = tree_builders.dynamic_tree(expand, root, depth=2, width=2, num_nodes=3)
  ext = tree.ext_tokens(root)
  logp = jax.nn.log_softmax(expand(ext, tree.ext_parents(), tree.ext_depths()), axis=-1)
  score = np.zeros((3, 4))
  for i in range(3):
    parent = np.asarray(tree.parents[:, i]) + 1
    score[:, i + 1] = score[np.arange(3), parent] + np.asarray(
        logp[jnp.arange(3), parent, tree.tokens[:, i]])
  best_root_children = np.sort(np.asarray(jax.lax.top_k(logp[:, 0], 2)[0]), axis=1)
  depth1 = np.sort(np.where(np.asarray(tree.depths) == 1, score[:, 1:], -np.inf), axis=1)
  np.testing.assert_allclose(depth1[:, -1], best_root_children[:, -1], rtol=1e-5)


def all_paths(tree: Tree, b: int):
  """Every root-to-leaf path of row `b` as a list of node indices."""
  parents = np.asarray(tree.parents[b]).tolist()
  leaves = [i for i in range(len(parents)) if i not in parents]
  paths = []
  for leaf in leaves:
    path, node = [], leaf
    while node >= 0:
      path.append(node)
      node = parents[node]
    paths.append(path[::-1])
  return paths


def test_tree_forward_equals_causal_forward_on_every_path(target, draft, batch):
  tokens, lengths = batch
  spec = TreeSpec("sampled", branching=(3, 2, 2), replacement=False)
  root = tokens[jnp.arange(3), lengths - 1]
  tree = tree_builders.build_tree(spec, expand=model_expand(draft, tokens, lengths), root=root,
                          sequence=tokens, lengths=lengths, sampling=sj.Sampling(temperature=1.0),
                          seeds=jnp.arange(3, dtype=jnp.uint32))
  scored_logits = model_expand(target, tokens, lengths)(
      tree.ext_tokens(root), tree.ext_parents(), tree.ext_depths())  # [B, N + 1, V]
  cases = []  # (row, prompt length, path); all paths go through one causal forward, right-padded
  for b in range(3):
    cases += [(b, int(lengths[b]), path) for path in all_paths(tree, b)]
  assert len(cases) == 3 * 12
  sequences = np.zeros((len(cases), tokens.shape[1] + spec.depth), np.int32)
  for row, (b, length, path) in enumerate(cases):
    sequences[row, :length + len(path)] = np.concatenate(
        [np.asarray(tokens[b, :length]), np.asarray(tree.tokens[b])[path]])
  plain = target(jnp.asarray(sequences), jnp.zeros((len(cases),), jnp.int32)).logits
  for row, (b, length, path) in enumerate(cases):
    expected = plain[row, length - 1:length + len(path)]  # after the root, then each path node
    got = scored_logits[b, np.asarray([0] + [i + 1 for i in path])]
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def test_compaction_equals_plain_decode_of_emitted_tokens(target, batch):
  tokens, lengths = batch
  spec = TreeSpec("static", depth=3, width=2)
  cand = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (3, 3, 2)), jnp.int32)
  tree = tree_builders.static_tree(cand, spec.resolved_choices)  # 0,1 | 2,3 | 4,5; spine 0-2-4
  root = tokens[jnp.arange(3), lengths - 1]
  batch_size, width = tokens.shape
  cache = target(tokens, jnp.zeros((3,), jnp.int32), target.init_cache(3, width + 40)).cache
  cache = cache.with_lengths(lengths - 1)
  starts = lengths - 1
  scored = target(tree.ext_tokens(root), starts, cache, positions=starts[:, None] +
                  tree.ext_depths(), block_mask=tree.ancestor_mask())
  path = jnp.array([[0, 2, 5], [1, 0, 0], [0, 3, 0]], jnp.int32)  # ragged: 3, 1, 2 accepted
  counts = jnp.array([3, 1, 2], jnp.int32)
  compacted = compact(scored.cache, lengths[:, None] + path, lengths, counts)
  for b in range(3):
    length, a = int(lengths[b]), int(counts[b])
    emitted = np.asarray(tree.tokens[b])[np.asarray(path[b, :a])]
    sequence = np.concatenate([np.asarray(tokens[b, :length]), emitted])
    plain = target(jnp.asarray(sequence)[None], jnp.zeros((1,), jnp.int32),
                   target.init_cache(1, width + 40)).cache
    valid = length + a  # slots [0, L + a): the prompt, the root and the accepted path
    for got, want in ((compacted.k, plain.k), (compacted.v, plain.v)):
      np.testing.assert_allclose(got[:, b, :, :valid], want[:, 0, :, :valid], atol=ATOL, rtol=0)


def test_compaction_never_touches_other_rows_or_wraps(target):
  cache = target.init_cache(2, 16)
  k = jnp.arange(cache.k.size, dtype=jnp.float32).reshape(cache.k.shape)
  cache = KVCache(k, k + 1, jnp.array([3, 14], jnp.int32))
  # Row 1's destination runs past the buffer (slots 14..17 of 16): dropped, never wrapped.
  moved = compact(cache, jnp.array([[5, 7, 9, 11], [15, 15, 15, 15]]), jnp.array([3, 14]),
                  jnp.array([2, 4]))
  np.testing.assert_array_equal(moved.k[:, 0, :, 3], k[:, 0, :, 5])
  np.testing.assert_array_equal(moved.k[:, 0, :, 4], k[:, 0, :, 7])
  np.testing.assert_array_equal(moved.k[:, 0, :, 5:], k[:, 0, :, 5:])  # past the count: unchanged
  np.testing.assert_array_equal(moved.k[:, 0, :, :3], k[:, 0, :, :3])
  np.testing.assert_array_equal(moved.k[:, 1, :, :14], k[:, 1, :, :14])
  np.testing.assert_array_equal(moved.k[:, 1, :, 14], k[:, 1, :, 15])


SPECS = {
    "static": TreeSpec("static", depth=3, width=2),
    "ngram": TreeSpec("ngram", depth=3, width=3),
    "sampled": TreeSpec("sampled", branching=(2, 2, 1), replacement=False),
    "dynamic": TreeSpec("dynamic", depth=4, width=3, num_nodes=10),
}


@pytest.mark.parametrize("name", [
    "dynamic", "ngram", pytest.param("static", marks=pytest.mark.slow),
    pytest.param("sampled", marks=pytest.mark.slow)])
def test_greedy_tree_decode_equals_generate(target, draft, batch, name):
  tokens, lengths = batch
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=20)
  out = sj.decode(target, draft, tokens, jax.random.key(0), lengths=lengths,  # one loop, a tree drafter
                  max_new_tokens=20, tree=SPECS[name])
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.num_tokens, ref.num_tokens)


def test_draft_equal_to_target_is_accepted_to_full_depth(target, batch):
  """With the target as its own drafter every round accepts a whole root-to-leaf path: exercises
  compaction across rounds (a wrong cache would change the tokens)."""
  tokens, lengths = batch
  spec = TreeSpec("static", depth=3, width=2)  # the spine is the drafter's greedy chain
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=20)
  out = sj.decode(target, target, tokens, jax.random.key(0), lengths=lengths,
                    max_new_tokens=20, tree=spec)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.stats.rounds, [5, 5, 5])  # 4 tokens per round


@pytest.mark.slow
def test_tree_decode_eos_and_limits(target, draft, batch):
  tokens, lengths = batch
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12)
  eos = int(ref.tokens[0, 3])
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12,
                    eos_id=eos)
  out = sj.decode(target, draft, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12,
                    eos_id=eos, tree=SPECS["dynamic"])
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.num_tokens, ref.num_tokens)


def test_one_while_loop_no_callbacks_no_recompilation(target, draft, batch):
  tokens, lengths = batch
  spec = SPECS["dynamic"]
  jaxpr = jax.make_jaxpr(lambda t, l: sj.decode(
      target, draft, t, jax.random.key(0), lengths=l, max_new_tokens=8, tree=spec,
      sampling=sj.Sampling(temperature=1.0)))(tokens, lengths)
  text = str(jaxpr)
  assert "callback" not in text
  inner = jaxpr.jaxpr.eqns
  # Everything runs inside one jitted program with exactly one top-level while loop.
  calls = [e for e in inner if e.primitive.name in ("pjit", "jit")]
  top = [e for e in calls[0].params["jaxpr"].jaxpr.eqns if e.primitive.name == "while"]
  assert len(top) == 1
  before = TRACE_COUNTS["decode"]
  for max_new, seed in ((10, 1), (30, 2), (64, 3)):  # one bucket of max_new_tokens
    sj.decode(target, draft, tokens, jax.random.key(seed), lengths=lengths,
                max_new_tokens=max_new, tree=spec, sampling=sj.Sampling(temperature=1.0))
  assert TRACE_COUNTS["decode"] - before <= 1


def test_bad_input_raises_before_tracing(target, draft, batch):
  tokens, lengths = batch
  with pytest.raises(ValueError, match="TreeSpec"):
    sj.decode(target, draft, tokens, jax.random.key(0), tree="dynamic")
  with pytest.raises(ValueError, match="draft model"):
    sj.decode(target, None, tokens, jax.random.key(0), tree=SPECS["dynamic"])
  with pytest.raises(ValueError, match="num_draft"):
    sj.decode(target, draft, tokens, jax.random.key(0), num_draft=2, tree=SPECS["dynamic"])


def test_valid_first_keeps_a_well_formed_tree():
  sequence = jnp.asarray([[1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 9, 7, 1, 2, 0, 0]], jnp.int32)
  tree = tree_builders.ngram_tree(sequence, jnp.array([14]), num_matches=3, depth=3, max_ngram=2)
  moved = trees.valid_first(tree)
  check_structure(moved, deterministic=True)
  count = int(tree.valid.sum())
  assert bool(moved.valid[0, :count].all()) and not bool(moved.valid[0, count:].any())
  paths = lambda t: sorted(tuple(int(t.tokens[0, i]) for i in p) for p in all_paths(t, 0)
                           if all(bool(t.valid[0, i]) for i in p))
  assert paths(moved) == paths(tree)


@pytest.mark.parametrize("spec", [
    TreeSpec("ngram", depth=3, width=3, widths=(0, 3, 6)),
    TreeSpec("dynamic", depth=4, width=3, num_nodes=10, min_prob=0.05, widths=(2, 5)),
], ids=["ngram", "dynamic_min_prob"])
def test_adaptive_widths_keep_greedy_identity(target, draft, batch, spec):
  """Verify widths chosen on device by lax.switch (and a per-row confidence stop) change no
  token."""
  tokens, lengths = batch
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=20)
  out = sj.decode(target, draft, tokens, jax.random.key(0), lengths=lengths,
                    max_new_tokens=20, tree=spec)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.num_tokens, ref.num_tokens)


@pytest.mark.parametrize("name", ["sampled", pytest.param("ngram", marks=pytest.mark.slow)])
def test_stream_with_a_tree_equals_decode(target, draft, batch, name):
  """`decode_stream(..., tree=)` runs the same round as `decode(..., tree=)`, one host step per
  round: each row's yields concatenate to decode's tokens (sampled, so the streams matter)."""
  from specjax.loop.stream import decode_stream
  tokens, lengths = batch
  common = dict(lengths=lengths, max_new_tokens=16, tree=SPECS[name],
                sampling=sj.Sampling(temperature=0.8, top_k=20))
  out = sj.decode(target, draft, tokens, jax.random.key(7), **common)
  rounds = list(decode_stream(target, draft, tokens, jax.random.key(7), **common))
  for b in range(tokens.shape[0]):
    streamed = np.concatenate([new[b] for new, _ in rounds])
    np.testing.assert_array_equal(streamed, np.asarray(out.tokens[b, :int(out.num_tokens[b])]))
  final = rounds[-1][1].stats
  np.testing.assert_array_equal(final.accepted, out.stats.accepted)
  assert len(rounds) == int(np.max(out.stats.rounds))
