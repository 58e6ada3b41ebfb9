"""Pallas reductions over a vocabulary slice: the local half of the vocabulary-sharded verify.

Under a mesh that splits the vocabulary, `specjax.verify.rule.verify_rule` runs over
`specjax.verify.sharded.ShardedVocab`, which reduces each device's `[..., Vl]` slice and combines
the results with collectives. `PallasVocab` does those local reductions (max, sum, first argmax
and the threshold search's `sum_at_least`) as tiled Pallas kernels that stream the slice once
each, with Mosaic on TPU or the Pallas interpreter. Rows are flattened to `[N, Vl]` and tiled in
blocks of `(8, block_v)`; results come back lane-dense in `[N, 128]`.

The flattening is a view of the logits, not a copy of them (`flatten_order`): XLA:TPU tiles an
array's two minor dimensions by `(8, 128)`, so a `[B, k + 1, V]` block of logits with `B` a
multiple of 8 and `k + 1` not is laid out token-major (`{2,0,1}`, physically `[k + 1, B, V]`,
no padding); its rows are then flattened token-major too (`[k + 1, B, V] -> [(k + 1) B, V]`, a
bitcast), where a batch-major reshape would copy the logits. The vocabulary is not padded either:
the last tile is partial and its lanes past `Vl` are masked in the kernels. Only a row count that
is not a multiple of 8 is padded.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax.kernels.common import replaces, tile_argmax

LANES = 128
ROWS = 8  # rows per block: the (8, 128) tiling rule's second-minor dimension
MAX_BLOCK_V = 16384  # 8 x 16384 f32 = 512 KiB per input block


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def flatten_order(shape) -> str:
  """"token" where `[B, T, V]` logits are flattened token-major (`B` a multiple of 8, `T > 1`
  not: the layout XLA:TPU gives such an array, see the module doc), else "batch"."""
  if len(shape) == 3 and shape[0] % ROWS == 0 and shape[1] > 1 and shape[1] % ROWS:
    return "token"
  return "batch"


def _rows(x, order: str):
  """`[..., V]` -> `[N, V]`, rows in `order` (`flatten_order`)."""
  if order == "token":
    x = jnp.swapaxes(x, 0, 1)
  return x.reshape(-1, x.shape[-1])


def _unflatten(out, lead, order: str):
  """Per-row results `[N, ...]` (rows in `order`) -> `lead + out.shape[1:]`."""
  tail = out.shape[1:]
  if order == "token":
    return jnp.swapaxes(out.reshape((lead[1], lead[0]) + tail), 0, 1)
  return out.reshape(tuple(lead) + tail)


def _flatten(x, fill, order: str):
  """`[..., V]` -> `([N', V], block_v)`: rows in `order`, padded with `fill` to a multiple of 8
  (the vocabulary is not padded: the kernels mask the last tile's lanes past `V`)."""
  rows = _rows(x, order)
  n, v = rows.shape
  block_v = v if v <= MAX_BLOCK_V else MAX_BLOCK_V
  if n % ROWS:
    rows = jnp.pad(rows, ((0, _round_up(n, ROWS) - n), (0, 0)), constant_values=fill)
  return rows, block_v


def _valid(ids, vocab):
  """Lanes of a tile that hold vocabulary entries (the last tile may run past `vocab`)."""
  return ids < vocab


def _reduce(kernel, inputs, small, *, out_dtypes, block_v, interpret, name):
  """Runs `kernel(*input_refs, small_ref, *out_refs)` over `(row blocks, vocab tiles)`."""
  n, v = inputs[0].shape
  in_specs = [pl.BlockSpec((ROWS, block_v), lambda i, j: (i, j)) for _ in inputs]
  operands = list(inputs)
  if small is not None:
    in_specs.append(pl.BlockSpec((ROWS, LANES), lambda i, j: (i, 0)))
    operands.append(small)
  out_spec = pl.BlockSpec((ROWS, LANES), lambda i, j: (i, 0))
  return pl.pallas_call(
      functools.partial(kernel, block_v=block_v, vocab=v),
      grid=(n // ROWS, pl.cdiv(v, block_v)),
      in_specs=in_specs,
      out_specs=[out_spec for _ in out_dtypes],
      out_shape=[jax.ShapeDtypeStruct((n, LANES), d) for d in out_dtypes],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name=name,
  )(*operands)


def _max_argmax_kernel(x_ref, max_ref, arg_ref, *, block_v, vocab):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
    arg_ref[...] = jnp.zeros(arg_ref.shape, jnp.int32)

  x = x_ref[...].astype(jnp.float32)  # [8, bv]
  ids = j * block_v + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  x = jnp.where(_valid(ids, vocab), x, -jnp.inf)
  # A NaN is the maximum and the first one wins (`tile_argmax`), as in `first_argmax`.
  tile_max, tile_arg = tile_argmax(x, ids)
  old = max_ref[:, 0:1]
  later = replaces(tile_max, old)
  arg_ref[...] = jnp.broadcast_to(jnp.where(later, tile_arg, arg_ref[:, 0:1]), arg_ref.shape)
  max_ref[...] = jnp.broadcast_to(jnp.where(later, tile_max, old), max_ref.shape)


def _sum_kernel(x_ref, sum_ref, *, block_v, vocab):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)

  x = x_ref[...].astype(jnp.float32)  # [8, bv]
  ids = j * block_v + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  total = jnp.sum(jnp.where(_valid(ids, vocab), x, 0.0), axis=-1, keepdims=True)
  sum_ref[...] = sum_ref[...] + jnp.broadcast_to(total, sum_ref.shape)


def _sum_at_least_kernel(x_ref, *refs, block_v, vocab, count: bool, num_thresholds: int):
  if count:
    thresholds_ref, out_ref = refs
    weights = None
  else:
    weights_ref, thresholds_ref, out_ref = refs
    weights = weights_ref[...].astype(jnp.float32)

  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

  x = x_ref[...].astype(jnp.float32)  # [8, bv]
  valid = _valid(j * block_v + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1), vocab)
  thresholds = thresholds_ref[...]  # [8, 128], lanes 0..R-1
  lane = jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 1)
  acc = out_ref[...]
  for t in range(num_thresholds):
    above = valid & (x >= thresholds[:, t:t + 1])
    if count:
      part = jnp.sum(above.astype(jnp.int32), axis=-1, keepdims=True)
    else:
      part = jnp.sum(jnp.where(above, weights, 0.0), axis=-1, keepdims=True)
    acc = acc + jnp.where(lane == t, part, 0).astype(acc.dtype)
  out_ref[...] = acc


@dataclasses.dataclass(frozen=True)
class PallasVocab:
  """`VocabOps` reductions over the whole last axis of a local slice, as Pallas kernels.

  Attributes:
    interpret: False (Mosaic, TPU), True or `pltpu.InterpretParams()` (the interpreter).
  """

  interpret: object = False
  vocab = None

  def ids(self, x):
    return jnp.arange(x.shape[-1], dtype=jnp.int32)

  def max_and_argmax(self, x):
    lead, order = x.shape[:-1], flatten_order(x.shape)
    rows, block_v = _flatten(x, -jnp.inf, order)
    best, arg = _reduce(_max_argmax_kernel, [rows], None, out_dtypes=(jnp.float32, jnp.int32),
                        block_v=block_v, interpret=self.interpret, name="vocab_argmax")
    n = _size(lead)
    return _unflatten(best[:n, 0], lead, order), _unflatten(arg[:n, 0], lead, order)

  def max(self, x):
    return self.max_and_argmax(x)[0]

  def argmax(self, x):
    return self.max_and_argmax(x)[1]

  def sum(self, x):
    lead, order = x.shape[:-1], flatten_order(x.shape)
    rows, block_v = _flatten(x, 0.0, order)
    (total,) = _reduce(_sum_kernel, [rows], None, out_dtypes=(jnp.float32,), block_v=block_v,
                       interpret=self.interpret, name="vocab_sum")
    return _unflatten(total[:_size(lead), 0], lead, order)

  def sum_at_least(self, x, weights, thresholds):
    lead, num, order = x.shape[:-1], thresholds.shape[-1], flatten_order(x.shape)
    rows, block_v = _flatten(x, -jnp.inf, order)
    inputs = [rows] if weights is None else [rows, _flatten(weights, 0.0, order)[0]]
    small = jnp.pad(_rows(thresholds.astype(jnp.float32), order),
                    ((0, rows.shape[0] - _size(lead)), (0, LANES - num)))
    kernel = functools.partial(_sum_at_least_kernel, count=weights is None, num_thresholds=num)
    (out,) = _reduce(kernel, inputs, small,
                     out_dtypes=(jnp.int32 if weights is None else jnp.float32,),
                     block_v=block_v, interpret=self.interpret, name="vocab_sum_at_least")
    return _unflatten(out[:_size(lead), :num], lead, order)

  def gather_at(self, x, ids):  # B * k scalars: a gather, no reduction
    return jnp.take_along_axis(x, ids[..., None], axis=-1)[..., 0]


def _size(shape) -> int:
  size = 1
  for d in shape:
    size *= d
  return size
