"""Fixed-shape key/value cache with per-row lengths.

The cache never changes shape while decoding: every layer owns a `[B, kv_heads, max_len, head_dim]`
buffer (stacked over layers), and `lengths[B]` says how many slots of each row are valid. Rows
advance independently: a block of new keys is written at each row's own offset, and rolling back
rejected draft tokens is only a matter of lowering `lengths` -- the stale slots are masked out by
attention and overwritten by the next write.

The layout `[L, B, KVH, S, D]` is the one attention reads: the score and value einsums
(`btkgd,bksd->bkgts`, `bkgts,bksd->btkgd`) take a layer's `[B, KVH, S, D]` slab as it lies, so no
forward copies a transposed slab. Writes are one scatter with explicit `(row, slot)` indices
whatever the batch size and under any mesh: the cost is the block's size, not the cache's.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of every layer plus the valid length of each row.

  `k` and `v` are either stacked over layers (one `[L, B, KVH, S, D]` array each, what a stacked
  model's `lax.scan` reads) or tuples of `L` per-layer `[B, KVH, S, D]` buffers (what an unstacked
  model's unrolled loop reads and updates in place: no slicing out of, or copying of, a stacked
  buffer). `Model.init_cache` picks the layout that matches the model's.
  """

  k: jax.Array | tuple[jax.Array, ...]  # [L, B, KVH, S, D] or L x [B, KVH, S, D]
  v: jax.Array | tuple[jax.Array, ...]  # same layout as k
  lengths: jax.Array  # [B] int32, valid slots per row

  @classmethod
  def create(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32, per_layer: bool = False, pack: int = 1) -> "KVCache":
    """Zeroed buffers. `pack` (stacked only; see `head_pack`): key/value heads stored `pack` to a
    row, `[L, B, KVH / pack, S, pack * D]`."""
    lengths = jnp.zeros((batch,), jnp.int32)
    if per_layer:
      shape = (batch, num_kv_heads, max_len, head_dim)
      zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
      return cls(k=zeros(), v=zeros(), lengths=lengths)
    if num_kv_heads % pack:
      raise ValueError(f"pack={pack} must divide num_kv_heads={num_kv_heads}")
    shape = (num_layers, batch, num_kv_heads // pack, max_len, pack * head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=lengths)

  @classmethod
  def create_layers(cls, geometry, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
    """Per-layer buffers whose layers differ in shape: `geometry` lists each layer's
    `(num_kv_heads, head_dim)` (Gemma 4's global layers are wider than its window layers)."""
    shapes = [(batch, kvh, max_len, d) for kvh, d in geometry]
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for shape in shapes)
    return cls(k=zeros(), v=zeros(), lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def per_layer(self) -> bool:
    """Whether `k`/`v` are tuples of per-layer buffers (else stacked arrays)."""
    return isinstance(self.k, (tuple, list))

  @property
  def layer_shape(self) -> tuple[int, ...]:
    """`(B, KVH, S, D)`: the shape of one layer's keys."""
    return tuple(self.k[0].shape) if self.per_layer else tuple(self.k.shape[1:])

  @property
  def batch(self) -> int:
    return self.layer_shape[0]

  @property
  def max_len(self) -> int:
    return self.layer_shape[2]

  def room(self) -> jax.Array:
    """Free slots left in each row, `[B]` int32."""
    return self.max_len - self.lengths

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    """The same buffers with new valid lengths: this is how rejected drafts are rolled back."""
    return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

  def stacked(self) -> "KVCache":
    """The same cache with `k`/`v` stacked over layers (a copy if they were per-layer)."""
    if not self.per_layer:
      return self
    return KVCache(jnp.stack(self.k), jnp.stack(self.v), self.lengths)

  def unstacked(self) -> "KVCache":
    """The same cache with `k`/`v` as tuples of per-layer buffers (a copy if they were stacked)."""
    if self.per_layer:
      return self
    return KVCache(tuple(self.k), tuple(self.v), self.lengths)


# A TPU vector register row: 128 lanes. A cache whose head_dim is narrower pads every slot's row
# to 128 lanes in HBM (twice the memory at head_dim 64) unless heads share a row.
LANES = 128


def head_pack(num_kv_heads: int, head_dim: int) -> int:
  """Key/value heads a stacked cache stores per row (`KVCache.create(pack=)`): `128 / head_dim`
  where head_dim is narrower than 128 and divides it, and that many divide the KV heads; else 1.

  Packed, a stacked cache is `[L, B, KVH / p, S, p * D]`: slot `s` of group `c` holds heads
  `c p .. c p + p - 1` side by side, so a row is 128 lanes wide with no padding (Qwen2.5-0.5B's
  and Llama-3.2-1B's head_dim 64: p = 2). Attention reads it as it lies
  (`specjax.models.layers.attention_reference`), writes pack their blocks (`match_block`)."""
  if head_dim >= LANES or LANES % head_dim:
    return 1
  pack = LANES // head_dim
  return pack if num_kv_heads % pack == 0 else 1


def match_block(block: jax.Array, buffer: jax.Array) -> jax.Array:
  """A `[..., KVH, D]` key/value block in `buffer`'s head packing (`head_pack`): unchanged when
  the buffer's rows are `D` wide, else `[..., KVH / p, p D]` (`p = buffer's row / D`)."""
  width, dim = buffer.shape[-1], block.shape[-1]
  if width == dim:
    return block
  pack = width // dim
  return block.reshape(block.shape[:-2] + (block.shape[-2] // pack, width))


def unpack_heads(slab: jax.Array, head_dim: int) -> jax.Array:
  """A packed `[B, KVH / p, S, p D]` slab (`head_pack`) as `[B, KVH, S, D]` (a copy); an
  unpacked one unchanged."""
  b, groups, slots, width = slab.shape
  if width == head_dim:
    return slab
  pack = width // head_dim
  return (slab.reshape(b, groups, slots, pack, head_dim).transpose(0, 1, 3, 2, 4)
          .reshape(b, groups * pack, slots, head_dim))


def is_float8(dtype) -> bool:
  """Whether a cache of `dtype` stores 8-bit floats (`float8_e4m3fn`, `float8_e5m2`): entries
  are clipped into its range when written (`to_cache`) and widened to the compute dtype when read
  (`read_dtype`)."""
  dtype = jnp.dtype(dtype)
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1


CACHE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def check_cache_dtype(dtype) -> str | None:
  """A cache dtype option as its name (hashable, static): None, or one of `CACHE_DTYPES`. An
  integer cache would need per-entry scales, which this cache does not hold: refused here, before
  anything compiles."""
  if dtype is None:
    return None
  try:
    name = jnp.dtype(dtype).name
  except TypeError as error:
    raise ValueError(f"cache_dtype must be None or one of {CACHE_DTYPES}, got {dtype!r}") from error
  if name not in CACHE_DTYPES:
    raise ValueError(f"cache_dtype must be None or one of {CACHE_DTYPES}, got {name!r} (an "
                     "integer cache would need scales: use float8_e4m3fn for an 8-bit cache)")
  return name


def to_cache(x: jax.Array, dtype) -> jax.Array:
  """`x` in a cache buffer's `dtype`. An 8-bit float cache's entries are clipped to its largest
  finite value first: a cast past `float8_e4m3fn`'s range (448) gives NaN, not a saturated
  entry."""
  dtype = jnp.dtype(dtype)
  if is_float8(dtype) and x.dtype != dtype:
    big = float(jnp.finfo(dtype).max)
    x = jnp.clip(x, -big, big)
  return x.astype(dtype)


def widen(x: jax.Array, dtype) -> jax.Array:
  """`x` read from a cache for a product in `dtype`: an 8-bit float cache's entries widened to
  `dtype` (JAX does not promote 8-bit floats implicitly), any other unchanged."""
  return x.astype(dtype) if is_float8(x.dtype) else x


def read_dtype(compute, stored):
  """The dtype attention's products take over a cache stored as `stored`, with queries in
  `compute`: an 8-bit float cache is widened to the queries' dtype (JAX does not promote 8-bit
  floats implicitly), any other the promotion of the two."""
  return jnp.dtype(compute) if is_float8(stored) else jnp.promote_types(compute, stored)


def _slots(starts: jax.Array, width: int) -> jax.Array:
  """`[B, T, 1]` int32: the slot entry `t` of row `b` of a block goes to."""
  starts = jnp.asarray(starts, jnp.int32)
  return (starts[:, None] + jnp.arange(width, dtype=jnp.int32))[..., None]


def _scatter(buffer, slots, block, dims):
  return jax.lax.scatter(buffer, slots, to_cache(block, buffer.dtype), dims,
                         indices_are_sorted=True, unique_indices=True,
                         mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


# Row b of the indices addresses row b of the buffer (a batching dimension, so each device of a
# batch-sharded mesh scatters into its own rows without gathering the block); the slot index picks
# the S position; the block's KVH and D (and L) dimensions are the window written at that slot.
_LAYER_DIMS = jax.lax.ScatterDimensionNumbers(  # buffer [B, KVH, S, D] <- block [B, T, KVH, D]
    update_window_dims=(2, 3), inserted_window_dims=(2,), scatter_dims_to_operand_dims=(2,),
    operand_batching_dims=(0,), scatter_indices_batching_dims=(0,))
_STACKED_DIMS = jax.lax.ScatterDimensionNumbers(  # [L, B, KVH, S, D] <- [L, B, T, KVH, D]
    update_window_dims=(0, 3, 4), inserted_window_dims=(3,), scatter_dims_to_operand_dims=(3,),
    operand_batching_dims=(1,), scatter_indices_batching_dims=(0,))


def write_block(buffer: jax.Array, block: jax.Array, starts: jax.Array) -> jax.Array:
  """Writes `block[b]` into `buffer[b]` at slots `starts[b] ..`, for every row (one layer).

  Args:
    buffer: `[B, KVH, S, D]` one layer's keys or values.
    block: `[B, T, KVH, D]` new entries (the layout of a key/value projection).
    starts: `[B]` int32 slot of each row's first new entry.

  Returns:
    The updated buffer. Entries that would land at slot `S` or later are dropped (callers size the
    cache so that `starts + T <= S`; `decode` and `generate` reserve that room).
  """
  return _scatter(buffer, _slots(starts, block.shape[1]), match_block(block, buffer), _LAYER_DIMS)


def write_stacked_block(stacked: jax.Array, block: jax.Array, starts: jax.Array) -> jax.Array:
  """Writes every layer's `block[:, b]` into `stacked[:, b]` at slots `starts[b] ..`, every row.

  Args:
    stacked: `[L, B, KVH, S, D]` all layers' keys or values.
    block: `[L, B, T, KVH, D]` new entries (per-layer key/value projections, stacked).
    starts: `[B]` int32 slot of each row's first new entry.

  Returns:
    The updated buffer; entries past slot `S - 1` are dropped (see `write_block`).

  One scatter with explicit `(row, slot)` indices, the same program for every batch size and on
  any mesh (Auto or Explicit axes): rows are a batching dimension, so the SPMD partitioner keeps
  the write local to the devices holding each row, and a donated cache is updated in place. A
  write costs the block's size, not the cache's.
  """
  return _scatter(stacked, _slots(starts, block.shape[2]), match_block(block, stacked),
                  _STACKED_DIMS)


def compact(cache: KVCache, sources: jax.Array, starts: jax.Array, counts: jax.Array, *,
            write=write_stacked_block) -> KVCache:
  """Moves each row's accepted tree path to contiguous slots (ragged per row, fixed shapes).

  Slot `starts[b] + j` receives slot `sources[b, j]` for `j < counts[b]`; the other slots keep
  their entries (they are rewritten with their own values). No index is ever -1: sources are
  clamped into the buffer and masked by `counts`; writes past slot `S - 1` are dropped.

  Args:
    cache: the cache after scoring a tree block.
    sources: `[B, W]` int32 slot of the `j`-th path entry (path order, so `sources >= starts`
      never reads a slot that is written earlier in the same call: all reads happen first).
    starts: `[B]` int32 first destination slot; counts: `[B]` int32 entries moved per row.
    write: a stacked cache's block write with `write_stacked_block`'s contract (default: it;
      `specjax.models.cache_write` passes the platform's).

  Returns:
    The cache with the same `lengths` (callers set them).
  """
  width = sources.shape[1]
  starts = jnp.asarray(starts, jnp.int32)
  index = jnp.arange(width, dtype=jnp.int32)
  dest = starts[:, None] + index  # [B, W]
  src = jnp.where(index[None] < counts[:, None], sources.astype(jnp.int32), dest)
  src = jnp.clip(src, 0, cache.max_len - 1)

  def move(stacked):  # [L, B, KVH, S, D]
    block = jnp.take_along_axis(stacked, src[None, :, None, :, None], axis=3)  # [L, B, KVH, W, D]
    return write(stacked, block.swapaxes(2, 3), starts)

  def move_layer(buffer):  # [B, KVH, S, D]
    block = jnp.take_along_axis(buffer, src[:, None, :, None], axis=2)  # [B, KVH, W, D]
    return write_block(buffer, block.swapaxes(1, 2), starts)

  if isinstance(cache.k, (tuple, list)):  # per-layer buffers
    return KVCache(tuple(map(move_layer, cache.k)), tuple(map(move_layer, cache.v)),
                   cache.lengths)
  return KVCache(move(cache.k), move(cache.v), cache.lengths)


class KVBlock(NamedTuple):
  """A forward's new keys and values, not yet written (`forward(..., write_cache=False)`).

  Attributes:
    k: `L x [B, T, KVH, D]` per layer (an unstacked model's) or `[L, B, T, KVH, D]` (stacked).
    v: the same layout as `k`.
  """

  k: jax.Array | tuple[jax.Array, ...]
  v: jax.Array | tuple[jax.Array, ...]

  def padded(self, width: int) -> "KVBlock":
    """The block with `T` zero-padded to `width` entries (so branches of a switch agree)."""
    def pad(x, axis):
      widths = [(0, 0)] * x.ndim
      widths[axis] = (0, width - x.shape[axis])
      return jnp.pad(x, widths)
    if isinstance(self.k, (tuple, list)):
      return KVBlock(tuple(pad(x, 1) for x in self.k), tuple(pad(x, 1) for x in self.v))
    return KVBlock(pad(self.k, 2), pad(self.v, 2))


def write_kv_block(cache: KVCache, block: KVBlock, starts: jax.Array, *,
                   write=write_stacked_block) -> KVCache:
  """Writes a `KVBlock` into `cache` at slots `starts[b] ..` of every row, in the cache's layout
  (a stacked cache through `write`, default `write_stacked_block`; see `compact`).

  Returns:
    The cache with the block written and `lengths = starts + T`; entries past slot `S - 1` are
    dropped (see `write_block`).
  """
  starts = jnp.asarray(starts, jnp.int32)
  per_layer_block = isinstance(block.k, (tuple, list))
  if cache.per_layer:
    ks = block.k if per_layer_block else tuple(block.k)
    vs = block.v if per_layer_block else tuple(block.v)
    width = ks[0].shape[1]
    return KVCache(tuple(write_block(c, x, starts) for c, x in zip(cache.k, ks)),
                   tuple(write_block(c, x, starts) for c, x in zip(cache.v, vs)), starts + width)
  k = jnp.stack(block.k) if per_layer_block else block.k
  v = jnp.stack(block.v) if per_layer_block else block.v
  return KVCache(write(cache.k, k, starts), write(cache.v, v, starts), starts + k.shape[2])
