"""The exact speculative accept/reject rule, written once over a small vocabulary-ops interface.

`verify_rule(ops, ...)` is the rule; `ops` says how to reduce over the vocabulary axis:

* `LocalVocab()`: the whole vocabulary on one device, plain jnp reductions. `verify_reference`
  is `verify_rule` with it, the oracle of the kernels and of every exactness test.
* `specjax.verify.sharded.ShardedVocab(axes)`: each device holds a vocabulary slice inside a
  `shard_map`; maxima, sums and race winners are combined with `pmax` / `psum` / `pmin`.

The rule: accept draft `x` with probability `min(1, p(x) / q(x))` (as `u * q(x) < p(x)`, no
division); at the first rejection sample from `normalize(max(p - q, 0))`, falling back to `p` when
the residual has no mass; after all of a row's drafts are accepted (`k`, or its own
`num_drafted`) sample a bonus token from `p`. Temperature 0 is greedy (accept while the draft
equals the target's argmax). All random numbers come from `specjax.core.sampling`'s per-row streams,
so every implementation returns identical tokens.
"""

from __future__ import annotations

import functools
from typing import Protocol

import chex
import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.sampling import (PURPOSE_ACCEPT, PURPOSE_RESIDUAL, JnpReductions, Sampling,
                                   VerifyResult, first_argmax, gumbel, leading_true, uniform,
                                   warp_logits)

_INT32_MAX = jnp.iinfo(jnp.int32).max


class VocabOps(Protocol):
  """Reductions over the vocabulary axis (the last one) of a `[..., Vl]` slice."""

  vocab: int | None  # the full vocabulary size (None: the slice is the whole vocabulary)

  def ids(self, x: jax.Array) -> jax.Array:
    """`[Vl]` int32 global vocabulary ids of `x`'s last axis."""

  def max(self, x: jax.Array) -> jax.Array:
    """`[..., Vl] -> [...]` the maximum over the whole vocabulary."""

  def sum(self, x: jax.Array) -> jax.Array:
    """`[..., Vl] -> [...]` the sum over the whole vocabulary."""

  def argmax(self, x: jax.Array) -> jax.Array:
    """`[..., Vl] -> [...]` int32 global id of the first maximum (as `jnp.argmax`)."""

  def gather_at(self, x: jax.Array, ids: jax.Array) -> jax.Array:
    """`x[..., ids]` for global `ids` of shape `x.shape[:-1]` (the owning slice contributes)."""

  def sum_at_least(self, x: jax.Array, weights: jax.Array | None,
                   thresholds: jax.Array) -> jax.Array:
    """`[..., R]` sums of `weights` (None: counts) where `x >= thresholds[..., j]`: one round of
    the threshold search (`specjax.core.sampling.radix_threshold`)."""


class LocalVocab(JnpReductions):
  """The whole vocabulary on one device."""

  vocab = None

  def ids(self, x):
    return jnp.arange(x.shape[-1], dtype=jnp.int32)

  def argmax(self, x):
    return first_argmax(x)

  def max_and_argmax(self, x):
    return jnp.max(x, axis=-1), first_argmax(x)

  def gather_at(self, x, ids):
    return jnp.take_along_axis(x, ids[..., None], axis=-1)[..., 0]


def softmax(ops: VocabOps, x: jax.Array) -> jax.Array:
  """`softmax(x)` over the vocabulary axis (`exp(x - max) / sum`, as `jax.nn.softmax`)."""
  unnormalized = jnp.exp(x - jax.lax.stop_gradient(ops.max(x))[..., None])
  return unnormalized / ops.sum(unnormalized)[..., None]


def verify_rule(ops: VocabOps, target_logits: jax.Array, draft_logits: jax.Array | None,
                draft_tokens: jax.Array, *, sampling: Sampling, seeds: jax.Array,
                positions: jax.Array, num_drafted: jax.Array | None = None) -> VerifyResult:
  """The exact speculative accept/reject rule.

  A row may propose fewer than `k` drafts (`num_drafted`, e.g. a drafter's confidence stop):
  slots `j >= num_drafted[b]` are not drafts, so acceptance stops there and the token at slot
  `num_drafted[b]`, if reached, is the bonus, a sample from p (q = 0 there), never a residual.

  Args:
    ops: the vocabulary reductions (`LocalVocab()`, or `ShardedVocab` inside a `shard_map`).
    target_logits: `[B, k + 1, Vl]` target logits at the k draft positions and one past them.
    draft_logits: `[B, k, Vl]` the drafter's raw logits for its proposals, or None when the
      drafter proposes deterministically (a point mass: n-gram lookup, argmax drafts).
    draft_tokens: `[B, k]` int32 proposals (global vocabulary ids).
    sampling: applied identically to both models' logits.
    seeds: `[B]` uint32 per-row stream seeds (`specjax.core.sampling.row_seeds`).
    positions: `[B]` int32 absolute sequence position of each row's first draft token.
    num_drafted: `[B]` int32 in `[0, k]` drafts each row really proposes; None = all `k`.
      Entries of `draft_tokens` / `draft_logits` past a row's count are ignored.

  Returns:
    `VerifyResult(num_accepted [B], tokens [B, k + 1])`: `tokens[b, :n]` are the accepted drafts,
    `tokens[b, n]` the correction (or the bonus when `n == k`), zeros after.

  Raises:
    ValueError: the arguments' shapes disagree (`check_shapes`), raised while tracing.
  """
  check_shapes(target_logits, draft_logits, draft_tokens, seeds, positions, num_drafted)
  draft_tokens, seeds, positions, num_drafted, drafted = row_inputs(draft_tokens, seeds,
                                                                    positions, num_drafted)
  k = draft_tokens.shape[1]
  if sampling.greedy:
    target_argmax = ops.argmax(target_logits)  # [B, k+1]
    num_accepted = leading_true(drafted & (draft_tokens == target_argmax[:, :k]))
    final = jnp.take_along_axis(target_argmax, num_accepted[:, None], axis=1)[:, 0]
  else:
    p = softmax(ops, warp_logits(target_logits, sampling, ops))  # [B, k+1, Vl]
    p_draft = ops.gather_at(p[:, :k], draft_tokens)  # [B, k]
    if draft_logits is None:
      q = None
      q_draft = jnp.ones_like(p_draft)
    else:
      q = softmax(ops, warp_logits(draft_logits, sampling, ops))  # [B, k, Vl]
      q_draft = ops.gather_at(q, draft_tokens)
    num_accepted = ratio_test(p_draft, q_draft, drafted, seeds, positions)
    final = _correction(ops, p, q, draft_tokens, num_accepted, num_drafted, seeds, positions)
  return verify_result(draft_tokens, num_accepted, final)


def check_shapes(target_logits, draft_logits, draft_tokens, seeds, positions,
                 num_drafted=None) -> None:
  """Raises a ValueError naming the argument whose shape disagrees with `draft_tokens [B, k]`.

  Static (chex's shape checks, at trace time: nothing is compiled first). Without it a
  `target_logits` one position short would be indexed past its end, which jnp clamps silently.
  """
  chex.assert_rank(draft_tokens, 2, custom_message="draft_tokens must be [B, k]",
                   exception_type=ValueError)
  batch, k = draft_tokens.shape
  expected = [("target_logits", target_logits, (batch, k + 1, None), "[B, k + 1, V]"),
              ("seeds", seeds, (batch,), "[B]"), ("positions", positions, (batch,), "[B]")]
  if draft_logits is not None:
    expected.append(("draft_logits", draft_logits, (batch, k, np.shape(target_logits)[-1]),
                     "[B, k, V]"))
  if num_drafted is not None:
    expected.append(("num_drafted", num_drafted, (batch,), "[B]"))
  for name, x, shape, described in expected:
    chex.assert_shape(x if hasattr(x, "shape") else np.asarray(x), shape,
                      custom_message=f"{name} must be {described} with B, k = {batch}, {k} "
                                     "(draft_tokens)", exception_type=ValueError)


def row_inputs(draft_tokens, seeds, positions, num_drafted):
  """The rule's per-row inputs in their dtypes: `(draft_tokens, seeds, positions, num_drafted
  [B] clipped to [0, k] (None: k), drafted [B, k] the slots that hold drafts)`."""
  k = draft_tokens.shape[1]
  if num_drafted is None:
    num_drafted = jnp.full(draft_tokens.shape[:1], k, jnp.int32)
  num_drafted = jnp.clip(jnp.asarray(num_drafted, jnp.int32), 0, k)
  drafted = jnp.arange(k, dtype=jnp.int32)[None] < num_drafted[:, None]
  return (draft_tokens.astype(jnp.int32), jnp.asarray(seeds, jnp.uint32),
          jnp.asarray(positions, jnp.int32), num_drafted, drafted)


def ratio_test(p_draft, q_draft, drafted, seeds, positions):
  """`[B]` leading acceptances: slot j accepts when `u * q(x_j) < p(x_j)` (`u < p / q`, and
  q = 0 < p always accepts), `u` the `PURPOSE_ACCEPT` uniform of the slot's position."""
  k = drafted.shape[1]
  u = uniform(seeds[:, None], positions[:, None] + jnp.arange(k, dtype=jnp.int32)[None], 0,
              PURPOSE_ACCEPT)  # [B, k]
  return leading_true(drafted & (u * q_draft < p_draft))


def verify_result(draft_tokens, num_accepted, final) -> VerifyResult:
  """`tokens [B, k + 1]`: the accepted drafts, then `final` at slot `num_accepted`, zeros after."""
  k = draft_tokens.shape[1]
  index = jnp.arange(k + 1, dtype=jnp.int32)
  tokens = jnp.where(index[None, :k] < num_accepted[:, None], draft_tokens, 0)  # [B, k]
  tokens = jnp.pad(tokens, ((0, 0), (0, 1)))  # [B, k+1]
  tokens = jnp.where(index[None] == num_accepted[:, None], final[:, None], tokens)
  return VerifyResult(num_accepted, tokens)


def _correction(ops, p, q, draft_tokens, num_accepted, num_drafted, seeds, positions,
                purpose: int = PURPOSE_RESIDUAL):
  """`[B]` the token at the first rejection (residual race) or the bonus (race on p), raced with
  the `purpose` stream (the residual's; another only in `specjax.testing.rules`' broken rules)."""
  k = draft_tokens.shape[1]
  n = num_accepted
  is_draft_slot = (n < num_drafted)[:, None]  # the bonus slot (n == num_drafted) has q = 0
  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, Vl]
  slot = jnp.minimum(n, k - 1)
  if q is None:  # point mass at the draft token of slot n
    token_n = jnp.take_along_axis(draft_tokens, slot[:, None], axis=1)  # [B, 1]
    q_n = (ops.ids(p) == token_n) & is_draft_slot
    q_n = q_n.astype(jnp.float32)
  else:
    q_n = jnp.where(is_draft_slot, jnp.take_along_axis(q, slot[:, None, None], axis=1)[:, 0], 0.0)
  residual = jnp.maximum(p_n - q_n, 0.0)
  has_mass = (ops.sum(residual) > 0)[:, None]
  weights = jnp.where(has_mass, residual, p_n)
  scores = jnp.where(weights > 0, jnp.log(weights), -jnp.inf)
  noise = gumbel(seeds[:, None], (positions + n)[:, None], ops.ids(p), purpose)
  return ops.argmax(scores + noise)


verify_reference = functools.partial(verify_rule, LocalVocab())
verify_reference.__doc__ = "`verify_rule` with the whole vocabulary on one device (the oracle)."
