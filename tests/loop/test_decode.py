"""Speculative decoding: greedy identity, ragged acceptance, EOS, determinism, recompilation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import Proposal
from specjax.loop import DecodeStats, draft_step, init_state, round_step, row_seeds, verify_block
from specjax.loop.decode import NEW_TOKEN_BUCKET
from specjax.testing.models import tiny_config
from specjax.core.tracing import TRACE_COUNTS

VOCAB = 61


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


def _greedy(target, batch, max_new=24, eos_id=None):
  tokens, lengths = batch
  return sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=max_new,
                     eos_id=eos_id)


@pytest.mark.parametrize("num_draft", [1, 2, 4, 7])
def test_greedy_equals_generate_with_random_draft(target, draft, batch, num_draft):
  tokens, lengths = batch
  expected = _greedy(target, batch)
  out = sj.decode(target, draft, tokens, jax.random.key(5), lengths=lengths, max_new_tokens=24,
                  num_draft=num_draft)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_tokens, expected.num_tokens)
  stats = out.stats
  np.testing.assert_array_equal(stats.drafted, stats.rounds * num_draft)
  # Every round yields accepted drafts plus one target token (the last round may be cut).
  assert np.all(np.asarray(stats.accepted + stats.rounds) >= 24)
  np.testing.assert_array_equal(stats.accepted_per_position.sum(1), stats.accepted)
  np.testing.assert_array_equal(stats.target_calls, stats.rounds + 1)
  np.testing.assert_array_equal(stats.draft_calls, stats.rounds * num_draft)


@pytest.mark.parametrize("num_draft", [1, 4, 7])
def test_draft_equal_to_target_accepts_everything(target, batch, num_draft):
  tokens, lengths = batch
  expected = _greedy(target, batch)
  out = sj.decode(target, target, tokens, jax.random.key(5), lengths=lengths, max_new_tokens=24,
                  num_draft=num_draft)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.stats.accepted, out.stats.drafted)
  rounds = -(-24 // (num_draft + 1))  # each round yields k + 1 tokens
  np.testing.assert_array_equal(out.stats.rounds, [rounds] * 3)


def test_ngram_drafter_greedy_identity_on_repetitive_prompts(target):
  pattern = [7, 3, 9, 12, 3]
  tokens = jnp.array([pattern * 4, (pattern * 4)[:12] + [0] * 8], jnp.int32)
  lengths = jnp.array([20, 12], jnp.int32)
  expected = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=40)
  for num_draft in (2, 4, 7):
    out = sj.decode(target, sj.NGramDrafter(max_ngram=3), tokens, jax.random.key(0),
                    lengths=lengths, max_new_tokens=40, num_draft=num_draft)
    np.testing.assert_array_equal(out.tokens, expected.tokens)
    np.testing.assert_array_equal(out.stats.draft_calls, [0, 0])


def test_ngram_lookup_proposes_the_continuation_of_the_latest_match():
  drafter = sj.NGramDrafter(max_ngram=2, min_ngram=1)
  #                    0  1  2  3  4  5  6  7  8  9
  seq = jnp.array([[4, 5, 6, 1, 4, 5, 2, 8, 4, 5, 0, 0, 0, 0]], jnp.int32)
  _, proposal = drafter.propose((), seq, jnp.array([10]), num_draft=3,
                                sampling=sj.Sampling(), seeds=None)
  # Suffix [4, 5] last occurred at 4..5 (followed by 2, 8, 4), more recently than at 0..1.
  assert proposal.tokens.tolist() == [[2, 8, 4]]
  assert proposal.logits is None
  # Only a 1-gram match: suffix [9]; 9 occurs at slot 1, followed by 3, 7, 9, then the end of
  # the text: the copy goes on with the period of the match (9 3 7 | 9 3 7 ...).
  seq = jnp.array([[2, 9, 3, 7, 9, 0, 0, 0]], jnp.int32)
  _, proposal = drafter.propose((), seq, jnp.array([5]), num_draft=5, sampling=sj.Sampling(),
                                seeds=None)
  assert proposal.tokens.tolist() == [[3, 7, 9, 3, 7]]
  # A match right before the end: `8 1 2 1 2` has its suffix [1, 2] two tokens back, so the
  # text continues with period 2.
  seq = jnp.array([[8, 1, 2, 1, 2, 0, 0, 0]], jnp.int32)
  _, proposal = drafter.propose((), seq, jnp.array([5]), num_draft=5, sampling=sj.Sampling(),
                                seeds=None)
  assert proposal.tokens.tolist() == [[1, 2, 1, 2, 1]]
  # No match at all: the last token repeated.
  seq = jnp.array([[1, 2, 3, 0, 0]], jnp.int32)
  _, proposal = drafter.propose((), seq, jnp.array([3]), num_draft=2, sampling=sj.Sampling(),
                                seeds=None)
  assert proposal.tokens.tolist() == [[3, 3]]


def test_ragged_acceptance_rows_advance_independently(target, draft, batch):
  """One round, built by hand through the public pieces: rows accept 3, 0 and 1 drafts."""
  tokens, lengths = batch
  expected = _greedy(target, batch, max_new=8).tokens
  k = 3
  seeds = row_seeds(jax.random.key(0), 3)
  drafter = sj.ModelDrafter(draft)
  state = init_state(target, drafter, tokens, lengths, jnp.int32(8), jnp.int32(-1), seeds,
                        num_draft=k, capacity=NEW_TOKEN_BUCKET)
  wrong = (expected + 1) % VOCAB
  drafts = jnp.stack([expected[0, :3],
                      jnp.array([wrong[1, 0], expected[1, 1], expected[1, 2]]),
                      jnp.array([expected[2, 0], wrong[2, 1], expected[2, 2]])])
  # The pieces run jitted, as callers run them (eagerly every op of a round dispatches alone).
  verify = jax.jit(lambda target, drafter, state, proposal: verify_block(
      target, drafter, state, proposal, sampling=sj.Sampling()))
  propose = jax.jit(lambda drafter, state: draft_step(drafter, state, num_draft=k,
                                                         sampling=sj.Sampling()))
  state = verify(target, drafter, state, Proposal(drafts, None))
  np.testing.assert_array_equal(state.stats.accepted, [3, 0, 1])
  np.testing.assert_array_equal(state.lengths - lengths, [4, 1, 2])
  for b, count in enumerate([4, 1, 2]):
    start = int(lengths[b])
    np.testing.assert_array_equal(state.tokens[b, start:start + count], expected[b, :count])
  np.testing.assert_array_equal(state.target_cache.lengths, state.lengths - 1)
  # Keep going with the draft model from this ragged state: still exactly greedy.
  for _ in range(8):
    state, proposal = propose(drafter, state)
    state = verify(target, drafter, state, proposal)
  assert bool(jnp.all(state.done))
  for b in range(3):
    start = int(lengths[b])
    np.testing.assert_array_equal(state.tokens[b, start:start + 8], expected[b])


def test_eos_stops_one_row_while_others_continue(target, draft, batch):
  tokens, lengths = batch
  free = _greedy(target, batch)
  eos = int(free.tokens[1, 5])
  expected = _greedy(target, batch, eos_id=eos)
  assert int(expected.num_tokens[1]) <= 6
  out = sj.decode(target, draft, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=24,
                  num_draft=4, eos_id=eos)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_tokens, expected.num_tokens)
  assert int(out.num_tokens.max()) > int(out.num_tokens[1])  # someone kept going
  for b in range(3):  # each row alone gives the same answer
    alone = sj.decode(target, draft, tokens[b:b + 1, :int(lengths[b])], jax.random.key(0),
                      max_new_tokens=24, num_draft=4, eos_id=eos)
    np.testing.assert_array_equal(alone.tokens[0], out.tokens[b])


def test_several_stop_ids(target, draft, batch):
  tokens, lengths = batch
  free = _greedy(target, batch)
  stops = (int(free.tokens[0, 2]), int(free.tokens[2, 4]))
  expected = _greedy(target, batch, eos_id=stops)
  for b, row in enumerate(np.asarray(free.tokens).tolist()):
    first = min([row.index(s) + 1 for s in stops if s in row] + [24])
    assert int(expected.num_tokens[b]) == first
  out = sj.decode(target, draft, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=24,
                  num_draft=3, eos_id=list(stops))
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_tokens, expected.num_tokens)
  with pytest.raises(ValueError, match="empty sequence"):
    sj.decode(target, draft, tokens, jax.random.key(0), lengths=lengths, eos_id=[])


def test_sampled_decode_is_seeded_and_bit_identical(target, draft, batch):
  tokens, lengths = batch
  sampling = sj.Sampling(temperature=0.8, top_k=20, top_p=0.9)
  run = lambda seed: sj.decode(target, draft, tokens, jax.random.key(seed), lengths=lengths,
                               max_new_tokens=30, num_draft=3, sampling=sampling)
  a, b, c = run(11), run(11), run(12)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  for field in dataclasses.fields(DecodeStats):
    np.testing.assert_array_equal(getattr(a.stats, field.name), getattr(b.stats, field.name))
  assert not np.array_equal(a.tokens, c.tokens)


def test_decode_traces_once_per_shape_bucket(target, draft, batch):
  tokens, lengths = batch
  before = TRACE_COUNTS["decode"]
  for new, seed in [(5, 0), (33, 1), (64, 2)]:
    sj.decode(target, draft, tokens, jax.random.key(seed), lengths=lengths, max_new_tokens=new,
              num_draft=3, sampling=sj.Sampling(1.0), eos_id=seed + 1)
  assert TRACE_COUNTS["decode"] - before == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_draft=0), "num_draft must be >= 1"),
    (dict(num_draft=2.0), "num_draft must be an int"),
    (dict(max_new_tokens=300), "exceeds the target's context"),
    (dict(verify_impl="fast"), "verify_impl"),
    (dict(sampling=sj.Sampling(1.0), rng="seed"), "PRNG key"),
])
def test_decode_rejects_bad_input_before_compiling(target, draft, batch, kwargs, message):
  tokens, lengths = batch
  rng = kwargs.pop("rng", jax.random.key(0))
  before = TRACE_COUNTS["decode"]
  with pytest.raises(ValueError, match=message):
    sj.decode(target, draft, tokens, rng, lengths=lengths, **kwargs)
  assert TRACE_COUNTS["decode"] == before


def test_decode_rejects_vocab_mismatch_and_short_draft_context(target, batch):
  tokens, lengths = batch
  other = sj.init_params(tiny_config(vocab_size=VOCAB + 1), jax.random.key(2))
  with pytest.raises(ValueError, match=r"draft vocabulary \(62\) does not match the target's \(61\)"):
    sj.decode(target, other, tokens, jax.random.key(0), lengths=lengths)
  short = sj.init_params(tiny_config(vocab_size=VOCAB, max_len=32), jax.random.key(2))
  with pytest.raises(ValueError, match="exceeds the draft's context of 32"):
    sj.decode(target, short, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=40)
  with pytest.raises(ValueError, match="draft must be"):
    sj.decode(target, "tiny", tokens, jax.random.key(0), lengths=lengths)


def test_streaming_decode_validates_like_decode(target, batch):
  from specjax.loop.stream import decode_stream
  tokens, lengths = batch
  other = sj.init_params(tiny_config(vocab_size=VOCAB + 1), jax.random.key(2))
  with pytest.raises(ValueError, match="draft vocabulary"):
    next(decode_stream(target, other, tokens, jax.random.key(0), lengths=lengths))
  with pytest.raises(ValueError, match="verify_impl"):
    next(decode_stream(target, target, tokens, jax.random.key(0), lengths=lengths,
                       verify_impl="fast"))


REPRO_SAMPLINGS = [sj.Sampling(temperature=1.0), sj.Sampling(temperature=0.7, top_k=5)]


def _slot_five_batch(prompt, key, rng_seed=100):
  """A batch of 8 with `prompt` and `key` in slot 5 and different prompts and keys elsewhere."""
  others = np.array(jax.random.randint(jax.random.key(rng_seed), (8, 6), 1, VOCAB), np.int32)
  lengths = np.array([6, 3, 5, 2, 6, 0, 4, 1], np.int32)
  others[5] = 0
  others[5, :len(prompt)] = prompt
  lengths[5] = len(prompt)
  keys = jax.random.split(jax.random.key(rng_seed + 1), 8)
  keys = keys.at[5].set(key)
  return others, lengths, keys


@pytest.mark.costly
@pytest.mark.parametrize("sampling", REPRO_SAMPLINGS, ids=str)
def test_sampled_tokens_depend_on_the_rows_own_key_not_its_slot(target, draft, sampling):
  """Same prompt and key in slot 0 of a batch of 1 and in slot 5 of a batch of 8: same tokens."""
  prompt, key = [5, 9, 2, 7], jax.random.key(42)
  common = dict(max_new_tokens=20, num_draft=3, sampling=sampling)
  alone = sj.decode(target, draft, np.array([prompt], np.int32), key[None],
                    lengths=np.array([4], np.int32), **common)
  tokens, lengths, keys = _slot_five_batch(prompt, key)
  crowded = sj.decode(target, draft, tokens, keys, lengths=lengths, **common)
  np.testing.assert_array_equal(crowded.tokens[5], alone.tokens[0])
  # Power: the rows are not all the same stream (a different key changes the tokens).
  other = sj.decode(target, draft, np.array([prompt], np.int32), jax.random.key(43)[None],
                    lengths=np.array([4], np.int32), **common)
  assert not np.array_equal(other.tokens[0], alone.tokens[0])
  # One key for the whole batch gives row b the stream of fold_in(key, b).
  folded = sj.decode(target, draft, np.array([prompt], np.int32),
                     jax.random.fold_in(key, 0)[None], lengths=np.array([4], np.int32), **common)
  single = sj.decode(target, draft, np.array([prompt], np.int32), key,
                     lengths=np.array([4], np.int32), **common)
  np.testing.assert_array_equal(folded.tokens, single.tokens)


def test_rng_must_be_one_key_or_one_per_row(target, draft, batch):
  tokens, lengths = batch
  with pytest.raises(ValueError, match="array of 3 keys"):
    sj.decode(target, draft, tokens, jax.random.split(jax.random.key(0), 2), lengths=lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _TapReader(sj.ModelDrafter):
  """A ModelDrafter that asks for target taps and the final hidden state and records what the
  loop hands it: the prefill's features in `init`, the verified block's in `observe`."""

  taps = (0, 2)
  needs_hidden = True

  def init(self, tokens, lengths, buffer_len, prefill=None):
    cache = super().init(tokens, lengths, buffer_len, prefill)
    return cache, prefill.taps[:, :, -1], prefill.hidden[:, -1], jnp.zeros_like(lengths)

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds):
    cache, taps, hidden, seen = state
    cache, proposal = super().propose(cache, sequence, lengths, num_draft=num_draft,
                                      sampling=sampling, seeds=seeds)
    return (cache, taps, hidden, seen), proposal

  def observe(self, state, scored, block, emitted, count, lengths):
    cache, _, _, seen = state
    k = block.shape[1] - 1
    assert scored.taps.shape[2] == k + 1 and scored.hidden.shape[1] == k + 1 == emitted.shape[1]
    return cache, scored.taps[:, :, 0], scored.hidden[:, 0], seen + count


def test_drafter_protocol_gets_prefill_and_verified_features(target, draft, batch):
  tokens, lengths = batch
  drafter = _TapReader(draft)
  seeds = row_seeds(jax.random.key(0), 3)
  # The pieces jitted, as the loop runs them (eagerly every op dispatches alone).
  state = jax.jit(lambda target, drafter, tokens, lengths, seeds: init_state(
      target, drafter, tokens, lengths, jnp.int32(8), jnp.int32(-1), seeds, num_draft=3,
      capacity=NEW_TOKEN_BUCKET))(target, drafter, tokens, lengths, seeds)
  _, taps, hidden, _ = state.draft_state
  embed = target.config.embed_dim
  features = jax.jit(lambda target, tokens: target(
      tokens, jnp.zeros((3,), jnp.int32), taps=(0, 2), return_hidden=True))
  prefill = features(target, tokens)
  np.testing.assert_allclose(taps, prefill.taps[:, :, -1], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(hidden, prefill.hidden[:, -1], rtol=1e-6, atol=1e-6)
  before = state.lengths
  state = jax.jit(lambda target, drafter, state: round_step(
      target, drafter, state, num_draft=3, sampling=sj.Sampling()))(target, drafter, state)
  _, taps, hidden, seen = state.draft_state
  # The target's features at the block's first slot (the row's last token before the round).
  last = jnp.take_along_axis(state.tokens, (before - 1)[:, None], axis=1)
  full = features(target, state.tokens[:, :int(before.max())])
  expected = jnp.take_along_axis(full.hidden, (before - 1)[:, None, None], axis=1)[:, 0]
  np.testing.assert_allclose(hidden, expected, rtol=1e-4, atol=1e-4)
  del last, embed
  np.testing.assert_array_equal(seen, state.lengths - before)  # observe saw each row's count
  # The loop's tokens are unchanged by what the drafter reads.
  out = sj.decode(target, drafter, tokens, jax.random.key(0), lengths=lengths,
                  max_new_tokens=12, num_draft=3)
  np.testing.assert_array_equal(out.tokens, _greedy(target, batch, max_new=12).tokens)
  np.testing.assert_array_equal(out.stats.draft_calls, out.stats.rounds * 3)


def test_stream_equals_decode_and_donates_the_state(target, draft, batch):
  from specjax.loop.stream import decode_stream
  tokens, lengths = batch
  sampling = sj.Sampling(temperature=0.8, top_k=10)
  out = sj.decode(target, draft, tokens, jax.random.key(7), lengths=lengths, max_new_tokens=16,
                  num_draft=3, sampling=sampling)
  stream = decode_stream(target, draft, tokens, jax.random.key(7), lengths=lengths,
                         max_new_tokens=16, num_draft=3, sampling=sampling)
  rows = [[] for _ in range(3)]
  previous = None
  for new, state in stream:
    if previous is not None:
      assert previous.target_cache.k.is_deleted()  # the last round's state was donated
    previous = state
    for b in range(3):
      rows[b] += new[b].tolist()
  for b in range(3):
    assert rows[b] == np.asarray(out.tokens[b, :out.num_tokens[b]]).tolist()


@pytest.mark.parametrize("same,num_draft", [(True, 5), (False, 3)],
                         ids=["draft=target-k5", "other-k3"])
def test_a_rope_model_decodes_to_its_full_context(same, num_draft):
  """Prompt + max_new_tokens = max_len for a rotary-position model: nothing is reserved (its
  positions are computed, `finite_past_max_len`), the last round scores drafts past the context,
  and the tokens equal `generate`'s."""
  config = tiny_config(vocab_size=VOCAB, max_len=32)
  target = sj.init_params(config, jax.random.key(0))
  draft = target if same else sj.init_params(config, jax.random.key(5))
  # 14 new tokens = the prefill's token, 2 full rounds of k + 1 = 6, and one token to go: the last
  # round scores k = 5 drafts past it, 4 of them past the context.
  tokens = jax.random.randint(jax.random.key(3), (2, 18), 1, VOCAB, jnp.int32)
  expected = sj.generate(target, tokens, jax.random.key(0), max_new_tokens=14)
  out = sj.decode(target, draft, tokens, jax.random.key(0), max_new_tokens=14,
                  num_draft=num_draft)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  assert not np.any(np.asarray(out.stats.nonfinite))
  if same:
    assert int(np.max(out.stats.rounds)) == 3
