"""Pieces shared by the TPU (`fused_verify`) and GPU (`fused_verify_gpu`) verify kernels.

Argument checks, the ratio test's uniforms (computed outside the kernels, bit-identical to the
reference's), the static pass schedule, and two tile helpers that lower on Mosaic and Triton.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core import sampling as sampling_lib
from specjax.core.sampling import Sampling

MAX_NUM_DRAFT = 126  # the TPU kernel's output row: tokens in lanes 0..k, num_accepted in lane 127
_INT32_MAX = np.iinfo(np.int32).max
_NEG_INF = float("-inf")


def check_verify_args(target_logits, draft_logits, draft_tokens) -> tuple[int, int]:
  """Validates the shapes and dtypes shared by every verify kernel; returns `(B, k)`."""
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
  return batch, num_draft


def drafted_tokens(draft_tokens, num_drafted) -> tuple[jax.Array, jax.Array]:
  """`(draft_tokens with -1 past each row's count, num_drafted [B] int32 in [0, k])`.

  A kernel treats token -1 as "no draft" (it matches no vocabulary id, so the ratio test and the
  greedy match fail there); `num_drafted` goes in as an operand as well, to give the bonus slot
  `q = 0` when a row stops before `k`. None = every row drafted all `k`.
  """
  batch, num_draft = draft_tokens.shape
  if num_drafted is None:
    return draft_tokens, jnp.full((batch,), num_draft, jnp.int32)
  num_drafted = jnp.clip(jnp.asarray(num_drafted, jnp.int32), 0, num_draft)
  index = jnp.arange(num_draft, dtype=jnp.int32)
  return jnp.where(index[None] < num_drafted[:, None], draft_tokens, -1), num_drafted


def accept_uniforms(seeds, positions, num_draft: int, sampling: Sampling) -> jax.Array:
  """`[B, k]` float32 uniforms of the ratio test: tiny, and bit-identical to the reference's."""
  if sampling.greedy:
    return jnp.zeros((seeds.shape[0], num_draft), jnp.float32)
  token_positions = positions[:, None] + jnp.arange(num_draft, dtype=jnp.int32)
  return sampling_lib.uniform(seeds[:, None], token_positions, 0, sampling_lib.PURPOSE_ACCEPT)


class ThresholdPasses:
  """Mixin for a static pass schedule with fields `greedy`, `top_k` and `top_p` (the active
  thresholds, None when off): from `first_top_k`, `RADIX_ROUNDS` passes for each active threshold,
  and `sum_pass` after them; the subclass names `first_top_k` and `race_pass` (the last pass).
  Shared by `Schedule` and `specjax.kernels.tree_common.TreeSchedule`."""

  @property
  def has_threshold(self) -> bool:
    return bool(self.top_k or self.top_p)

  @property
  def first_top_p(self) -> int:
    return self.first_top_k + (sampling_lib.RADIX_ROUNDS if self.top_k else 0)

  @property
  def sum_pass(self) -> int:
    return self.first_top_p + (sampling_lib.RADIX_ROUNDS if self.top_p else 0)

  @property
  def num_passes(self) -> int:
    return 1 if self.greedy else self.race_pass + 1


@dataclasses.dataclass(frozen=True)
class Schedule(ThresholdPasses):
  """Static pass layout: `[STATS] [TOP_K x n] [TOP_P x n] [SUM] [RACE]`; greedy is `[STATS]`."""

  greedy: bool
  top_k: int | None  # active top-k (None when off or >= V)
  top_p: float | None  # active top-p (None when off or 1)

  @property
  def first_top_k(self) -> int:
    return 1

  @property
  def race_pass(self) -> int:
    return self.sum_pass + (1 if self.has_threshold else 0)


def schedule_for(sampling: Sampling, vocab: int) -> Schedule:
  """The static pass schedule of `sampling` over a vocabulary of `vocab` ."""
  if sampling.greedy:
    return Schedule(True, None, None)
  top_k = sampling.top_k if sampling.top_k is not None and sampling.top_k < vocab else None
  top_p = sampling.top_p if sampling.top_p is not None and sampling.top_p < 1.0 else None
  return Schedule(False, top_k, top_p)


def tile_argmax(scores, vocab_ids):
  """Per row: (max [..., 1], first vocab id attaining it [..., 1]) of a tile.

  A NaN counts as the maximum, as in `jnp.argmax` (`specjax.core.sampling.first_argmax`): a row
  holding one gives NaN and the id of its first NaN. The NaN is found with `x != x`, not left to
  the max reduction, whose NaN handling differs between XLA:CPU (interpret mode), Mosaic and
  Triton. Tiles combine with `replaces`.
  """
  is_nan = scores != scores
  has_nan = jnp.max(is_nan.astype(jnp.int32), axis=-1, keepdims=True) > 0
  best = jnp.max(jnp.where(is_nan, _NEG_INF, scores), axis=-1, keepdims=True)
  hit = (is_nan & has_nan) | ((scores == best) & ~has_nan)
  token = jnp.min(jnp.where(hit, vocab_ids, _INT32_MAX), axis=-1, keepdims=True)
  return jnp.where(has_nan, jnp.nan, best), token


def replaces(tile_best, best):
  """Whether a later tile's maximum `tile_best` (`tile_argmax`) takes over the running `best` of
  the tiles before it: it is larger, or NaN where `best` is not. Ties keep the earlier tile's
  token, so the first maximum (the first NaN) wins, as in `jnp.argmax`."""
  return (tile_best > best) | ((tile_best != tile_best) & (best == best))


def select_row(values, n):
  """values[:, n] of [bb, R, C] at per-batch-row n [bb, 1, 1] -> [bb, 1, C] (masked reduction
  instead of a dynamic sublane slice); rows n >= R select -inf (int32: int32 min)."""
  row_ids = jax.lax.broadcasted_iota(jnp.int32, (1, values.shape[1], 1), 1)
  empty = np.iinfo(np.int32).min if values.dtype == jnp.int32 else _NEG_INF
  return jnp.max(jnp.where(row_ids == n, values, empty), axis=1, keepdims=True)


def leading_ones(flags, k):
  """[bb, rows, 1] int32 0/1 -> [bb, 1, 1] number of leading ones among the first k rows."""
  alive = jnp.ones_like(flags[:, 0:1])
  count = jnp.zeros_like(alive)
  for i in range(k):
    alive = alive * flags[:, i:i + 1]
    count = count + alive
  return count
