"""A draft model's KV cache in 8-bit floats (`sj.ModelDrafter(model, cache_dtype=...)`).

The cache holds half a bfloat16 cache's bytes (what lets the batch-64 Qwen pair and the Llama pair
fit a 16 GiB v5e chip, `benchmarks.tpu_memory`'s `decode-fp8`). What is checked here, on CPU:

- a write clips entries into the 8-bit type's range, where a plain cast gives NaN;
- a dtype the cache cannot hold (integers, which would need scales) is refused before compiling;
- the drafter's cache really is 8-bit, on stacked and unstacked draft models and on the shared
  prompt of a self-drafter, and its q differs from the full-precision cache's (the option is
  live), by little;
- greedy `decode` with it equals `generate` token for token (the verify keeps the target's
  output whatever the drafter's q). The sampled chi-square and its broken twin are in
  tests/exactness/test_exactness.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.core.cache import CACHE_DTYPES, check_cache_dtype, to_cache
from specjax.testing.models import tiny_config

VOCAB = 64
FP8 = ("float8_e4m3fn", "float8_e5m2")


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=2), jax.random.key(0))


@pytest.fixture(scope="module")
def draft():
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=1), jax.random.key(1))


def _prompt():
  tokens = jax.random.randint(jax.random.key(2), (3, 11), 0, VOCAB)
  return tokens, jnp.array([11, 4, 8], jnp.int32)


def test_a_write_clips_into_range_where_a_plain_cast_gives_nan():
  x = jnp.array([1000.0, -1000.0, 1.3, 0.0], jnp.float32)
  got = np.asarray(to_cache(x, jnp.float8_e4m3fn).astype(jnp.float32))
  np.testing.assert_array_equal(got, [448.0, -448.0, 1.25, 0.0])
  # The twin: the cast alone turns the out-of-range entries into NaN (so the clip is needed).
  plain = np.asarray(x.astype(jnp.float8_e4m3fn).astype(jnp.float32))
  assert np.isnan(plain[:2]).all()
  # Wider caches are a plain cast.
  np.testing.assert_array_equal(np.asarray(to_cache(x, jnp.bfloat16).astype(jnp.float32)),
                                np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)))


@pytest.mark.parametrize("bad", ["int8", jnp.int4, "uint8", "float64x", 3])
def test_a_cache_dtype_it_cannot_hold_is_refused(draft, bad):
  with pytest.raises(ValueError, match="cache_dtype must be None or one of"):
    sj.ModelDrafter(draft, cache_dtype=bad)


def test_cache_dtypes_are_kept_by_name(draft):
  assert check_cache_dtype(jnp.float8_e4m3fn) == "float8_e4m3fn"
  assert set(FP8) < set(CACHE_DTYPES)
  drafter = sj.ModelDrafter(draft, cache_dtype=jnp.bfloat16)
  assert drafter.cache_dtype == "bfloat16"
  # Static: a pytree round trip keeps it.
  again = jax.tree.unflatten(*reversed(jax.tree.flatten(drafter)))
  assert again.cache_dtype == "bfloat16"


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("stacked", [True, False])
def test_the_draft_cache_is_8bit_and_greedy_decode_equals_generate(target, dtype, stacked):
  # The target itself drafts, over its 8-bit cache: most drafts are accepted, not all.
  model = target if stacked else target.unstacked()
  tokens, lengths = _prompt()
  drafter = sj.ModelDrafter(model, cache_dtype=dtype)
  cache = drafter.init(tokens, lengths, 48)
  full = sj.ModelDrafter(model).init(tokens, lengths, 48)
  leaves = jax.tree.leaves((cache.k, cache.v))
  assert {x.dtype for x in leaves} == {jnp.dtype(dtype)}
  assert (sum(x.nbytes for x in leaves) * 4
          == sum(x.nbytes for x in jax.tree.leaves((full.k, full.v))))  # float32 -> 8 bits
  want = sj.generate(target, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=24)
  out = sj.decode(target, drafter, tokens, jax.random.key(3), lengths=lengths,
                  max_new_tokens=24, num_draft=4)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
  summary = out.stats.summary()
  assert summary["accepted"] > 0, summary


@pytest.mark.parametrize("stacked", [True, False])
def test_the_8bit_cache_moves_q_by_little(draft, stacked):
  """The draft model's next-token logits after a prompt, over its cache in float32 and in
  float8_e4m3fn: different (the option is live), within a small fraction of their spread."""
  model = draft if stacked else draft.unstacked()
  tokens, lengths = _prompt()
  step = jnp.array([[5], [9], [17]], jnp.int32)

  def logits(dtype):
    cache = sj.ModelDrafter(model, cache_dtype=dtype).init(tokens, lengths, 48)
    # `init` leaves the last prompt token unfed: feed it and one more token.
    fed = jnp.concatenate([jnp.take_along_axis(tokens, lengths[:, None] - 1, 1), step], 1)
    return np.asarray(model(fed, cache.lengths, cache).logits, np.float64)

  full, narrow = logits(None), logits("float8_e4m3fn")
  assert np.abs(full - narrow).max() > 0
  p, q = (np.exp(x - x.max(-1, keepdims=True)) for x in (full, narrow))
  p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
  total_variation = 0.5 * np.abs(p - q).sum(-1)
  assert total_variation.max() < 0.05, total_variation


def test_a_self_drafter_copies_the_shared_prompt_into_its_8bit_cache(target):
  tokens, lengths = _prompt()
  drafter = dataclasses.replace(sj.self_drafter(target, bits=8), cache_dtype="float8_e4m3fn")
  assert drafter.share_prompt
  out = sj.decode(target, drafter, tokens, jax.random.key(4), lengths=lengths,
                  max_new_tokens=20, num_draft=3)
  want = sj.generate(target, tokens, jax.random.key(4), lengths=lengths, max_new_tokens=20)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
  # The copy: the target's prefilled cache, clipped and cast, not the draft model's own prefill.
  from specjax.models.prefill import prefill  # noqa: PLC0415
  shared = prefill(target, tokens, target.init_cache(3, 48), lengths)
  cache = drafter.init(tokens, lengths, 48, prefill=shared)
  assert cache.k.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(np.asarray(cache.k.astype(jnp.float32)),
                                np.asarray(to_cache(shared.cache.k, jnp.float8_e4m3fn)
                                           .astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(lengths) - 1)


def test_a_draft_model_tree_keeps_the_8bit_cache(target):
  tokens, lengths = _prompt()
  spec = sj.TreeSpec("static", depth=3, width=2)
  drafter = sj.ModelDrafter(target, cache_dtype="float8_e4m3fn")
  from specjax.drafters.tree import tree_drafter  # noqa: PLC0415
  tree = tree_drafter(target, drafter, spec)
  assert tree.cache_dtype == "float8_e4m3fn"
  assert tree.init(tokens, lengths, 48, None).k.dtype == jnp.float8_e4m3fn
  out = sj.decode(target, drafter, tokens, jax.random.key(5), lengths=lengths,
                  max_new_tokens=20, tree=spec)
  want = sj.generate(target, tokens, jax.random.key(5), lengths=lengths, max_new_tokens=20)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
