"""The KV cache's block write on TPU: a Pallas kernel that copies each row's new keys (or values)
into the stacked cache in place, by DMA, so the cache keeps one layout everywhere.

Why a kernel. XLA:TPU lays a scatter's operand out with the update window minor. The decode loop
writes each step's `[L, B, T, KVH, D]` block into the `[L, B, KVH, S, D]` cache at per-row slots
(`specjax.core.cache.write_stacked_block`, a scatter), so the compiler gave the loop-carried cache
a window-minor layout and copied the whole cache, every step, into the layout attention's einsums
read (slots, then head_dim, minor) - and at the prefill's exit a second copy, a second cache at
the peak (docs/tpu.md). A Mosaic kernel fixes its operands' layout (row-major, the einsums' own),
and with the cache aliased to the output it writes only the block's bytes.

What runs. One grid step per row `b` and layer `l`: a DMA reads the tile-aligned window of slots
around the row's block (`[KVH, span, D]`; Mosaic needs DMA offsets and sizes on the slot axis
aligned to tiles), the block (padded to `span` rows outside the kernel) is rolled to its offset
and merged under a mask in VMEM, and a DMA writes the window back. Entries at slot `S` or later are
dropped, as the scatter's `FILL_OR_DROP` does. `starts` is scalar-prefetched into SMEM.

A step's VMEM grows with the block's width (two `[KVH, span, D]` buffers and the float32 merge).
A block wider than `max_width` - a long prompt's prefill - is written as consecutive chunks of at
most that width, one kernel call each on the same aliased cache, so that no step exceeds
`VMEM_BUDGET` (the TPU compiler rejected an 8k-slot prefill write at 28 MiB of scoped VMEM
against v5e's 16 MiB when the whole block was one window).

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

from specjax.core.cache import to_cache

__all__ = ["VMEM_BUDGET", "alignment", "fits", "kv_write", "max_width", "window_slots"]

# Scoped VMEM one grid step may plan on: half of v5e's default 16 MiB scoped limit (v6e's and
# v5p's are larger), leaving the rest to Mosaic's own buffers.
VMEM_BUDGET = 8 << 20
_LANES = 128


def alignment(dtype) -> int:
  """Slots per HBM tile row group of a `dtype` cache: Mosaic's DMAs start at tile-aligned
  slots (8 rows of 32-bit words; 16 bfloat16 or 32 int8 entries, conservatively)."""
  return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def window_slots(width: int, dtype) -> int:
  """Slots of the aligned window one row's write reads and writes back (static)."""
  align = alignment(dtype)
  return -(-(width + align - 1) // align) * align


def max_width(heads: int, dim: int, dtype, budget: int = VMEM_BUDGET) -> int:
  """The widest block one kernel call writes within `budget` bytes of VMEM per grid step (static;
  0 where not even one aligned window fits). Counted per window slot: the window and the
  incoming block in the cache's dtype, and three float32 temporaries of the merge, each row
  padded to whole 128-lane vregs (a conservative count: the compiler's own for a bfloat16 cache
  is about 0.4 of it)."""
  lanes = -(-dim // _LANES) * _LANES
  per_slot = heads * lanes * (2 * jnp.dtype(dtype).itemsize + 3 * 4)
  align = alignment(dtype)
  groups = budget // (per_slot * align)  # whole aligned groups of slots in one window
  return max(0, groups * align - align + 1)


def fits(shape, width: int, dtype, budget: int = VMEM_BUDGET) -> bool:
  """Whether a `[L, B, KVH, S, D]` cache of `dtype` takes a `width`-entry write (static): its
  slots are a multiple of the alignment and hold one window of the (chunked) write, and one
  aligned window fits the VMEM budget."""
  _, _, heads, slots, dim = shape
  widest = max_width(heads, dim, dtype, budget)
  return (slots % alignment(dtype) == 0 and widest >= 1
          and slots >= window_slots(min(width, widest), dtype))


def _kernel(starts_ref, block_ref, cache_ref, out_ref, window, incoming, sem, *, width: int,
            slots: int, span: int, align: int):
  del cache_ref  # aliased to `out_ref`: read and written in place
  b, layer = pl.program_id(0), pl.program_id(1)
  start = starts_ref[b]
  # (lax.rem, not `//`: jnp's floor division lowers through `sign`, whose Mosaic rule asks the
  # local TPU's generation, which an export or AOT compile on another host does not have.)
  base = jnp.minimum(start - jax.lax.rem(start, align), slots - span)
  base = pl.multiple_of(base, align)
  offset = start - base  # the block's first row in the window, >= 0
  window_hbm = out_ref.at[layer, b, :, pl.ds(base, span), :]
  read = pltpu.make_async_copy(window_hbm, window, sem.at[0])
  read.start()
  fetch = pltpu.make_async_copy(block_ref.at[layer, b], incoming, sem.at[1])
  fetch.start()
  fetch.wait()
  read.wait()
  # The block's rows moved to `offset ..` of the window (rows past the window are dropped: they
  # are slots past `S`), merged in float32 (exact for the cache's narrower float types).
  shifted = pltpu.roll(incoming[...].astype(jnp.float32), offset, 1)
  row = jax.lax.broadcasted_iota(jnp.int32, shifted.shape, 1)
  mine = (row >= offset) & (row < offset + width)
  window[...] = jnp.where(mine, shifted, window[...].astype(jnp.float32)).astype(window.dtype)
  write = pltpu.make_async_copy(window, window_hbm, sem.at[0])
  write.start()
  write.wait()


def _write_one(cache, block, starts, *, interpret):
  layers, batch, heads, slots, dim = cache.shape
  width = block.shape[2]
  span = window_slots(width, cache.dtype)
  # [L, B, KVH, span, D], zero past T: the DMA's source, whole tiles.
  block = jnp.pad(to_cache(jnp.swapaxes(block, 2, 3), cache.dtype),
                  ((0, 0), (0, 0), (0, 0), (0, span - width), (0, 0)))
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      functools.partial(_kernel, width=width, slots=slots, span=span,
                        align=alignment(cache.dtype)),
      out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(batch, layers), in_specs=[hbm, hbm], out_specs=hbm,
          scratch_shapes=[pltpu.VMEM((heads, span, dim), cache.dtype),
                          pltpu.VMEM((heads, span, dim), cache.dtype),
                          pltpu.SemaphoreType.DMA((2,))]),
      input_output_aliases={2: 0},
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
      interpret=interpret,
      name="specjax_kv_write",
  )(starts, block, cache)


def kv_write(cache: jax.Array, block: jax.Array, starts: jax.Array, *,
             interpret: bool = False, budget: int = VMEM_BUDGET) -> jax.Array:
  """`cache` with `block` written at slots `starts[b] ..` of every row, in place.

  Args:
    cache: `[L, B, KVH, S, D]` all layers' keys or values.
    block: `[L, B, T, KVH, D]` new entries (the layer scan's stacked key/value projections).
    starts: `[B]` int32 slot of each row's first new entry, `>= 0`.
    interpret: run the kernel in Pallas interpret mode (any backend).
    budget: VMEM bytes one grid step may plan on (`max_width`); a wider block is written in
      chunks, one kernel call each.

  Returns:
    The updated cache (the same buffer where the caller donates it); entries that would land at
    slot `S` or later are dropped.
  """
  layers, batch, heads, slots, dim = cache.shape
  width = block.shape[2]
  if block.shape != (layers, batch, width, heads, dim):
    raise ValueError(f"kv_write: block {block.shape} does not match cache {cache.shape}")
  if not fits(cache.shape, width, cache.dtype, budget):
    raise ValueError(
        f"kv_write: the cache's {slots} slots must be a multiple of {alignment(cache.dtype)} and "
        f"hold one write window, and one window of {heads} heads x {dim} must fit {budget} bytes "
        f"of VMEM")
  chunk = min(width, max_width(heads, dim, cache.dtype, budget))
  starts = jnp.asarray(starts, jnp.int32)
  for first in range(0, width, chunk):  # static: one call per chunk, in place on one buffer
    cache = _write_one(cache, block[:, :, first:first + chunk], starts + first,
                       interpret=interpret)
  return cache
