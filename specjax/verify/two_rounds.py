"""The vocabulary-sharded verify in two collective rounds, for sampling without top-k or top-p.

Under plain temperature sampling the rule needs, per position, the target's and the drafter's
softmax normalizers and the probabilities of the drafted tokens (to accept or reject), and then,
at the first rejection, one race over the residual `max(p - q, 0)` (or over p for the bonus).
`ShardedVocab` runs that as one collective per statistic (max, sum and gather for p, the same for
q, the residual's mass, and the race's max and min: nine round trips). Here each device, inside
the `shard_map`, reduces its own slice and sends everything a round needs in one `all_gather`:

1. *Normalizers.* Per position, the slice's maximum `m_s` and `s_s = sum exp(x - m_s)` of the
   tempered logits of p (k + 1 positions) and q (k), and the drafted tokens' logits where the
   slice owns them (`-inf` elsewhere). Every device combines them the same way, as a streaming
   log-sum-exp: `M = max_s m_s`, `S = sum_s s_s exp(m_s - M)`, `p(x_j) = exp(l_j - M) / S`. The
   ratio test then runs on every device with the same uniforms, so every device knows each row's
   number of accepted drafts `n`.
2. *The race.* At slot `n` the slice's `p_n`, `q_n` and residual follow from the gathered
   normalizers; the slice sends its residual mass and the winners (value, global id) of two
   Gumbel races with the residual stream's noise (keyed by global ids, as on one device): over
   the residual and over p. Where the whole residual has no mass (or at the bonus slot, q = 0)
   the rule samples from p, so the winner over p is the one taken; otherwise the residual's.
   Winners combine as `first_argmax` does: the largest value, then the smallest id.

Random numbers, the acceptance test and the races are those of `specjax.verify.rule.verify_rule`;
the sums run in another order (float32 rounding in the last place), as with `ShardedVocab`, so
the law is the same. The local reductions are `ShardedVocab`'s (Pallas kernels on TPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.core.sampling import PURPOSE_RESIDUAL, Sampling, VerifyResult, gumbel
from specjax.verify.rule import ratio_test, row_inputs, verify_result

__all__ = ["combine_argmax", "combine_normalizers", "slice_normalizer", "two_round_verify",
           "uses_two_rounds"]

_INT32_MAX = jnp.iinfo(jnp.int32).max


def uses_two_rounds(sampling: Sampling, vocab: int) -> bool:
  """Whether the two-round verify applies: sampling with no top-k below the vocabulary and no
  top-p below 1 (the threshold searches need the reduction rule or the candidate verify)."""
  return (not sampling.greedy
          and (sampling.top_k is None or sampling.top_k >= vocab)
          and (sampling.top_p is None or sampling.top_p >= 1.0))


def _as_float(ids):
  return jax.lax.bitcast_convert_type(ids.astype(jnp.int32), jnp.float32)


def _as_ids(x):
  return jax.lax.bitcast_convert_type(x, jnp.int32)


def combine_argmax(values: jax.Array, ids: jax.Array) -> jax.Array:
  """`[..., S] -> [...]`: the global first argmax from each shard's (maximum, its first id), as
  `first_argmax` over the whole vocabulary: a NaN wins (the smallest such id), else the largest
  value with the smallest id."""
  nan = jnp.isnan(values)
  best = jnp.max(jnp.where(nan, -jnp.inf, values), axis=-1, keepdims=True)
  chosen = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, values == best)
  return jnp.min(jnp.where(chosen, ids, _INT32_MAX), axis=-1)


def slice_normalizer(local, x):
  """`(m, s)`: the slice's maximum and `sum exp(x - m)` per position (`m = -inf`, `s = 0` on an
  all-`-inf` slice, e.g. a padded one), reduced with `local` (`max`, `sum`)."""
  m = local.max(x)
  shift = jnp.where(jnp.isfinite(m), m, 0.0)
  return m, local.sum(jnp.exp(x - shift[..., None]))


def combine_normalizers(m, s):
  """`[..., S]` per-shard `(m, s)` -> `(M, S)` of the whole vocabulary (a streaming log-sum-exp:
  `M = max_s m_s`, `S = sum_s s_s exp(m_s - M)`; `M` is 0 where every slice is `-inf`)."""
  big = jnp.max(m, axis=-1)
  safe = jnp.where(jnp.isfinite(big), big, 0.0)
  scale = jnp.where(jnp.isfinite(m), jnp.exp(m - safe[..., None]), 0.0)
  return safe, jnp.sum(s * scale, axis=-1)


def _owned(x, tokens, offset):
  """`x[b, j, tokens[b, j]]` where this slice holds the token, else `-inf`."""
  local = tokens - offset
  owned = (local >= 0) & (local < x.shape[-1])
  value = jnp.take_along_axis(x, jnp.clip(local, 0, x.shape[-1] - 1)[..., None], axis=-1)[..., 0]
  return jnp.where(owned, value, -jnp.inf)


def two_round_verify(target_logits, draft_logits, draft_tokens, *, sampling: Sampling, seeds,
                     positions, num_drafted=None, axes, vocab: int, offset, local
                     ) -> VerifyResult:
  """Inside a `shard_map` over the vocabulary `axes`: `verify_rule`'s result in two `all_gather`s
  (see the module docstring).

  Args:
    target_logits / draft_logits: this device's `[B, k + 1, Vl]` / `[B, k, Vl]` (or None: a
      point-mass drafter) slices.
    draft_tokens, seeds, positions, num_drafted: as `verify_rule`.
    axes: the mesh axes the vocabulary is split over; vocab: the full vocabulary size (a top-k
      at or above it keeps every token); offset: this slice's first global id.
    local: the reductions over the slice (`max`, `sum`, `max_and_argmax`).
  """
  if not uses_two_rounds(sampling, vocab):
    raise ValueError(f"two_round_verify needs sampling without top-k / top-p, got {sampling}")
  draft_tokens, seeds, positions, num_drafted, drafted = row_inputs(draft_tokens, seeds,
                                                                    positions, num_drafted)
  k = draft_tokens.shape[1]
  temperature = jnp.float32(sampling.temperature)
  has_draft = draft_logits is not None

  # Round 1: each slice's normalizers and owned draft-token logits, gathered once.
  xt = target_logits.astype(jnp.float32) / temperature  # [B, k+1, Vl]
  parts = [*slice_normalizer(local, xt), _owned(xt[:, :k], draft_tokens, offset)]
  if has_draft:
    xq = draft_logits.astype(jnp.float32) / temperature  # [B, k, Vl]
    parts += [*slice_normalizer(local, xq), _owned(xq, draft_tokens, offset)]
  sizes = [part.shape[1] for part in parts]
  stats = jax.lax.all_gather(jnp.concatenate(parts, axis=1), axes, axis=2, tiled=False)
  pieces = jnp.split(stats, [sum(sizes[:i]) for i in range(1, len(sizes))], axis=1)  # [B, ., S]
  max_p, sum_p = combine_normalizers(pieces[0], pieces[1])  # [B, k+1]
  p_draft = jnp.exp(jnp.max(pieces[2], axis=-1) - max_p[:, :k]) / sum_p[:, :k]
  if has_draft:
    max_q, sum_q = combine_normalizers(pieces[3], pieces[4])  # [B, k]
    q_draft = jnp.exp(jnp.max(pieces[5], axis=-1) - max_q) / sum_q
  else:
    q_draft = jnp.ones_like(p_draft)
  n = ratio_test(p_draft, q_draft, drafted, seeds, positions)  # [B], the same on every device

  # Round 2: the slice's residual mass and its winners of the residual's and p's races.
  def at(x, i):
    return jnp.take_along_axis(x, i[:, None, None], axis=1)[:, 0]

  def row(x, i):
    return jnp.take_along_axis(x, i[:, None], axis=1)[:, 0]

  ids = offset + jnp.arange(xt.shape[-1], dtype=jnp.int32)
  p_n = jnp.exp(at(xt, n) - row(max_p, n)[:, None]) / row(sum_p, n)[:, None]  # [B, Vl]
  is_draft_slot = (n < num_drafted)[:, None]
  slot = jnp.minimum(n, k - 1)
  if has_draft:
    q_n = jnp.exp(at(xq, slot) - row(max_q, slot)[:, None]) / row(sum_q, slot)[:, None]
  else:
    q_n = (ids[None] == row(draft_tokens, slot)[:, None]).astype(jnp.float32)
  q_n = jnp.where(is_draft_slot, q_n, 0.0)
  residual = jnp.maximum(p_n - q_n, 0.0)
  noise = gumbel(seeds[:, None], (positions + n)[:, None], ids, PURPOSE_RESIDUAL)

  def race(weights):
    best, arg = local.max_and_argmax(jnp.where(weights > 0, jnp.log(weights), -jnp.inf) + noise)
    return best, _as_float(arg + offset)

  sent = jnp.stack([local.sum(residual), *race(residual), *race(p_n)], axis=1)  # [B, 5]
  got = jax.lax.all_gather(sent, axes, axis=2, tiled=False)  # [B, 5, S]
  has_mass = jnp.sum(got[:, 0], axis=-1) > 0
  final = jnp.where(has_mass, combine_argmax(got[:, 1], _as_ids(got[:, 2])),
                    combine_argmax(got[:, 3], _as_ids(got[:, 4])))
  return verify_result(draft_tokens, n, final)
