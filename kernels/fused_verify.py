"""Fused rejection-sampling verify over vocabulary tiles (Pallas; TPU Mosaic and interpret mode).

One `pallas_call` turns target logits `[B, k+1, V]`, draft logits `[B, k, V]` (or a point-mass
drafter) and the draft tokens `[B, k]` into `VerifyResult(num_accepted [B], tokens [B, k+1])`.
It never writes a `[B, k+1, V]` probability array: every quantity is a per-row scalar accumulated
tile by tile, and the one vocabulary-sized draw (the correction / bonus token) is a Gumbel-max race
whose noise is a counter-based hash computed in the kernel.

The grid is `(B / block_b, num_passes, num_vocab_tiles)`. Each program owns a block of `block_b`
batch rows, each with its `k+1` target rows and `k` draft rows (blocks `[block_b, k+1, block_v]`;
a partial last block computes garbage in its missing rows, which are never written back); the pass
and tile axes run in order. The pass schedule is static:

  pass 0              STATS   online max / log-sum-exp (greedy: running argmax), logit at each draft
  1 ..                TOP_K   `RADIX_ROUNDS` = 8 counting passes, each tests RADIX - 1 = 15
                              candidate thresholds (one per lane) and narrows an int32 key interval
  ..                  TOP_P   `RADIX_ROUNDS` mass passes on the top-k survivors, searched between
                              the top-k threshold and the max
  ..                  SUM     the normaliser over the final kept set (only after a threshold)
  last                RACE    ratio test at tile 0 -> n accepted; residual and fallback races

so greedy is 1 pass, plain temperature 2, temperature with top-k and/or top-p 3 + 8 per threshold.
When the whole vocabulary fits one tile (`num_vocab_tiles == 1`) the block index never changes and
Pallas fetches the logits from HBM once; later passes re-read VMEM. With several tiles each pass
streams the logits again, so `BlockSizes.get_default` first makes the tile hold the whole
vocabulary, and only then batches rows (up to 8) while that still fits the VMEM budget of the TPU
generation being compiled for (`blocks.compile_device_kind`: a v5e / v6e keeps a 152k float32
vocabulary resident). The body never computes on a whole tile at once: it walks the tile in chunks
of `block_c` lanes (`blocks.over_chunks`, a `fori_loop` of aligned lane slices), so its
temporaries are a few `[block_b, rows, block_c]` arrays whatever the vocabulary; every statistic
is already accumulated chunk by chunk exactly as tile by tile. In interpret mode, which has no VMEM
and pays per grid step, the default blocks are far larger (up to 1024 rows) and not chunked: a
20,000-row verify at V = 8 takes about 1 s interpreted instead of about 50 s with 8-row blocks.

The math is `specjax.verify.rule`'s: `verify_reference` (jnp) is the oracle, and the kernel calls
the same elementwise helpers (`gumbel`, `radix_start`, `radix_candidates`, `radix_update`) on
tiles. Decisions agree token for token with the reference; the only difference is the order of
float32 additions inside sums over the vocabulary, which can move a decision only when a comparison
is within rounding of its boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax.core import sampling as sampling_lib
from specjax.kernels.blocks import (INTERPRET_MAX_BLOCK_B, INTERPRET_VMEM_BUDGET, LANES,
                                    TPU_VMEM_BYTES, BlockSizes, Chunk,
                                    compile_device_kind, over_chunks, tpu_generation,
                                    vmem_budget_for, vmem_limit_for)
from specjax.kernels.common import (MAX_NUM_DRAFT, Schedule, accept_uniforms,
                                    check_verify_args, drafted_tokens, leading_ones,
                                    replaces, schedule_for, select_row, tile_argmax)
from specjax.core.sampling import Sampling, VerifyResult

NUM_ACCEPTED_LANE = LANES - 1  # lane of the output row that carries num_accepted
_INT32_MAX = np.iinfo(np.int32).max
_NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------
# Public wrapper.
# --------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("sampling", "block_sizes", "interpret",
                                             "device_kind"))
def fused_verify(target_logits: jax.Array, draft_logits: jax.Array | None,
                 draft_tokens: jax.Array, *, sampling: Sampling, seeds: jax.Array,
                 positions: jax.Array, num_drafted: jax.Array | None = None,
                 block_sizes: BlockSizes | None = None, interpret=False,
                 device_kind: str | None = None) -> VerifyResult:
  """The speculative accept/reject rule, fused over vocabulary tiles.

  Same contract and same tokens as `specjax.verify.rule.verify_reference`.

  Args:
    target_logits: `[B, k+1, V]` raw target logits (float32 or bfloat16).
    draft_logits: `[B, k, V]` raw draft logits, or None for a point-mass (deterministic) drafter.
    draft_tokens: `[B, k]` int32 proposals.
    sampling: `specjax.Sampling`, static; applied to both models' logits.
    seeds: `[B]` uint32 per-row stream seeds.
    positions: `[B]` int32 absolute position of each row's first draft token.
    num_drafted: `[B]` int32 drafts each row really proposes (the rest are not drafts; the
      token at that slot is the bonus); None = all `k`.
    block_sizes: `BlockSizes` (default `BlockSizes.get_default(...)`, with the interpret-mode
      budget when `interpret` is set).
    interpret: False (compiled: Mosaic on TPU), True (Pallas interpreter) or
      `pltpu.InterpretParams()` (TPU interpreter with TPU memory semantics).
    device_kind: the TPU kind whose VMEM sizes the blocks (default: the local TPU, if any;
      otherwise the smallest, v4).

  Returns:
    `VerifyResult(num_accepted [B] int32, tokens [B, k+1] int32)`.
  """
  batch, num_draft = check_verify_args(target_logits, draft_logits, draft_tokens)
  vocab = target_logits.shape[-1]
  if device_kind is None and not interpret:
    device_kind = compile_device_kind()
  if block_sizes is None:
    budget = (dict(vmem_budget=INTERPRET_VMEM_BUDGET, max_block_b=INTERPRET_MAX_BLOCK_B,
                   chunked=False) if interpret else dict(device_kind=device_kind))
    block_sizes = BlockSizes.get_default(vocab, num_draft, target_logits.dtype, batch=batch,
                                         has_draft_logits=draft_logits is not None, **budget)
  draft_tokens, num_drafted = drafted_tokens(draft_tokens.astype(jnp.int32), num_drafted)
  out = _fused_verify_impl(target_logits, draft_logits, draft_tokens, num_drafted,
                           jnp.asarray(seeds, jnp.uint32), positions.astype(jnp.int32),
                           sampling=sampling, block_v=block_sizes.tile(vocab),
                           block_b=block_sizes.rows(batch), block_c=block_sizes.chunk(vocab),
                           interpret=interpret,
                           vmem_limit=None if interpret else vmem_limit_for(device_kind))
  return VerifyResult(num_accepted=out[:, 0, NUM_ACCEPTED_LANE],
                      tokens=out[:, 0, :num_draft + 1])


# --------------------------------------------------------------------------------------------
# Grid, BlockSpecs, pass schedule.
# --------------------------------------------------------------------------------------------

# Per-row statistics in VMEM scratch, one set for the target rows and one for the draft rows.
# Each is [block_b, rows, 128] with the value replicated across lanes (lane-dense for Mosaic).
# "count" / "mass" hold one threshold-search candidate per lane (lanes 1 .. RADIX-1).
_ROW_STATS = ("max", "sum", "draft_logit", "argmax", "base", "width", "top_k_key", "count", "mass")
_ROW_STATS_DTYPE = dict(argmax=jnp.int32, base=jnp.int32, width=jnp.int32, top_k_key=jnp.int32,
                        count=jnp.int32)
# Race state, [block_b, 1, 128] each.
_RACE_STATE = ("num_accepted", "residual_best", "residual_token", "fallback_best",
               "fallback_token", "has_mass")
_RACE_STATE_DTYPE = dict(num_accepted=jnp.int32, residual_token=jnp.int32, fallback_token=jnp.int32,
                         has_mass=jnp.int32)


def _fused_verify_impl(target_logits, draft_logits, draft_tokens, num_drafted, seeds,
                       positions, *, sampling: Sampling, block_v: int, block_b: int,
                       block_c: int | None, interpret, vmem_limit: int | None = None):
  batch, num_draft = draft_tokens.shape
  vocab = target_logits.shape[-1]
  schedule = schedule_for(sampling, vocab)
  num_tiles = pl.cdiv(vocab, block_v)
  has_draft_logits = draft_logits is not None and not schedule.greedy

  # Per-row columns [B, k+1, 1]: draft token -1 (matches nothing) from num_drafted on; uniform 1.
  uniforms = accept_uniforms(seeds, positions, num_draft, sampling)
  draft_column = jnp.pad(draft_tokens, ((0, 0), (0, 1)), constant_values=-1)[..., None]
  uniform_column = jnp.pad(uniforms, ((0, 0), (0, 1)), constant_values=1.0)[..., None]
  seed_words = jax.lax.bitcast_convert_type(seeds, jnp.int32)
  row_columns = jnp.stack([seed_words, positions, num_drafted], axis=-1)[:, None, :]  # [B, 1, 3]
  scalars = ()

  def logits_spec(num_rows):  # [block_b, rows, block_v]: rows = whole axis, block_v aligned or V
    return pl.BlockSpec((block_b, num_rows, block_v), lambda b, p, j, *_: (b, 0, j))

  def row_spec(num_rows, width):
    return pl.BlockSpec((block_b, num_rows, width), lambda b, p, j, *_: (b, 0, 0))

  in_specs = [row_spec(num_draft + 1, 1), row_spec(num_draft + 1, 1), row_spec(1, 3),
              logits_spec(num_draft + 1)]
  inputs = [draft_column, uniform_column, row_columns, target_logits]
  if has_draft_logits:
    in_specs.append(logits_spec(num_draft))
    inputs.append(draft_logits)
  stats_sets = [num_draft + 1] + ([num_draft] if has_draft_logits else [])
  scratch = []
  for num_rows in stats_sets:
    scratch += [pltpu.VMEM((block_b, num_rows, LANES), _ROW_STATS_DTYPE.get(name, jnp.float32))
                for name in _ROW_STATS]
  scratch += [pltpu.VMEM((block_b, 1, LANES), _RACE_STATE_DTYPE.get(name, jnp.float32))
              for name in _RACE_STATE]

  kernel = functools.partial(
      _fused_verify_kernel, sampling=sampling, schedule=schedule, num_draft=num_draft,
      vocab=vocab, block_v=block_v, block_c=block_c, num_tiles=num_tiles,
      has_draft_logits=has_draft_logits)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(scalars),
      grid=(pl.cdiv(batch, block_b), schedule.num_passes, num_tiles),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((block_b, 1, LANES), lambda b, p, j, *_: (b, 0, 0)),
      scratch_shapes=scratch)
  logits_bytes = sum(x.size * x.dtype.itemsize for x in inputs[3:])
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((batch, 1, LANES), jnp.int32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary"),
          vmem_limit_bytes=vmem_limit),
      cost_estimate=pl.CostEstimate(
          flops=8 * schedule.num_passes * batch * (2 * num_draft + 1) * vocab,
          transcendentals=(2 * num_draft + 4) * batch * vocab,
          bytes_accessed=logits_bytes * (1 if num_tiles == 1 else schedule.num_passes)
          + batch * LANES * 4),
      interpret=interpret,
      name="fused_verify",
  )(*scalars, *inputs)


# --------------------------------------------------------------------------------------------
# Kernel body.
# --------------------------------------------------------------------------------------------

def _column(ref):
  """[block_b, rows, 1] view of a lane-replicated [block_b, rows, 128] scratch value."""
  return ref[:, :, 0:1]


def _set_column(ref, value):
  ref[...] = jnp.broadcast_to(value, ref.shape).astype(ref.dtype)


def _fused_verify_kernel(draft_column_ref, uniform_column_ref, row_columns_ref, *refs,
                         sampling: Sampling, schedule: Schedule, num_draft: int, vocab: int,
                         block_v: int, block_c: int | None, num_tiles: int,
                         has_draft_logits: bool):
  target_ref, *refs = refs
  draft_ref = refs.pop(0) if has_draft_logits else None
  out_ref, *scratch = refs
  num_stats = len(_ROW_STATS)
  target_stats = dict(zip(_ROW_STATS, scratch[:num_stats]))
  draft_stats = dict(zip(_ROW_STATS, scratch[num_stats:2 * num_stats])) if has_draft_logits else None
  race = dict(zip(_RACE_STATE, scratch[-len(_RACE_STATE):]))

  over_chunks(functools.partial(
      _chunk_body, draft_column_ref, uniform_column_ref, row_columns_ref, target_ref, draft_ref,
      out_ref, target_stats, draft_stats, race, pass_id=pl.program_id(1), sampling=sampling,
      schedule=schedule, num_draft=num_draft, has_draft_logits=has_draft_logits),
              tile=pl.program_id(2), num_tiles=num_tiles, block_v=block_v, block_c=block_c,
              vocab=vocab)


def _chunk_body(draft_column_ref, uniform_column_ref, row_columns_ref, target_ref, draft_ref,
                out_ref, target_stats, draft_stats, race, chunk: Chunk, *, pass_id,
                sampling: Sampling, schedule: Schedule, num_draft: int, has_draft_logits: bool):
  """Every pass's work on one chunk of the current vocabulary tile (`over_chunks`); `pass_id` is
  the grid's pass index, read outside the chunk loop (the interpreter resolves program ids there
  only)."""
  k = num_draft
  first_tile, last_tile = chunk.first, chunk.last  # first / last chunk of the whole vocabulary
  vocab_ids, in_vocab = chunk.vocab_ids, chunk.in_vocab  # the last tile may run past V
  draft_column = draft_column_ref[...]  # [bb, k+1, 1], -1 from slot num_drafted on

  def load(ref):  # [bb, rows, chunk] float32 scaled logits, -inf outside the vocabulary
    x = ref[:, :, chunk.lanes].astype(jnp.float32)
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
      tile_max, tile_token = tile_argmax(x, vocab_ids)
      later = replaces(tile_max, old_max)
      new_max = jnp.where(later, tile_max, old_max)
      if schedule.greedy:
        _set_column(stats["argmax"], jnp.where(later, tile_token, _column(stats["argmax"])))
      else:
        # Online log-sum-exp; the where()s keep all -inf prefixes from producing NaN.
        rescale = jnp.where(old_max == new_max, 1.0, jnp.exp(old_max - new_max))
        terms = jnp.where(x == _NEG_INF, 0.0, jnp.exp(x - new_max))
        _set_column(stats["sum"], _column(stats["sum"]) * rescale
                    + jnp.sum(terms, axis=-1, keepdims=True))
        at_draft = jnp.where(vocab_ids == draft_column[:, :num_rows], x, _NEG_INF)
        _set_column(stats["draft_logit"], jnp.maximum(_column(stats["draft_logit"]),
                                                      jnp.max(at_draft, axis=-1, keepdims=True)))
      _set_column(stats["max"], new_max)

  if schedule.greedy:
    @pl.when(last_tile)
    def _greedy_finish():
      target_argmax = _column(target_stats["argmax"])  # [bb, k+1, 1]
      matches = (target_argmax == draft_column).astype(jnp.int32)
      num_accepted = leading_ones(matches, k)  # [bb, 1, 1]
      _write_tokens(out_ref, draft_column, k, num_accepted,
                    select_row(target_argmax, num_accepted))
    return

  def top_k_floor(stats):  # [bb, rows, 1] float32 top-k threshold (-inf without top-k)
    if schedule.top_k:
      return sampling_lib.key_to_float(_column(stats["top_k_key"]))
    return jnp.full(stats["max"].shape[:2] + (1,), _NEG_INF, jnp.float32)

  def threshold(stats):  # [bb, rows, 1] float32 of the final kept set
    if schedule.top_p:
      return sampling_lib.key_to_float(_column(stats["base"]))
    return top_k_floor(stats)

  lane = jax.lax.broadcasted_iota(jnp.int32, (1, 1, LANES), 2)
  candidate_lane = (lane >= 1) & (lane < sampling_lib.RADIX)

  def search_pass(stats, first_pass, low, accumulate, holds):
    """One radix round per pass: per-candidate sums over the tiles, then narrow (base, width)."""
    @pl.when((pass_id == first_pass) & first_tile)
    def _init_bounds():
      base, width = sampling_lib.radix_start(low(), _column(stats["max"]))
      _set_column(stats["base"], base)
      _set_column(stats["width"], width)

    base, width = _column(stats["base"]), _column(stats["width"])
    thresholds, open_ = sampling_lib.radix_candidates(base, width, lane)  # [bb, rows, 128]
    open_ = open_ & candidate_lane
    accumulate(thresholds)

    @pl.when(last_tile)
    def _narrow():
      good = open_ & holds()
      count = lambda mask: jnp.sum(mask.astype(jnp.int32), axis=-1, keepdims=True)
      new_base, new_width = sampling_lib.radix_update(base, width, count(good), count(open_))
      _set_column(stats["base"], new_base)
      _set_column(stats["width"], new_width)

  def lane_sums(ref, thresholds, values):  # [bb, rows, 128]: lane j sums values where x >= t_j
    x = load(ref)
    total = jnp.zeros(thresholds.shape, values(x).dtype)
    for j in range(1, sampling_lib.RADIX):
      part = jnp.sum(jnp.where(x >= thresholds[:, :, j:j + 1], values(x), 0), axis=-1,
                     keepdims=True)
      total = total + jnp.where(lane == j, part, 0).astype(total.dtype)
    return total

  # ---- top-k: count(x >= t) >= top_k for RADIX - 1 candidates t per pass.
  if schedule.top_k:
    @pl.when((pass_id >= schedule.first_top_k) & (pass_id < schedule.first_top_p))
    def _top_k_pass():
      for ref, stats in row_sets:
        @pl.when(first_tile)
        def _reset():
          stats["count"][...] = jnp.zeros(stats["count"].shape, jnp.int32)

        def accumulate(thresholds, ref=ref, stats=stats):
          ones = lambda x: jnp.ones(x.shape, jnp.int32)
          stats["count"][...] += lane_sums(ref, thresholds, ones)

        search_pass(stats, schedule.first_top_k,
                    lambda stats=stats: jnp.full(stats["max"].shape[:2] + (1,), _NEG_INF),
                    accumulate, lambda stats=stats: stats["count"][...] >= schedule.top_k)

        @pl.when(last_tile)
        def _keep():
          _set_column(stats["top_k_key"], _column(stats["base"]))

  def kept_weights(x, stats, floor):  # exp(x - max) on tokens >= floor, else 0
    return jnp.where(x >= floor, jnp.exp(x - _column(stats["max"])), 0.0)

  # ---- top-p: mass(x >= t) >= top_p * mass(top-k survivors), searched above the top-k floor.
  if schedule.top_p:
    @pl.when((pass_id >= schedule.first_top_p) & (pass_id < schedule.sum_pass))
    def _top_p_pass():
      for ref, stats in row_sets:
        @pl.when(first_tile)
        def _reset():
          stats["mass"][...] = jnp.zeros(stats["mass"].shape, jnp.float32)
          _set_column(stats["sum"], 0.0)

        def accumulate(thresholds, ref=ref, stats=stats):
          weights = lambda x: kept_weights(x, stats, top_k_floor(stats))
          _set_column(stats["sum"], _column(stats["sum"])
                      + jnp.sum(weights(load(ref)), -1, keepdims=True))
          stats["mass"][...] += lane_sums(ref, thresholds, weights)

        def holds(stats=stats):
          return stats["mass"][...] >= jnp.float32(schedule.top_p) * _column(stats["sum"])

        search_pass(stats, schedule.first_top_p, lambda stats=stats: top_k_floor(stats),
                    accumulate, holds)

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
    def probability(logit, max_, sum_, floor):  # softmax of the warped logits at `logit`
      warped = jnp.where(logit >= floor, logit, _NEG_INF)
      return jnp.exp(warped - max_) / sum_

    def stats_at(stats, n=None):  # (max, sum, threshold) of every row, or of row n
      values = (_column(stats["max"]), _column(stats["sum"]), threshold(stats))
      return values if n is None else tuple(select_row(v, n) for v in values)

    @pl.when(first_tile)
    def _ratio_test():
      p_draft = probability(_column(target_stats["draft_logit"]), *stats_at(target_stats))
      p_draft = p_draft[:, :k]  # [bb, k, 1]
      if has_draft_logits:
        q_draft = probability(_column(draft_stats["draft_logit"]), *stats_at(draft_stats))
      else:
        q_draft = jnp.ones_like(p_draft)
      accepted = (uniform_column_ref[:, :k] * q_draft < p_draft).astype(jnp.int32)
      _set_column(race["num_accepted"], leading_ones(accepted, k))
      _set_column(race["residual_best"], _NEG_INF)
      _set_column(race["fallback_best"], _NEG_INF)
      _set_column(race["residual_token"], 0)
      _set_column(race["fallback_token"], 0)
      _set_column(race["has_mass"], 0)

    n = _column(race["num_accepted"])  # [bb, 1, 1]
    row_columns = row_columns_ref[...]  # [bb, 1, 3]: seed, position, num_drafted
    p = probability(select_row(load(target_ref), n), *stats_at(target_stats, n))  # [bb, 1, bv]
    if has_draft_logits:
      q = probability(select_row(load(draft_ref), n), *stats_at(draft_stats, n))
      q = jnp.where(n < row_columns[:, :, 2:3], q, 0.0)  # bonus slot n == num_drafted: q = 0
    else:  # point mass at the draft token; slots from num_drafted on hold -1: the bonus has q = 0
      q = (vocab_ids == select_row(draft_column, n)).astype(jnp.float32)
    residual = jnp.maximum(p - q, 0.0)
    noise = sampling_lib.gumbel(row_columns[:, :, 0:1], row_columns[:, :, 1:2] + n, vocab_ids,
                                sampling_lib.PURPOSE_RESIDUAL)  # [bb, 1, bv]
    for weights, best_key, token_key in ((residual, "residual_best", "residual_token"),
                                         (p, "fallback_best", "fallback_token")):
      scores = jnp.where(weights > 0, jnp.log(weights), _NEG_INF) + noise
      tile_best, tile_token = tile_argmax(jnp.where(in_vocab, scores, _NEG_INF), vocab_ids)
      old_best = _column(race[best_key])
      later = replaces(tile_best, old_best)
      _set_column(race[token_key], jnp.where(later, tile_token, _column(race[token_key])))
      _set_column(race[best_key], jnp.where(later, tile_best, old_best))
    tile_has_mass = jnp.max((residual > 0).astype(jnp.int32), axis=-1, keepdims=True)
    _set_column(race["has_mass"], jnp.maximum(_column(race["has_mass"]), tile_has_mass))

    @pl.when(last_tile)
    def _finish():
      final = jnp.where(_column(race["has_mass"]) > 0, _column(race["residual_token"]),
                        _column(race["fallback_token"]))
      _write_tokens(out_ref, draft_column, k, n, final)


def _write_tokens(out_ref, draft_column, k, num_accepted, final):
  """Output rows [bb, 1, 128]: lanes 0..n-1 accepted drafts, lane n the final token, lane 127 n."""
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, 1, LANES), 2)
  drafts = jnp.zeros(num_accepted.shape[:2] + (LANES,), jnp.int32)
  for i in range(k):
    drafts = jnp.where(lane == i, draft_column[:, i:i + 1], drafts)
  tokens = jnp.where(lane < num_accepted, drafts, 0)
  tokens = jnp.where(lane == num_accepted, final, tokens)
  tokens = jnp.where(lane == NUM_ACCEPTED_LANE, num_accepted, tokens)
  out_ref[...] = tokens
