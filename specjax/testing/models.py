"""Small models for tests: `tiny_config` (a random-weight Llama-style config), `load_toy` (the
7M toy pair shipped under `checkpoints/toy`) and `random_quantized` (a quantized weight's
arrays)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.pretrained.pairs import (DRAFT_DIR, TARGET_DIR, TOKENIZER_FILE, TOY_DIR, DefaultPair,
                                      default_dir)
from specjax.models.config import ModelConfig

__all__ = ["load_toy", "random_quantized", "tiny_config"]


def tiny_config(vocab_size: int = 64, **overrides) -> ModelConfig:
  """A very small Llama-style config: 2 layers, width 32, 4 heads (2 KV heads) of 8; `overrides`
  replaces any `ModelConfig` field."""
  base = dict(vocab_size=vocab_size, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, mlp_dim=64, max_len=256, rope_theta=10_000.0)
  base.update(overrides)
  return ModelConfig(**base)


def random_quantized(rng: np.random.Generator, out: int, n: int, bits: int, group: int):
  """Random `(values, scales)` of a quantized `[out, n]` weight: int8 in [-127, 127], or int4
  packed two to a byte (`[out, n / 2]` uint8), and positive float32 scales per group."""
  values = (rng.integers(-127, 128, (out, n)).astype(np.int8) if bits == 8
            else rng.integers(0, 256, (out, n // 2)).astype(np.uint8))
  scales = rng.random((out, n // group)).astype(np.float32) + 0.01
  return jnp.asarray(values), jnp.asarray(scales)


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
                            f"(checkpoints/toy), not part of an installed wheel: no "
                            f"{directory}")
  return DefaultPair(target=load(directory / TARGET_DIR, dtype=dtype),
                     draft=load(directory / DRAFT_DIR, dtype=dtype),
                     tokenizer=load_tokenizer(directory / TOKENIZER_FILE))
