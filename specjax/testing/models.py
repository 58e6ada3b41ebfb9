"""Small models for tests: `tiny_config` (a random-weight Llama-style config) and `load_toy` (the
7M toy pair shipped under `checkpoints/toy`)."""

from __future__ import annotations

import jax.numpy as jnp

from specjax.default import (DRAFT_DIR, TARGET_DIR, TOKENIZER_FILE, TOY_DIR, DefaultPair,
                             default_dir)
from specjax.models.config import ModelConfig

__all__ = ["load_toy", "tiny_config"]


def tiny_config(vocab_size: int = 64, **overrides) -> ModelConfig:
  """A very small Llama-style config: 2 layers, width 32, 4 heads (2 KV heads) of 8; `overrides`
  replaces any `ModelConfig` field."""
  base = dict(vocab_size=vocab_size, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, mlp_dim=64, max_len=256, rope_theta=10_000.0)
  base.update(overrides)
  return ModelConfig(**base)


def load_toy(dtype=jnp.float32) -> DefaultPair:
  """The 7M toy pair of `checkpoints/toy` (a target trained on the Python standard library, a
  draft distilled from it, their byte-level BPE tokenizer): small and fast, for tests.

  A test fixture of the source checkout (and of editable installs of it): the wheel leaves it out.

  Raises:
    FileNotFoundError: no `checkpoints/toy` here (specjax installed from a wheel).
  """
  from specjax.io.orbax import load
  from specjax.io.tokenizer import load_tokenizer
  directory = default_dir() / TOY_DIR
  if not directory.is_dir():
    raise FileNotFoundError(f"the toy pair is a test fixture of the specjax source checkout "
                            f"(checkpoints/toy), not part of an installed wheel: no {directory}")
  return DefaultPair(target=load(directory / TARGET_DIR, dtype=dtype),
                     draft=load(directory / DRAFT_DIR, dtype=dtype),
                     tokenizer=load_tokenizer(directory / TOKENIZER_FILE))
