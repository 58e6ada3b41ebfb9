"""The threshold-search passes of the TPU tree verify kernel (`tree_verify`), over VMEM scratch.

Top-k and top-p keep the tokens whose scaled logit is `>=` a threshold found by
`specjax.core.sampling.radix_threshold`'s search: `RADIX_ROUNDS` = 8 rounds, each one pass over the
vocabulary tiles that counts (top-k) or sums the mass (top-p) above RADIX - 1 = 15 candidate
thresholds at once, one per lane, and narrows an int32 key interval at the last tile. Per-node
state lives in `[block_b, rows, 128]` scratch refs, one value replicated across the lanes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from specjax.core import sampling as sampling_lib

_NEG_INF = float("-inf")


def column(ref, lane: int = 0):
  """[bb, rows, 1] view of one lane of a [bb, rows, 128] scratch value."""
  return ref[:, :, lane:lane + 1]


def set_column(ref, value):
  ref[...] = jnp.broadcast_to(value, ref.shape).astype(ref.dtype)


def threshold_passes(schedule, row_sets, load, pass_id, first_tile, last_tile, lane):
  """TOP_K and TOP_P: one radix round per pass, RADIX - 1 candidates (one per lane) counted or
  summed over the tiles, then `(base, width)` narrowed (`specjax.core.sampling.radix_threshold`)."""
  candidate_lane = (lane >= 1) & (lane < sampling_lib.RADIX)

  def lane_sums(x, thresholds, values):  # [bb, rows, 128]: lane j sums values where x >= t_j
    total = jnp.zeros(thresholds.shape, values.dtype)
    for j in range(1, sampling_lib.RADIX):
      part = jnp.sum(jnp.where(x >= thresholds[:, :, j:j + 1], values, 0), -1, keepdims=True)
      total = total + jnp.where(lane == j, part, 0).astype(total.dtype)
    return total

  def floor_of(stats):  # the top-k threshold, -inf without top-k
    if schedule.top_k:
      return sampling_lib.key_to_float(column(stats["top_k_key"]))
    return jnp.full(stats["max"].shape[:2] + (1,), _NEG_INF, jnp.float32)

  def search(first_pass, last_pass, accumulator, low, accumulate, holds, after=None):
    @pl.when((pass_id >= first_pass) & (pass_id < last_pass))
    def _search_pass():
      for ref, stats in row_sets:
        @pl.when(first_tile)
        def _reset(stats=stats):
          @pl.when(pass_id == first_pass)
          def _init_bounds():
            base, width = sampling_lib.radix_start(low(stats), column(stats["max"]))
            set_column(stats["base"], base)
            set_column(stats["width"], width)
          stats[accumulator][...] = jnp.zeros(stats[accumulator].shape,
                                              stats[accumulator].dtype)
          if accumulator == "mass":
            set_column(stats["sum"], 0.0)

        base, width = column(stats["base"]), column(stats["width"])
        thresholds, open_ = sampling_lib.radix_candidates(base, width, lane)
        open_ = open_ & candidate_lane
        accumulate(load(ref), stats, thresholds)

        @pl.when(last_tile)
        def _narrow(stats=stats, base=base, width=width, open_=open_):
          good = open_ & holds(stats)
          count = lambda mask: jnp.sum(mask.astype(jnp.int32), axis=-1, keepdims=True)
          new_base, new_width = sampling_lib.radix_update(base, width, count(good),
                                                          count(open_))
          set_column(stats["base"], new_base)
          set_column(stats["width"], new_width)
          if after is not None:
            after(stats, new_base)

  if schedule.top_k:
    def count_above(x, stats, thresholds):
      stats["count"][...] += lane_sums(x, thresholds, jnp.ones(x.shape, jnp.int32))

    search(schedule.first_top_k, schedule.first_top_p, "count",
           lambda stats: jnp.full(stats["max"].shape[:2] + (1,), _NEG_INF), count_above,
           lambda stats: stats["count"][...] >= schedule.top_k,
           after=lambda stats, base: set_column(stats["top_k_key"], base))

  if schedule.top_p:
    def mass_above(x, stats, thresholds):
      weights = jnp.where(x >= floor_of(stats), jnp.exp(x - column(stats["max"])), 0.0)
      set_column(stats["sum"], column(stats["sum"]) + jnp.sum(weights, -1, keepdims=True))
      stats["mass"][...] += lane_sums(x, thresholds, weights)

    search(schedule.first_top_p, schedule.sum_pass, "mass", floor_of, mass_above,
           lambda stats: stats["mass"][...] >= jnp.float32(schedule.top_p)
           * column(stats["sum"]))
