"""The constrained sampling law: the one definition `generate` and (later) `decode` share.

Contract: a constrained step samples from the target's *warped* distribution (temperature, then
top-k, then top-p, exactly `specjax.core.sampling.warp_logits`) restricted to the tokens the
grammar allows in the row's state, renormalized. Top-k and top-p are therefore computed on the
unconstrained distribution and the grammar's mask is applied after them.

That restriction can be empty: every allowed token may lie outside the top-k / nucleus (a model
that wants to write prose where the grammar wants `{`). The law then falls back to warping the
*masked* logits (the grammar's mask first, then temperature / top-k / top-p over the allowed
tokens only), which always keeps at least one allowed token. Both branches are deterministic
functions of the logits and the mask, so a speculative verifier can rebuild the same
distribution. Greedy (`temperature = 0`) is the argmax over the allowed tokens (the first one on
ties, as `first_argmax`).

A row whose allowed set is empty, or whose target gives every allowed token a `-inf` logit, has
no distribution at all: `stuck` says so, and the caller stops the row without emitting a token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.constrain.tables import mask_logits
from specjax.core.sampling import Sampling, first_argmax, sample_race, warp_logits

__all__ = ["constrained_logits", "constrained_probs", "sample_constrained", "stuck"]


def constrained_logits(logits: jax.Array, mask: jax.Array, sampling: Sampling) -> jax.Array:
  """`[..., V]` float32 log-weights of the constrained law (see the module doc).

  Args:
    logits: `[..., V]` raw target logits.
    mask: `[..., V]` bool allowed tokens.
    sampling: the sampling settings.

  Returns:
    Greedy: the masked raw logits (the law is their argmax). Otherwise warped logits, `-inf`
    outside the allowed tokens, whose softmax is the law.
  """
  logits = logits.astype(jnp.float32)
  if sampling.greedy:
    return mask_logits(logits, mask)
  restricted = mask_logits(warp_logits(logits, sampling), mask)
  empty = ~jnp.any(restricted > -jnp.inf, axis=-1)
  return jax.lax.cond(jnp.any(empty),
                      lambda: jnp.where(empty[..., None],
                                        warp_logits(mask_logits(logits, mask), sampling),
                                        restricted),
                      lambda: restricted)


def constrained_probs(logits: jax.Array, mask: jax.Array, sampling: Sampling) -> jax.Array:
  """`[..., V]` float32 the constrained law's probabilities (one-hot at the greedy token)."""
  scores = constrained_logits(logits, mask, sampling)
  if sampling.greedy:
    return jax.nn.one_hot(first_argmax(scores), scores.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(scores, axis=-1)


def stuck(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """`[...]` bool: no allowed token has a logit above `-inf` (a NaN counts as present: it is
  reported as a nonfinite row, as in unconstrained decoding)."""
  return ~jnp.any(mask & ~(logits == -jnp.inf), axis=-1)


def sample_constrained(logits: jax.Array, mask: jax.Array, sampling: Sampling, seeds: jax.Array,
                       positions: jax.Array, purpose: int) -> jax.Array:
  """One token per leading index from the constrained law, with `specjax.core.sampling`'s random
  streams (the Gumbel race keyed by seed, position and purpose). Meaningless where `stuck`."""
  scores = constrained_logits(logits, mask, sampling)
  if sampling.greedy:
    return first_argmax(scores)
  return sample_race(scores, seeds, positions, purpose)
