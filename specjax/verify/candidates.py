"""The vocabulary-sharded verify in one collective round, for top-k sampling and for top-p alone.

Under top-k sampling the target's and the drafter's warped distributions live on their top-`K`
tokens, and the global top-`K` of a position is contained in the union of every vocabulary
shard's local top-`K`. So each device, inside the `shard_map`, takes its slice's top-`K + 1`
tokens at every position of p (k + 1 positions) and of q (k positions), and the logits of those
candidate tokens at *every* position (`[B, k + 1, M]` and `[B, k, M]`, `M = (2k + 1)(K + 1)` ids
per row, duplicates masked); one `all_gather` over the vocabulary axes then gives every device the
same candidate set, `S * M` ids per row for `S` shards, and the exact rule
(`specjax.verify.rule.verify_rule`) runs on it with `CandidateVocab` in place of the vocabulary.

Why this is the rule on the whole vocabulary, not an approximation:

* Every token that can be sampled, accepted or raced is a candidate: the top-k threshold's
  search counts tokens at or above a trial value, and for every value at or above the true
  threshold the candidates hold all such tokens (checked below), so the search returns the same
  threshold; top-p then runs over the top-k survivors, all candidates; the residual
  `max(p - q, 0)` and the bonus live on p's support.
* Tokens outside the candidates have probability 0 under both warped distributions: a draft
  token outside p's candidates has `p = 0`, as on the whole vocabulary.
* Random numbers are keyed by global token ids (`CandidateVocab.ids`), so the races draw the
  same Gumbel noise as on one device, and candidates are sorted by id so that ties in an argmax
  go to the smallest id, as `first_argmax` does.
* Ties at the threshold: a shard whose `(K + 1)`-th largest logit at a position is not below the
  global top-k threshold may hold more tied tokens than it sent. Then (the check is identical on
  every device of the vocabulary axes) the round falls back to `ShardedVocab`'s
  reduction-per-statistic rule, under `lax.cond`.

Top-p without top-k has no bound on its support, so each shard sends its `NUCLEUS_CANDIDATES + 1`
most likely tokens per position, and with them its slice's normalizer (maximum `m_s` and
`sum exp(x - m_s)` of the tempered logits), so that the nucleus's needed mass, `top_p` times the
whole vocabulary's, is exact. The threshold search then runs over the candidates: at every trial
value above each shard's largest unsent logit the candidates hold every token at or above it, so
when the threshold found lies above all of them it is the whole vocabulary's (the trial sums only
shrink below it); otherwise the round falls back, as for ties. The candidates' logits are warped
here and the rule runs on them at temperature 1.

Sums run in another order than on one device (float32 rounding in the last place), as with
`ShardedVocab`; the law is the same. Greedy keeps `ShardedVocab` (one all-gather per argmax),
sampling without top-k or top-p runs `specjax.verify.two_rounds`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.core.sampling import (JnpReductions, Sampling, VerifyResult, first_argmax,
                                   radix_threshold, top_k_threshold)
from specjax.verify.rule import verify_rule
from specjax.verify.two_rounds import combine_normalizers, slice_normalizer

__all__ = ["CandidateVocab", "candidate_verify", "uses_candidates"]


# Under top-p alone, each shard sends its NUCLEUS_CANDIDATES + 1 most likely tokens per position:
# the round is exact whenever every shard's share of each nucleus lies within them (else it falls
# back). A nucleus of 0.9 at T = 0.7 on a chat model is mostly a handful of tokens.
NUCLEUS_CANDIDATES = 64


def _nucleus_only(sampling: Sampling, vocab: int) -> bool:
  return ((sampling.top_k is None or sampling.top_k >= vocab)
          and sampling.top_p is not None and sampling.top_p < 1.0)


def uses_candidates(sampling: Sampling, vocab: int) -> bool:
  """Whether the one-round candidate verify applies: sampling with a top-k below the vocabulary,
  or with top-p alone."""
  if sampling.greedy:
    return False
  return (sampling.top_k is not None and sampling.top_k + 1 < vocab) or _nucleus_only(sampling,
                                                                                      vocab)


class CandidateVocab(JnpReductions):
  """A per-row candidate set in place of the vocabulary: `ids [B, C]` global ids sorted
  ascending (-1 = a masked slot, whose logits are `-inf`); reductions are jnp over the set."""

  def __init__(self, ids: jax.Array, vocab: int):
    self._ids = ids
    self.vocab = vocab

  def ids(self, x):
    del x
    return self._ids  # [B, C]: broadcasts against a row's `[B, C]` values

  def _row_ids(self, x):
    return self._ids.reshape(self._ids.shape[:1] + (1,) * (x.ndim - 2) + self._ids.shape[1:])

  def argmax(self, x):
    index = first_argmax(x)  # [B, ...]
    ids = jnp.broadcast_to(self._row_ids(x), x.shape)
    return jnp.take_along_axis(ids, index[..., None], axis=-1)[..., 0]

  def gather_at(self, x, ids):
    match = self._row_ids(x) == ids[..., None]
    return jnp.sum(jnp.where(match, x, 0.0), axis=-1)


def _local_candidates(target, draft, top, offset):
  """One shard's candidates: `(ids [B, M], p [B, k+1, M], q [B, k, M] or None, kth_p [B, k+1],
  kth_q [B, k] or None)`, ids global and unique (repeats masked to -1 with `-inf` logits);
  `kth_*`: the shard's `top`-th largest logit per position (`-inf` where it sent everything)."""
  vocab_local = target.shape[-1]
  sources = [target] if draft is None else [target, draft]
  values = [jax.lax.top_k(x, top) for x in sources]
  index = jnp.concatenate([i.reshape(i.shape[0], -1) for _, i in values], axis=1)  # [B, M]
  index = jnp.sort(index, axis=-1)
  repeat = jnp.concatenate([jnp.zeros_like(index[:, :1], bool), index[:, 1:] == index[:, :-1]],
                           axis=1)
  gathered = [jnp.where(repeat[:, None, :], -jnp.inf,
                        jnp.take_along_axis(x, index[:, None, :], axis=-1)) for x in sources]
  ids = jnp.where(repeat, -1, index + offset)
  sent_all = top >= vocab_local
  kth = [jnp.where(sent_all, -jnp.inf, v[..., -1]) for v, _ in values]
  return (ids, gathered[0], gathered[1] if draft is not None else None,
          kth[0], kth[1] if draft is not None else None)


def _gather_once(ids, p, q, side_p, side_q, axes):
  """Every shard's candidates on every device of the vocabulary `axes`, in one `all_gather`.

  One collective, not one per array: five independent gathers (which share one channel id in the
  compiled `shard_map`) deadlocked on XLA:CPU's simulated devices under load, the devices waiting
  in different collectives; one gather has no order to disagree on. The ids travel as float32
  bits in row 0; each position's `side` values (`[B, n, c]`: the `kth` logit, and the slice's
  normalizer for top-p alone) ride in extra last columns. Returns them as `[B, n, S, c]`.
  """
  width = ids.shape[1]
  # Row 0's extra columns are unused (they repeat side values: a concatenation, not a padded copy).
  rows = [jnp.concatenate([jax.lax.bitcast_convert_type(ids, jnp.float32)[:, None, :],
                           side_p[:, :1]], axis=-1)]
  for values, side in ((p, side_p), (q, side_q)):
    if values is not None:
      rows.append(jnp.concatenate([values, side], axis=-1))
  packed = jax.lax.all_gather(jnp.concatenate(rows, axis=1), axes, axis=2, tiled=False)
  # packed: [B, R, S, M + c] for S shards; shard-major order along the candidates.
  def candidates(x):
    return x[..., :width].reshape(x.shape[0], x.shape[1], -1)

  ids = jax.lax.bitcast_convert_type(candidates(packed[:, :1])[:, 0], jnp.int32)
  p_rows = slice(1, 1 + p.shape[1])
  p, side_p = candidates(packed[:, p_rows]), packed[:, p_rows, :, width:]
  if q is not None:
    q_rows = slice(p_rows.stop, p_rows.stop + q.shape[1])
    q, side_q = candidates(packed[:, q_rows]), packed[:, q_rows, :, width:]
  return ids, p, q, side_p, side_q


def _slice_mass(logits, temperature):
  """`[B, n, 2]`: the slice's `(m, s)` of the tempered logits per position (`slice_normalizer`)."""
  x = logits.astype(jnp.float32) / temperature
  return jnp.stack(slice_normalizer(JnpReductions(), x), axis=-1)


def _nucleus_floor(x, mass, top_p: float):
  """`[B, n]` the top-p threshold of the whole vocabulary from the candidates' tempered logits
  `x [B, n, C]` and every slice's `(m, s)` (`mass [B, n, S, 2]`): `top_p_threshold`'s search, its
  needed mass `top_p * Z` from the slices' sums (not the candidates'), its trial sums over the
  candidates (exact at every trial value above each shard's unsent logits: checked by the caller)."""
  top = jnp.max(x, axis=-1)  # every shard sends its maximum: the global one is a candidate
  _, total = combine_normalizers(mass[..., 0], mass[..., 1])  # relative to that same maximum
  weights = jnp.exp(x - top[..., None])
  needed = jnp.float32(top_p) * total
  local = JnpReductions()
  return radix_threshold(jnp.full_like(top, -jnp.inf), top,
                         lambda t: local.sum_at_least(x, weights, t) >= needed[..., None])


def candidate_verify(target_logits, draft_logits, draft_tokens, *, sampling: Sampling, seeds,
                     positions, num_drafted=None, axes, vocab: int, offset, fallback
                     ) -> VerifyResult:
  """Inside a `shard_map` over the vocabulary `axes`: the exact rule on the gathered candidates
  (see the module docstring), or `fallback(...)` (the same arguments) when a shard may hold
  tokens tied at the top-k threshold that it did not send.

  Args:
    target_logits / draft_logits: this device's `[B, k + 1, Vl]` / `[B, k, Vl]` (or None) slices.
    vocab: the full vocabulary size; offset: the global id of this slice's first token.
    fallback: the rule to run on the slices when the candidates may not hold the support.
  """
  nucleus = _nucleus_only(sampling, vocab)
  top = min((NUCLEUS_CANDIDATES if nucleus else sampling.top_k) + 1, target_logits.shape[-1])
  temperature = jnp.float32(sampling.temperature)
  ids, p, q, kth_p, kth_q = _local_candidates(target_logits, draft_logits, top, offset)
  side_p, side_q = kth_p[..., None], None if kth_q is None else kth_q[..., None]
  if nucleus:
    side_p = jnp.concatenate([side_p, _slice_mass(target_logits, temperature)], axis=-1)
    if draft_logits is not None:
      side_q = jnp.concatenate([side_q, _slice_mass(draft_logits, temperature)], axis=-1)
  ids, p, q, side_p, side_q = _gather_once(ids, p, q, side_p, side_q, axes)
  order = jnp.argsort(ids, axis=-1)  # ascending ids: argmax ties go to the smallest id
  ids = jnp.take_along_axis(ids, order, axis=-1)
  p = jnp.take_along_axis(p, order[:, None, :], axis=-1)
  q = None if q is None else jnp.take_along_axis(q, order[:, None, :], axis=-1)
  rule_sampling = sampling

  if nucleus:  # the candidates' logits warped here; the rule then runs at temperature 1
    def warped(logits, side):
      x = logits / temperature
      floor = _nucleus_floor(x, side[..., 1:], sampling.top_p)
      ok = jnp.all(side[..., 0] / temperature < floor[..., None])
      return jnp.where(x >= floor[..., None], x, -jnp.inf), ok

    p, exact = warped(p, side_p)
    if q is not None:
      q, exact_q = warped(q, side_q)
      exact &= exact_q
    rule_sampling = Sampling(temperature=1.0)
  else:
    def threshold_ok(logits, kth):
      scaled = logits / temperature
      floor = top_k_threshold(scaled, sampling.top_k)  # [B, n]
      return jnp.all(kth / temperature < floor[..., None])

    exact = threshold_ok(p, side_p[..., 0])
    if q is not None:
      exact &= threshold_ok(q, side_q[..., 0])
  extra = dict(num_drafted=num_drafted)

  def on_candidates():
    result = verify_rule(CandidateVocab(ids, vocab), p, q, draft_tokens, sampling=rule_sampling,
                         seeds=seeds, positions=positions, **extra)
    return result.num_accepted, result.tokens

  def on_slices():
    result = fallback(target_logits, draft_logits, draft_tokens, sampling=sampling, seeds=seeds,
                      positions=positions, **extra)
    return result.num_accepted, result.tokens

  num_accepted, tokens = jax.lax.cond(exact, on_candidates, on_slices)
  return VerifyResult(num_accepted, tokens)
