"""`return_logprobs`: each new token's log-probability under the target, from the verify's logits.

The reference is one cache-free forward of the target over prompt + new tokens: at every new
token, `log_softmax(logits / T)[token]` over the whole vocabulary (T = 1 when greedy, no top-k /
top-p). `decode` (chain drafters, a tree, verify widths) and `generate` must return it to float32
rounding, 0 past each row's end, and nothing (None) unless asked.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.core.sampling import token_logprobs
from specjax.testing.models import tiny_config

VOCAB = 61


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=VOCAB), jax.random.key(0))


@pytest.fixture(scope="module")
def batch():
  tokens = jnp.array([[5, 9, 2, 7, 1, 3], [3, 8, 0, 0, 0, 0], [11, 4, 6, 4, 0, 0]], jnp.int32)
  return tokens, jnp.array([6, 2, 4], jnp.int32)


def _reference(target, batch, out, sampling):
  """The target's log-probabilities of `out`'s new tokens, from one forward per row."""
  tokens, lengths = batch
  want = np.zeros(out.tokens.shape, np.float32)
  for b in range(tokens.shape[0]):
    n, start = int(out.num_tokens[b]), int(lengths[b])
    row = np.concatenate([np.asarray(tokens[b, :start]), np.asarray(out.tokens[b, :n])])
    logits = target(jnp.asarray(row[None]), jnp.zeros((1,), jnp.int32)).logits[0]
    want[b, :n] = token_logprobs(logits[start - 1:start - 1 + n], jnp.asarray(row[start:]),
                                 sampling)
  return want


SETTINGS = [sj.Sampling(), sj.Sampling(temperature=1.0),
            sj.Sampling(temperature=0.7, top_k=20, top_p=0.9)]


@pytest.mark.parametrize("sampling", SETTINGS, ids=["greedy", "t1", "t0.7_topk_topp"])
def test_generate_returns_the_target_logprobs(target, batch, sampling):
  tokens, lengths = batch
  out = sj.generate(target, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=10,
                    sampling=sampling, eos_id=7, return_logprobs=True)
  assert out.logprobs.shape == out.tokens.shape and out.logprobs.dtype == jnp.float32
  np.testing.assert_allclose(out.logprobs, _reference(target, batch, out, sampling), atol=2e-5)


@pytest.mark.parametrize("drafter,sampling", [("self_int8", SETTINGS[2]), ("ngram", SETTINGS[0]),
                                              ("confidence", SETTINGS[1])],
                         ids=["self_int8-t0.7_topk_topp", "ngram-greedy", "confidence-t1"])
def test_decode_returns_the_verify_logprobs(target, batch, sampling, drafter):
  tokens, lengths = batch
  draft, widths = {"self_int8": (sj.self_drafter(target, bits=8), None),
                   "ngram": (sj.NGramDrafter(), None),
                   "confidence": (sj.ModelDrafter(sj.quantize(target, 4), confidence=0.5),
                                  (2, 3))}[drafter]
  out = sj.decode(target, draft, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=12,
                  num_draft=4, sampling=sampling, eos_id=7, verify_widths=widths,
                  return_logprobs=True)
  assert out.logprobs.shape == out.tokens.shape
  np.testing.assert_allclose(out.logprobs, _reference(target, batch, out, sampling), atol=2e-5)
  # Past each row's end: 0.
  index = np.arange(out.tokens.shape[1])[None]
  assert np.all(np.asarray(out.logprobs)[index >= np.asarray(out.num_tokens)[:, None]] == 0)


def test_a_tree_decode_returns_the_logprobs_of_its_path(target, batch):
  tokens, lengths = batch
  sampling = sj.Sampling(temperature=0.8)
  out = sj.decode(target, sj.quantize(target, 8), tokens, jax.random.key(4), lengths=lengths,
                  max_new_tokens=12, sampling=sampling,
                  tree=sj.TreeSpec("sampled", depth=3, width=2), return_logprobs=True)
  np.testing.assert_allclose(out.logprobs, _reference(target, batch, out, sampling), atol=2e-5)


def test_logprobs_only_where_asked(target, batch):
  tokens, lengths = batch
  assert sj.generate(target, tokens, jax.random.key(0), lengths=lengths,
                     max_new_tokens=4).logprobs is None
  out = sj.decode(target, sj.NGramDrafter(), tokens, jax.random.key(0), lengths=lengths,
                  max_new_tokens=4)
  assert out.logprobs is None
  # Asking does not change the tokens.
  asked = sj.decode(target, sj.NGramDrafter(), tokens, jax.random.key(0), lengths=lengths,
                    max_new_tokens=4, return_logprobs=True)
  np.testing.assert_array_equal(asked.tokens, out.tokens)
