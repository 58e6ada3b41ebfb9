"""Export a `specjax.Model` to a Hugging Face Llama-format checkpoint directory.

The inverse of the Llama branch of `specjax.io.hf.from_hf`: `config.json` (`LlamaForCausalLM`)
plus one `model.safetensors` whose tensor names and layouts are those `from_hf` reads, so that
`from_hf(export_hf(model, path))` returns bitwise-equal weights and `transformers` loads the same
directory with `LlamaForCausalLM.from_pretrained`. This is how the benchmarks run a peer on exactly
specjax's weights.

Only the Llama architecture is written: configs using Gemma, Qwen or Mistral features (offset
norms, soft-capping, post norms, q/k norms, q/k/v biases, sliding windows, scaled embeddings) are
rejected with a `ValueError` naming the feature.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

from specjax.io.hf import hf_layer_names
from specjax.models.config import ModelConfig
from specjax.models.transformer import Model

_UNSUPPORTED = (("norm_offset", 0.0), ("scale_embeddings", False), ("qkv_bias", False),
                ("qk_norm", False), ("post_norms", False), ("attn_logit_softcap", None),
                ("final_logit_softcap", None), ("query_pre_attn_scalar", None),
                ("sliding_window", None), ("rope_local_theta", None), ("activation", "silu"))


def llama_config_dict(config: ModelConfig) -> dict:
  """The Hugging Face `config.json` of a Llama-architecture `ModelConfig`.

  Raises:
    ValueError: the config uses a feature the Llama architecture does not have.
  """
  for field, plain in _UNSUPPORTED:
    if getattr(config, field) != plain:
      raise ValueError(f"export_hf writes the Llama architecture only; {field}="
                       f"{getattr(config, field)!r} is not a Llama feature")
  hf = {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": config.vocab_size,
      "hidden_size": config.embed_dim,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": config.max_len,
      "rms_norm_eps": config.norm_eps,
      "rope_theta": config.rope_theta,
      "tie_word_embeddings": config.tie_embeddings,
      "attention_bias": False,
      "attention_dropout": 0.0,
      "mlp_bias": False,
      "pad_token_id": config.pad_id,
      "bos_token_id": config.bos_id,
      "eos_token_id": config.eos_id,
      "torch_dtype": "float32",
  }
  scaling = config.rope_scaling
  if scaling is not None:
    if scaling.kind == "linear":
      hf["rope_scaling"] = {"rope_type": "linear", "factor": scaling.factor}
    else:
      hf["rope_scaling"] = {
          "rope_type": "llama3", "factor": scaling.factor,
          "low_freq_factor": scaling.low_freq_factor,
          "high_freq_factor": scaling.high_freq_factor,
          "original_max_position_embeddings": scaling.original_max_position_embeddings}
  return hf


def hf_tensors(model: Model) -> dict[str, np.ndarray]:
  """`{Hugging Face tensor name: array}` for a Llama-architecture model (layouts as PyTorch's)."""
  config = model.config
  llama_config_dict(config)  # validates the architecture
  params = model.stacked().without_output_copy().params

  def host(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x))

  tensors = {"model.embed_tokens.weight": host(params["embed"]),
             "model.norm.weight": host(params["final_norm"])}
  if not config.tie_embeddings:
    tensors["lm_head.weight"] = host(np.asarray(params["lm_head"]).T)
  for name, (hf_name, transpose) in hf_layer_names(config).items():
    stacked = np.asarray(params["layers"][name])  # [L, ...]
    for i in range(config.num_layers):
      tensors[f"model.layers.{i}.{hf_name}"] = host(stacked[i].T if transpose else stacked[i])
  return tensors


def export_hf(model: Model, path: str | os.PathLike, *,
              tokenizer_file: str | os.PathLike | None = None, overwrite: bool = False) -> pathlib.Path:
  """Writes `model` as a Hugging Face Llama checkpoint directory.

  Args:
    model: a Llama-architecture `specjax.Model` (any float dtype; written as stored).
    path: the directory to create (`config.json`, `model.safetensors`, `generation_config.json`).
    tokenizer_file: optionally a `tokenizer.json` to copy beside the weights.
    overwrite: write into an existing directory instead of raising.

  Returns:
    The directory.

  Raises:
    ValueError: unsupported architecture, or `path` exists and `overwrite` is False.
  """
  from safetensors.numpy import save_file

  path = pathlib.Path(path)
  if path.exists() and not overwrite:
    raise ValueError(f"{path} already exists (pass overwrite=True to write into it)")
  hf = llama_config_dict(model.config)
  hf["torch_dtype"] = np.dtype(model.dtype).name
  tensors = hf_tensors(model)
  path.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
  (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
  generation = {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"],
                "pad_token_id": hf["pad_token_id"]}
  (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
  if tokenizer_file is not None:
    import shutil
    shutil.copyfile(tokenizer_file, path / "tokenizer.json")
  return path
