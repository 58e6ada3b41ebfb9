"""`verify_block`: the target scores a round's drafts in one forward pass and keeps an exact prefix.

The target sees `[last token, d_1 .. d_k]` at each row's own offset, which yields its
distributions for the `k` draft positions and one past them. The accept/reject rule itself is
`specjax.sampling.verify_reference` or the fused Pallas kernel (`verify_tokens` picks). Each row
then appends its accepted drafts plus the correction or bonus token, cut at EOS and at the row's
length limit; rejected drafts are rolled back by setting the target cache's length, never by
copying.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from specjax import kernels, sharding
from specjax.draft import Proposal, gather_tokens
from specjax.sampling import Sampling, VerifyResult, seed_from_key, verify_reference
from specjax.validation import is_eos as is_eos_token

if TYPE_CHECKING:
  from specjax.decode import DecodeState

VERIFY_IMPLS = ("auto", "reference", "kernel", "interpret")


def check_verify_impl(impl):
  if not (callable(impl) or impl in VERIFY_IMPLS):
    raise ValueError(f"verify_impl must be one of {VERIFY_IMPLS} or a callable, got {impl!r}")
  return impl


def verify_tokens(target_logits, draft_logits, draft_tokens, *, sampling: Sampling, seed,
                  positions, rows=None, impl: str = "auto") -> VerifyResult:
  """Runs the accept/reject rule with the chosen implementation.

  Args:
    impl: "reference" (pure jnp), "kernel" (the fused Pallas kernel, compiled for the platform it
      is lowered for), "interpret" (the kernel in Pallas interpret mode, for CPU tests), or "auto":
      the kernel where the computation is lowered for TPU or GPU, the reference on CPU. "auto"
      follows the lowering platform (`lax.platform_dependent`), not the host's default backend, so
      exporting for TPU from a CPU machine picks the kernel. Under an active mesh that splits the
      vocabulary ("auto" and "reference"), the vocab-sharded rule `specjax.sharding.sharded_verify`
      runs instead, so full-vocabulary logits are never gathered. A callable with the signature of
      `verify_reference` is used as the rule itself (for experiments and for the tests that prove
      the exactness checks can tell a wrong rule from a right one).
    Other arguments: see `specjax.sampling.verify_reference`.
  """
  check_verify_impl(impl)
  kwargs = dict(sampling=sampling, seed=seed, positions=positions, rows=rows)
  if callable(impl):
    return impl(target_logits, draft_logits, draft_tokens, **kwargs)
  if impl in ("auto", "reference"):
    if sharding.vocab_is_sharded():  # under a mesh that splits the vocabulary: never gather it
      return sharding.sharded_verify(target_logits, draft_logits, draft_tokens, **kwargs)
  if impl == "reference":
    return verify_reference(target_logits, draft_logits, draft_tokens, **kwargs)
  return kernels.verify_dispatch(target_logits, draft_logits, draft_tokens, impl=impl, **kwargs)


def verify_block(target, state: "DecodeState", proposal: Proposal, key: jax.Array, *,
                 sampling: Sampling, impl: str = "auto") -> "DecodeState":
  """Verifies one round of drafts for every row and advances the state.

  Args:
    target: the target model.
    state: the decode state before verification (its target cache holds all but the last token).
    proposal: the round's drafts from `draft_step`.
    key: this round's PRNG key (the same one `draft_step` got).
    sampling: the sampling settings (identical to the drafter's).
    impl: which verify implementation to run (see `verify_tokens`).

  Returns:
    The advanced state. Rows already done are left unchanged.
  """
  batch, k = proposal.tokens.shape
  rows = jnp.arange(batch, dtype=jnp.int32)
  lengths = state.lengths
  last = gather_tokens(state.tokens, lengths - 1, 1)
  block = jnp.concatenate([last, proposal.tokens.astype(jnp.int32)], axis=1)  # [B, k+1]
  scored = target(block, lengths - 1, state.target_cache)
  result = verify_tokens(scored.logits, proposal.logits, proposal.tokens, sampling=sampling,
                         seed=seed_from_key(key), positions=lengths, rows=rows, impl=impl)
  accepted = result.num_accepted

  # How many of the k+1 candidate tokens each row keeps: up to the correction, cut at EOS
  # (inclusive) and at the row's limit.
  index = jnp.arange(k + 1, dtype=jnp.int32)
  is_eos = is_eos_token(result.tokens, state.eos_ids) & (index[None] <= accepted[:, None])
  first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), k + 1)
  live = ~state.done
  count = jnp.minimum(jnp.minimum(accepted + 1, first_eos + 1), state.limits - lengths)
  count = jnp.where(live, count, 0)
  new_lengths = lengths + count

  def write(row, new, start):
    return jax.lax.dynamic_update_slice(row, new, (start,))

  tokens = jax.vmap(write)(state.tokens, result.tokens, lengths)  # past new_lengths is scratch
  hit_eos = live & (first_eos < count)
  done = state.done | hit_eos | (new_lengths >= state.limits)
  target_cache = scored.cache.with_lengths(new_lengths - 1)

  live_i = live.astype(jnp.int32)
  stats = state.stats
  stats = dataclasses.replace(
      stats,
      rounds=stats.rounds + live_i,
      drafted=stats.drafted + k * live_i,
      accepted=stats.accepted + accepted * live_i,
      accepted_per_position=stats.accepted_per_position
      + (index[None, :k] < accepted[:, None]).astype(jnp.int32) * live_i[:, None],
      target_calls=stats.target_calls + live_i,
  )
  return dataclasses.replace(state, tokens=tokens, lengths=new_lengths, done=done,
                             target_cache=target_cache, stats=stats)
