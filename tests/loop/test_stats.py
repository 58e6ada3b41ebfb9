"""`DecodeStats` count what was emitted, and flag rows whose target logits were not finite.

The counts are checked against counts recomputed from the emitted tokens alone. With the target as
its own drafter at temperature 0 every draft is accepted, so a row's rounds emit `D + 1` tokens
each (`D` = k, or a tree's depth along its top-1 spine) until the last one, which a stop token or
`max_new_tokens` may cut: the last round of a row that emitted `n` tokens emits `r = n - (rounds -
1)(D + 1)` of them, and when `r <= D` all of them are drafts and no target token is emitted. The
drafts after the cut were accepted by the rule but never emitted, and must not be counted.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.testing.models import tiny_config

VOCAB = 61
K = 4
TREE = sj.TreeSpec("static", depth=3, width=2)  # a top-1 spine: draft = target accepts it all


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=VOCAB), jax.random.key(0))


@pytest.fixture(scope="module")
def batch():
  tokens = jnp.array([[5, 9, 2, 7, 1, 3], [3, 8, 0, 0, 0, 0], [11, 4, 6, 4, 0, 0]], jnp.int32)
  return tokens, jnp.array([6, 2, 4], jnp.int32)


def _recount(num_tokens, depth):
  """Per-row stats recomputed from the emitted token counts alone, every draft accepted."""
  n = np.asarray(num_tokens)
  rounds = -(-n // (depth + 1))
  last = n - (rounds - 1) * (depth + 1)
  kept_last = np.minimum(last, depth)  # a cut round emits drafts only
  per_position = np.stack([rounds - 1 + (kept_last > j) for j in range(depth)], axis=1)
  return dict(rounds=rounds, accepted=(rounds - 1) * depth + kept_last,
              accepted_per_position=per_position, emitted=n)


def _check(out, depth, expected_tokens):
  np.testing.assert_array_equal(out.tokens, expected_tokens)  # greedy identity: all accepted
  stats = out.stats
  expected = _recount(out.num_tokens, depth)
  for name, value in expected.items():
    np.testing.assert_array_equal(getattr(stats, name), value, err_msg=name)
  # Not vacuous: some row's last round was cut before its last draft, so a count of the rule's
  # acceptances (every draft of every round) would differ.
  assert np.any(expected["accepted"] < expected["rounds"] * depth)
  summary = stats.summary()
  n = np.asarray(out.num_tokens)
  assert summary["emitted"] == int(n.sum())
  assert summary["tokens_per_round"] == pytest.approx(n.sum() / expected["rounds"].sum())
  np.testing.assert_allclose(stats.mean_accepted_length, n / expected["rounds"], rtol=1e-6)
  assert summary["nonfinite"] == 0 and not np.any(stats.nonfinite)


def _decode(target, batch, **kwargs):
  tokens, lengths = batch
  return sj.decode(target, target, tokens, jax.random.key(3), lengths=lengths, **kwargs)


def _generate(target, batch, **kwargs):
  tokens, lengths = batch
  return sj.generate(target, tokens, jax.random.key(0), lengths=lengths, **kwargs)


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_a_round_cut_at_max_new_tokens_counts_only_its_emitted_drafts(target, batch, tree):
  depth = K if tree is None else TREE.depth
  max_new = 2 * (depth + 1) + 2  # the third round emits 2 of its drafts
  shape = dict(num_draft=K) if tree is None else dict(tree=tree)
  out = _decode(target, batch, max_new_tokens=max_new, **shape)
  np.testing.assert_array_equal(out.num_tokens, [max_new] * 3)
  _check(out, depth, _generate(target, batch, max_new_tokens=max_new).tokens)
  if tree is None:
    np.testing.assert_array_equal(out.stats.drafted, out.stats.rounds * K)


def _eos_cutting_a_round(tokens, depth):
  """A token whose first occurrence in row 0 of `tokens` ends a round early (`r < depth`)."""
  row = [int(t) for t in np.asarray(tokens)[0]]
  for index, token in enumerate(row):
    if row.index(token) == index and 1 <= (index + 1) % (depth + 1) < depth and index > depth:
      return token
  raise AssertionError(f"no token of {row} stops row 0 inside a round")


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_a_round_cut_at_eos_counts_only_its_emitted_drafts(target, batch, tree):
  depth = K if tree is None else TREE.depth
  eos = _eos_cutting_a_round(_generate(target, batch, max_new_tokens=24).tokens, depth)
  expected = _generate(target, batch, max_new_tokens=24, eos_id=eos)
  shape = dict(num_draft=K) if tree is None else dict(tree=tree)
  out = _decode(target, batch, max_new_tokens=24, eos_id=eos, **shape)
  assert int(out.num_tokens[0]) < 24 and int(out.tokens[0, int(out.num_tokens[0]) - 1]) == eos
  np.testing.assert_array_equal(out.num_tokens, expected.num_tokens)
  _check(out, depth, expected.tokens)


def _with_nan(model, token=None):
  """All weights NaN, or (with `token`) only that token's embedding row."""
  if token is None:
    return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), model)
  params = dict(model.params, embed=model.params["embed"].at[token].set(jnp.nan))
  return dataclasses.replace(model, params=params)


def test_an_all_nan_target_is_flagged_eagerly_and_inside_a_callers_jit(target, batch):
  broken = _with_nan(target)
  tokens, lengths = batch
  out = sj.decode(broken, target, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=8,
                  num_draft=K)
  np.testing.assert_array_equal(out.stats.nonfinite, [True] * 3)
  assert out.stats.summary()["nonfinite"] == 3

  @jax.jit
  def flags(model, tokens, lengths):
    return sj.decode(model, target, tokens, jax.random.key(3), lengths=lengths,
                     max_new_tokens=8, num_draft=K).stats.nonfinite

  np.testing.assert_array_equal(flags(broken, tokens, lengths), [True] * 3)
  np.testing.assert_array_equal(flags(target, tokens, lengths), [False] * 3)
  plain = sj.generate(broken, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=8)
  np.testing.assert_array_equal(plain.stats.nonfinite, [True] * 3)


def test_only_the_rows_that_read_a_broken_weight_are_flagged(target):
  tokens = jnp.array([[5, 9, 2, 7], [3, 8, 6, 0], [11, 4, 6, 4]], jnp.int32)
  lengths = jnp.array([4, 3, 4], jnp.int32)
  clean = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12)
  seen = set(np.asarray(tokens).ravel().tolist()) | set(np.asarray(clean.tokens).ravel().tolist())
  unused = min(set(range(1, VOCAB)) - seen)
  tokens = tokens.at[1, 1].set(unused)  # row 1 reads the NaN embedding row; rows 0, 2 never do
  broken = _with_nan(target, unused)
  out = sj.decode(broken, target, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=12,
                  num_draft=K)
  np.testing.assert_array_equal(out.stats.nonfinite, [False, True, False])
  np.testing.assert_array_equal(out.tokens[::2], clean.tokens[::2])
  tree = sj.decode(broken, target, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=12,
                   tree=TREE)
  np.testing.assert_array_equal(tree.stats.nonfinite, [False, True, False])
  np.testing.assert_array_equal(clean.stats.nonfinite, [False] * 3)
  plain = sj.generate(broken, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=12)
  np.testing.assert_array_equal(plain.stats.nonfinite, [False, True, False])


def test_generate_flags_a_row_whose_logits_break_inside_its_loop(target):
  """The prefill's logits are finite; a token the row samples later reads a NaN embedding row,
  so only the loop's steps see NaN logits (and only in that row)."""
  tokens = jnp.array([[5, 9, 2, 7], [3, 8, 6, 0], [11, 4, 6, 4]], jnp.int32)
  lengths = jnp.array([4, 3, 4], jnp.int32)
  clean = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12)
  rows = [set(np.asarray(tokens[i, :int(lengths[i])]).tolist())
          | set(np.asarray(clean.tokens[i]).tolist()) for i in range(3)]
  row0 = np.asarray(clean.tokens[0]).tolist()
  # A token row 0 samples (and then feeds back) before its last step, never in rows 1 and 2.
  later = next(t for i, t in enumerate(row0[:-1]) if t not in row0[:i] and t not in rows[1]
               and t not in rows[2] and t not in np.asarray(tokens[0]).tolist())
  out = sj.generate(_with_nan(target, later), tokens, jax.random.key(0), lengths=lengths,
                    max_new_tokens=12)
  np.testing.assert_array_equal(out.stats.nonfinite, [True, False, False])
  np.testing.assert_array_equal(out.tokens[1:], clean.tokens[1:])
