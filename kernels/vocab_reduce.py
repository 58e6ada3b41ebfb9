"""Pallas reductions over a vocabulary slice: the local half of the vocabulary-sharded verify.

Under a mesh that splits the vocabulary, `specjax.verify.rule.verify_rule` runs over
`specjax.verify.sharded.ShardedVocab`, which reduces each device's `[..., Vl]` slice and combines
the results with collectives. `PallasVocab` does those local reductions (max, sum, first argmax
and the threshold search's `sum_at_least`) as tiled Pallas kernels that stream the slice once
each, with Mosaic on TPU or the Pallas interpreter. Rows are flattened to `[N, Vl]` and tiled in
blocks of `(8, block_v)`; results come back lane-dense in `[N, 128]`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
ROWS = 8  # rows per block: the (8, 128) tiling rule's second-minor dimension
MAX_BLOCK_V = 16384  # 8 x 16384 f32 = 512 KiB per input block


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _flatten(x, fill):
  """`[..., V]` -> `[N, V]` padded to `(8, block_v)` multiples with `fill`; returns block_v."""
  rows = x.reshape(-1, x.shape[-1])
  n, v = rows.shape
  block_v = min(MAX_BLOCK_V, _round_up(v, LANES))
  rows = jnp.pad(rows, ((0, _round_up(n, ROWS) - n), (0, _round_up(v, block_v) - v)),
                 constant_values=fill)
  return rows, block_v


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
      functools.partial(kernel, block_v=block_v),
      grid=(n // ROWS, v // block_v),
      in_specs=in_specs,
      out_specs=[out_spec for _ in out_dtypes],
      out_shape=[jax.ShapeDtypeStruct((n, LANES), d) for d in out_dtypes],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name=name,
  )(*operands)


def _max_argmax_kernel(x_ref, max_ref, arg_ref, *, block_v):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
    arg_ref[...] = jnp.zeros(arg_ref.shape, jnp.int32)

  x = x_ref[...].astype(jnp.float32)  # [8, bv]
  ids = j * block_v + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  tile_max = jnp.max(x, axis=-1, keepdims=True)
  tile_arg = jnp.min(jnp.where(x == tile_max, ids, 2**31 - 1), axis=-1, keepdims=True)
  old = max_ref[:, 0:1]
  arg_ref[...] = jnp.broadcast_to(jnp.where(tile_max > old, tile_arg, arg_ref[:, 0:1]),
                                  arg_ref.shape)
  max_ref[...] = jnp.broadcast_to(jnp.maximum(old, tile_max), max_ref.shape)


def _sum_kernel(x_ref, sum_ref, *, block_v):
  del block_v

  @pl.when(pl.program_id(1) == 0)
  def _init():
    sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)

  total = jnp.sum(x_ref[...].astype(jnp.float32), axis=-1, keepdims=True)
  sum_ref[...] = sum_ref[...] + jnp.broadcast_to(total, sum_ref.shape)


def _sum_at_least_kernel(x_ref, *refs, block_v, count: bool, num_thresholds: int):
  del block_v
  if count:
    thresholds_ref, out_ref = refs
    weights = None
  else:
    weights_ref, thresholds_ref, out_ref = refs
    weights = weights_ref[...].astype(jnp.float32)

  @pl.when(pl.program_id(1) == 0)
  def _init():
    out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

  x = x_ref[...].astype(jnp.float32)  # [8, bv]
  thresholds = thresholds_ref[...]  # [8, 128], lanes 0..R-1
  lane = jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 1)
  acc = out_ref[...]
  for j in range(num_thresholds):
    above = x >= thresholds[:, j:j + 1]
    if count:
      part = jnp.sum(above.astype(jnp.int32), axis=-1, keepdims=True)
    else:
      part = jnp.sum(jnp.where(above, weights, 0.0), axis=-1, keepdims=True)
    acc = acc + jnp.where(lane == j, part, 0).astype(acc.dtype)
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
    lead = x.shape[:-1]
    rows, block_v = _flatten(x, -jnp.inf)
    best, arg = _reduce(_max_argmax_kernel, [rows], None, out_dtypes=(jnp.float32, jnp.int32),
                        block_v=block_v, interpret=self.interpret, name="vocab_argmax")
    n = _size(lead)
    return best[:n, 0].reshape(lead), arg[:n, 0].reshape(lead)

  def max(self, x):
    return self.max_and_argmax(x)[0]

  def argmax(self, x):
    return self.max_and_argmax(x)[1]

  def sum(self, x):
    lead = x.shape[:-1]
    rows, block_v = _flatten(x, 0.0)
    (total,) = _reduce(_sum_kernel, [rows], None, out_dtypes=(jnp.float32,), block_v=block_v,
                       interpret=self.interpret, name="vocab_sum")
    return total[:_size(lead), 0].reshape(lead)

  def sum_at_least(self, x, weights, thresholds):
    lead, num = x.shape[:-1], thresholds.shape[-1]
    rows, block_v = _flatten(x, -jnp.inf)
    inputs = [rows] if weights is None else [rows, _flatten(weights, 0.0)[0]]
    small = jnp.pad(thresholds.reshape(-1, num).astype(jnp.float32),
                    ((0, rows.shape[0] - _size(lead)), (0, LANES - num)))
    kernel = functools.partial(_sum_at_least_kernel, count=weights is None, num_thresholds=num)
    (out,) = _reduce(kernel, inputs, small,
                     out_dtypes=(jnp.int32 if weights is None else jnp.float32,),
                     block_v=block_v, interpret=self.interpret, name="vocab_sum_at_least")
    return out[:_size(lead), :num].reshape(lead + (num,))

  def gather_at(self, x, ids):  # B * k scalars: a gather, no reduction
    return jnp.take_along_axis(x, ids[..., None], axis=-1)[..., 0]


def _size(shape) -> int:
  size = 1
  for d in shape:
    size *= d
  return size
