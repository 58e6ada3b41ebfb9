"""The KV cache's block write on TPU: a Pallas kernel that copies each row's new keys (or values)
into the stacked cache in place, by DMA, so the cache keeps one layout everywhere.

Why a kernel. XLA:TPU lays a scatter's operand out with the update window minor. The decode loop
writes each step's `[L, B, T, KVH, D]` block into the `[L, B, KVH, S, D]` cache at per-row slots
(`specjax.core.cache.write_stacked_block`, a scatter), so the compiler gave the loop-carried cache
a window-minor layout and copied the whole cache, every step, into the layout attention's einsums
read (slots, then head_dim, minor) - and at the prefill's exit a second copy, a second cache at
the peak (docs/tpu.md). A Mosaic kernel fixes its operands' layout (row-major, the einsums' own),
and with the cache aliased to the output it writes only the block's bytes.

What runs. One grid step per row `b`: a DMA reads the tile-aligned window of slots around the
row's block (`[L, KVH, span, D]`; Mosaic needs DMA offsets and sizes on the slot axis aligned to
tiles), the block (padded to `span` rows outside the kernel) is rolled to its offset and merged
under a mask in VMEM, and a DMA writes the window back. Entries at slot `S` or later are dropped,
as the scatter's `FILL_OR_DROP` does. `starts` is scalar-prefetched into SMEM.

Interpret mode (`interpret=True`) runs the same kernel on CPU for its numbers
(tests/models/test_cache_write.py); `specjax.models.cache_write` calls it only in programs lowered
for TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["alignment", "fits", "kv_write", "window_slots"]


def alignment(dtype) -> int:
  """Slots per HBM tile row group of a `dtype` cache: Mosaic's DMAs start at tile-aligned
  slots (8 rows of 32-bit words; 16 bfloat16 or 32 int8 entries, conservatively)."""
  return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def window_slots(width: int, dtype) -> int:
  """Slots of the aligned window one row's write reads and writes back (static)."""
  align = alignment(dtype)
  return -(-(width + align - 1) // align) * align


def fits(slots: int, width: int, dtype) -> bool:
  """Whether a cache of `slots` slots takes a `width`-entry write (static): its slots are a
  multiple of the alignment and hold one window."""
  return slots % alignment(dtype) == 0 and slots >= window_slots(width, dtype)


def _kernel(starts_ref, block_ref, cache_ref, out_ref, window, incoming, sem, *, width: int,
            slots: int, span: int, align: int):
  del cache_ref  # aliased to `out_ref`: read and written in place
  b = pl.program_id(0)
  start = starts_ref[b]
  # (lax.rem, not `//`: jnp's floor division lowers through `sign`, whose Mosaic rule asks the
  # local TPU's generation, which an export or AOT compile on another host does not have.)
  base = jnp.minimum(start - jax.lax.rem(start, align), slots - span)
  base = pl.multiple_of(base, align)
  offset = start - base  # the block's first row in the window, >= 0
  window_hbm = out_ref.at[:, b, :, pl.ds(base, span), :]
  read = pltpu.make_async_copy(window_hbm, window, sem.at[0])
  read.start()
  fetch = pltpu.make_async_copy(block_ref.at[:, b], incoming, sem.at[1])
  fetch.start()
  fetch.wait()
  read.wait()
  # The block's rows moved to `offset ..` of the window (rows past the window are dropped: they
  # are slots past `S`), merged in float32 (exact for the cache's narrower float types).
  shifted = pltpu.roll(incoming[...].astype(jnp.float32), offset, 2)
  row = jax.lax.broadcasted_iota(jnp.int32, shifted.shape, 2)
  mine = (row >= offset) & (row < offset + width)
  window[...] = jnp.where(mine, shifted, window[...].astype(jnp.float32)).astype(window.dtype)
  write = pltpu.make_async_copy(window, window_hbm, sem.at[0])
  write.start()
  write.wait()


def kv_write(cache: jax.Array, block: jax.Array, starts: jax.Array, *,
             interpret: bool = False) -> jax.Array:
  """`cache` with `block` written at slots `starts[b] ..` of every row, in place.

  Args:
    cache: `[L, B, KVH, S, D]` all layers' keys or values.
    block: `[L, B, T, KVH, D]` new entries (the layer scan's stacked key/value projections).
    starts: `[B]` int32 slot of each row's first new entry, `>= 0`.
    interpret: run the kernel in Pallas interpret mode (any backend).

  Returns:
    The updated cache (the same buffer where the caller donates it); entries that would land at
    slot `S` or later are dropped.
  """
  layers, batch, heads, slots, dim = cache.shape
  width = block.shape[2]
  if block.shape != (layers, batch, width, heads, dim):
    raise ValueError(f"kv_write: block {block.shape} does not match cache {cache.shape}")
  align = alignment(cache.dtype)
  span = window_slots(width, cache.dtype)
  if not fits(slots, width, cache.dtype):
    raise ValueError(f"kv_write: the cache's {slots} slots must be a multiple of {align} and at "
                     f"least {span}")
  # [L, B, KVH, span, D], zero past T: the DMA's source, whole tiles.
  block = jnp.pad(jnp.swapaxes(block, 2, 3).astype(cache.dtype),
                  ((0, 0), (0, 0), (0, 0), (0, span - width), (0, 0)))
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      functools.partial(_kernel, width=width, slots=slots, span=span, align=align),
      out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(batch,), in_specs=[hbm, hbm], out_specs=hbm,
          scratch_shapes=[pltpu.VMEM((layers, heads, span, dim), cache.dtype),
                          pltpu.VMEM((layers, heads, span, dim), cache.dtype),
                          pltpu.SemaphoreType.DMA((2,))]),
      input_output_aliases={2: 0},
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
      interpret=interpret,
      name="specjax_kv_write",
  )(jnp.asarray(starts, jnp.int32), block, cache)
