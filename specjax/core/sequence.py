"""Token-buffer helpers shared by the loop and the drafters: windows of each row, padding
cleared; and, on the host, one prompt padded to a bucketed width."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["clear_padding", "gather_tokens", "padded_prompt", "prompt_width"]


def gather_tokens(sequence: jax.Array, starts: jax.Array, width: int) -> jax.Array:
  """`sequence[b, starts[b] : starts[b] + width]` for every row: `[B, S]` -> `[B, width]`."""
  index = starts.astype(jnp.int32)[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, width]
  return jnp.take_along_axis(sequence, index, axis=1, mode="clip")


def clear_padding(tokens: jax.Array, lengths: jax.Array) -> jax.Array:
  """`tokens` with every id at or past its row's length set to 0: what pads a prompt (-1, an id
  outside the vocabulary) never reaches an embedding. Called at the top of the jitted loops."""
  width = tokens.shape[1]
  return jnp.where(jnp.arange(width, dtype=jnp.int32)[None] < lengths[:, None], tokens, 0)


def prompt_width(length: int, multiple: int = 32) -> int:
  """The width a `length`-token prompt is padded to: the next multiple of `multiple`, at least
  one multiple (one compiled program per width, however many prompt lengths share it)."""
  return max(multiple, -(-length // multiple) * multiple)


def padded_prompt(ids, multiple: int = 32, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """One prompt as a `[1, prompt_width(len(ids))]` int32 batch padded with `pad_id`, and its
  `[1]` length: what `decode` and `generate` take."""
  width = prompt_width(len(ids), multiple)
  tokens = np.full((1, width), pad_id, np.int32)
  tokens[0, :len(ids)] = ids
  return tokens, np.asarray([len(ids)], np.int32)
