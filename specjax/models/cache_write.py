"""The stacked KV cache's writes, per platform: XLA's scatter off TPU, a Pallas DMA kernel on TPU.

`specjax.core.cache.write_stacked_block` (one scatter with `(row, slot)` indices) is the write's
definition and what every CPU / GPU program runs. On TPU a scatter makes the compiler lay the
loop-carried cache out with the update window minor, unlike the layout attention reads: it then
copied the whole cache every decode step, and held two caches at the prefill's exit (docs/tpu.md,
"The KV cache's layout on TPU"). `write_stacked` lowers, for TPU, to `specjax.kernels.kv_write`,
which fixes the cache's layout to the row-major one attention reads and writes only an aligned
window around each row's block, in place; the prefill pins the same layout
(`specjax.models.prefill`). Under a mesh the kernel runs inside `jax.shard_map`, each device on
its rows and key/value heads as the sharding rules place them (a Mosaic kernel cannot be
partitioned automatically).

A cache whose slot count is not a multiple of the kernel's alignment, or shorter than one write
window, keeps the scatter on TPU too. A write wider than one window's VMEM budget (a long
prompt's prefill) runs as several kernel calls (`specjax.kernels.kv_write.max_width`).
"""

from __future__ import annotations

import functools

import jax

from specjax.core import cache as cache_lib
from specjax.core.cache import KVBlock, KVCache
from specjax.kernels import kv_write as kv_kernel
from specjax.parallel.rules import CACHE_AXES, active_rules, auto_mesh_shape

__all__ = ["compact", "kernel_fits", "write_kv_block", "write_stacked"]

# The block `[L, B, T, KVH, D]`'s logical axes, and the per-row starts'.
_BLOCK_AXES = ("layers", "batch", None, "kv_heads", None)


def kernel_fits(stacked: jax.Array, block: jax.Array) -> bool:
  """Whether the TPU kernel takes this write (static): the cache's slots are a multiple of its
  alignment and hold one write window, and one window fits the kernel's VMEM budget (counted
  for the whole cache's heads; a shard's are fewer)."""
  return kv_kernel.fits(stacked.shape, block.shape[2], stacked.dtype)


def _tpu_write(stacked, block, starts):
  if not kernel_fits(stacked, block):
    return cache_lib.write_stacked_block(stacked, block, starts)
  mesh_shape = auto_mesh_shape()
  if mesh_shape is None:  # one device, or inside the caller's shard_map
    return kv_kernel.kv_write(stacked, block, starts)
  rules = active_rules()
  cache_spec = rules.spec(CACHE_AXES, stacked.shape, mesh_shape)
  block_spec = rules.spec(_BLOCK_AXES, block.shape, mesh_shape)
  starts_spec = jax.sharding.PartitionSpec(block_spec[1])
  if (cache_spec[0], cache_spec[1], cache_spec[2]) != (block_spec[0], block_spec[1],
                                                       block_spec[3]) or cache_spec[3] is not None:
    return cache_lib.write_stacked_block(stacked, block, starts)
  mesh = jax.sharding.get_abstract_mesh()
  return jax.shard_map(kv_kernel.kv_write, mesh=mesh,
                       in_specs=(cache_spec, block_spec, starts_spec), out_specs=cache_spec,
                       check_vma=False)(stacked, block, starts)


def write_stacked(stacked: jax.Array, block: jax.Array, starts: jax.Array) -> jax.Array:
  """`specjax.core.cache.write_stacked_block`'s result (`[L, B, KVH, S, D]` with every layer's
  `block[:, b]` (`[L, B, T, KVH, D]`) at slots `starts[b] ..`, entries past `S - 1` dropped),
  written by the platform's best program (see the module docstring)."""
  block = cache_lib.match_block(block, stacked)  # a packed cache's heads (`head_pack`)
  return jax.lax.platform_dependent(stacked, block, starts, tpu=_tpu_write,
                                    default=cache_lib.write_stacked_block)


def write_kv_block(cache: KVCache, block: KVBlock, starts: jax.Array) -> KVCache:
  """`specjax.core.cache.write_kv_block`, a stacked cache written by `write_stacked`."""
  return cache_lib.write_kv_block(cache, block, starts, write=write_stacked)


compact = functools.partial(cache_lib.compact, write=write_stacked)
compact.__doc__ = ("`specjax.core.cache.compact`, a stacked cache's moved entries written by "
                   "`write_stacked`.")
