"""The TPU cache attention kernel's numbers (Pallas interpret mode, on CPU) and its dispatch.

`specjax.kernels.cache_attention.cache_attention` attends one layer of a stacked `[L, B, C, S, E]`
cache over the live slots `slot < starts[b]` only (the key/value block index clamped to the row's
last live block) and returns flash-decoding partials, which `specjax.models.layers.merge_cache_partials` combines with the block
segment's scores. Checked here:

  * a hand-worked case: zero queries weigh every visible slot alike;
  * the partials against `cache_attention_reference` (jnp over every slot), and the merged result
    against `specjax.models.layers.attention_reference` over the cache and the block, for float32
    and bfloat16 caches, packed (`p = 2` heads per row) and not, ragged starts (0, 1, just under,
    at and just over a block boundary, mid-block), a decode step (T = 1), a chain's verify block
    (T = 5) and a tree (T = 6) whose per-query ancestor mask lies on the block segment, grouped
    queries (G > 1), a sliding window and a soft-cap, a layer other than the first;
  * the schedule's fetch count (`fetched_slots`) and the VMEM-driven block choice;
  * `layers.attention` with `stacked_cache` lowers to the reference on CPU (numbers bit for bit
    as without it) and to the kernel when lowered for TPU.
"""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from specjax.kernels import cache_attention as ca
from specjax.models import layers
from specjax.models.layers import attention, attention_reference

# Tolerances against the reference: float32 rounding; bfloat16 caches also round the
# probabilities to bfloat16 (normalised after the product in the kernel, before it in the
# reference).
# An 8-bit float cache is widened to the queries' float32 on both sides: float32's tolerance.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float8_e4m3fn: 2e-5}
SCALE = 0.125
BLOCK = 128  # 3 blocks of the 384-slot caches below
SLOTS, LAYERS = 384, 2
STARTS = (0, 1, 127, 128, 129, 300)  # ragged: empty, one slot, around a block boundary, mid-block


def _case(dtype, t, pack, *, kvh=2, g=3, d=64, seed=0, starts=STARTS):
  rng = np.random.default_rng(seed)
  b = len(starts)
  groups = kvh // pack
  q = jnp.asarray(rng.normal(size=(b, t, kvh, g, d)), jnp.float32)
  keys = jnp.asarray(rng.normal(size=(LAYERS, b, groups, SLOTS, pack * d)), dtype)
  values = jnp.asarray(rng.normal(size=(LAYERS, b, groups, SLOTS, pack * d)), dtype)
  block_k = jnp.asarray(rng.normal(size=(b, kvh, t, d)), dtype)
  block_v = jnp.asarray(rng.normal(size=(b, kvh, t, d)), dtype)
  starts = jnp.asarray(starts, jnp.int32)
  return q, keys, values, block_k, block_v, starts


def _tree_mask(t):
  """A small tree's ancestor mask (node 0 the root; 1, 2 its children; 3 under 1; 4, 5 under 2)."""
  parent = [-1, 0, 0, 1, 2, 2][:t]
  mask = np.eye(t, dtype=bool)
  for node in range(t):
    up = parent[node]
    while up >= 0:
      mask[node, up] = True
      up = parent[up]
  return mask


def _expected(q, keys, values, block_k, block_v, starts, q_pos, block_mask, *, layer, window,
              softcap):
  """`attention_reference` over the cache layer (unpacked) and the block, with `attention`'s
  masks."""
  from specjax.core.cache import unpack_heads  # pylint: disable=import-outside-toplevel
  d = q.shape[-1]
  cache_k, cache_v = unpack_heads(keys[layer], d), unpack_heads(values[layer], d)
  slot = jnp.arange(SLOTS)
  seen = (slot[None, None] <= q_pos[:, :, None]) & (slot[None, None] < starts[:, None, None])
  seen &= (window == 0) | (slot[None, None] > q_pos[:, :, None] - window)
  return attention_reference(q, [cache_k, block_k], [cache_v, block_v], [seen, block_mask],
                             scale=SCALE, softcap=softcap)


def _merged(partials, q, block_k, block_v, block_mask, softcap):
  from specjax.models.layers import _scores  # pylint: disable=import-outside-toplevel
  scores = _scores(q, block_k) * SCALE
  if softcap is not None:
    scores = softcap * jnp.tanh(scores / softcap)
  scores = jnp.where(block_mask[:, None, None], scores, -jnp.inf)
  return layers.merge_cache_partials(partials, scores, block_v, q.shape[-1])


def test_zero_queries_average_the_visible_slots():
  # q = 0: every score is 0, so m = 0, l = (visible slots) and acc = their values' sum.
  # Row 0: starts 3 -> slots 0, 1, 2; row 1: starts 130 with a window of 4 at position 131 ->
  # slots 128, 129 (slot > 131 - 4 = 127 and < 130).
  values = jnp.arange(2 * 1 * 1 * 256 * 8, dtype=jnp.float32).reshape(1, 2, 1, 256, 8)
  keys = jnp.ones_like(values)
  q = jnp.zeros((2, 1, 1, 1, 8), jnp.float32)
  starts = jnp.asarray([3, 130], jnp.int32)
  m, l, acc = ca.cache_attention(q, keys, values, starts, jnp.asarray([[3], [131]]), window=4,
                                 scale=1.0, block=BLOCK, interpret=True)
  np.testing.assert_array_equal(np.asarray(m).ravel(), [0.0, 0.0])
  np.testing.assert_array_equal(np.asarray(l).ravel(), [3.0, 2.0])
  np.testing.assert_array_equal(acc[0, 0, 0, 0], values[0, 0, 0, 0:3].sum(0))
  np.testing.assert_array_equal(acc[1, 0, 0, 0], values[0, 1, 0, 128:130].sum(0))


CASES = [  # dtype, T, pack, tree, window, softcap
    (jnp.float32, 1, 1, False, 0, None),
    (jnp.float32, 5, 2, False, 0, None),
    (jnp.bfloat16, 1, 2, False, 0, None),
    (jnp.bfloat16, 5, 1, False, 0, None),
    (jnp.float32, 6, 1, True, 0, None),
    (jnp.float32, 5, 1, False, 100, 20.0),
    (jnp.float8_e4m3fn, 1, 2, False, 0, None),
    (jnp.float8_e4m3fn, 5, 1, False, 0, None),
]


@pytest.mark.parametrize("dtype,t,pack,tree,window,softcap", CASES)
def test_kernel_matches_the_reference(dtype, t, pack, tree, window, softcap):
  q, keys, values, block_k, block_v, starts = _case(dtype, t, pack)
  layer = 1
  if tree:  # a tree's nodes sit at starts + depth
    depth = jnp.asarray([0, 1, 1, 2, 2, 2][:t], jnp.int32)
    q_pos = starts[:, None] + depth
    block_mask = jnp.broadcast_to(jnp.asarray(_tree_mask(t)), (len(STARTS), t, t))
  else:
    q_pos = starts[:, None] + jnp.arange(t, dtype=jnp.int32)
    block_mask = q_pos[:, None, :] <= q_pos[:, :, None]
  run = functools.partial(ca.cache_attention, layer=layer, window=window, scale=SCALE,
                          softcap=softcap)
  partials = run(q, keys, values, starts, q_pos, block=BLOCK, interpret=True)
  want_partials = layers.cache_attention_reference(q, keys, values, starts, q_pos, layer=layer,
                                               window=window, scale=SCALE, softcap=softcap)
  m, l, acc = (np.asarray(x) for x in partials)
  want_m, want_l, want_acc = (np.asarray(x) for x in want_partials)
  np.testing.assert_array_equal(np.isneginf(m), np.isneginf(want_m))
  assert np.isneginf(m[0]).all() and not np.isneginf(m[1:]).any()  # starts 0: nothing visible
  finite = ~np.isneginf(want_m)
  np.testing.assert_allclose(m[finite], want_m[finite], rtol=TOL[dtype], atol=TOL[dtype])
  np.testing.assert_allclose(l, want_l, rtol=TOL[dtype], atol=TOL[dtype])
  np.testing.assert_allclose(acc, want_acc, rtol=TOL[dtype], atol=TOL[dtype] * 10)
  got = _merged(partials, q, block_k, block_v, block_mask, softcap)
  want = _expected(q, keys, values, block_k, block_v, starts, q_pos, block_mask, layer=layer,
                   window=window, softcap=softcap)
  assert got.shape == want.shape == q.shape[:1] + q.shape[2:4] + q.shape[1:2] + q.shape[4:]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=TOL[dtype],
                             atol=TOL[dtype])


def test_schedule_fetches_blocks_up_to_the_last_live_one():
  assert [ca.fetched_slots(live, 2048, 512) for live in (0, 1, 512, 513, 1024, 4096)] == [
      512, 512, 512, 1024, 1024, 2048]


def test_the_block_follows_the_budget():
  # Qwen2.5 1.5B (2 heads of 128) at a verify block of 7 and a 64-query block: 512 slots a step.
  assert ca.block_slots(2048, 2, 6 * 7, 128, jnp.bfloat16, jnp.bfloat16) == 512
  assert ca.block_slots(2048, 2, 6 * 64, 128, jnp.bfloat16, jnp.bfloat16) == 512
  # Qwen2.5 0.5B packed (one group of 2 x 64 lanes), a decode step.
  assert ca.block_slots(2048, 1, 2 * 7, 128, jnp.bfloat16, jnp.bfloat16) == 512
  # A slot count that is not a multiple of 128 takes no block; neither does a tiny budget.
  assert ca.block_slots(2000, 2, 6, 128, jnp.bfloat16, jnp.bfloat16) == 0
  assert ca.block_slots(2048, 2, 6, 128, jnp.bfloat16, jnp.bfloat16, budget=1 << 16) == 0
  assert ca.vmem_bytes(2, 384, 128, 512, jnp.bfloat16, jnp.bfloat16) <= ca.VMEM_BUDGET


def _attention_call(stacked):
  from specjax.testing.models import tiny_config  # pylint: disable=import-outside-toplevel
  config = tiny_config()
  q, keys, values, block_k, block_v, starts = _case(jnp.float32, 5, 1, kvh=config.num_kv_heads,
                                                    g=config.num_heads // config.num_kv_heads,
                                                    d=config.head_dim)
  b, t = q.shape[:2]
  q = q.reshape(b, t, -1, q.shape[-1])
  q_pos = starts[:, None] + jnp.arange(t, dtype=jnp.int32)
  slot_pos = jnp.broadcast_to(jnp.arange(SLOTS, dtype=jnp.int32), (b, SLOTS))
  slot_valid = (slot_pos < starts[:, None])[:, None, :]

  def fn(q, keys, values, block_k, block_v, starts, layer):
    segments = [(keys[layer], values[layer], slot_pos, slot_valid),
                (block_k, block_v, q_pos, None)]
    return attention(q, segments, q_pos, jnp.int32(0), config, causal_block=True,
                     stacked_cache=(keys, values, layer, starts) if stacked else None)
  return fn, (q, keys, values, block_k, block_v, starts, jnp.int32(1))


def test_cpu_runs_the_reference_bit_for_bit():
  fn, args = _attention_call(stacked=True)
  text = jax.jit(fn).lower(*args).as_text()
  assert "tpu_custom_call" not in text
  plain, _ = _attention_call(stacked=False)
  np.testing.assert_array_equal(np.asarray(jax.jit(fn)(*args)),
                                np.asarray(jax.jit(plain)(*args)))


def test_tpu_lowering_runs_the_kernel():
  fn, args = _attention_call(stacked=True)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text and ca.KERNEL_NAME in text
