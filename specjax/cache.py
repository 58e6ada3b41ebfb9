"""Fixed-shape key/value cache with per-row lengths.

The cache never changes shape while decoding: every layer owns a `[B, max_len, kv_heads, head_dim]`
buffer (stacked over layers), and `lengths[B]` says how many slots of each row are valid. Rows
advance independently: a block of new keys is written at each row's own offset, and rolling back
rejected draft tokens is only a matter of lowering `lengths` -- the stale slots are masked out by
attention and overwritten by the next write.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of every layer plus the valid length of each row."""

  k: jax.Array  # [L, B, S, KVH, D]
  v: jax.Array  # [L, B, S, KVH, D]
  lengths: jax.Array  # [B] int32, valid slots per row

  @classmethod
  def create(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32) -> "KVCache":
    shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def room(self) -> jax.Array:
    """Free slots left in each row, `[B]` int32."""
    return self.max_len - self.lengths

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    """The same buffers with new valid lengths: this is how rejected drafts are rolled back."""
    return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))


def write_block(buffer: jax.Array, block: jax.Array, starts: jax.Array) -> jax.Array:
  """Writes `block[b]` into `buffer[b]` at slot `starts[b]`, for every row (one layer).

  Args:
    buffer: `[B, S, H, D]` one layer's keys or values.
    block: `[B, T, H, D]` new entries.
    starts: `[B]` int32 slot of each row's first new entry.

  Returns:
    The updated buffer. Callers size the cache so that `starts + T <= S`; an update past the end
    would be clamped by `dynamic_update_slice`, which is why `decode` and `generate` reserve room.
  """
  def one_row(row_buffer, row_block, start):
    return jax.lax.dynamic_update_slice(row_buffer, row_block.astype(row_buffer.dtype),
                                        (start, 0, 0))

  return jax.vmap(one_row)(buffer, block, starts.astype(jnp.int32))


UNROLLED_WRITE_MAX_BATCH = 16  # larger batches write with one batched scatter


def write_stacked_block(stacked: jax.Array, block: jax.Array, starts: jax.Array) -> jax.Array:
  """Writes every layer's `block[:, b]` into `stacked[:, b]` at slot `starts[b]`, for every row.

  Args:
    stacked: `[L, B, S, H, D]` all layers' keys or values.
    block: `[L, B, T, H, D]` new entries.
    starts: `[B]` int32 slot of each row's first new entry.

  Returns:
    The updated buffer. Callers size the cache so that `starts + T <= S` (see `write_block`).

  For a small batch on one device this is one in-place `dynamic_update_slice` of a `[L, T, H, D]`
  slab per row, unrolled: the cost is the block's size, not the cache's. A large batch (the unrolled
  updates would grow the program with B) and any batch under a mesh (per-row updates of a sharded
  array would need collective permutes; the SPMD partitioner keeps a batched scatter local to each
  device) use one batched scatter instead.
  """
  starts = starts.astype(jnp.int32)
  block = block.astype(stacked.dtype)
  mesh = jax.sharding.get_abstract_mesh()
  under_mesh = mesh is not None and not mesh.empty and any(size > 1 for size in mesh.axis_sizes)
  if under_mesh or stacked.shape[1] > UNROLLED_WRITE_MAX_BATCH:
    def one_row(row_buffer, row_block, start):  # [L, S, H, D] <- [L, T, H, D]
      return jax.lax.dynamic_update_slice(row_buffer, row_block, (0, start, 0, 0))
    return jax.vmap(one_row, in_axes=(1, 1, 0), out_axes=1)(stacked, block, starts)
  for row in range(stacked.shape[1]):
    stacked = jax.lax.dynamic_update_slice(stacked, block[:, row:row + 1],
                                           (0, row, starts[row], 0, 0))
  return stacked
