"""Fused rejection-sampling verify over vocabulary tiles (Pallas; TPU Mosaic and interpret mode).

One `pallas_call` turns target logits `[B, k+1, V]`, draft logits `[B, k, V]` (or a point-mass
drafter) and the draft tokens `[B, k]` into `VerifyResult(num_accepted [B], tokens [B, k+1])`.
It never writes a `[B, k+1, V]` probability array: every quantity is a per-row scalar accumulated
tile by tile, and the one vocabulary-sized draw (the correction / bonus token) is a Gumbel-max race
whose noise is a counter-based hash computed in the kernel.

The grid is `(B, num_passes, num_vocab_tiles)`. Each program owns one batch row and its `k+1`
target rows and `k` draft rows; the pass and tile axes run in order. The pass schedule is static:

  pass 0              STATS   online max / log-sum-exp (greedy: running argmax), logit at each draft
  1 ..                TOP_K   `BISECT_STEPS` counting passes, each halves an int32 key interval
  ..                  TOP_P   `BISECT_STEPS` mass passes on the top-k survivors
  ..                  SUM     the normaliser over the final kept set (only after a threshold)
  last                RACE    ratio test at tile 0 -> n accepted; residual and fallback races

so greedy is 1 pass, plain temperature 2, temperature with top-k and/or top-p 3 + 32 per threshold.
When the whole vocabulary fits one tile (`num_vocab_tiles == 1`) the block index never changes and
Pallas fetches the logits from HBM once; later passes re-read VMEM. With several tiles each pass
streams the logits again, so `BlockSizes.get_default` picks the largest tile the VMEM budget allows.

The math is `specjax.sampling`'s: `verify_reference` (aliased here as `fused_verify_reference`) is
the oracle, and the kernel calls the same elementwise helpers (`gumbel`, `float_to_key`,
`bisect_midpoint`, `bisect_update`) on tiles. Decisions agree token for token with the reference;
the only difference is the order of float32 additions inside sums over the vocabulary, which can
move a decision only when a comparison is within rounding of its boundary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax import sampling as sampling_lib
from specjax.sampling import Sampling, VerifyResult

LANES = 128  # TPU vector lanes; the (8, 128) tiling rule's minor dimension
SUBLANES = 8
NUM_ACCEPTED_LANE = LANES - 1  # lane of the output row that carries num_accepted
MAX_NUM_DRAFT = NUM_ACCEPTED_LANE - 1  # tokens take lanes 0..k, so k + 1 < 127
DEFAULT_VMEM_BUDGET = 8 * 2**20  # double-buffered logits blocks; under every TPU's scoped VMEM
_INT32_MAX = np.iinfo(np.int32).max
_NEG_INF = float("-inf")

fused_verify_reference = sampling_lib.verify_reference


# --------------------------------------------------------------------------------------------
# Block sizes.
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Vocabulary tile of the fused verify kernel.

  Attributes:
    block_v: lanes per vocabulary tile. A multiple of 128 (TPU (8, 128) rule: the minor block dim
      must be a multiple of 128 or the whole axis). A vocabulary that is not a multiple of it is
      handled by masking the last tile; one that is smaller uses one tile of exactly `V`.
  """

  block_v: int = 2048

  def __post_init__(self):
    if isinstance(self.block_v, bool) or not isinstance(self.block_v, int):
      raise ValueError(f"BlockSizes.block_v must be an int, got {self.block_v!r}")
    if self.block_v < LANES or self.block_v % LANES:
      raise ValueError(f"BlockSizes.block_v must be a positive multiple of {LANES}, "
                       f"got {self.block_v}")

  def tile(self, vocab: int) -> int:
    """The tile actually used for `vocab`: `block_v`, clamped to the whole axis if that is smaller."""
    return vocab if vocab <= self.block_v else self.block_v

  @classmethod
  def get_default(cls, vocab: int, num_draft: int, dtype=jnp.float32, *, has_draft_logits=True,
                  vmem_budget: int = DEFAULT_VMEM_BUDGET) -> BlockSizes:
    """The largest tile whose double-buffered target and draft blocks fit `vmem_budget` bytes.

    Rows are counted padded to the dtype's sublane tile (8 for 32-bit, 16 for 16-bit), as VMEM
    stores them. A result `>= vocab` means one tile: the logits are read from HBM exactly once.
    """
    itemsize = jnp.dtype(dtype).itemsize
    row_tile = SUBLANES * max(1, 4 // itemsize)
    rows = _round_up(num_draft + 1, row_tile) + (_round_up(num_draft, row_tile)
                                                 if has_draft_logits else 0)
    per_lane = 2 * rows * itemsize  # two pipeline buffers
    block_v = max(LANES, (vmem_budget // per_lane) // LANES * LANES)
    return cls(block_v=min(block_v, _round_up(vocab, LANES)))


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


# --------------------------------------------------------------------------------------------
# Public wrapper.
# --------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("sampling", "block_sizes", "interpret"))
def fused_verify(target_logits: jax.Array, draft_logits: jax.Array | None,
                 draft_tokens: jax.Array, *, sampling: Sampling, seed: jax.Array,
                 positions: jax.Array, rows: jax.Array | None = None,
                 block_sizes: BlockSizes | None = None, interpret=False) -> VerifyResult:
  """The speculative accept/reject rule, fused over vocabulary tiles.

  Same contract and same tokens as `specjax.sampling.verify_reference`.

  Args:
    target_logits: `[B, k+1, V]` raw target logits (float32 or bfloat16).
    draft_logits: `[B, k, V]` raw draft logits, or None for a point-mass (deterministic) drafter.
    draft_tokens: `[B, k]` int32 proposals.
    sampling: `specjax.Sampling`, static; applied to both models' logits.
    seed: `uint32[2]` seed words of this round.
    positions: `[B]` int32 absolute position of each row's first draft token.
    rows: `[B]` int32 random-stream row ids (default `arange(B)`).
    block_sizes: `BlockSizes` (default `BlockSizes.get_default(...)`).
    interpret: False (compiled: Mosaic on TPU), True (Pallas interpreter) or
      `pltpu.InterpretParams()` (TPU interpreter with TPU memory semantics).

  Returns:
    `VerifyResult(num_accepted [B] int32, tokens [B, k+1] int32)`.
  """
  batch, num_draft = draft_tokens.shape
  vocab = target_logits.shape[-1]
  if target_logits.ndim != 3 or target_logits.shape[:2] != (batch, num_draft + 1):
    raise ValueError(f"target_logits must be [B, k+1, V] = [{batch}, {num_draft + 1}, V], "
                     f"got {target_logits.shape}")
  if draft_logits is not None and draft_logits.shape != (batch, num_draft, vocab):
    raise ValueError(f"draft_logits must be [B, k, V] = {(batch, num_draft, vocab)}, "
                     f"got {draft_logits.shape}")
  if not 1 <= num_draft <= MAX_NUM_DRAFT:
    raise ValueError(f"num_draft must be in [1, {MAX_NUM_DRAFT}], got {num_draft}")
  for name, x in (("target_logits", target_logits), ("draft_logits", draft_logits)):
    if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point, got {x.dtype}")
  if block_sizes is None:
    block_sizes = BlockSizes.get_default(vocab, num_draft, target_logits.dtype,
                                         has_draft_logits=draft_logits is not None)
  rows = jnp.arange(batch, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
  out = _fused_verify_impl(target_logits, draft_logits, draft_tokens.astype(jnp.int32),
                           seed.astype(jnp.uint32), positions.astype(jnp.int32), rows,
                           sampling=sampling, block_v=block_sizes.tile(vocab),
                           interpret=interpret)
  return VerifyResult(num_accepted=out[:, 0, NUM_ACCEPTED_LANE],
                      tokens=out[:, 0, :num_draft + 1])


# --------------------------------------------------------------------------------------------
# Grid, BlockSpecs, pass schedule.
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Schedule:
  """Static pass layout: `[STATS] [TOP_K x n] [TOP_P x n] [SUM] [RACE]`; greedy is `[STATS]`."""

  greedy: bool
  top_k: int | None  # active top-k (None when off or >= V)
  top_p: float | None  # active top-p (None when off or 1)

  @property
  def first_top_k(self) -> int:
    return 1

  @property
  def first_top_p(self) -> int:
    return self.first_top_k + (sampling_lib.BISECT_STEPS if self.top_k else 0)

  @property
  def sum_pass(self) -> int:
    return self.first_top_p + (sampling_lib.BISECT_STEPS if self.top_p else 0)

  @property
  def has_threshold(self) -> bool:
    return bool(self.top_k or self.top_p)

  @property
  def race_pass(self) -> int:
    return self.sum_pass + (1 if self.has_threshold else 0)

  @property
  def num_passes(self) -> int:
    return 1 if self.greedy else self.race_pass + 1


def _schedule(sampling: Sampling, vocab: int) -> _Schedule:
  if sampling.greedy:
    return _Schedule(True, None, None)
  top_k = sampling.top_k if sampling.top_k is not None and sampling.top_k < vocab else None
  top_p = sampling.top_p if sampling.top_p is not None and sampling.top_p < 1.0 else None
  return _Schedule(False, top_k, top_p)


# Per-row statistics in VMEM scratch, one set for the target rows and one for the draft rows.
# Each is [rows, 128] with the value replicated across lanes (lane-dense for Mosaic).
_ROW_STATS = ("max", "sum", "draft_logit", "argmax", "lo", "hi", "top_k_key", "count", "mass")
_ROW_STATS_DTYPE = dict(argmax=jnp.int32, lo=jnp.int32, hi=jnp.int32, top_k_key=jnp.int32,
                        count=jnp.int32)
# Race state, [1, 128] each.
_RACE_STATE = ("num_accepted", "residual_best", "residual_token", "fallback_best",
               "fallback_token", "has_mass")
_RACE_STATE_DTYPE = dict(num_accepted=jnp.int32, residual_token=jnp.int32, fallback_token=jnp.int32,
                         has_mass=jnp.int32)


def _fused_verify_impl(target_logits, draft_logits, draft_tokens, seed, positions, rows, *,
                       sampling: Sampling, block_v: int, interpret):
  batch, num_draft = draft_tokens.shape
  vocab = target_logits.shape[-1]
  schedule = _schedule(sampling, vocab)
  num_tiles = pl.cdiv(vocab, block_v)
  has_draft_logits = draft_logits is not None and not schedule.greedy

  if schedule.greedy:
    accept_uniforms = jnp.zeros((batch, num_draft), jnp.float32)
  else:  # [B, k]: tiny, and bit-identical to the reference's draw
    token_positions = positions[:, None] + jnp.arange(num_draft, dtype=jnp.int32)
    accept_uniforms = sampling_lib.uniform(seed, rows[:, None], token_positions, 0,
                                           sampling_lib.PURPOSE_ACCEPT)
  scalars = (jax.lax.bitcast_convert_type(seed, jnp.int32),  # SMEM [2]
             rows, positions,  # SMEM [B]
             draft_tokens.reshape(-1), accept_uniforms.reshape(-1))  # SMEM [B * k]

  def logits_spec(num_rows):  # [1, rows, block_v]: rows = whole axis, block_v lane-aligned or V
    return pl.BlockSpec((1, num_rows, block_v), lambda b, p, j, *_: (b, 0, j))

  in_specs = [logits_spec(num_draft + 1)]
  inputs = [target_logits]
  if has_draft_logits:
    in_specs.append(logits_spec(num_draft))
    inputs.append(draft_logits)
  stats_sets = [num_draft + 1] + ([num_draft] if has_draft_logits else [])
  scratch = []
  for num_rows in stats_sets:
    scratch += [pltpu.VMEM((num_rows, LANES), _ROW_STATS_DTYPE.get(name, jnp.float32))
                for name in _ROW_STATS]
  scratch += [pltpu.VMEM((1, LANES), _RACE_STATE_DTYPE.get(name, jnp.float32))
              for name in _RACE_STATE]

  kernel = functools.partial(
      _fused_verify_kernel, sampling=sampling, schedule=schedule, num_draft=num_draft,
      vocab=vocab, block_v=block_v, num_tiles=num_tiles, has_draft_logits=has_draft_logits)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(scalars),
      grid=(batch, schedule.num_passes, num_tiles),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((1, 1, LANES), lambda b, p, j, *_: (b, 0, 0)),
      scratch_shapes=scratch)
  bytes_accessed = sum(x.size * x.dtype.itemsize for x in inputs)
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((batch, 1, LANES), jnp.int32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      cost_estimate=pl.CostEstimate(
          flops=8 * schedule.num_passes * batch * (2 * num_draft + 1) * vocab,
          transcendentals=(2 * num_draft + 4) * batch * vocab,
          bytes_accessed=bytes_accessed * (1 if num_tiles == 1 else schedule.num_passes)
          + batch * LANES * 4),
      interpret=interpret,
      name="fused_verify",
  )(*scalars, *inputs)


# --------------------------------------------------------------------------------------------
# Kernel body.
# --------------------------------------------------------------------------------------------

def _column(ref):
  """[rows, 1] view of a lane-replicated [rows, 128] scratch value."""
  return ref[:, 0:1]


def _set_column(ref, value):
  ref[...] = jnp.broadcast_to(value, ref.shape).astype(ref.dtype)


def _tile_argmax(scores, vocab_ids):
  """Per row: (max [R, 1], first vocab id attaining it [R, 1]) of a tile."""
  best = jnp.max(scores, axis=-1, keepdims=True)
  token = jnp.min(jnp.where(scores == best, vocab_ids, _INT32_MAX), axis=-1, keepdims=True)
  return best, token


def _select_row(values, row_ids, row):
  """values[row] of [R, C] -> [1, C] (masked reduction instead of a dynamic sublane slice)."""
  return jnp.max(jnp.where(row_ids == row, values, _NEG_INF), axis=0, keepdims=True)


def _fused_verify_kernel(seed_ref, rows_ref, positions_ref, draft_tokens_ref, accept_uniforms_ref,
                         *refs, sampling: Sampling, schedule: _Schedule, num_draft: int, vocab: int,
                         block_v: int, num_tiles: int, has_draft_logits: bool):
  target_ref, *refs = refs
  draft_ref = refs.pop(0) if has_draft_logits else None
  out_ref, *scratch = refs
  num_stats = len(_ROW_STATS)
  target_stats = dict(zip(_ROW_STATS, scratch[:num_stats]))
  draft_stats = dict(zip(_ROW_STATS, scratch[num_stats:2 * num_stats])) if has_draft_logits else None
  race = dict(zip(_RACE_STATE, scratch[-len(_RACE_STATE):]))

  k = num_draft
  b = pl.program_id(0)
  pass_id = pl.program_id(1)
  tile = pl.program_id(2)
  first_tile = tile == 0
  last_tile = tile == num_tiles - 1

  vocab_ids = tile * block_v + jax.lax.broadcasted_iota(jnp.int32, (1, block_v), 1)  # [1, bv]
  in_vocab = vocab_ids < vocab  # the last tile may run past V: its tail is garbage

  def draft_column(num_rows):  # [rows, 1] int32: draft token of each row, -1 past k
    row_ids = jax.lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0)
    column = jnp.full((num_rows, 1), -1, jnp.int32)
    for i in range(min(k, num_rows)):
      column = jnp.where(row_ids == i, draft_tokens_ref[b * k + i], column)
    return column

  def load(ref):  # [rows, bv] float32 scaled logits, -inf outside the vocabulary
    x = ref[0].astype(jnp.float32)
    if not schedule.greedy:
      x = x / jnp.float32(sampling.temperature)
    return jnp.where(in_vocab, x, _NEG_INF)

  row_sets = [(target_ref, target_stats)]
  if has_draft_logits:
    row_sets.append((draft_ref, draft_stats))

  # ---- pass 0: running max, online sum of exp, logit at the draft token (greedy: argmax).
  @pl.when(pass_id == 0)
  def _stats():
    for ref, stats in row_sets:
      num_rows = ref.shape[1]

      @pl.when(first_tile)
      def _init():
        _set_column(stats["max"], _NEG_INF)
        _set_column(stats["sum"], 0.0)
        _set_column(stats["draft_logit"], _NEG_INF)
        _set_column(stats["argmax"], 0)

      x = load(ref)
      old_max = _column(stats["max"])
      tile_max, tile_token = _tile_argmax(x, vocab_ids)
      new_max = jnp.maximum(old_max, tile_max)
      if schedule.greedy:
        _set_column(stats["argmax"], jnp.where(tile_max > old_max,
                                               tile_token, _column(stats["argmax"])))
      else:
        # Online log-sum-exp; the where()s keep all -inf prefixes from producing NaN.
        rescale = jnp.where(old_max == new_max, 1.0, jnp.exp(old_max - new_max))
        terms = jnp.where(x == _NEG_INF, 0.0, jnp.exp(x - new_max))
        _set_column(stats["sum"], _column(stats["sum"]) * rescale
                    + jnp.sum(terms, axis=-1, keepdims=True))
        at_draft = jnp.where(vocab_ids == draft_column(num_rows), x, _NEG_INF)
        _set_column(stats["draft_logit"], jnp.maximum(_column(stats["draft_logit"]),
                                                      jnp.max(at_draft, axis=-1, keepdims=True)))
      _set_column(stats["max"], new_max)

  if schedule.greedy:
    @pl.when(last_tile)
    def _greedy_finish():
      target_argmax = _column(target_stats["argmax"])  # [k+1, 1]
      matches = (target_argmax == draft_column(k + 1)).astype(jnp.int32)
      num_accepted = _leading_ones(matches, k)
      final = jnp.max(jnp.where(jax.lax.broadcasted_iota(jnp.int32, (k + 1, 1), 0)
                                == num_accepted, target_argmax, -1), axis=0, keepdims=True)
      _write_tokens(out_ref, draft_tokens_ref, b, k, num_accepted, final)
    return

  def threshold(stats):  # [rows, 1] float32 of the final kept set
    if schedule.top_p:
      return sampling_lib.key_to_float(stats["lo"][:, 0:1])
    if schedule.top_k:
      return sampling_lib.key_to_float(_column(stats["top_k_key"]))
    return jnp.full(stats["max"].shape[:1] + (1,), _NEG_INF, jnp.float32)

  # ---- top-k: count(x >= mid) >= top_k, one bisection step per pass.
  if schedule.top_k:
    @pl.when((pass_id >= schedule.first_top_k) & (pass_id < schedule.first_top_p))
    def _top_k_pass():
      for ref, stats in row_sets:
        @pl.when((pass_id == schedule.first_top_k) & first_tile)
        def _init_bounds():
          _set_column(stats["lo"], sampling_lib.float_to_key(jnp.float32(_NEG_INF)))
          _set_column(stats["hi"], sampling_lib.float_to_key(_column(stats["max"])))

        @pl.when(first_tile)
        def _reset():
          _set_column(stats["count"], 0)

        lo, hi = _column(stats["lo"]), _column(stats["hi"])
        mid = sampling_lib.bisect_midpoint(lo, hi)
        x = load(ref)
        count = jnp.sum((x >= sampling_lib.key_to_float(mid)).astype(jnp.int32), axis=-1,
                        keepdims=True)
        _set_column(stats["count"], _column(stats["count"]) + count)

        @pl.when(last_tile)
        def _step():
          new_lo, new_hi = sampling_lib.bisect_update(
              lo, hi, mid, _column(stats["count"]) >= schedule.top_k)
          _set_column(stats["lo"], new_lo)
          _set_column(stats["hi"], new_hi)
          _set_column(stats["top_k_key"], new_lo)

  def kept_weights(x, stats, floor):  # exp(x - max) on tokens >= floor, else 0
    return jnp.where(x >= floor, jnp.exp(x - _column(stats["max"])), 0.0)

  def top_k_floor(stats):
    if schedule.top_k:
      return sampling_lib.key_to_float(_column(stats["top_k_key"]))
    return jnp.full(stats["max"].shape[:1] + (1,), _NEG_INF, jnp.float32)

  # ---- top-p: mass(x >= mid) >= top_p * mass(all kept), one bisection step per pass.
  if schedule.top_p:
    @pl.when((pass_id >= schedule.first_top_p) & (pass_id < schedule.sum_pass))
    def _top_p_pass():
      for ref, stats in row_sets:
        @pl.when((pass_id == schedule.first_top_p) & first_tile)
        def _init_bounds():
          _set_column(stats["lo"], sampling_lib.float_to_key(jnp.float32(_NEG_INF)))
          _set_column(stats["hi"], sampling_lib.float_to_key(_column(stats["max"])))

        @pl.when(first_tile)
        def _reset():
          _set_column(stats["mass"], 0.0)
          _set_column(stats["sum"], 0.0)

        lo, hi = _column(stats["lo"]), _column(stats["hi"])
        mid = sampling_lib.bisect_midpoint(lo, hi)
        x = load(ref)
        weights = kept_weights(x, stats, top_k_floor(stats))
        _set_column(stats["sum"], _column(stats["sum"]) + jnp.sum(weights, -1, keepdims=True))
        above = jnp.where(x >= sampling_lib.key_to_float(mid), weights, 0.0)
        _set_column(stats["mass"], _column(stats["mass"]) + jnp.sum(above, -1, keepdims=True))

        @pl.when(last_tile)
        def _step():
          needed = jnp.float32(schedule.top_p) * _column(stats["sum"])
          new_lo, new_hi = sampling_lib.bisect_update(lo, hi, mid,
                                                      _column(stats["mass"]) >= needed)
          _set_column(stats["lo"], new_lo)
          _set_column(stats["hi"], new_hi)

  # ---- normaliser over the final kept set, with the final max (no rescaling).
  if schedule.has_threshold:
    @pl.when(pass_id == schedule.sum_pass)
    def _sum_pass():
      for ref, stats in row_sets:
        @pl.when(first_tile)
        def _reset():
          _set_column(stats["sum"], 0.0)

        weights = kept_weights(load(ref), stats, threshold(stats))
        _set_column(stats["sum"], _column(stats["sum"]) + jnp.sum(weights, -1, keepdims=True))

  # ---- ratio test, then the residual race (and the fallback race on p) over row n.
  @pl.when(pass_id == schedule.race_pass)
  def _race_pass():
    def probability(logit, stats):  # softmax of the warped logits at given [rows, 1] logits
      warped = jnp.where(logit >= threshold(stats), logit, _NEG_INF)
      return jnp.exp(warped - _column(stats["max"])) / _column(stats["sum"])

    @pl.when(first_tile)
    def _ratio_test():
      row_ids = jax.lax.broadcasted_iota(jnp.int32, (k + 1, 1), 0)
      p_draft = probability(_column(target_stats["draft_logit"]), target_stats)  # [k+1, 1]
      if has_draft_logits:
        q_draft = probability(_column(draft_stats["draft_logit"]), draft_stats)  # [k, 1]
        q_draft = jnp.concatenate([q_draft, jnp.ones((1, 1), jnp.float32)], axis=0)
      else:
        q_draft = jnp.ones((k + 1, 1), jnp.float32)
      uniforms = jnp.ones((k + 1, 1), jnp.float32)
      for i in range(k):
        uniforms = jnp.where(row_ids == i, accept_uniforms_ref[b * k + i], uniforms)
      accepted = (uniforms * q_draft < p_draft).astype(jnp.int32)
      _set_column(race["num_accepted"], _leading_ones(accepted, k))
      _set_column(race["residual_best"], _NEG_INF)
      _set_column(race["fallback_best"], _NEG_INF)
      _set_column(race["residual_token"], 0)
      _set_column(race["fallback_token"], 0)
      _set_column(race["has_mass"], 0)

    n = _column(race["num_accepted"])  # [1, 1]
    target_rows = jax.lax.broadcasted_iota(jnp.int32, (k + 1, 1), 0)
    p = probability(_select_row(load(target_ref), target_rows, n), _RowPick(target_stats, n))
    if has_draft_logits:
      draft_rows = jax.lax.broadcasted_iota(jnp.int32, (k, 1), 0)
      q = probability(_select_row(load(draft_ref), draft_rows, n), _RowPick(draft_stats, n))
      q = jnp.where(n < k, q, 0.0)  # the bonus slot has q = 0
    else:  # point mass at the draft token
      draft_n = jnp.max(jnp.where(target_rows == n, draft_column(k + 1), -1), axis=0,
                        keepdims=True)
      q = (vocab_ids == draft_n).astype(jnp.float32)
    residual = jnp.maximum(p - q, 0.0)
    seed_words = (seed_ref[0], seed_ref[1])
    noise = sampling_lib.gumbel(seed_words, rows_ref[b], positions_ref[b] + n, vocab_ids,
                                sampling_lib.PURPOSE_RESIDUAL)  # [1, bv]
    for weights, best_key, token_key in ((residual, "residual_best", "residual_token"),
                                         (p, "fallback_best", "fallback_token")):
      scores = jnp.where(weights > 0, jnp.log(weights), _NEG_INF) + noise
      tile_best, tile_token = _tile_argmax(jnp.where(in_vocab, scores, _NEG_INF), vocab_ids)
      old_best = _column(race[best_key])
      _set_column(race[token_key], jnp.where(tile_best > old_best, tile_token,
                                             _column(race[token_key])))
      _set_column(race[best_key], jnp.maximum(old_best, tile_best))
    tile_has_mass = jnp.max((residual > 0).astype(jnp.int32), axis=-1, keepdims=True)
    _set_column(race["has_mass"], jnp.maximum(_column(race["has_mass"]), tile_has_mass))

    @pl.when(last_tile)
    def _finish():
      final = jnp.where(_column(race["has_mass"]) > 0, _column(race["residual_token"]),
                        _column(race["fallback_token"]))
      _write_tokens(out_ref, draft_tokens_ref, b, k, n, final)


class _RowPick:
  """The per-row statistics of one selected row `n`, looking like a stats dict of [1, 128] refs."""

  def __init__(self, stats, n):
    self._stats = stats
    self._n = n

  def __getitem__(self, name):
    value = self._stats[name][...]
    row_ids = jax.lax.broadcasted_iota(jnp.int32, value.shape, 0)
    if value.dtype == jnp.int32:
      picked = jnp.max(jnp.where(row_ids == self._n, value, np.iinfo(np.int32).min), axis=0,
                       keepdims=True)
    else:
      picked = _select_row(value, row_ids, self._n)
    return picked


def _leading_ones(flags, k):
  """[rows, 1] int32 0/1 -> [1, 1] number of leading ones among the first k rows."""
  alive = jnp.ones((1, 1), jnp.int32)
  count = jnp.zeros((1, 1), jnp.int32)
  for i in range(k):
    alive = alive * flags[i:i + 1, :]
    count = count + alive
  return count


def _write_tokens(out_ref, draft_tokens_ref, b, k, num_accepted, final):
  """Output row: lanes 0..n-1 accepted drafts, lane n the final token, lane 127 n; zeros else."""
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
  drafts = jnp.zeros((1, LANES), jnp.int32)
  for i in range(k):
    drafts = jnp.where(lane == i, draft_tokens_ref[b * k + i], drafts)
  tokens = jnp.where(lane < num_accepted, drafts, 0)
  tokens = jnp.where(lane == num_accepted, final, tokens)
  tokens = jnp.where(lane == NUM_ACCEPTED_LANE, num_accepted, tokens)
  out_ref[0] = tokens
