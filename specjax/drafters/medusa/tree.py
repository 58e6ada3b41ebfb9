"""Medusa heads' draft trees: head `i`'s logits are the depth-`i + 1` candidates
(`medusa_logits`); `specjax.drafters.tree_heads` builds static and sampled trees from them."""

from __future__ import annotations

import jax

from specjax.drafters.medusa import network as medusa
from specjax.drafters.medusa.drafter import MedusaDrafter

__all__ = ["medusa_logits"]


def medusa_logits(drafter: MedusaDrafter, state, depth: int) -> jax.Array:
  """`[B, D, N]` draft-vocabulary logits of heads `0 .. D - 1` (head `i`: depth `i + 1`)."""
  return medusa.medusa_forward(drafter.heads, state.hidden[:, None])[:, 0, :depth]
