"""Long prompts: attention a tile at a time (`specjax.models.long_attention`) and the prefill in
chunks (`specjax.models.prefill`), the same math as the reference.

* `blockwise_attention` (the jnp path for TPU where the kernel does not fit, and for GPU) equals
  `attention_reference` over a cache and a block: ragged rows (a prefill from 0, a row with a
  cache before it), sliding windows, soft-capping, tiles that do not divide the lengths (the
  clamped last tile), grouped queries.
* `splash_attention` (the TPU kernel, in Pallas interpret mode here) equals it for causal blocks,
  with soft-capping and a non-power-of-two scale.
* `attention` sends only long blocks with a cache there, and on CPU keeps the reference: a
  forward over a 300-token prompt gives the logits of a forward that never takes the path.
* The chunked prefill (the loop off CPU) gives the one forward's cache, hidden state, taps and
  last-token logits, for ragged rows whose last tokens fall in different chunks (the clamped last
  chunk's overlap included); on CPU `prefill` is that one forward, bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import layers, long_attention, prefill
from specjax.models.transformer import forward, init_params
from specjax.testing.models import tiny_config

TOL = dict(rtol=1e-5, atol=2e-5)


def _problem(batch, length, cache_len, kv_heads, group, head_dim, starts, seed=0):
  """`(q, keys, values, k_pos, valid, q_pos)`: a cache segment (slots before each row's start
  valid) and the block at `starts .. starts + T - 1`, as the decoder's forward builds them."""
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (batch, length, kv_heads, group, head_dim))
  cache_k = jax.random.normal(ks[1], (batch, kv_heads, cache_len, head_dim))
  cache_v = jax.random.normal(ks[2], (batch, kv_heads, cache_len, head_dim))
  block_k = jax.random.normal(ks[3], (batch, kv_heads, length, head_dim))
  block_v = jax.random.normal(ks[4], (batch, kv_heads, length, head_dim))
  starts = jnp.asarray(starts, jnp.int32)
  q_pos = starts[:, None] + jnp.arange(length, dtype=jnp.int32)
  slots = jnp.broadcast_to(jnp.arange(cache_len, dtype=jnp.int32), (batch, cache_len))
  valid = (slots < starts[:, None])[:, None, :]
  return q, (cache_k, block_k), (cache_v, block_v), (slots, q_pos), (valid, None), q_pos


def _reference(q, keys, values, k_pos, valid, q_pos, window, scale, softcap):
  masks = []
  for kp, vd in zip(k_pos, valid):
    seen = (kp[:, None, :] <= q_pos[:, :, None]) & (
        (window == 0) | (kp[:, None, :] > q_pos[:, :, None] - window))
    masks.append(seen if vd is None else seen & vd)
  return layers.attention_reference(q, keys, values, masks, scale=scale, softcap=softcap)


@pytest.mark.parametrize("window,softcap,tile", [(0, None, 128), (50, None, 128), (0, 5.0, 64),
                                                 (64, 5.0, 96)])
def test_blockwise_attention_equals_the_reference(window, softcap, tile):
  # 300 queries and 333 cache slots: neither is a multiple of the tile (the last tile is clamped).
  args = _problem(2, 300, 333, 2, 3, 32, starts=(0, 120))
  scale = 32 ** -0.5
  want = _reference(*args, jnp.int32(window), scale, softcap)
  got = jax.jit(lambda: long_attention.blockwise_attention(
      *args, jnp.int32(window), scale=scale, softcap=softcap, tile=tile))()
  np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_splash_attention_equals_the_reference(softcap):
  q, keys, values, k_pos, valid, q_pos = _problem(2, 200, 150, 1, 4, 64, starts=(0, 97))
  scale = 256 ** -0.5 * 3  # not a power of two: the kernel takes pre-scaled queries
  want = _reference(q, keys, values, k_pos, valid, q_pos, jnp.int32(0), scale, softcap)
  got = long_attention.splash_attention(q, keys, values, valid, scale=scale, softcap=softcap,
                                        interpret=True)
  np.testing.assert_allclose(got, want, **TOL)


def test_only_long_blocks_with_a_cache_take_the_long_path():
  q = jnp.zeros((1, long_attention.LONG_BLOCK, 1, 1, 8))
  short = jnp.zeros((1, long_attention.LONG_BLOCK - 1, 1, 1, 8))
  cache = (None, None, None, jnp.zeros((1, 1, 16), bool))
  block = (None, None, None, None)
  tree = (None, None, None, jnp.zeros((1, long_attention.LONG_BLOCK, long_attention.LONG_BLOCK),
                                      bool))
  assert long_attention.is_long(q, [cache, block])
  assert not long_attention.is_long(short, [cache, block])  # a verify block, a decode step
  assert not long_attention.is_long(q, [block])  # the cache-free (training) pass
  assert not long_attention.is_long(q, [cache, tree])  # a per-query mask


def test_a_long_prefill_on_cpu_keeps_the_reference(monkeypatch):
  """The forward over a 300-token prompt (the long path's dispatch, CPU branch) gives the logits
  and cache of the same forward with the long path switched off."""
  config = tiny_config(max_len=512)
  model = init_params(config, jax.random.key(1))
  tokens = jax.random.randint(jax.random.key(2), (2, 300), 0, config.vocab_size)
  starts = jnp.zeros((2,), jnp.int32)
  run = lambda: jax.jit(lambda m, t: forward(m, t, starts, m.init_cache(2, 320)))(model, tokens)
  long = run()
  monkeypatch.setattr(layers.long_attention, "is_long", lambda q, segments: False)
  jax.clear_caches()
  plain = run()
  np.testing.assert_array_equal(long.logits, plain.logits)
  np.testing.assert_array_equal(long.cache.k, plain.cache.k)


def test_chunk_length():
  assert prefill.chunk_length(1, 8192) == 8192  # fits PREFILL_TOKENS: one forward
  assert prefill.chunk_length(1, 32_000) == 8192
  assert prefill.chunk_length(64, 3584) == 128
  assert prefill.chunk_length(256, 3584) == prefill.CHUNK_MULTIPLE  # never below one tile
  assert prefill.chunk_length(3, 4000) == 2688  # a multiple of 128


@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_the_chunked_prefill_equals_one_forward(layout, monkeypatch):
  config = tiny_config(max_len=512)
  model = init_params(config, jax.random.key(1))
  model = model if layout == "stacked" else model.unstacked()
  tokens = jax.random.randint(jax.random.key(2), (3, 300), 0, config.vocab_size)
  # Last tokens in the first chunk, in the clamped last chunk's overlap, and at the end.
  lengths = jnp.asarray([100, 200, 300], jnp.int32)
  features = dict(return_hidden=True, taps=(1, 2))
  monkeypatch.setattr(prefill, "PREFILL_TOKENS", 384)  # chunks of 128: starts 0, 128, 172
  assert prefill.chunk_length(3, 300) == 128
  cache = model.init_cache(3, 320)
  last = lengths - 1
  one = jax.jit(lambda m, t, c: m(t, jnp.zeros(3, jnp.int32), c, logits_at=last[:, None],
                                  **features))(model, tokens, cache)
  chunked = jax.jit(lambda m, t, c: prefill._chunked(m, t, c, last, chunk=128,
                                                     features=features))(model, tokens, cache)
  for a, b in ((chunked.logits, one.logits), (chunked.hidden, one.hidden),
               (chunked.taps, one.taps), (chunked.cache.stacked().k, one.cache.stacked().k),
               (chunked.cache.stacked().v, one.cache.stacked().v)):
    np.testing.assert_allclose(a, b, **TOL)
  np.testing.assert_array_equal(chunked.cache.lengths, one.cache.lengths)
  # On CPU the prefill is the one forward, bit for bit.
  cpu = jax.jit(lambda m, t, c: prefill.prefill(m, t, c, lengths, **features))(model, tokens,
                                                                              cache)
  np.testing.assert_array_equal(cpu.logits, one.logits)
  np.testing.assert_array_equal(cpu.cache.stacked().k, one.cache.stacked().k)
