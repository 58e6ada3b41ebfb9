"""Medusa heads: `k` residual blocks over the target's final normed hidden state.

Head `i` is `x + SiLU(x @ W_i)` with `W_i` zero-initialised (so it starts as the identity on the
target's hidden state) followed by an LM head over the reduced draft vocabulary (`d2t` as in
`specjax.drafters.eagle.network`), initialised from the target's output rows. Reading the hidden
state at position `t`, head `i` predicts token `t + 2 + i`: all `k` drafts come out of one forward.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.eagle.network import (_check_draft_ids, _DraftVocabHead, _head_metadata,
                                            target_output_head)
from specjax.io.orbax import restore_tree, save_tree
from specjax.models.transformer import Model

__all__ = ["MedusaConfig", "MedusaHeads", "init_medusa", "load_medusa", "medusa_forward",
           "num_heads", "save_medusa", "to_target_logits"]

MEDUSA_KIND = "medusa_heads"


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
  """Shape of `MedusaHeads`: `num_heads` blocks of width `embed_dim`, draft vocabulary `N`."""

  embed_dim: int
  num_heads: int
  draft_vocab_size: int
  vocab_size: int

  def __post_init__(self):
    for name in ("embed_dim", "num_heads", "draft_vocab_size", "vocab_size"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"MedusaConfig.{name} must be a positive int, got {value!r}")
    if self.draft_vocab_size > self.vocab_size:
      raise ValueError("draft_vocab_size exceeds vocab_size")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MedusaHeads(_DraftVocabHead):
  """Medusa heads: `params` {`w [k, E, E]`, `lm_head [k, E, N]`, `d2t [N] int32`} + config."""

  params: dict
  config: MedusaConfig = dataclasses.field(metadata=dict(static=True))


def num_heads(heads: MedusaHeads) -> int:
  return heads.config.num_heads


def init_medusa(config: MedusaConfig, target: Model, draft_ids) -> MedusaHeads:
  """Fresh heads: zero residual weights, LM heads = the target's output rows of `draft_ids`."""
  if (target.config.embed_dim, target.config.vocab_size) != (config.embed_dim, config.vocab_size):
    raise ValueError("MedusaConfig does not fit the target's embed_dim / vocab_size")
  ids = _check_draft_ids(draft_ids, config.vocab_size, config.draft_vocab_size)
  k, e = config.num_heads, config.embed_dim
  rows = jnp.asarray(target_output_head(target), jnp.float32)[:, ids]  # [E, N]
  params = {"w": jnp.zeros((k, e, e), jnp.float32),
            "lm_head": jnp.broadcast_to(rows, (k,) + rows.shape),
            "d2t": jnp.asarray(ids - np.arange(ids.shape[0]), jnp.int32)}
  return MedusaHeads(params, config)


def medusa_forward(heads: MedusaHeads, hidden: jax.Array) -> jax.Array:
  """`[B, T, E]` final normed hidden states -> `[B, T, k, N]` float32 draft logits."""
  p = heads.params
  x = hidden.astype(p["w"].dtype)
  blocks = x[:, :, None, :] + jax.nn.silu(jnp.einsum("bte,kef->btkf", x, p["w"]))  # [B, T, k, E]
  return jnp.einsum("btke,ken->btkn", blocks, p["lm_head"], preferred_element_type=jnp.float32)


def to_target_logits(heads: MedusaHeads, draft_logits: jax.Array) -> jax.Array:
  """`[..., N]` -> `[..., V]` with `-inf` outside the draft vocabulary."""
  full = jnp.full(draft_logits.shape[:-1] + (heads.config.vocab_size,), -jnp.inf,
                  draft_logits.dtype)
  return full.at[..., heads.draft_ids].set(draft_logits)


def save_medusa(heads: MedusaHeads, path: str | os.PathLike, *, overwrite: bool = False
                ) -> pathlib.Path:
  return save_tree(path, heads.params, {"kind": MEDUSA_KIND,
                                        "config": dataclasses.asdict(heads.config)},
                   overwrite=overwrite)


def load_medusa(path: str | os.PathLike, dtype=jnp.float32) -> MedusaHeads:
  """Loads heads written by `save_medusa`; ValueError on a corrupt or foreign checkpoint."""
  path = pathlib.Path(path)
  metadata = _head_metadata(path, MEDUSA_KIND, "Medusa", "a Medusa")
  c = MedusaConfig(**metadata["config"])
  s = jax.ShapeDtypeStruct
  abstract = {"w": s((c.num_heads, c.embed_dim, c.embed_dim), jnp.float32),
              "lm_head": s((c.num_heads, c.embed_dim, c.draft_vocab_size), jnp.float32),
              "d2t": s((c.draft_vocab_size,), jnp.int32)}
  params, _ = restore_tree(path, abstract)
  return MedusaHeads(params, c).astype(dtype)
