"""The shipped default pair: a target LM trained on the Python standard library, a draft distilled
from it, and their byte-level BPE tokenizer.

The files live in the repository's `checkpoints/` folder, installed as the package-data package
`specjax._default` so that `load_default()` works from a source checkout, an editable install and
a regular wheel alike. Weights are stored in bfloat16 and loaded as float32 (XLA's CPU bfloat16
matmuls are slow). `checkpoints/README.md` says how the pair was made.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import pathlib

import jax.numpy as jnp

from specjax.models.transformer import Model
from specjax.io.tokenizer import Tokenizer

TARGET_DIR = "target"
DRAFT_DIR = "draft"
TOKENIZER_FILE = "tokenizer.json"


@dataclasses.dataclass(frozen=True)
class DefaultPair:
  """The shipped target, its draft and their tokenizer.

  Attributes:
    target: the target `specjax.Model`.
    draft: the distilled draft `specjax.Model` (same vocabulary).
    tokenizer: the shared `specjax.Tokenizer` (prepends `<bos>`; `<eos>` ends a file).
  """

  target: Model
  draft: Model
  tokenizer: Tokenizer


def default_dir() -> pathlib.Path:
  """Directory holding the shipped checkpoints (`specjax._default`, i.e. `checkpoints/`)."""
  try:
    path = pathlib.Path(str(importlib.resources.files("specjax._default")))
  except ModuleNotFoundError:
    path = pathlib.Path(__file__).resolve().parent.parent / "checkpoints"
  if not (path / TARGET_DIR).is_dir():
    fallback = pathlib.Path(__file__).resolve().parent.parent / "checkpoints"
    if (fallback / TARGET_DIR).is_dir():
      return fallback
    raise FileNotFoundError(f"the default checkpoints are missing from {path}: this build of "
                            "specjax was made without checkpoints/")
  return path


def load_default(dtype=jnp.float32) -> DefaultPair:
  """Loads the shipped target/draft pair and tokenizer.

  Args:
    dtype: compute dtype of the loaded weights (float32 by default; bfloat16 on TPU).

  Returns:
    A `DefaultPair` with `.target`, `.draft` and `.tokenizer`.
  """
  from specjax.io.orbax import load
  from specjax.io.tokenizer import load_tokenizer
  directory = default_dir()
  return DefaultPair(target=load(directory / TARGET_DIR, dtype=dtype),
                     draft=load(directory / DRAFT_DIR, dtype=dtype),
                     tokenizer=load_tokenizer(directory / TOKENIZER_FILE))


def export(target: Model, draft: Model, tokenizer_path: str | pathlib.Path,
           directory: str | pathlib.Path, dtype=jnp.bfloat16) -> pathlib.Path:
  """Writes a pair in the shipped layout (weights cast to `dtype`), e.g. into `checkpoints/`."""
  import shutil

  from specjax.io.orbax import save
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  save(target.astype(dtype), directory / TARGET_DIR, overwrite=True)
  save(draft.astype(dtype), directory / DRAFT_DIR, overwrite=True)
  if pathlib.Path(tokenizer_path).resolve() != (directory / TOKENIZER_FILE).resolve():
    shutil.copyfile(tokenizer_path, directory / TOKENIZER_FILE)
  return directory
