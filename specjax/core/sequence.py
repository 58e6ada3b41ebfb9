"""Token-buffer helpers shared by the loop and the drafters: windows of each row, padding
cleared."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["clear_padding", "gather_tokens"]


def gather_tokens(sequence: jax.Array, starts: jax.Array, width: int) -> jax.Array:
  """`sequence[b, starts[b] : starts[b] + width]` for every row: `[B, S]` -> `[B, width]`."""
  index = starts.astype(jnp.int32)[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, width]
  return jnp.take_along_axis(sequence, index, axis=1, mode="clip")


def clear_padding(tokens: jax.Array, lengths: jax.Array) -> jax.Array:
  """`tokens` with every id at or past its row's length set to 0: what pads a prompt (-1, an id
  outside the vocabulary) never reaches an embedding. Called at the top of the jitted loops."""
  width = tokens.shape[1]
  return jnp.where(jnp.arange(width, dtype=jnp.int32)[None] < lengths[:, None], tokens, 0)
