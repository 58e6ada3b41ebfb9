"""Drafting over a reduced draft vocabulary (the feature heads'): `draft_tokens` maps a head's
draft-vocabulary logits to target ids, greedy or sampled from the full-vocabulary q it was drawn
from; `take_rows` picks each row's entry of a per-position array.

At temperature > 0 every draft is sampled from the head's warped distribution over the full
vocabulary (the reduced draft vocabulary mapped through `d2t`, `-inf` elsewhere) with the
`PURPOSE_DRAFT` stream, and those full-vocabulary logits go into the `Proposal`, so the verify
rule divides by the `q` each draft was really drawn from. Greedy drafts are the argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.core.sampling import PURPOSE_DRAFT, Sampling, first_argmax, sample_token

__all__ = ["draft_tokens", "take_rows"]


def take_rows(values: jax.Array, index: jax.Array) -> jax.Array:
  """`values[b, index[b]]` for every row: `[B, T, ...]` -> `[B, ...]`."""
  index = jnp.clip(index, 0, values.shape[1] - 1).astype(jnp.int32)
  return jax.vmap(lambda row, i: row[i])(values, index)


def draft_tokens(logits: jax.Array, draft_ids: jax.Array, full_logits, sampling: Sampling,
                 seeds: jax.Array, positions: jax.Array):
  """Drafts from draft-vocabulary logits `[..., N]`.

  Greedy: the argmax mapped to its target id (`draft_ids [N]`), no full-vocabulary logits built.
  Otherwise a `PURPOSE_DRAFT` sample from the warped full-vocabulary logits `full_logits(logits)`
  (`-inf` outside the draft vocabulary), which are returned as the q the draft was drawn from.

  Returns:
    `(tokens [...] int32, full-vocabulary logits [..., V] or None when greedy)`.
  """
  if sampling.greedy:
    return jnp.take(draft_ids, first_argmax(logits)).astype(jnp.int32), None
  full = full_logits(logits)
  return sample_token(full, sampling, seeds, positions, PURPOSE_DRAFT), full
