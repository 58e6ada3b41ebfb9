"""Fused tree verify for GPUs (Pallas Triton backend; also runs in interpret mode).

The same per-node decisions (`tree_common.NodeResults`), random numbers and elementwise steps as
the TPU kernel in `tree_verify.py`; only the schedule's form differs. Triton has no sequential grid
axes with persistent scratch, so each program owns `block_b` batch rows with all their `N + 1`
nodes and runs every pass itself, as `lax.fori_loop`s over vocabulary tiles: STATS, the top-k /
top-p radix rounds (RADIX - 1 = 15 candidates per round, one per lane), SUM, one SIBLING loop per
sibling rank (unrolled: the replay of the rejected ranks grows with the rank) and the RACE.
Per-node state is `[block_b, R, 1]` register values (`R` = `N + 1` rounded up to a power of two, as
Triton requires); tiles are masked loads, so rows past `B` or `N + 1` and lanes past `V` are never
read. Exporting it (`platforms=["cuda"]`) needs `fused_verify_gpu.GPU_EXPORT_DISABLED_CHECKS`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.trees import structure as trees
from specjax.kernels.common import replaces, tile_argmax
from specjax.kernels.fused_verify_gpu import GpuBlockSizes, threshold_floors
from specjax.kernels.tree_common import (EXACT_STEPS, NodeResults, TileSteps, TreeSchedule,
                                         log_weights, node_results, replay, sibling_sums,
                                         tree_kernel_setup)
from specjax.core.sampling import Sampling

_NEG_INF = float("-inf")
# sampling.float_to_key(-inf) as a Python int (Triton cannot lower a bitcast of a constant).
OUT_LANES = 4  # token, p_token, accepted rank, unused


@functools.partial(jax.jit, static_argnames=("rule", "sampling", "max_children", "block_sizes",
                                             "interpret", "tile_steps"))
def tree_node_results_gpu(target_logits: jax.Array, tree: trees.Tree, *, rule: str,
                          sampling: Sampling, seeds: jax.Array, positions: jax.Array,
                          max_children: int | None = None,
                          block_sizes: GpuBlockSizes | None = None, interpret: bool = False,
                          tile_steps: TileSteps = EXACT_STEPS) -> NodeResults:
  """The per-node decisions of `specjax.verify.tree_rule.verify_tree` on GPU (Triton).

  Same arguments and results as `tree_verify.tree_node_results`, except `block_sizes` is a
  `GpuBlockSizes` (default: `GpuBlockSizes.get_default` over the `N + 1` node rows) and
  `interpret` a bool.
  """
  schedule, inputs, q_logits = tree_kernel_setup(target_logits, tree, rule, sampling, seeds,
                                                 positions, max_children)
  batch, num_rows, vocab = target_logits.shape
  if block_sizes is None:
    block_sizes = GpuBlockSizes.get_default(vocab, num_rows - 1, batch)
  lanes = pl.next_power_of_2(inputs.child_tokens.shape[-1])
  pad = ((0, 0), (0, 0), (0, lanes - inputs.child_tokens.shape[-1]))
  operands = [inputs.columns, target_logits]
  if q_logits is not None:
    operands += [jnp.pad(inputs.child_tokens, pad, constant_values=-1),
                 jnp.pad(inputs.uniforms, pad, constant_values=1.0), q_logits]
  kernel = functools.partial(
      _tree_verify_gpu_kernel, sampling=sampling, schedule=schedule, batch=batch,
      num_rows=num_rows, vocab=vocab, block_b=block_sizes.block_b, block_v=block_sizes.block_v,
      tile_steps=tile_steps)
  out = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(batch, block_sizes.block_b),),
      out_shape=jax.ShapeDtypeStruct((batch, num_rows, OUT_LANES), jnp.int32),
      compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=1),
      interpret=interpret,
      name="tree_verify_gpu",
  )(*operands)
  return node_results(out[..., 0], out[..., 1], out[..., 2], inputs)


def _lane(values, j):
  """values[..., j:j+1] as a masked reduction (Triton has no tensor slicing)."""
  lane_ids = lax.broadcasted_iota(jnp.int32, (1, 1, values.shape[-1]), 2)
  return jnp.sum(jnp.where(lane_ids == j, values, 0), axis=-1, keepdims=True)


def _tree_verify_gpu_kernel(columns_ref, target_ref, *refs, sampling: Sampling,
                            schedule: TreeSchedule, batch: int, num_rows: int, vocab: int,
                            block_b: int, block_v: int, tile_steps: TileSteps):
  if schedule.sampled:
    child_tokens_ref, uniforms_ref, draft_ref, out_ref = refs
  else:
    (out_ref,), draft_ref = refs, None
  rows = pl.next_power_of_2(num_rows)
  num_tiles = pl.cdiv(vocab, block_v)
  batch_ids = pl.program_id(0) * block_b + lax.broadcasted_iota(jnp.int32, (block_b, 1, 1), 0)
  row_ids = lax.broadcasted_iota(jnp.int32, (1, rows, 1), 1)
  ok = (batch_ids < batch) & (row_ids < num_rows)  # [bb, R, 1]

  def small(ref, lanes, other):  # [bb, R, lanes] of a small per-node input
    lane_ids = lax.broadcasted_iota(jnp.int32, (1, 1, lanes), 2)
    return plgpu.load(ref.at[batch_ids, row_ids, lane_ids], mask=ok, other=other)

  columns = small(columns_ref, 2, 0)
  seeds, positions = _lane(columns, 0), _lane(columns, 1)
  sets = [target_ref] + ([draft_ref] if schedule.sampled else [])

  def load(ref, tile):  # ([bb, R, bv] scaled logits, -inf outside; [1, 1, bv] vocab ids)
    vocab_ids = tile * block_v + lax.broadcasted_iota(jnp.int32, (1, 1, block_v), 2)
    mask = ok & (vocab_ids < vocab)
    x = plgpu.load(ref.at[batch_ids, row_ids, vocab_ids], mask=mask, other=0.0)
    x = x.astype(jnp.float32)
    if not schedule.greedy:
      x = x / jnp.float32(sampling.temperature)
    return jnp.where(mask, x, _NEG_INF), vocab_ids

  def column(value, lanes=1):
    return jnp.full((block_b, rows, lanes), value,
                    jnp.int32 if isinstance(value, int) else jnp.float32)

  def store(token, p_token, accepted):
    lane_ids = lax.broadcasted_iota(jnp.int32, (1, 1, OUT_LANES), 2)
    out = jnp.where(lane_ids == 0, token, jnp.where(lane_ids == 1, p_token, accepted))
    plgpu.store(out_ref.at[batch_ids, row_ids, lane_ids], jnp.where(lane_ids < 3, out, 0),
                mask=ok)

  # ---- STATS: running argmax (greedy), max, and online sum of exp (sampled rules).
  def stats_step(tile, carry):
    new_carry = []
    for ref, (max_, sum_, argmax) in zip(sets, carry):
      x, vocab_ids = load(ref, tile)
      tile_max, tile_token = tile_argmax(x, vocab_ids)
      later = replaces(tile_max, max_)
      new_max = jnp.where(later, tile_max, max_)
      argmax = jnp.where(later, tile_token, argmax)
      if schedule.sampled:  # online log-sum-exp; the where()s keep -inf prefixes from NaN
        rescale = jnp.where(max_ == new_max, 1.0, jnp.exp(max_ - new_max))
        terms = jnp.where(x == _NEG_INF, 0.0, jnp.exp(x - new_max))
        sum_ = sum_ * rescale + jnp.sum(terms, axis=-1, keepdims=True)
      new_carry.append((new_max, sum_, argmax))
    return tuple(new_carry)

  maxes = sums = None
  if schedule.has_stats:
    init = tuple((column(_NEG_INF), column(0.0), column(0)) for _ in sets)
    stats = lax.fori_loop(0, num_tiles, stats_step, init)
    if schedule.greedy:
      store(stats[0][2], stats[0][2], -1)
      return
    maxes, sums = [s[0] for s in stats], [s[1] for s in stats]

  floors = _thresholds(schedule, sets, load, maxes, column, num_tiles)

  def warped(i, tile):
    x, vocab_ids = load(sets[i], tile)
    return (jnp.where(x >= floors[i], x, _NEG_INF) if schedule.has_threshold else x), vocab_ids

  def noise(vocab_ids, purpose):
    return tile_steps.noise(seeds, positions, row_ids, vocab_ids, purpose)

  def race(scores, vocab_ids, best, token):
    tile_best, tile_token = tile_argmax(jnp.where(vocab_ids < vocab, scores, _NEG_INF), vocab_ids)
    later = replaces(tile_best, best)
    return jnp.where(later, tile_best, best), jnp.where(later, tile_token, token)

  if not schedule.sampled:  # ---- "match": y_n = argmax(warped p_n + G_n), every node at once.
    def match_step(tile, carry):
      x, vocab_ids = warped(0, tile)
      return race(x + noise(vocab_ids, trees.PURPOSE_TREE_SAMPLE), vocab_ids, *carry)
    _, y = lax.fori_loop(0, num_tiles, match_step, (column(_NEG_INF), column(0)))
    store(y, y, -1)
    return

  # ---- SUM: the normaliser over the final kept set, with the final max.
  if schedule.has_threshold:
    def sum_step(tile, totals):
      return tuple(total + jnp.sum(jnp.exp(warped(i, tile)[0] - maxes[i]), -1, keepdims=True)
                   for i, total in enumerate(totals))
    sums = list(lax.fori_loop(0, num_tiles, sum_step, (column(0.0), column(0.0))))

  def probabilities(tile):  # (p_n, q of n's children, vocab ids) on the tile
    (x, vocab_ids), (y, _) = warped(0, tile), warped(1, tile)
    return jnp.exp(x - maxes[0]) / sums[0], jnp.exp(y - maxes[1]) / sums[1], vocab_ids

  # ---- SIBLING j: the ratio test of every node's rank-j child against r_j, s_j.
  child_tokens = small(child_tokens_ref, child_tokens_ref.shape[-1], -1)  # [bb, R, Mp]
  uniforms = small(uniforms_ref, uniforms_ref.shape[-1], 1.0)
  steps = []
  accepted = column(-1)
  for j in range(schedule.num_children):
    token = _lane(child_tokens, j)

    def sibling_step(tile, totals, token=token, steps=tuple(steps)):
      p, q, vocab_ids = probabilities(tile)
      r, s = replay(p, q, vocab_ids, steps, schedule.without_replacement, tile_steps)
      return tuple(a + b for a, b in zip(totals, sibling_sums(r, s, vocab_ids == token)))

    r_at, s_at, mass_r, mass_s = lax.fori_loop(0, num_tiles, sibling_step,
                                               tuple(column(0.0) for _ in range(4)))
    searching = (token >= 0) & (accepted < 0)
    accept = searching & (_lane(uniforms, j) * s_at < r_at)  # tree_rule.accepts
    accepted = jnp.where(accept, j, accepted)
    steps.append((searching & ~accept, mass_r, mass_s, token))

  # ---- RACE: the residual race over log r (after every rejected rank) and the race over log p.
  def race_step(tile, carry):
    p, q, vocab_ids = probabilities(tile)
    r, _ = replay(p, q, vocab_ids, steps, schedule.without_replacement, tile_steps)
    g = noise(vocab_ids, trees.PURPOSE_TREE_RESIDUAL)
    return (*race(log_weights(r) + g, vocab_ids, *carry[:2]),
            *race(log_weights(p) + g, vocab_ids, *carry[2:]))

  init = (column(_NEG_INF), column(0), column(_NEG_INF), column(0))
  _, token, _, p_token = lax.fori_loop(0, num_tiles, race_step, init)
  store(token, p_token, accepted)


def _thresholds(schedule, sets, load, maxes, column, num_tiles):
  """Per set `[bb, R, 1]` floors of the kept set (top-k, then top-p over its survivors), by
  `RADIX_ROUNDS` radix rounds each (`specjax.core.sampling.radix_threshold`); `-inf` without
  them."""
  floors = [column(_NEG_INF) for _ in sets]
  if not schedule.has_threshold:
    return floors

  def tile_sums(fn, init_value, lanes=1):  # per set: sum over the tiles of fn(i, x)
    def step(tile, totals):
      return tuple(total + fn(i, load(ref, tile)[0])
                   for i, (ref, total) in enumerate(zip(sets, totals)))
    return list(lax.fori_loop(0, num_tiles, step,
                              tuple(column(init_value, lanes) for _ in sets)))

  return threshold_floors(schedule, maxes, tile_sums)
