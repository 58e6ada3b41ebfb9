"""Fused rejection-sampling verify for GPUs (Pallas Triton backend; also runs in interpret mode).

The same math, the same random numbers and the same `VerifyResult` as the TPU kernel in
`fused_verify.py` and the oracle `specjax.verify.rule.verify_reference`; only the schedule differs.
Triton has no sequential grid axes with persistent scratch, so each program owns a block of
`block_b` batch rows and runs every pass itself, as `lax.fori_loop`s over vocabulary tiles:

  STATS   online max / log-sum-exp (greedy: running argmax), logit at each draft token
  TOP_K   `RADIX_ROUNDS` = 8 radix rounds, each a loop over the tiles counting RADIX - 1 = 15
          candidate thresholds at once (one per lane)
  TOP_P   `RADIX_ROUNDS` radix rounds of masses on the top-k survivors, above the top-k floor
  SUM     the normaliser over the final kept set (only after a threshold)
  RACE    ratio test -> n accepted; residual and fallback Gumbel races over row n

Per-row statistics are `[block_b, R, 1]` register values carried by the loops (`R` = `k+1` rounded
up to a power of two, as Triton requires); logits tiles are `[block_b, R, block_v]` masked loads,
so rows past `B`, rows past `k` (`k+1` for the target) and lanes past `V` are never read.

Export: `jax.export(..., platforms=["cuda"])` lowers this kernel to the custom call
`__gpu$xla.gpu.triton`, which `jax.export` accepts only with
`disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]`
(`GPU_EXPORT_DISABLED_CHECKS`). That check guards serialization compatibility: the Triton IR in
the module is not covered by jax's stability guarantee, so an exported artifact should be run with
the jax / jaxlib version that exported it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.core import sampling as sampling_lib
from specjax.kernels.common import (Schedule, accept_uniforms, check_verify_args,
                                    drafted_tokens, replaces, schedule_for, select_row,
                                    tile_argmax)
from specjax.core.sampling import Sampling, VerifyResult

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
GPU_EXPORT_DISABLED_CHECKS = (jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL),)
SEARCH_LANES = 16  # RADIX as a power of two: candidate j of a threshold-search round in lane j
DEFAULT_TILE_ELEMENTS = 8192  # block_b * R * block_v per loaded tile: ~64 float32 per thread
_NEG_INF = float("-inf")
# sampling.float_to_key(-inf) as a Python int (Triton cannot lower a bitcast of a constant): the
# sign bit is set, so the key is the bit pattern with the magnitude bits flipped.
_NEG_INF_KEY = int(np.float32(_NEG_INF).view(np.int32)) ^ 0x7FFFFFFF


# --------------------------------------------------------------------------------------------
# Block sizes.
# --------------------------------------------------------------------------------------------

def _is_power_of_two(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
  """Tiles of the GPU kernel. Triton block shapes are powers of two.

  Attributes:
    block_v: vocabulary lanes per tile (a power of two); the last tile is masked.
    block_b: batch rows per program (a power of two); a partial last block is masked.
    num_warps: warps per program.
  """

  block_v: int = 1024
  block_b: int = 1
  num_warps: int = 4

  def __post_init__(self):
    for name in ("block_v", "block_b", "num_warps"):
      if not _is_power_of_two(getattr(self, name)):
        raise ValueError(f"GpuBlockSizes.{name} must be a power of two, "
                         f"got {getattr(self, name)!r}")

  @classmethod
  def get_default(cls, vocab: int, num_draft: int, batch: int | None = None) -> GpuBlockSizes:
    """One batch row per program (B programs keep the GPU busy already), the widest tile with
    at most `DEFAULT_TILE_ELEMENTS` elements, never wider than the vocabulary needs."""
    del batch
    rows = pl.next_power_of_2(num_draft + 1)
    block_v = max(16, min(pl.next_power_of_2(vocab), DEFAULT_TILE_ELEMENTS // rows))
    return cls(block_v=block_v, block_b=1, num_warps=4 if block_v * rows <= 4096 else 8)


# --------------------------------------------------------------------------------------------
# Public wrapper.
# --------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("sampling", "block_sizes", "interpret"))
def fused_verify_gpu(target_logits: jax.Array, draft_logits: jax.Array | None,
                     draft_tokens: jax.Array, *, sampling: Sampling, seeds: jax.Array,
                     positions: jax.Array, num_drafted: jax.Array | None = None,
                     block_sizes: GpuBlockSizes | None = None,
                     interpret: bool = False) -> VerifyResult:
  """The speculative accept/reject rule on GPU (Triton), fused over vocabulary tiles.

  Same arguments, contract and tokens as `specjax.kernels.fused_verify` (and
  `specjax.verify.rule.verify_reference`), except `block_sizes` is a `GpuBlockSizes` and `interpret`
  is a bool (the Pallas interpreter, any platform).
  """
  batch, num_draft = check_verify_args(target_logits, draft_logits, draft_tokens)
  vocab = target_logits.shape[-1]
  if block_sizes is None:
    block_sizes = GpuBlockSizes.get_default(vocab, num_draft, batch)
  draft_tokens, num_drafted = drafted_tokens(draft_tokens.astype(jnp.int32), num_drafted)
  out = _fused_verify_gpu_impl(target_logits, draft_logits, draft_tokens, num_drafted,
                               jnp.asarray(seeds, jnp.uint32), positions.astype(jnp.int32),
                               sampling=sampling, block_sizes=block_sizes, interpret=interpret)
  return VerifyResult(num_accepted=out[:, 0, -1], tokens=out[:, 0, :num_draft + 1])


def _fused_verify_gpu_impl(target_logits, draft_logits, draft_tokens, num_drafted, seeds,
                           positions, *,
                           sampling: Sampling, block_sizes: GpuBlockSizes, interpret: bool):
  batch, num_draft = draft_tokens.shape
  vocab = target_logits.shape[-1]
  schedule = schedule_for(sampling, vocab)
  has_draft_logits = draft_logits is not None and not schedule.greedy
  num_rows = pl.next_power_of_2(num_draft + 1)  # R: row axis of every block
  out_lanes = pl.next_power_of_2(num_draft + 2)  # tokens in lanes 0..k, n in the last lane

  # Small per-row inputs, padded to R rows: draft token -1 (matches nothing; also every slot
  # past a row's num_drafted), uniform 1.
  uniforms = accept_uniforms(seeds, positions, num_draft, sampling)
  pad = ((0, 0), (0, num_rows - num_draft))
  draft_column = jnp.pad(draft_tokens, pad, constant_values=-1)[..., None]  # [B, R, 1]
  uniform_column = jnp.pad(uniforms, pad, constant_values=1.0)[..., None]  # [B, R, 1]
  seed_words = jax.lax.bitcast_convert_type(seeds, jnp.int32)
  zeros = jnp.zeros_like(positions)
  row_columns = jnp.stack([seed_words, positions, num_drafted, zeros],
                          axis=-1)[:, None, :]  # [B, 1, 4]: stream seed, position, num_drafted
  inputs = [draft_column, uniform_column, row_columns, target_logits]
  if has_draft_logits:
    inputs.append(draft_logits)

  kernel = functools.partial(
      _fused_verify_gpu_kernel, sampling=sampling, schedule=schedule, batch=batch,
      num_draft=num_draft, vocab=vocab, num_rows=num_rows, out_lanes=out_lanes,
      block_b=block_sizes.block_b, block_v=block_sizes.block_v,
      has_draft_logits=has_draft_logits)
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(batch, block_sizes.block_b),),
      out_shape=jax.ShapeDtypeStruct((batch, 1, out_lanes), jnp.int32),
      compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=1),
      interpret=interpret,
      name="fused_verify_gpu",
  )(*inputs)


# --------------------------------------------------------------------------------------------
# Kernel body.
# --------------------------------------------------------------------------------------------

def _fused_verify_gpu_kernel(draft_column_ref, uniform_column_ref, row_columns_ref,
                             *refs, sampling: Sampling, schedule: Schedule, batch: int,
                             num_draft: int, vocab: int, num_rows: int, out_lanes: int,
                             block_b: int, block_v: int, has_draft_logits: bool):
  target_ref, *refs = refs
  draft_ref = refs.pop(0) if has_draft_logits else None
  (out_ref,) = refs
  k = num_draft
  num_tiles = pl.cdiv(vocab, block_v)

  batch_ids = pl.program_id(0) * block_b + lax.broadcasted_iota(jnp.int32, (block_b, 1, 1), 0)
  row_ids = lax.broadcasted_iota(jnp.int32, (1, num_rows, 1), 1)
  batch_ok = batch_ids < batch  # [bb, 1, 1]

  def small(ref, rows_, lanes, other):  # [bb, rows_, lanes] of a small per-row input
    lane_ids = lax.broadcasted_iota(jnp.int32, (1, 1, lanes), 2)
    ids = lax.broadcasted_iota(jnp.int32, (1, rows_, 1), 1)
    return plgpu.load(ref.at[batch_ids, ids, lane_ids], mask=batch_ok, other=other)

  draft_column = small(draft_column_ref, num_rows, 1, -1)  # [bb, R, 1]; -1 from slot k on

  sets = [(target_ref, k + 1)] + ([(draft_ref, k)] if has_draft_logits else [])

  def load(ref, valid_rows, tile):  # ([bb, R, bv] scaled logits, -inf outside; [1, 1, bv] ids)
    vocab_ids = tile * block_v + lax.broadcasted_iota(jnp.int32, (1, 1, block_v), 2)
    mask = batch_ok & (row_ids < valid_rows) & (vocab_ids < vocab)
    x = plgpu.load(ref.at[batch_ids, row_ids, vocab_ids], mask=mask, other=0.0)
    x = x.astype(jnp.float32)
    if not schedule.greedy:
      x = x / jnp.float32(sampling.temperature)
    return jnp.where(mask, x, _NEG_INF), vocab_ids

  def column(value):
    return jnp.full((block_b, num_rows, 1), value,
                    jnp.int32 if isinstance(value, int) else jnp.float32)

  # ---- STATS: running max, online sum of exp, logit at the draft token (greedy: argmax).
  def stats_step(tile, carry):
    new_carry = []
    for (ref, valid_rows), (max_, sum_, draft_logit, argmax) in zip(sets, carry):
      x, vocab_ids = load(ref, valid_rows, tile)
      tile_max, tile_token = tile_argmax(x, vocab_ids)
      later = replaces(tile_max, max_)
      new_max = jnp.where(later, tile_max, max_)
      if schedule.greedy:
        argmax = jnp.where(later, tile_token, argmax)
      else:  # online log-sum-exp; the where()s keep all -inf prefixes from producing NaN
        rescale = jnp.where(max_ == new_max, 1.0, jnp.exp(max_ - new_max))
        terms = jnp.where(x == _NEG_INF, 0.0, jnp.exp(x - new_max))
        sum_ = sum_ * rescale + jnp.sum(terms, axis=-1, keepdims=True)
        at_draft = jnp.where(vocab_ids == draft_column, x, _NEG_INF)
        draft_logit = jnp.maximum(draft_logit, jnp.max(at_draft, axis=-1, keepdims=True))
      new_carry.append((new_max, sum_, draft_logit, argmax))
    return tuple(new_carry)

  init = tuple((column(_NEG_INF), column(0.0), column(_NEG_INF), column(0)) for _ in sets)
  stats = lax.fori_loop(0, num_tiles, stats_step, init)
  maxes = [s[0] for s in stats]
  sums = [s[1] for s in stats]
  draft_logits_at = [s[2] for s in stats]

  if schedule.greedy:
    target_argmax = stats[0][3]  # [bb, R, 1]
    num_accepted = _leading_ones((target_argmax == draft_column).astype(jnp.int32), k)
    _store_tokens(out_ref, batch_ids, batch_ok, draft_column, k, out_lanes, num_accepted,
                  select_row(target_argmax, num_accepted))
    return

  def tile_sums(fn, init_value, lanes=1):  # per set: sum over tiles of fn(i, x) [bb, R, lanes]
    def step(tile, totals):
      return tuple(total + fn(i, load(ref, valid_rows, tile)[0])
                   for i, ((ref, valid_rows), total) in enumerate(zip(sets, totals)))
    init = jnp.full((block_b, num_rows, lanes), init_value,
                    jnp.int32 if isinstance(init_value, int) else jnp.float32)
    return list(lax.fori_loop(0, num_tiles, step, tuple(init for _ in sets)))

  def kept_weights(i, x, floor):  # exp(x - max) on tokens >= floor, else 0
    return jnp.where(x >= floor, jnp.exp(x - maxes[i]), 0.0)

  floors = [column(_NEG_INF) for _ in sets]
  if schedule.top_k or schedule.top_p:
    floors = threshold_floors(schedule, maxes, tile_sums)

  # ---- SUM: normaliser over the final kept set, with the final max.
  if schedule.has_threshold:
    final_floors = floors
    sums = tile_sums(lambda i, x: jnp.sum(kept_weights(i, x, final_floors[i]), axis=-1,
                                          keepdims=True), 0.0)

  def probability(i, logit, n=None):  # softmax of set i's warped logits at `logit`
    max_, sum_, floor = maxes[i], sums[i], floors[i]
    if n is not None:
      max_, sum_, floor = (select_row(v, n) for v in (max_, sum_, floor))
    return jnp.exp(jnp.where(logit >= floor, logit, _NEG_INF) - max_) / sum_

  # ---- RACE: ratio test, then the residual race (and the fallback race on p) over row n.
  p_draft = probability(0, draft_logits_at[0])  # [bb, R, 1]
  q_draft = probability(1, draft_logits_at[1]) if has_draft_logits else jnp.ones_like(p_draft)
  uniform_column = small(uniform_column_ref, num_rows, 1, 1.0)
  num_accepted = _leading_ones((uniform_column * q_draft < p_draft).astype(jnp.int32), k)
  n = num_accepted  # [bb, 1, 1]
  row_columns = small(row_columns_ref, 1, 4, 0)  # [bb, 1, 4]
  lane4 = lax.broadcasted_iota(jnp.int32, (1, 1, 4), 2)
  stream_seeds = jnp.sum(jnp.where(lane4 == 0, row_columns, 0), axis=-1, keepdims=True)
  positions = jnp.sum(jnp.where(lane4 == 1, row_columns, 0), axis=-1, keepdims=True)
  num_drafted = jnp.sum(jnp.where(lane4 == 2, row_columns, 0), axis=-1, keepdims=True)

  def race_step(tile, carry):
    residual_best, residual_token, fallback_best, fallback_token, has_mass = carry
    x, vocab_ids = load(target_ref, k + 1, tile)
    p = probability(0, select_row(x, n), n)  # [bb, 1, bv]
    if has_draft_logits:
      q = probability(1, select_row(load(draft_ref, k, tile)[0], n), n)
      # The bonus slot (n == num_drafted <= k) has q = 0 (at n == k, NaN statistics).
      q = jnp.where(n < num_drafted, q, 0.0)
    else:  # point mass at the draft token; slots from num_drafted on hold -1: the bonus has q = 0
      q = (vocab_ids == select_row(draft_column, n)).astype(jnp.float32)
    residual = jnp.maximum(p - q, 0.0)
    noise = sampling_lib.gumbel(stream_seeds, positions + n, vocab_ids,
                                sampling_lib.PURPOSE_RESIDUAL)  # [bb, 1, bv]
    in_vocab = vocab_ids < vocab
    out = []
    for weights, best, token in ((residual, residual_best, residual_token),
                                 (p, fallback_best, fallback_token)):
      scores = jnp.where(weights > 0, jnp.log(weights), _NEG_INF) + noise
      tile_best, tile_token = tile_argmax(jnp.where(in_vocab, scores, _NEG_INF), vocab_ids)
      later = replaces(tile_best, best)
      out += [jnp.where(later, tile_best, best), jnp.where(later, tile_token, token)]
    has_mass = jnp.maximum(has_mass, jnp.max((residual > 0).astype(jnp.int32), axis=-1,
                                             keepdims=True))
    return (*out, has_mass)

  single = lambda value: jnp.full((block_b, 1, 1), value,
                                  jnp.int32 if isinstance(value, int) else jnp.float32)
  _, residual_token, _, fallback_token, has_mass = lax.fori_loop(
      0, num_tiles, race_step,
      (single(_NEG_INF), single(0), single(_NEG_INF), single(0), single(0)))
  final = jnp.where(has_mass > 0, residual_token, fallback_token)
  _store_tokens(out_ref, batch_ids, batch_ok, draft_column, k, out_lanes, n, final)


def _store_tokens(out_ref, batch_ids, batch_ok, draft_column, k, out_lanes, num_accepted, final):
  """Output rows [bb, 1, L]: lanes 0..n-1 accepted drafts, lane n the final token, last lane n."""
  lane = lax.broadcasted_iota(jnp.int32, (1, 1, out_lanes), 2)
  drafts = jnp.zeros(num_accepted.shape[:2] + (out_lanes,), jnp.int32)
  for i in range(k):
    drafts = jnp.where(lane == i, _row(draft_column, i), drafts)
  tokens = jnp.where(lane < num_accepted, drafts, 0)
  tokens = jnp.where(lane == num_accepted, final, tokens)
  tokens = jnp.where(lane == out_lanes - 1, num_accepted, tokens)
  zero = lax.broadcasted_iota(jnp.int32, (1, 1, 1), 1)
  plgpu.store(out_ref.at[batch_ids, zero, lane], tokens, mask=batch_ok)


def _row(values, i: int):
  """values[:, i:i+1] of [bb, R, C] as a masked reduction (Triton has no tensor slicing)."""
  row_ids = lax.broadcasted_iota(jnp.int32, (1, values.shape[1], 1), 1)
  return jnp.sum(jnp.where(row_ids == i, values, 0), axis=1, keepdims=True)


def _leading_ones(flags, k: int):
  """[bb, R, 1] int32 0/1 -> [bb, 1, 1] number of leading ones among the first k rows."""
  alive = jnp.ones(flags.shape[:1] + (1, 1), jnp.int32)
  count = jnp.zeros_like(alive)
  for i in range(k):
    alive = alive * _row(flags, i)
    count = count + alive
  return count


def threshold_floors(schedule, maxes, tile_sums):
  """The GPU kernels' threshold search (chain and tree): per set `[bb, R, 1]` floors of the kept
  set, top-k then top-p over its survivors, each by `RADIX_ROUNDS` radix rounds
  (`specjax.core.sampling.radix_threshold`) testing `RADIX - 1` candidates per round, one per lane.

  Args:
    schedule: has `top_k` and `top_p` (None / 0 when off; at least one is on).
    maxes: per set `[bb, R, 1]` the row maxima of the scaled logits.
    tile_sums: `tile_sums(fn, init_value, lanes)` -> per set the sum over vocabulary tiles of
      `fn(i, x)` (`x` the set's `[bb, R, bv]` scaled tile, `-inf` outside), `[bb, R, lanes]`.
  """
  lane = lax.broadcasted_iota(jnp.int32, (1, 1, SEARCH_LANES), 2)  # candidate j in lane j

  def radix_search(lows, holds_per_set):  # per set [bb, R, 1] float32: largest t that holds
    def search_round(_, bounds):
      candidates = [sampling_lib.radix_candidates(base, width, lane) for base, width in bounds]
      holds = holds_per_set([thresholds for thresholds, _ in candidates])  # [bb, R, L] each
      new_bounds = []
      for (base, width), (_, open_), h in zip(bounds, candidates, holds):
        open_ = open_ & (lane >= 1) & (lane < sampling_lib.RADIX)
        count = lambda mask: jnp.sum(mask.astype(jnp.int32), axis=-1, keepdims=True)
        new_bounds.append(sampling_lib.radix_update(base, width, count(open_ & h), count(open_)))
      return tuple(new_bounds)

    bounds = []
    for low, top in zip(lows, maxes):
      base = (jnp.full(top.shape, _NEG_INF_KEY, jnp.int32) if low is None
              else sampling_lib.float_to_key(low))
      bounds.append((base, sampling_lib.float_to_key(top) - base + 1))
    bounds = lax.fori_loop(0, sampling_lib.RADIX_ROUNDS, search_round, tuple(bounds))
    return [sampling_lib.key_to_float(base) for base, _ in bounds]

  def lane_sums(x, thresholds, values):  # [bb, R, L]: lane j sums `values` where x >= t_j
    total = jnp.zeros(thresholds.shape, values.dtype)
    for j in range(1, sampling_lib.RADIX):
      t_j = jnp.sum(jnp.where(lane == j, thresholds, 0.0), axis=-1, keepdims=True)
      part = jnp.sum(jnp.where(x >= t_j, values, 0), axis=-1, keepdims=True)
      total = total + jnp.where(lane == j, part, 0).astype(values.dtype)
    return total

  def kept_weights(i, x, floor):  # exp(x - max) on tokens >= floor (None: all), else 0
    return jnp.exp(x - maxes[i]) if floor is None else jnp.where(x >= floor,
                                                                   jnp.exp(x - maxes[i]), 0.0)

  no_floor = [None for _ in maxes]
  floors = no_floor
  # ---- TOP_K: count(x >= t) >= top_k for RADIX - 1 candidates t per round.
  if schedule.top_k:
    def top_k_holds(thresholds):
      counts = tile_sums(lambda i, x: lane_sums(x, thresholds[i], jnp.ones(x.shape, jnp.int32)),
                         0, SEARCH_LANES)
      return [count >= schedule.top_k for count in counts]
    floors = radix_search(no_floor, top_k_holds)

  # ---- TOP_P: mass(x >= t) >= top_p * mass(top-k survivors), searched above the top-k floor.
  if schedule.top_p:
    top_k_floors = floors
    kept_mass = tile_sums(lambda i, x: jnp.sum(kept_weights(i, x, top_k_floors[i]), axis=-1,
                                               keepdims=True), 0.0)

    def top_p_holds(thresholds):
      masses = tile_sums(lambda i, x: lane_sums(x, thresholds[i],
                                                kept_weights(i, x, top_k_floors[i])),
                         0.0, SEARCH_LANES)
      return [mass >= jnp.float32(schedule.top_p) * total
              for mass, total in zip(masses, kept_mass)]
    floors = radix_search(top_k_floors, top_p_holds)
  return floors
