"""On-device autoregressive generation: batching, EOS, recompilation, sampling sets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.loop import row_seeds
from specjax.core.tracing import TRACE_COUNTS
from specjax.testing.models import tiny_config
from specjax.models.transformer import forward


@pytest.fixture(scope="module")
def model():
  return sj.init_params(tiny_config(vocab_size=61), jax.random.key(0))


def _batch():
  tokens = jnp.array([[5, 9, 2, 7, 1], [3, 8, 0, 0, 0], [11, 4, 6, 0, 0]], jnp.int32)
  return tokens, jnp.array([5, 2, 3], jnp.int32)


def _reference_greedy(model, prompt, steps):
  """Greedy by repeated full forward passes (no cache): the simplest possible oracle."""
  seq = list(prompt)
  for _ in range(steps):
    logits = forward(model, jnp.array([seq], jnp.int32), jnp.zeros(1, jnp.int32)).logits
    seq.append(int(jnp.argmax(logits[0, -1])))
  return seq[len(prompt):]


@pytest.mark.slow  # ~1 min; the default selection keeps the other greedy identities
def test_greedy_batch_equals_each_row_alone_and_full_forward_oracle(model):
  tokens, lengths = _batch()
  out = sj.generate(model, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12)
  assert out.tokens.shape == (3, 12)
  np.testing.assert_array_equal(out.num_tokens, [12, 12, 12])
  for b in range(3):
    prompt = tokens[b:b + 1, :int(lengths[b])]
    alone = sj.generate(model, prompt, jax.random.key(0), max_new_tokens=12)
    np.testing.assert_array_equal(out.tokens[b], alone.tokens[0])
    assert out.tokens[b].tolist() == _reference_greedy(model, prompt[0].tolist(), 12)


def test_eos_stops_a_row_and_pads(model):
  tokens, lengths = _batch()
  free = sj.generate(model, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=10)
  eos = int(free.tokens[1, 3])  # the 4th token row 1 emits
  out = sj.generate(model, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=10,
                    eos_id=eos, pad_id=60)
  for b in range(3):
    row = free.tokens[b].tolist()
    stop = row.index(eos) + 1 if eos in row else 10
    assert int(out.num_tokens[b]) == stop
    assert out.tokens[b, :stop].tolist() == row[:stop]
    assert all(t == 60 for t in out.tokens[b, stop:].tolist())
  assert int(out.num_tokens[1]) <= 4


def test_traces_once_per_shape_bucket(model):
  tokens, lengths = _batch()
  before = TRACE_COUNTS["generate"]
  sampling = sj.Sampling(temperature=0.9, top_k=7)
  for new, seed in [(3, 0), (17, 1), (40, 2), (64, 3)]:  # one bucket of 64
    sj.generate(model, tokens, jax.random.key(seed), lengths=lengths, max_new_tokens=new,
                sampling=sampling, eos_id=seed)
  assert TRACE_COUNTS["generate"] - before == 1
  sj.generate(model, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=65,
              sampling=sampling)
  assert TRACE_COUNTS["generate"] - before == 2  # the next bucket


def test_sampling_is_reproducible_and_seed_dependent(model):
  tokens, lengths = _batch()
  sampling = sj.Sampling(temperature=1.0)
  a = sj.generate(model, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=20,
                  sampling=sampling)
  b = sj.generate(model, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=20,
                  sampling=sampling)
  c = sj.generate(model, tokens, jax.random.key(4), lengths=lengths, max_new_tokens=20,
                  sampling=sampling)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)


@pytest.mark.parametrize("sampling", [sj.Sampling(1.5, top_k=3), sj.Sampling(1.5, top_p=0.5),
                                      sj.Sampling(2.0, top_k=5, top_p=0.6)])
def test_top_k_top_p_never_leave_the_allowed_set(model, sampling):
  tokens, lengths = _batch()
  out = sj.generate(model, tokens, jax.random.key(5), lengths=lengths, max_new_tokens=24,
                    sampling=sampling)
  for b in range(3):
    seq = jnp.concatenate([tokens[b, :int(lengths[b])], out.tokens[b]])[None]
    # jitted (eagerly the forward ran op by op)
    logits = jax.jit(forward)(model, seq, jnp.zeros(1, jnp.int32)).logits[0]
    logits = logits / sampling.temperature
    start = int(lengths[b]) - 1
    for i, token in enumerate(out.tokens[b].tolist()):
      step = np.asarray(logits[start + i], np.float64)
      order = np.sort(step)[::-1]
      allowed = np.ones_like(step, bool)
      if sampling.top_k:
        allowed &= step >= order[sampling.top_k - 1] - 1e-4
      if sampling.top_p:
        kept = np.where(allowed, step, -np.inf)
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        sorted_probs = np.sort(probs)[::-1]
        cutoff = np.searchsorted(np.cumsum(sorted_probs), sampling.top_p - 1e-6)
        allowed &= probs >= sorted_probs[min(cutoff, len(probs) - 1)] - 1e-5
      assert allowed[token], (b, i, token)


def test_sample_token_frequencies_match_softmax():
  """The Gumbel race samples the warped distribution: chi-square, 40k draws, alpha = 1e-3."""
  from scipy import stats as scipy_stats
  logits = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
  n = 40_000
  seeds = row_seeds(jax.random.key(123), n)  # [n] one stream per draw
  draws = sj.core.sampling.sample_token(jnp.broadcast_to(logits, (n, 6)), sj.Sampling(1.0), seeds,
                                   jnp.zeros(n, jnp.int32))
  counts = np.bincount(np.asarray(draws), minlength=6)
  expected = np.asarray(jax.nn.softmax(logits), np.float64)
  expected = expected / expected.sum() * n
  assert scipy_stats.chisquare(counts, expected).pvalue > 1e-3
  # Power check: the same counts are far from a wrong distribution (temperature 2).
  wrong = np.asarray(jax.nn.softmax(logits / 2), np.float64)
  wrong = wrong / wrong.sum() * n
  assert scipy_stats.chisquare(counts, wrong).pvalue < 1e-6


@pytest.mark.parametrize("sampling", [sj.Sampling(temperature=1.0),
                                      sj.Sampling(temperature=0.7, top_k=5)], ids=str)
def test_sampled_tokens_depend_on_the_rows_own_key_not_its_slot(model, sampling):
  """Same prompt and key in slot 0 of a batch of 1 and in slot 5 of a batch of 8: same tokens."""
  vocab = model.vocab_size
  prompt, key = [5, 9, 2, 7], jax.random.key(42)
  alone = sj.generate(model, np.array([prompt], np.int32), key[None],
                      lengths=np.array([4], np.int32), max_new_tokens=20, sampling=sampling)
  tokens = np.array(jax.random.randint(jax.random.key(100), (8, 6), 1, vocab), np.int32)
  lengths = np.array([6, 3, 5, 2, 6, 4, 4, 1], np.int32)
  tokens[5] = 0
  tokens[5, :4] = prompt
  keys = jax.random.split(jax.random.key(101), 8).at[5].set(key)
  crowded = sj.generate(model, tokens, keys, lengths=lengths, max_new_tokens=20,
                        sampling=sampling)
  np.testing.assert_array_equal(crowded.tokens[5], alone.tokens[0])
  other = sj.generate(model, np.array([prompt], np.int32), jax.random.key(43)[None],
                      lengths=np.array([4], np.int32), max_new_tokens=20, sampling=sampling)
  assert not np.array_equal(other.tokens[0], alone.tokens[0])  # power: keys matter
