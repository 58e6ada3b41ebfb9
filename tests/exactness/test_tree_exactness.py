"""Exact tree verification reproduces the target's own distribution, and the test can tell.

A small "world" over an 8-token vocabulary: the target's and the draft's logits for the next token
are fixed tables of the last two tokens (`[8, 8, 8]`, different but correlated). Every builder grows
its tree from the draft table each round (through the same `expand` interface a draft model uses),
the target table scores the tree, and `verify_tree` walks it; rounds repeat until each of
N = 20,000 rows (one prompt, each row its own seed) has 3 new tokens. The joint of the first 3
tokens (512 cells) is compared with the target's exact joint, enumerated in float64 NumPy with an
independent implementation of temperature / top-k / top-p. Cells with expected count < 5 are
pooled; chi-square at alpha = 1e-3. Cells of probability 0 must never occur. Every broken variant
(defined here, not in the library) must fail the same test with p < 1e-6 at the same N.
Everything is seeded.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.verify import tree_rule
from specjax.trees import structure as trees
from specjax.core.sampling import Sampling, row_seeds
from specjax.trees.builders import build_tree
from specjax.trees.structure import TreeSpec
# The float64 oracle and the pooled chi-square of tests/exactness/test_exactness.py (same VOCAB and NEW).
from tests.exactness.test_exactness import chi_square_pvalue, numpy_distribution


VOCAB = 8
NEW = 3
N = 20_000
ALPHA = 1e-3
POWER_ALPHA = 1e-6

SETTINGS = {
    "t1": Sampling(temperature=1.0),
    "t0.7_topk3": Sampling(temperature=0.7, top_k=3),
    "t0.7_topp0.8": Sampling(temperature=0.7, top_p=0.8),
}

SPECS = {
    "static": TreeSpec("static", depth=3, width=2),
    "dynamic": TreeSpec("dynamic", depth=3, width=2, num_nodes=6),
    "ngram": TreeSpec("ngram", depth=3, width=3, max_ngram=2),
    "ngram_valid_first": TreeSpec("ngram", depth=3, width=3, max_ngram=2, widths=(3, 6)),
    "iid": TreeSpec("sampled", branching=(2, 2, 1), replacement=True),
    "without_replacement": TreeSpec("sampled", branching=(3, 2, 1), replacement=False),
}

_rng = np.random.default_rng(1234)
TARGET_TABLE = (1.4 * _rng.normal(size=(VOCAB, VOCAB, VOCAB))).astype(np.float32)
DRAFT_TABLE = (0.6 * TARGET_TABLE + 1.0 * _rng.normal(size=(VOCAB, VOCAB, VOCAB))).astype(
    np.float32)


def _chain(a, b, first_rank, length):
  out = []
  for i in range(length):
    c = int(np.argsort(-TARGET_TABLE[a, b])[first_rank if i == 0 else 0])
    out.append(c)
    a, b = b, c
  return out


# The prompt ends in (1, 2), which occurred twice before: once followed by the target's greedy
# continuation, once by a continuation starting with its second choice (n-gram trees branch).
PROMPT = [1, 2] + _chain(1, 2, 0, 3) + [1, 2] + _chain(1, 2, 1, 3) + [1, 2]


def table_expand(table, previous):
  """`expand` of a bigram-context table model: logits after each extended node."""
  table = jnp.asarray(table)

  def expand(ext_tokens, ext_parents, ext_depths):
    del ext_depths
    before = jnp.take_along_axis(ext_tokens, ext_parents, axis=1)
    before = before.at[:, 0].set(previous)  # the root's predecessor is in the sequence
    return table[before, ext_tokens]

  return expand


def chain_candidates(table, previous, root, depth, width):
  """Static trees: the draft's greedy chain, top-`width` candidates at each depth."""
  table = jnp.asarray(table)
  out = []
  a, b = previous, root
  for _ in range(depth):
    logits = table[a, b]
    out.append(jax.lax.top_k(logits, width)[1])
    a, b = b, out[-1][:, 0]
  return jnp.stack(out, axis=1)


def one_round(spec, sampling, rule, sequence, lengths, seeds):
  root = jnp.take_along_axis(sequence, (lengths - 1)[:, None], axis=1)[:, 0]
  previous = jnp.take_along_axis(sequence, (lengths - 2)[:, None], axis=1)[:, 0]
  tree = build_tree(spec, expand=table_expand(DRAFT_TABLE, previous), root=root,
                    sequence=sequence, lengths=lengths, sampling=sampling, seeds=seeds,
                    chain_candidates=lambda: chain_candidates(DRAFT_TABLE, previous, root,
                                                              spec.depth, spec.width))
  if spec.widths is not None:  # as the tree drafters do before choosing a verify width
    tree = trees.valid_first(tree)
  logits = table_expand(TARGET_TABLE, previous)(tree.ext_tokens(root), tree.ext_parents(),
                                                tree.ext_depths())
  result = tree_rule.verify_tree(logits, tree, rule=rule, sampling=sampling, seeds=seeds,
                                 positions=lengths, max_depth=spec.depth,
                                 max_children=spec.max_children)
  write = lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,))
  sequence = jax.vmap(write)(sequence, result.tokens, lengths)
  return sequence, lengths + result.num_accepted + 1, result.num_accepted


def run(spec, sampling, rule=None, seed=0):
  """Emits at least NEW tokens per row; returns the first NEW and the mean accepted per round."""
  step = jax.jit(functools.partial(one_round, spec, sampling, rule or spec.rule))  # fresh trace
  sequence = jnp.zeros((N, len(PROMPT) + NEW * (spec.depth + 1) + 1), jnp.int32)
  sequence = sequence.at[:, :len(PROMPT)].set(jnp.asarray(PROMPT, jnp.int32))
  lengths = jnp.full((N,), len(PROMPT), jnp.int32)
  seeds = row_seeds(jax.random.key(seed), N)
  accepted = []
  while int(jnp.min(lengths)) < len(PROMPT) + NEW:
    sequence, lengths, count = step(sequence, lengths, seeds)
    accepted.append(np.asarray(count))
  return np.asarray(sequence[:, len(PROMPT):len(PROMPT) + NEW]), np.mean(accepted[0])


def exact_joint(sampling) -> np.ndarray:
  probs = numpy_distribution(TARGET_TABLE, sampling)  # [prev, cur, next]
  a, b = PROMPT[-2], PROMPT[-1]
  p1 = probs[a, b]  # [x1]
  p2 = probs[b]  # [x1, x2]
  p3 = probs  # [x1, x2, x3]
  return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


@pytest.mark.parametrize("setting", [
    "t1", "t0.7_topk3", pytest.param("t0.7_topp0.8", marks=pytest.mark.slow)])
@pytest.mark.parametrize("builder", sorted(SPECS))
def test_tree_rule_matches_target_distribution(builder, setting):
  sampling = SETTINGS[setting]
  tokens, accepted = run(SPECS[builder], sampling)
  assert accepted > 0.1  # the tree is really used: some nodes are accepted
  pvalue = chi_square_pvalue(tokens, exact_joint(sampling))
  print(f"{builder} {setting}: p = {pvalue:.3g}, accepted per round {accepted:.2f}")
  assert pvalue > ALPHA


def test_greedy_is_argmax_path():
  """Greedy: every emitted token is the target table's argmax given the two before it."""
  spec = SPECS["dynamic"]
  tokens, _ = run(spec, Sampling(), seed=1)
  a, b = PROMPT[-2], PROMPT[-1]
  expected = []
  for _ in range(NEW):
    a, b = b, int(np.argmax(TARGET_TABLE[a, b]))
    expected.append(b)
  assert (tokens == np.asarray(expected)).all()


# Broken variants: each changes one step of the exact rules; the same test must reject them.

def test_no_renormalisation_of_q_after_rejected_sibling_is_detected(monkeypatch):
  monkeypatch.setattr(tree_rule, "remove_rejected", lambda s, token: s)
  sampling = SETTINGS["t1"]
  tokens, _ = run(SPECS["without_replacement"], sampling)
  pvalue = chi_square_pvalue(tokens, exact_joint(sampling))
  print(f"no renormalisation: p = {pvalue:.3g}")
  assert pvalue < POWER_ALPHA


def test_top_m_children_treated_as_sampled_is_detected():
  sampling = SETTINGS["t1"]
  tokens, _ = run(SPECS["dynamic"], sampling, rule="iid")
  pvalue = chi_square_pvalue(tokens, exact_joint(sampling))
  print(f"top-m as sampled: p = {pvalue:.3g}")
  assert pvalue < POWER_ALPHA


def test_one_stream_shared_by_drafting_and_verification_is_detected(monkeypatch):
  monkeypatch.setattr(trees, "PURPOSE_TREE_RESIDUAL", trees.PURPOSE_TREE_DRAFT)
  sampling = SETTINGS["t0.7_topk3"]  # frequent rejections: the correction reuses the draft noise
  tokens, _ = run(SPECS["iid"], sampling)
  pvalue = chi_square_pvalue(tokens, exact_joint(sampling))
  print(f"shared stream: p = {pvalue:.3g}")
  assert pvalue < POWER_ALPHA


def test_acceptance_threshold_below_one_is_detected(monkeypatch):
  monkeypatch.setattr(tree_rule, "accepts", lambda u, r_c, s_c: u * 0.8 * s_c < r_c)
  sampling = SETTINGS["t1"]
  tokens, _ = run(SPECS["iid"], sampling)
  pvalue = chi_square_pvalue(tokens, exact_joint(sampling))
  print(f"threshold 0.8: p = {pvalue:.3g}")
  assert pvalue < POWER_ALPHA


# End to end: `decode(..., tree=)` with real (tiny) transformer models, the tree forward, compaction
# and the per-row streams across rounds, against the target's exact joint (same N, same alpha).

@pytest.mark.slow
@pytest.mark.parametrize("builder", ["sampled_wor", "dynamic"])
def test_decode_tree_matches_target_distribution(builder):
  import specjax as sj
  from specjax.testing.models import tiny_config
  from specjax.models.transformer import forward
  
  target = sj.init_params(tiny_config(vocab_size=VOCAB), jax.random.key(10))
  draft = sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=1), jax.random.key(11))
  spec = {"sampled_wor": TreeSpec("sampled", branching=(2, 2), replacement=False),
          "dynamic": TreeSpec("dynamic", depth=2, width=2, num_nodes=4)}[builder]
  sampling = SETTINGS["t1"]
  prompt = [1, 2, 3, 1, 2, 3, 1]
  tokens = jnp.tile(jnp.asarray(prompt, jnp.int32), (N, 1))
  out = sj.decode(target, draft, tokens, jax.random.key(0), max_new_tokens=NEW, tree=spec,
                    sampling=sampling)
  assert np.all(np.asarray(out.num_tokens) == NEW)
  assert out.stats.summary()["accepted"] > 0
  grid = np.stack(np.meshgrid(*[np.arange(VOCAB)] * NEW, indexing="ij"), -1).reshape(-1, NEW)
  seqs = np.concatenate([np.tile(prompt, (len(grid), 1)), grid], axis=1)
  logits = np.asarray(forward(target, jnp.asarray(seqs, jnp.int32),
                              jnp.zeros(len(seqs), jnp.int32)).logits)
  joint = np.ones(len(grid))
  for i in range(NEW):
    joint *= numpy_distribution(logits[:, len(prompt) - 1 + i], sampling)[np.arange(len(grid)),
                                                                             grid[:, i]]
  pvalue = chi_square_pvalue(np.asarray(out.tokens), joint)
  print(f"decode(tree=) {builder}: p = {pvalue:.3g}")
  assert pvalue > ALPHA
