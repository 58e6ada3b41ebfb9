"""Checks that turn bad input into a clear `ValueError` before anything is traced or compiled.

Shapes and dtypes are always checked. Values (prompt lengths, token ids) are checked when they are
concrete; inside a user's own `jax.jit` they are tracers and only their shapes can be checked.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.sampling import Sampling

NEW_TOKEN_BUCKET = 64  # output/cache capacity is max_new_tokens rounded up to this


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_tokens(tokens, lengths, vocab_size: int, name: str = "tokens"):
  """Validates a right-padded prompt batch.

  Only the ids before each row's length must be in the vocabulary: what pads a row (0, -1, a
  pad id) is never read as a token (the jitted loops replace it by 0:
  `specjax.core.sequence.clear_padding`).

  Returns:
    `(tokens [B, T] int32, lengths [B] int32)`.
  """
  if not hasattr(tokens, "dtype"):
    tokens = np.asarray(tokens)
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array of token ids, got dtype {tokens.dtype}")
  if tokens.ndim != 2:
    raise ValueError(f"{name} must have shape [batch, length], got shape {tuple(tokens.shape)}")
  batch, width = tokens.shape
  if batch == 0 or width == 0:
    raise ValueError(f"{name} is empty (shape {tuple(tokens.shape)}): every row needs a prompt "
                     "of at least one token")
  if lengths is None:
    lengths = np.full((batch,), width, np.int32)
  else:
    if not hasattr(lengths, "dtype"):
      lengths = np.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise ValueError(f"lengths must be an integer array, got dtype {lengths.dtype}")
    if tuple(lengths.shape) != (batch,):
      raise ValueError(f"lengths must have shape [{batch}] (one per row), got "
                       f"{tuple(lengths.shape)}")
    if is_concrete(lengths):
      values = np.asarray(lengths)
      if values.min() < 1:
        raise ValueError(f"empty prompt: lengths must be >= 1, got {values.tolist()}")
      if values.max() > width:
        raise ValueError(f"lengths ({values.max()}) exceed the token array width ({width})")
  if is_concrete(tokens) and is_concrete(lengths):
    values = np.asarray(tokens)
    inside = np.arange(width)[None] < np.asarray(lengths)[:, None]
    prompt = values[inside]
    low, high = int(prompt.min()), int(prompt.max())
    if low < 0 or high >= vocab_size:
      row = int(np.argmax(np.any(inside & ((values < 0) | (values >= vocab_size)), axis=1)))
      raise ValueError(f"{name} holds ids outside [0, {vocab_size}) within the prompts (before "
                       f"lengths): min {low}, max {high} (first in row {row})")
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32)


def check_count(value, name: str, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{name} must be an int, got {value!r}")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")
  return int(value)


def check_context(lengths, width: int, max_new_tokens: int, max_len: int, what: str = "model",
                  reserved: int = 0):
  """Prompt plus new tokens (plus `reserved` positions, `reserved_positions`) must fit the
  model's context."""
  longest = int(np.max(np.asarray(lengths))) if is_concrete(lengths) else width
  if longest + max_new_tokens + reserved > max_len:
    plus = (f" + {reserved} positions the last round scores past the new tokens (the {what} "
            "does not declare finite_past_max_len: see specjax.models.adapter.CacheSpec)"
            if reserved else "")
    raise ValueError(f"prompt length {longest} + max_new_tokens {max_new_tokens}{plus} = "
                     f"{longest + max_new_tokens + reserved} exceeds the {what}'s context of "
                     f"{max_len} tokens")


def reserved_positions(model, num_draft: int) -> int:
  """Positions a decode must keep free at the end of `model`'s context for its last round.

  A round calls the model on up to `num_draft` positions past each row's last token. A model
  that declares `finite_past_max_len` (rotary positions, a clipped position table) needs none; any
  other model (one specjax cannot inspect, e.g. a Flax module whose table would be indexed past
  its end) gets `num_draft`, so every position it is called at lies inside its context.
  """
  return 0 if model is None or getattr(model, "finite_past_max_len", False) else num_draft


def check_rng(rng, batch: int | None = None):
  """One PRNG key, or (with `batch`) a `[batch]` array of keys, one per row (per request).

  Raw `uint32[2]` keys (`jax.random.PRNGKey`) and `uint32[batch, 2]` arrays of them are accepted.
  """
  if not hasattr(rng, "dtype"):
    raise ValueError(f"rng must be a JAX PRNG key (jax.random.key(0)), got {type(rng).__name__}")
  shape = tuple(rng.shape)
  per_row = "" if batch is None else f" or an array of {batch} keys (one per row)"
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if shape == () or (batch is not None and shape == (batch,)):
      return rng
    raise ValueError(f"rng must be a single PRNG key{per_row}, got a key array of shape {shape}")
  if rng.dtype == jnp.uint32 and (shape == (2,) or (batch is not None and shape == (batch, 2))):
    return rng
  raise ValueError(f"rng must be a JAX PRNG key (jax.random.key(seed) or "
                   f"jax.random.PRNGKey(seed)){per_row}, got dtype {rng.dtype} shape {shape}")


def check_eos(eos_id, vocab_size: int) -> tuple[int, ...]:
  """`eos_id` as a tuple of stop ids: None -> `(-1,)` (never matches), an int, or a sequence."""
  if eos_id is None:
    return (-1,)
  ids = list(eos_id) if isinstance(eos_id, (list, tuple, np.ndarray)) else [eos_id]
  if not ids:
    raise ValueError("eos_id is an empty sequence: pass None for no stop token")
  for value in ids:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ValueError(f"eos_id must be an int, a sequence of ints, or None, got {eos_id!r}")
    if not 0 <= value < vocab_size:
      raise ValueError(f"eos_id {value} is outside the vocabulary [0, {vocab_size})")
  return tuple(int(v) for v in ids)


def is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
  """`tokens [...]` == any of `eos_ids [E]`, elementwise."""
  return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def round_up(value: int, multiple: int) -> int:
  return int(math.ceil(value / multiple) * multiple)


def check_model(model, name: str = "model"):
  """The model protocol: `vocab_size`, `max_len`, `init_cache`."""
  for attribute in ("vocab_size", "max_len", "init_cache"):
    if not hasattr(model, attribute):
      raise ValueError(f"{name} does not follow the specjax model protocol: no `{attribute}` "
                       "(pass a specjax.Model or wrap your module with specjax.models.adapter)")


def check_sampling(sampling):
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a specjax.Sampling, got {type(sampling).__name__}")
  return sampling


def resolve_pad_id(model, pad_id: int | None) -> int:
  """`pad_id`, or the model config's `pad_id` (0 when the model has no config) when None.

  It only fills the output after each row's end, so any int32 value is allowed (-1 is a common
  marker); it must be a Python or NumPy int, not a float, a bool or an array.
  """
  if pad_id is None:
    return int(getattr(getattr(model, "config", None), "pad_id", 0))
  if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)):
    raise ValueError(f"pad_id must be an int (or None for the model's own), got {pad_id!r}")
  if not -2**31 <= int(pad_id) < 2**31:
    raise ValueError(f"pad_id must fit in int32, got {pad_id}")
  return int(pad_id)


def pytree_classes(*trees) -> tuple[type, ...]:
  """The classes of every node of `trees`' structures, in order: a static `jax.jit` argument that
  keeps the compiled programs of two pytree classes apart.

  In jax 0.10 two `PyTreeDef`s whose dataclass nodes differ only in their class (a subclass that
  keeps its parent's fields, e.g. a drafter that overrides `propose`) compare equal while their
  hashes differ, so a jitted function's cache can, depending on its contents, hand one class the
  program compiled for the other. Keyed on these classes (compared by identity), it cannot.
  """
  classes = []

  def walk(treedef):
    data = treedef.node_data()
    if data is not None:
      classes.append(data[0])
    for child in treedef.children():
      walk(child)

  for tree in trees:
    walk(jax.tree.structure(tree))
  return tuple(classes)
