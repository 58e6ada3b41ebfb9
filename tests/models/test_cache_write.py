"""The stacked cache's block write: the TPU kernel's numbers (Pallas interpret mode, on CPU) against
a plain numpy loop, and what each platform runs.

`specjax.kernels.kv_write.kv_write` writes each row's `[L, T, KVH, D]` block into the
`[L, B, KVH, S, D]` cache at slots `starts[b] ..` through an aligned window (read, merged, written
back). Checked against an entry-by-entry numpy write for float32, bfloat16 and int8 caches, block
widths 1 (a decode step), 5 (a chain's verify block) and 40 (a tree's nodes), and starts at 0, at
and just after an alignment boundary, in the middle, where the block ends exactly at the last slot,
where it runs past it (the excess dropped, as the scatter's FILL_OR_DROP does) and past the end
entirely (nothing written). The neighbouring entries must be left as they were.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from specjax.core.cache import write_stacked_block
from specjax.kernels import kv_write as kv_kernel
from specjax.models import cache_write
from specjax.models.transformer import CACHE_SLOT_MULTIPLE


def _numpy_write(cache, block, starts):
  out = np.array(cache)
  slots = out.shape[3]
  for b, start in enumerate(starts):
    for t in range(block.shape[2]):
      if start + t < slots:
        out[:, b, :, start + t, :] = block[:, b, t]
  return out


def _case(dtype, width, slots=128, layers=2, heads=2, dim=8, seed=0):
  rng = np.random.default_rng(seed)
  align = kv_kernel.alignment(dtype)
  starts = [0, align, align + 1, 37, slots - width, slots - 3, slots + 5, 3 * align - 1]
  batch = len(starts)
  if jnp.issubdtype(dtype, jnp.integer):
    cache = rng.integers(-100, 100, (layers, batch, heads, slots, dim))
    block = rng.integers(-100, 100, (layers, batch, width, heads, dim))
  else:
    cache = rng.normal(size=(layers, batch, heads, slots, dim))
    block = rng.normal(size=(layers, batch, width, heads, dim))
  cache = np.asarray(jnp.asarray(cache, dtype))
  block = np.asarray(jnp.asarray(block, dtype))
  return cache, block, np.asarray(starts, np.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("width", [1, 5, 40])
def test_kernel_matches_an_entry_by_entry_write(dtype, width):
  cache, block, starts = _case(dtype, width)
  want = _numpy_write(cache, block, starts)
  got = kv_kernel.kv_write(jnp.asarray(cache), jnp.asarray(block), jnp.asarray(starts),
                           interpret=True)
  assert got.dtype == cache.dtype
  np.testing.assert_array_equal(np.asarray(got), want)
  # Not vacuous: the write changed entries of every row that had room.
  changed = np.any(np.asarray(got) != cache, axis=(0, 2, 3, 4))
  assert changed.tolist() == [s < cache.shape[3] for s in starts]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_wide_block_is_written_in_chunks(dtype):
  """A block wider than one window's VMEM budget (a long prompt's prefill) is written as several
  kernel calls: a budget of 3 aligned slot groups gives chunks of 2 groups + 1 entries, so the
  40-entry block takes 3 or 2 calls, whose seams must leave nothing out or doubled."""
  cache, block, starts = _case(dtype, 40)
  heads, dim = cache.shape[2], cache.shape[4]
  align = kv_kernel.alignment(dtype)
  per_slot = heads * 128 * (2 * jnp.dtype(dtype).itemsize + 12)
  budget = 3 * align * per_slot
  widest = kv_kernel.max_width(heads, dim, dtype, budget)
  assert widest == 2 * align + 1 < 40
  fn = lambda c, b, s: kv_kernel.kv_write(c, b, s, interpret=True, budget=budget)
  jaxpr = jax.make_jaxpr(fn)(jnp.asarray(cache), jnp.asarray(block), jnp.asarray(starts))
  calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
  assert len(calls) == -(-40 // widest)  # one call per chunk
  got = fn(jnp.asarray(cache), jnp.asarray(block), jnp.asarray(starts))
  np.testing.assert_array_equal(np.asarray(got), _numpy_write(cache, block, starts))


def test_the_budget_decides_what_fits():
  shape = (2, 1, 2, 8256, 128)  # the 8k-prompt prefill the TPU compiler rejected as one window
  widest = kv_kernel.max_width(2, 128, jnp.bfloat16)
  assert 16 < widest < 8208
  assert kv_kernel.fits(shape, 8208, jnp.bfloat16)  # chunked
  # Heads so many that one aligned window exceeds the budget: the scatter keeps the write.
  assert kv_kernel.max_width(4096, 128, jnp.bfloat16) == 0
  assert not kv_kernel.fits((2, 1, 4096, 8256, 128), 1, jnp.bfloat16)
  with pytest.raises(ValueError, match="VMEM"):
    kv_kernel.kv_write(jnp.zeros((1, 1, 8, 32, 128), jnp.float32),
                       jnp.zeros((1, 1, 1, 8, 128), jnp.float32), jnp.zeros((1,), jnp.int32),
                       interpret=True, budget=1024)


def test_scatter_matches_the_same_reference():
  cache, block, starts = _case(jnp.float32, 5)
  got = write_stacked_block(jnp.asarray(cache), jnp.asarray(block), jnp.asarray(starts))
  np.testing.assert_array_equal(np.asarray(got), _numpy_write(cache, block, starts))


def test_kernel_refuses_unaligned_caches():
  cache = jnp.zeros((1, 2, 1, 40, 8), jnp.float32)
  block = jnp.zeros((1, 2, 1, 1, 8), jnp.float32)
  with pytest.raises(ValueError, match="multiple of 8"):  # 36 slots
    kv_kernel.kv_write(cache[:, :, :, :36], block, jnp.zeros((2,), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="does not match"):
    kv_kernel.kv_write(cache, block[:, :1], jnp.zeros((2,), jnp.int32), interpret=True)


def test_cpu_lowering_is_the_scatter():
  cache, block, starts = _case(jnp.float32, 5)
  args = (jnp.asarray(cache), jnp.asarray(block), jnp.asarray(starts))
  text = jax.jit(cache_write.write_stacked).lower(*args).as_text()
  assert "scatter" in text and "tpu_custom_call" not in text
  np.testing.assert_array_equal(np.asarray(cache_write.write_stacked(*args)),
                                _numpy_write(cache, block, starts))


def test_stacked_caches_are_slot_aligned():
  from specjax.models.transformer import init_params  # pylint: disable=import-outside-toplevel
  from specjax.testing.models import tiny_config  # pylint: disable=import-outside-toplevel
  model = init_params(tiny_config(), jax.random.key(0))
  assert model.is_stacked
  cache = model.init_cache(2, 37)
  assert cache.max_len == 64 and cache.max_len % CACHE_SLOT_MULTIPLE == 0
  assert model.unstacked().init_cache(2, 37).max_len == 37  # the CPU layout keeps its size
  assert kv_kernel.alignment(jnp.int8) <= CACHE_SLOT_MULTIPLE
