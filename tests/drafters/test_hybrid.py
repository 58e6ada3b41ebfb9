"""`HybridDrafter`: prompt lookup in rows whose recent text repeats, a feature head elsewhere.

* Greedy decoding with the hybrid around an EAGLE-3 head and around Medusa heads, on a ragged
  batch over a 12-id vocabulary, returns exactly `sj.generate`'s tokens; lookup fires in some
  rounds and not in others (checked on the outputs), so both drafters are exercised.
* The head's state stays the target's: after decoding, its cache and carried output equal a fresh
  head forward over the target's features (the check of tests/drafters/test_heads.py), although lookup
  replaced many of its drafts.
* Sampled decoding (the harness of tests/exactness/test_heads_exactness.py: N = 20,000 rows, 3 tokens over 8
  ids, pooled chi-square against the exact joint, seeded, ALPHA = 1e-3) matches the target at
  T = 0.7 with top-k 5 / top-p 0.9 and at T = 1; a hybrid that forgets to replace the head's q by
  a point mass in lookup rows fails the same test at p < 1e-6.
* Adaptive length goes around it (greedy-identical, and at T = 0.7 by the same harness, which a
  copy choice that peeks at the head's current draw fails at p < 1e-6);
  around a hybrid it keeps the copy's counts apart from the head's (a greedy round by hand,
  checked against a slot-by-slot oracle); the calibration's copy counts are hand-worked.
  Bad arguments are refused.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.loop import draft_step, init_state, row_seeds, verify_block
from specjax.drafters.adaptive.drafter import AdaptiveDrafter
from specjax.drafters.hybrid import HybridDrafter
from specjax.drafters.ngram import lookup
from specjax.testing.models import tiny_config
from tests.exactness.test_exactness import ALPHA, POWER_ALPHA, PROMPT, chi_square_pvalue, exact_joint
from tests.drafters import test_heads
from tests.exactness import test_heads_exactness as hx


def lookup_outcomes(drafter: HybridDrafter, sequences, lengths, final_lengths) -> set[bool]:
  """Whether lookup finds a match at each prefix length a row passes through."""
  seen = set()
  for row, start, end in zip(np.asarray(sequences), np.asarray(lengths),
                             np.asarray(final_lengths)):
    for length in range(max(int(start), 1), int(end)):
      _, found = lookup(jnp.asarray(row), jnp.int32(length), 2, drafter.max_ngram, drafter.ngram)
      seen.add(bool(found))
  return seen


@pytest.fixture(scope="module")
def target():  # test_heads.py's tiny target (12 ids, 4 layers)
  return sj.init_params(tiny_config(vocab_size=test_heads.VOCAB, num_layers=4), jax.random.key(0))


def ragged_batch():  # test_heads.py's batch (one row a single-token prompt)
  tokens = jnp.array([[5, 9, 2, 7, 1, 3], [3, 0, 0, 0, 0, 0], [11, 4, 6, 4, 0, 0]], jnp.int32)
  return tokens, jnp.array([6, 1, 4], jnp.int32)


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_greedy_equals_generate_ragged_batch(target, kind):
  tokens, lengths = ragged_batch()
  expected = sj.generate(target, tokens, jax.random.key(0), lengths=lengths,
                         max_new_tokens=test_heads.MAX_NEW)
  drafter = HybridDrafter(test_heads.make_drafter(target, kind))
  out = sj.decode(target, drafter, tokens, jax.random.key(5), lengths=lengths,
                  max_new_tokens=test_heads.MAX_NEW, num_draft=test_heads.NUM_DRAFT)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_tokens, expected.num_tokens)
  full = np.zeros((tokens.shape[0], tokens.shape[1] + test_heads.MAX_NEW), np.int32)
  for b, length in enumerate(np.asarray(lengths)):
    full[b, :length] = np.asarray(tokens)[b, :length]
    full[b, length:length + test_heads.MAX_NEW] = np.asarray(out.tokens)[b]
  assert lookup_outcomes(drafter, full, lengths, lengths + test_heads.MAX_NEW) == {True, False}
  assert int(np.sum(out.stats.accepted)) > 0


def test_head_cache_holds_the_targets_features(target):
  tokens, lengths = ragged_batch()
  drafter = HybridDrafter(test_heads.make_drafter(target, "eagle3"))
  assert test_heads.features_mismatch(target, drafter, tokens, lengths) < 1e-4


def test_adaptive_length_wraps_the_hybrid(target):
  tokens, lengths = ragged_batch()
  expected = sj.generate(target, tokens, jax.random.key(0), lengths=lengths,
                         max_new_tokens=test_heads.MAX_NEW)
  k = test_heads.NUM_DRAFT
  drafter = AdaptiveDrafter(HybridDrafter(test_heads.make_drafter(target, "eagle3")), k,
                            (20.0, 24.0, 26.0, 28.0), (0.6, 0.5, 0.4))
  out = sj.decode(target, drafter, tokens, jax.random.key(5), lengths=lengths,
                  max_new_tokens=test_heads.MAX_NEW, num_draft=k)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_tokens, expected.num_tokens)


def copy_counts_oracle(copy, emitted, count, found, k):
  """`(reached, accepted)` per slot of one row's copy, by the rule in
  `specjax.drafters.adaptive.drafter`, looped
  slot by slot: slot j is reached when copies 0..j-1 equal the emitted tokens and j < count."""
  reached, accepted = np.zeros(k), np.zeros(k)
  if not found:
    return reached, accepted
  for j in range(min(k, count)):
    reached[j] = 1
    if copy[j] != emitted[j]:
      break
    accepted[j] = 1
  return reached, accepted


def test_adaptive_hybrid_copies_where_copies_held_and_keeps_counts_apart(target):
  """One greedy round by hand through `draft_step` / `verify_block`. Row 0's last 2 tokens recur
  and its copies have held (counts set by hand): it proposes its copy, as many tokens as the
  copy's estimate pays for. Row 1's also recur but its copies have failed: the head drafts.
  Row 2 has no match: the head drafts. Then the head's counts move only in rows 1 and 2, the
  copy's in rows 0 and 1 (row 1's from what the target emitted, its copy unproposed)."""
  k = test_heads.NUM_DRAFT
  tokens = jnp.array([[5, 9, 2, 7, 5, 9], [3, 8, 1, 4, 3, 8], [11, 4, 6, 1, 0, 0]], jnp.int32)
  lengths = jnp.array([6, 6, 4], jnp.int32)
  hybrid = HybridDrafter(test_heads.make_drafter(target, "eagle3"))
  drafter = AdaptiveDrafter(hybrid, k, (20.0, 21.0, 22.0, 40.0), (0.5, 0.5, 0.5),
                            copy_prior=(0.5, 0.5, 0.5))
  seeds = row_seeds(jax.random.key(0), 3)
  state = init_state(target, drafter, tokens, lengths, lengths + 8, jnp.int32(-1), seeds,
                        num_draft=k, capacity=16)
  held = jnp.array([[40.0, 40.0, 40.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
  reached = jnp.array([[40.0, 40.0, 40.0], [40.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
  start = dataclasses.replace(state.draft_state, copy_accepted=held, copy_reached=reached)
  state = dataclasses.replace(state, draft_state=start)
  before = state
  # Each piece jitted, as callers run them (eagerly every op of the round dispatches alone).
  state, proposal = jax.jit(lambda drafter, state: draft_step(
      drafter, state, num_draft=k, sampling=sj.Sampling()))(drafter, state)
  ds = state.draft_state
  np.testing.assert_array_equal(ds.found, [True, True, False])
  np.testing.assert_array_equal(ds.copied, [True, False, False])
  # Row 0's copies: what followed the earlier "5 9"; all held 40 of 40 times, so its estimate is
  # above 0.99 at every slot: about 3 tokens for 22 ms (k = 2) beats 4 for 40 ms (k = 3).
  np.testing.assert_array_equal(proposal.tokens[0], [2, 7, 5])
  assert int(proposal.num_drafted[0]) == 2
  state = jax.jit(lambda target, drafter, state, proposal: verify_block(
      target, drafter, state, proposal, sampling=sj.Sampling()))(target, drafter, state, proposal)
  after = state.draft_state
  emitted = np.asarray(state.tokens)
  count = np.asarray(state.lengths - before.lengths)
  for b in range(3):
    row = emitted[b, int(lengths[b]):int(lengths[b]) + int(count[b])]
    r, a = copy_counts_oracle(np.asarray(ds.copy_tokens[b]), row, int(count[b]),
                              bool(ds.found[b]), k)
    decay = np.where(r > 0, drafter.decay, 1.0)
    np.testing.assert_allclose(after.copy_reached[b], np.asarray(reached[b]) * decay + r)
    np.testing.assert_allclose(after.copy_accepted[b], np.asarray(held[b]) * decay + a)
  np.testing.assert_array_equal(after.reached[0], np.zeros(k))  # row 0 copied: head untouched
  assert float(after.reached[1, 0]) == 1.0 and float(after.reached[2, 0]) == 1.0
  assert float(after.copy_reached[1, 0]) > 40.0 * drafter.decay - 1e-6  # unproposed, observed


def test_lookup_counts_hand_worked(target):
  """Row 0: prompt 1 2 3 4, text 1 2 3 9 1 2. Matches at 2 of its 6 positions: after `1 2`
  (copies 3 4; the text goes on 3 9: slot 1 held, slot 2 not) and after `1 2 3` (copies 4 1,
  text 9 1: nothing held). Row 1: prompt 7 8, text 7 8 7: one match, after `7 8 7 8` (copies
  7 8, the text has only 7 left: slot 1 held, slot 2 past the end counts as wrong)."""
  from specjax.tuning.calibrate import lookup_counts
  hybrid = HybridDrafter(test_heads.make_drafter(target, "eagle3"))
  tokens = np.array([[1, 2, 3, 4], [7, 8, 0, 0]])
  new = np.array([[1, 2, 3, 9, 1, 2], [7, 8, 7, 0, 0, 0]])
  positions, accepted = lookup_counts(hybrid, tokens, [4, 2], new, [6, 3], 2)
  assert positions == 3
  np.testing.assert_array_equal(accepted, [2, 0])


def test_bad_arguments_are_refused(target):
  head = test_heads.make_drafter(target, "eagle3")
  draft_model = sj.init_params(tiny_config(vocab_size=test_heads.VOCAB), jax.random.key(1))
  with pytest.raises(ValueError, match="feature head"):
    HybridDrafter(sj.ModelDrafter(draft_model))
  with pytest.raises(ValueError, match="feature head"):
    HybridDrafter(sj.NGramDrafter())
  with pytest.raises(ValueError, match="ngram must be an int >= 1"):
    HybridDrafter(head, ngram=0)
  with pytest.raises(ValueError, match="max_ngram >= ngram"):
    HybridDrafter(head, ngram=3, max_ngram=2)
  tokens, lengths = ragged_batch()
  with pytest.raises(ValueError, match="pass its `.drafter`"):
    sj.decode(target, HybridDrafter(head), tokens, jax.random.key(0), lengths=lengths,
              max_new_tokens=4, tree=sj.TreeSpec(builder="static", depth=2, width=2))
  hybrid = HybridDrafter(head)
  assert hybrid.taps == head.taps and hybrid.vocab_size == head.vocab_size
  assert hybrid.head is head.head and hybrid.forwards_per_round(4) == 4


# ---------------------------------------------------------------------------------------------
# Sampled: the target's distribution, and a test that can tell.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForgetfulHybrid(HybridDrafter):
  """Copies lookup tokens but leaves the head's q in the proposal: verify divides by a q the
  draft was not drawn from."""

  def propose(self, state, sequence, lengths, *, num_draft, **kwargs):
    state, proposal = self.drafter.propose(state, sequence, lengths, num_draft=num_draft,
                                           **kwargs)
    copied, found = self.lookup(sequence, lengths, num_draft)
    tokens = jnp.where(found[:, None], copied, proposal.tokens)
    return state, dataclasses.replace(proposal, tokens=tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PeekingCopyChoice(HybridDrafter):
  """A broken copy choice: a row the adaptive wrapper sends to its copy drafts the head's tokens
  instead where the head's first draw is its own most likely token, a choice that depends on the
  current round's draw rather than on tokens already emitted."""

  def propose(self, state, sequence, lengths, *, num_draft, copy=None, **kwargs):
    _, head = self.drafter.propose(state, sequence, lengths, num_draft=num_draft, **kwargs)
    copied, rows = self.lookup(sequence, lengths, num_draft) if copy is None else copy
    rows = rows & (head.tokens[:, 0] != jnp.argmax(head.logits[:, 0], axis=-1))
    return super().propose(state, sequence, lengths, num_draft=num_draft, copy=(copied, rows),
                           **kwargs)


@pytest.fixture(scope="module")
def small_target():  # test_heads_exactness.py's target (8 ids, 4 layers)
  return sj.init_params(tiny_config(vocab_size=hx.VOCAB, num_layers=4), jax.random.key(10))


def sampled_pvalue(target, drafter, name):
  tokens, summary = hx.run(target, drafter, hx.SETTINGS[name])
  p = chi_square_pvalue(tokens, exact_joint(target, hx.SETTINGS[name]))
  print(f"{type(drafter).__name__} {name}: p = {p:.3g}, acceptance "
        f"{summary['acceptance_rate']:.3f}")
  return p, tokens, summary


# `slow`, both settings: CI's slow step runs the hybrid through the exactness harness at T = 0.7
# with top-k / top-p, with copied drafts verified with the head's q as its broken variant.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["t0.7_topk5_topp0.9", "t1"])
def test_hybrid_matches_target_distribution(small_target, name):
  drafter = HybridDrafter(hx.make_eagle(small_target, "eagle3"))
  p, tokens, summary = sampled_pvalue(small_target, drafter, name)
  assert 0.05 < summary["acceptance_rate"] < 0.95
  # Both drafters drafted: the prompt's last tokens recur (lookup in round 1), and after one
  # round some rows' last 2 tokens have no earlier occurrence (the head drafts).
  n = len(PROMPT)
  rows = np.concatenate([np.tile(PROMPT, (200, 1)), tokens[:200]], axis=1)
  assert lookup_outcomes(drafter, rows, np.full(200, n), np.full(200, n + 1)) == {True}
  assert False in lookup_outcomes(drafter, rows, np.full(200, n + 1), np.full(200, n + 3))
  assert p > ALPHA


@pytest.mark.slow  # ~20 s; the adaptive rule's own chi-square runs by default (test_adaptive_rows)
def test_adaptive_hybrid_matches_target_distribution(small_target):
  """Adaptive length around the hybrid at T = 0.7, top-k 5 / top-p 0.9: copies trusted at first
  (copy prior 0.9, head prior 0.3), so round 1 copies in every row (the prompt's last tokens
  recur) and later rounds choose between copy and head from what round 1 showed."""
  k = hx.NUM_DRAFT
  drafter = AdaptiveDrafter(HybridDrafter(hx.make_eagle(small_target, "eagle3")), k,
                            (10.0, 10.5, 11.0), (0.3,) * k, copy_prior=(0.9,) * k)
  p, _, summary = sampled_pvalue(small_target, drafter, "t0.7_topk5_topp0.9")
  assert 0.05 < summary["acceptance_rate"] < 0.95
  assert p > ALPHA


@pytest.mark.slow  # a power check: CI runs it in its slow step
def test_head_q_in_lookup_rows_is_detected(small_target):
  drafter = ForgetfulHybrid(hx.make_eagle(small_target, "eagle3"))
  p, _, _ = sampled_pvalue(small_target, drafter, "t1")
  assert p < POWER_ALPHA


@pytest.mark.slow  # a power check: CI runs it in its slow step
def test_adaptive_copy_choice_that_peeks_at_the_round_is_detected(small_target):
  """The adaptive wrapper's copy choice must read only emitted tokens: the same wrapper and
  priors as the test above, with a copy choice that looks at the head's current draw, fail the
  same harness (N = 20,000, p < 1e-6) under the same sampling."""
  k = hx.NUM_DRAFT
  drafter = AdaptiveDrafter(PeekingCopyChoice(hx.make_eagle(small_target, "eagle3")), k,
                            (10.0, 10.5, 11.0), (0.3,) * k, copy_prior=(0.9,) * k)
  p, _, _ = sampled_pvalue(small_target, drafter, "t0.7_topk5_topp0.9")
  assert p < POWER_ALPHA
