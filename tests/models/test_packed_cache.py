"""A stacked cache stores heads narrower than 128 lanes several to a row (`head_pack`), and
attention reads them as they lie: the same numbers as the unpacked cache.

A tiny stacked model with head_dim 16 and 8 key/value heads (so `head_pack` = 8: one 128-wide row
per slot) is run with its packed cache `[L, B, 1, S, 128]` and with an unpacked `[L, B, 8, S, 16]`
cache of the same model: a prefill, then decode steps and a verify block (short blocks through
`attention_reference`'s packed products), and a long prompt (at least `LONG_BLOCK` rows, where the
packed segment is unpacked for the long-block path). Logits must agree to float32 rounding, the
packed cache must hold the unpacked cache's entries (re-laid out; equal to float32 rounding), and greedy `decode`
must give `generate`'s tokens on ragged prompts. A broken packing (heads interleaved the other
way round) must not match.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import specjax as sj
from specjax.core.cache import KVCache, head_pack, match_block, unpack_heads
from specjax.models.prefill import prefill
from specjax.models.transformer import init_params
from specjax.testing.models import tiny_config

HEAD_DIM, KV_HEADS = 16, 8


@pytest.fixture(scope="module")
def model():
  config = tiny_config(vocab_size=96, embed_dim=64, num_heads=16, num_kv_heads=KV_HEADS,
                       head_dim=HEAD_DIM, max_len=512)
  return init_params(config, jax.random.key(3))


def _unpacked_cache(model, batch, slots):
  c = model.config
  return KVCache.create(c.num_layers, batch, slots, c.num_kv_heads, c.head_dim, jnp.float32)


def test_head_pack():
  assert head_pack(KV_HEADS, HEAD_DIM) == 8
  assert head_pack(2, 64) == 2 and head_pack(8, 64) == 2  # Qwen2.5-0.5B, Llama-3.2-1B
  assert head_pack(3, 64) == 1  # SmolLM2-135M: 3 heads do not pair
  assert head_pack(2, 128) == 1 and head_pack(1, 256) == 1 and head_pack(4, 96) == 1


def test_packed_cache_shape(model):
  cache = model.init_cache(2, 40)
  assert cache.k.shape == (2, 2, 1, 64, 128)  # 40 slots rounded to 64, 8 heads of 16 in a row


def _run(model, cache, tokens, lengths):
  """Prefill, three single-token steps, then a 4-token block: every step's logits."""
  first = prefill(model, tokens, cache, lengths)
  logits, cache = [first.logits], first.cache.with_lengths(lengths)
  rng = np.random.default_rng(0)
  starts = jnp.asarray(lengths)
  for width in (1, 1, 1, 4):
    block = jnp.asarray(rng.integers(0, 96, (tokens.shape[0], width)), jnp.int32)
    step = model(block, starts, cache)
    logits.append(step.logits)
    cache, starts = step.cache, starts + width
  return logits, cache


@pytest.mark.parametrize("prompt", [9, 130])  # a short prompt, and one past LONG_BLOCK rows
def test_packed_equals_unpacked(model, prompt):
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, 96, (2, prompt)), jnp.int32)
  lengths = jnp.asarray([prompt, prompt - 3], jnp.int32)
  packed = model.init_cache(2, prompt + 16)
  assert packed.k.shape[2] == 1  # really packed
  plain = _unpacked_cache(model, 2, packed.max_len)
  got, got_cache = _run(model, packed, tokens, lengths)
  want, want_cache = _run(model, plain, tokens, lengths)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)
  for layer in range(model.config.num_layers):  # later layers' entries carry earlier rounding
    np.testing.assert_allclose(np.asarray(unpack_heads(got_cache.k[layer], HEAD_DIM)),
                               np.asarray(want_cache.k[layer]), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(unpack_heads(got_cache.v[layer], HEAD_DIM)),
                               np.asarray(want_cache.v[layer]), rtol=2e-5, atol=2e-5)


def test_broken_packing_is_caught(model):
  """Heads written into a row in the other order (head j of group c at lanes of `p - 1 - j`):
  the same test's comparison fails."""
  block = jnp.arange(2 * 3 * KV_HEADS * HEAD_DIM, dtype=jnp.float32).reshape(
      2, 3, KV_HEADS, HEAD_DIM)
  buffer = jnp.zeros((2, 1, 5, KV_HEADS * HEAD_DIM))
  right = match_block(block, buffer)
  wrong = match_block(block[:, :, ::-1], buffer)
  assert np.array_equal(np.asarray(unpack_heads(right.swapaxes(1, 2), HEAD_DIM)),
                        np.asarray(block.swapaxes(1, 2)))
  assert not np.array_equal(np.asarray(unpack_heads(wrong.swapaxes(1, 2), HEAD_DIM)),
                            np.asarray(block.swapaxes(1, 2)))


def test_greedy_decode_equals_generate_with_packed_caches(model):
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(0, 96, (3, 12)), jnp.int32)
  lengths = jnp.asarray([12, 7, 10], jnp.int32)
  draft = init_params(model.config, jax.random.key(4))  # packed too: same widths
  want = sj.generate(model, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=20)
  got = sj.decode(model, draft, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=20,
                  num_draft=3)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
