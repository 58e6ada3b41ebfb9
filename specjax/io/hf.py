"""Hugging Face import: config.json mapping for the supported families, safetensors weights.

`from_hf` reads a Hugging Face checkpoint directory (config.json + safetensors, single file or
sharded with `model.safetensors.index.json`) of a supported family and maps names and layouts onto
the built-in decoder; `convert_hf` writes the result as a specjax (Orbax) checkpoint.
"""

from __future__ import annotations

import os
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.io.orbax import (check_param_shapes, expected_shapes, flatten, nest_params, put,
                              resolve_sharding, save)
from specjax.io.safetensors import SafetensorsFiles, read_json, safetensors_files
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.transformer import Model, init_params, layer_param_shapes

# ---------------------------------------------------------------------------------------------
# Hugging Face import

SUPPORTED_HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                         "gemma3", "gemma4_text", "gemma4")
_MIXTURE_OF_EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3",
                       "dbrx", "jamba", "olmoe", "granitemoe", "phimoe", "llama4")
_GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    query_pre_attn_scalar=256, rms_norm_eps=1e-6, max_position_embeddings=131_072,
    sliding_window=4096, sliding_window_pattern=6, rope_local_base_freq=10_000.0,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
# `Gemma4TextConfig`'s defaults for the fields a config.json may leave out.
_GEMMA4_TEXT_DEFAULTS = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    max_position_embeddings=131_072, sliding_window=512, hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True, vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256,
    attention_k_eq_v=False, num_kv_shared_layers=0, enable_moe_block=False,
    use_double_wide_mlp=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
_GEMMA4_ROPE_DEFAULTS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0}}


def _rope_parameters(hf: dict, layer_type: str | None) -> dict:
  """Merges the legacy (`rope_theta`, `rope_scaling`) and current (`rope_parameters`) formats."""
  merged: dict = {}
  if hf.get("rope_theta") is not None:
    merged["rope_theta"] = hf["rope_theta"]
  if hf.get("rope_scaling"):
    if layer_type in (None, "full_attention"):
      merged.update(hf["rope_scaling"])
  params = hf.get("rope_parameters") or {}
  if layer_type is not None and isinstance(params.get(layer_type), dict):
    params = params[layer_type]
  elif layer_type is not None and any(isinstance(v, dict) for v in params.values()):
    params = {}
  merged.update(params)
  if "type" in merged and "rope_type" not in merged:
    merged["rope_type"] = merged["type"]
  merged.setdefault("rope_type", "default")
  return merged


def _rope_scaling(rope: dict, family: str) -> RopeScaling | None:
  kind = rope["rope_type"]
  if kind not in _SUPPORTED_ROPE_TYPES:
    raise ValueError(f"{family}: rope_type {kind!r} is not supported (supported: "
                     f"{', '.join(_SUPPORTED_ROPE_TYPES)})")
  if rope.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"{family}: partial_rotary_factor={rope['partial_rotary_factor']} is not "
                     "supported (RoPE on the whole head only)")
  if kind == "default":
    return None
  if kind == "linear":
    return RopeScaling(kind="linear", factor=float(rope["factor"]))
  return RopeScaling(kind="llama3", factor=float(rope["factor"]),
                     low_freq_factor=float(rope["low_freq_factor"]),
                     high_freq_factor=float(rope["high_freq_factor"]),
                     original_max_position_embeddings=int(rope["original_max_position_embeddings"]))


def _layer_types(hf: dict, family: str, num_layers: int) -> list[str]:
  if hf.get("layer_types"):
    return list(hf["layer_types"])
  window = hf.get("sliding_window")
  if family == "mistral":
    sliding = [window is not None] * num_layers
  elif family == "gemma2":
    sliding = [bool((i + 1) % 2) for i in range(num_layers)]
  elif family == "gemma3_text":
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    sliding = [bool((i + 1) % pattern) for i in range(num_layers)]
  elif family in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
    sliding = [i >= hf.get("max_window_layers", 28) for i in range(num_layers)]
  else:
    sliding = [False] * num_layers
  return ["sliding_attention" if s else "full_attention" for s in sliding]


def _window_fields(hf: dict, family: str, num_layers: int) -> dict:
  """`sliding_window` and `sliding_window_pattern` reproducing the checkpoint's layer types."""
  types = _layer_types(hf, family, num_layers)
  unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
  if unknown:
    raise ValueError(f"{family}: attention layer types {unknown} are not supported")
  if len(types) != num_layers:
    raise ValueError(f"{family}: layer_types has {len(types)} entries for {num_layers} layers")
  window = hf.get("sliding_window")
  if family in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
    window = None
  if "sliding_attention" not in types or window is None:
    return dict(sliding_window=None, sliding_window_pattern=1)
  for pattern in range(1, num_layers + 2):
    candidate = ModelConfig(vocab_size=1, embed_dim=1, num_layers=num_layers, num_heads=1,
                            num_kv_heads=1, head_dim=2, mlp_dim=1, sliding_window=int(window),
                            sliding_window_pattern=pattern)
    if [w > 0 for w in candidate.layer_windows()] == [t == "sliding_attention" for t in types]:
      return dict(sliding_window=int(window), sliding_window_pattern=pattern)
  raise ValueError(f"{family}: this arrangement of sliding-window layers is not supported "
                   f"(every n-th layer global only): {types}")


def _activation(hf: dict, family: str) -> str:
  name = hf.get("hidden_activation") or hf.get("hidden_act") or (
      "gelu_pytorch_tanh" if family in _GEMMA_FAMILIES else "silu")
  if family == "gemma" and name == "gelu":
    name = "gelu_pytorch_tanh"  # the legacy value of Gemma 1 configs means the tanh form
  if name in ("silu", "swish"):
    return "silu"
  if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
    return "gelu_tanh"
  raise ValueError(f"{family}: MLP activation {name!r} is not supported (silu or tanh-gelu)")


def gemma4_text_fields(hf: dict) -> dict:
  """A Gemma 4 text config (`gemma4_text`) with `Gemma4TextConfig`'s defaults filled in and its
  derived fields resolved: `layer_types` (every 6th layer global, the last one always),
  `rope_parameters` per layer type, and the global layers' head width and key/value heads
  (`global_head_dim`, 512 unless given, and `num_global_key_value_heads` with
  `attention_k_eq_v`, or a `per_layer_config` table indexed by layer) as `_global_head_dim`,
  `_global_kv_heads`.

  Raises:
    ValueError: naming a Gemma 4 feature the built-in decoder does not implement (mixture of
      experts, bidirectional attention, global layers of different shapes, ...).
  """
  hf = {**_GEMMA4_TEXT_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
  if hf.get("enable_moe_block"):
    raise ValueError("gemma4: enable_moe_block=True (mixture-of-experts layers) is not "
                     "implemented by the built-in decoder")
  if hf.get("use_bidirectional_attention"):
    raise ValueError(f"gemma4: use_bidirectional_attention={hf['use_bidirectional_attention']!r} "
                     "is not supported (decoder-only models only)")
  if hf.get("attention_bias"):
    raise ValueError("gemma4: attention_bias=True is not supported")
  num_layers = int(hf["num_hidden_layers"])
  types = list(hf.get("layer_types") or [
      "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)])
  if types:
    types[-1] = "full_attention"  # as `Gemma4TextConfig` forces it
  hf["layer_types"] = types
  rope = dict(_GEMMA4_ROPE_DEFAULTS)
  rope.update(hf.get("rope_parameters") or {})
  hf["rope_parameters"] = rope
  global_dim = int(hf.get("global_head_dim") or 512)
  global_kv = (hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None)
  global_kv = int(global_kv or hf["num_key_value_heads"])
  overrides = hf.get("per_layer_config") or {}
  shapes = set()
  for index, kind in enumerate(types):
    entry = dict(overrides.get(str(index), overrides.get(index, {})) or {})
    unknown = sorted(set(entry) - {"head_dim", "num_key_value_heads"})
    if unknown:
      raise ValueError(f"gemma4: per_layer_config sets {unknown} on layer {index}; only "
                       "head_dim and num_key_value_heads are supported")
    if kind == "full_attention":
      if not overrides:
        entry = {"head_dim": global_dim}
      shapes.add((int(entry.get("head_dim", hf["head_dim"])),
                  int(entry.get("num_key_value_heads", global_kv if not overrides
                                else hf["num_key_value_heads"]))))
    elif entry:
      raise ValueError(f"gemma4: per_layer_config overrides sliding-window layer {index}; only "
                       "the global layers may differ")
  if len(shapes) > 1:
    raise ValueError(f"gemma4: the global layers differ in shape ({sorted(shapes)}); one head "
                     "width and key/value head count for all of them is supported")
  hf["_global_head_dim"], hf["_global_kv_heads"] = shapes.pop() if shapes else (
      int(hf["head_dim"]), int(hf["num_key_value_heads"]))
  ple = int(hf.get("hidden_size_per_layer_input") or 0)
  if ple and int(hf.get("vocab_size_per_layer_input") or 0) < int(hf["vocab_size"]):
    raise ValueError(f"gemma4: vocab_size_per_layer_input ({hf.get('vocab_size_per_layer_input')})"
                     f" is smaller than vocab_size ({hf['vocab_size']}): per-layer embeddings "
                     "for every token id are needed")
  return hf


def _gemma4_config(hf: dict) -> ModelConfig:
  """The `ModelConfig` of a Gemma 4 text config (see `gemma4_text_fields`)."""
  hf = gemma4_text_fields(hf)
  family = "gemma4_text"
  num_layers = int(hf["num_hidden_layers"])
  local = dict(hf["rope_parameters"].get("sliding_attention") or {})
  full = dict(hf["rope_parameters"].get("full_attention") or {})
  local.setdefault("rope_type", "default")
  full.setdefault("rope_type", "default")
  if local["rope_type"] not in ("default", "proportional") or (
      local.get("partial_rotary_factor", 1.0) != 1.0 or local.get("factor", 1.0) != 1.0):
    raise ValueError(f"gemma4: RoPE {local} on sliding-window layers is not supported (plain "
                     "RoPE on the whole head only)")
  if full["rope_type"] not in ("default", "proportional"):
    raise ValueError(f"gemma4: rope_type {full['rope_type']!r} on global layers is not supported "
                     "(default or proportional)")
  partial = float(full.get("partial_rotary_factor", 1.0))
  factor = float(full.get("factor", 1.0))
  if full["rope_type"] == "default" and partial != 1.0:
    raise ValueError("gemma4: partial_rotary_factor with rope_type 'default' is not supported")
  scaling = None if partial == 1.0 and factor == 1.0 else RopeScaling(
      kind="proportional", factor=factor, partial_rotary_factor=partial)
  num_heads = int(hf["num_attention_heads"])
  shared = int(hf.get("num_kv_shared_layers") or 0)
  pad_id = _first_id(hf.get("pad_token_id"))
  return ModelConfig(
      vocab_size=int(hf["vocab_size"]),
      embed_dim=int(hf["hidden_size"]),
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=int(hf["num_key_value_heads"]),
      head_dim=int(hf["head_dim"]),
      mlp_dim=int(hf["intermediate_size"]),
      max_len=int(hf["max_position_embeddings"]),
      rope_theta=float(full.get("rope_theta", 1_000_000.0)),
      rope_scaling=scaling,
      rope_local_theta=float(local.get("rope_theta", 10_000.0)),
      norm_eps=float(hf["rms_norm_eps"]),
      norm_offset=0.0,
      activation=_activation(hf, family),
      tie_embeddings=bool(hf["tie_word_embeddings"]),
      scale_embeddings=True,
      qk_norm=True,
      post_norms=True,
      final_logit_softcap=hf.get("final_logit_softcapping"),
      query_pre_attn_scalar=1.0,  # Gemma 4 scales attention by 1 (its q/k norms set the scale)
      global_head_dim=hf["_global_head_dim"],
      global_kv_heads=hf["_global_kv_heads"],
      v_norm=True,
      kv_shared_layers=shared,
      per_layer_input_dim=int(hf.get("hidden_size_per_layer_input") or 0),
      per_layer_vocab_size=int(hf.get("vocab_size_per_layer_input") or 0)
      if hf.get("hidden_size_per_layer_input") else 0,
      layer_scalar=True,
      double_wide_mlp=bool(hf.get("use_double_wide_mlp")) and shared > 0,
      bos_id=_first_id(hf.get("bos_token_id")),
      eos_id=_first_id(hf.get("eos_token_id")),
      pad_id=0 if pad_id is None else pad_id,
      family=family,
      **_window_fields(hf, family, num_layers),
  )


def _first_id(value) -> int | None:
  if isinstance(value, list):
    return int(value[0]) if value else None
  return None if value is None else int(value)


def hf_config_to_model_config(hf: dict) -> ModelConfig:
  """The `ModelConfig` equivalent to a Hugging Face `config.json` of a supported family.

  Raises:
    ValueError: naming the architecture, RoPE type or feature that is not supported.
  """
  family = hf.get("model_type")
  if family == "gemma3":
    if not isinstance(hf.get("text_config"), dict):
      raise ValueError("gemma3: config.json has no text_config")
    hf = dict(hf["text_config"], model_type="gemma3_text")
    family = "gemma3_text"
  if family == "gemma3_text":
    # Multimodal Gemma 3 configs list only the text fields that differ from these defaults.
    hf = {**_GEMMA3_TEXT_DEFAULTS, **hf}
  if family == "gemma4":
    if not isinstance(hf.get("text_config"), dict):
      raise ValueError("gemma4: config.json has no text_config")
    hf = dict(hf["text_config"], model_type="gemma4_text")
    family = "gemma4_text"
  if family == "gemma4_text":
    return _gemma4_config(hf)
  if family in _MIXTURE_OF_EXPERTS or hf.get("num_local_experts") or hf.get("num_experts"):
    raise ValueError(f"unsupported architecture {family!r}: mixture-of-experts layers are not "
                     "implemented by the built-in decoder")
  if family not in SUPPORTED_HF_FAMILIES:
    architectures = hf.get("architectures")
    raise ValueError(f"unsupported architecture {family!r} ({architectures}); supported "
                     f"model_type values: {', '.join(SUPPORTED_HF_FAMILIES)}")
  if hf.get("attention_bias") and family != "qwen2":
    raise ValueError(f"{family}: attention_bias=True (a bias on o_proj) is not supported")
  if hf.get("mlp_bias"):
    raise ValueError(f"{family}: mlp_bias=True is not supported")
  if hf.get("use_bidirectional_attention"):
    raise ValueError(f"{family}: use_bidirectional_attention=True is not supported "
                     "(decoder-only models only)")
  gemma = family in _GEMMA_FAMILIES
  num_layers = int(hf["num_hidden_layers"])
  num_heads = int(hf["num_attention_heads"])
  head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads
  if family == "gemma3_text":
    global_rope = _rope_parameters(hf, "full_attention")
    local_rope = _rope_parameters(hf, "sliding_attention")
    if "rope_theta" not in local_rope:
      local_rope["rope_theta"] = hf.get("rope_local_base_freq", 10_000.0)
    if local_rope["rope_type"] != "default":
      raise ValueError(f"gemma3: rope scaling on sliding-window layers ({local_rope['rope_type']}) "
                       "is not supported")
    global_rope.setdefault("rope_theta", 1_000_000.0)
    rope_local_theta = float(local_rope["rope_theta"])
  else:
    global_rope = _rope_parameters(hf, None)
    global_rope.setdefault("rope_theta", 10_000.0)
    rope_local_theta = None
  query_pre_attn_scalar = hf.get("query_pre_attn_scalar") if family in ("gemma2",
                                                                          "gemma3_text") else None
  pad_id = _first_id(hf.get("pad_token_id"))
  return ModelConfig(
      vocab_size=int(hf["vocab_size"]),
      embed_dim=int(hf["hidden_size"]),
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
      head_dim=int(head_dim),
      mlp_dim=int(hf["intermediate_size"]),
      max_len=int(hf.get("max_position_embeddings", 2048)),
      rope_theta=float(global_rope["rope_theta"]),
      rope_scaling=_rope_scaling(global_rope, family),
      rope_local_theta=rope_local_theta,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      norm_offset=1.0 if gemma else 0.0,
      activation=_activation(hf, family),
      tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
      scale_embeddings=gemma,
      qkv_bias=family == "qwen2",
      qk_norm=family in ("qwen3", "gemma3_text"),
      post_norms=family in ("gemma2", "gemma3_text"),
      attn_logit_softcap=hf.get("attn_logit_softcapping") if family != "gemma" else None,
      final_logit_softcap=hf.get("final_logit_softcapping") if family != "gemma" else None,
      query_pre_attn_scalar=None if query_pre_attn_scalar is None else float(query_pre_attn_scalar),
      bos_id=_first_id(hf.get("bos_token_id")),
      eos_id=_first_id(hf.get("eos_token_id")),
      pad_id=0 if pad_id is None else pad_id,
      family=family,
      **_window_fields(hf, family, num_layers),
  )


def hf_layer_names(config: ModelConfig) -> dict[str, tuple[str, bool]]:
  """specjax layer weight -> (Hugging Face name inside a layer, transpose?)."""
  names = {
      "attn_norm": ("input_layernorm.weight", False),
      "wq": ("self_attn.q_proj.weight", True),
      "wk": ("self_attn.k_proj.weight", True),
      "wv": ("self_attn.v_proj.weight", True),
      "wo": ("self_attn.o_proj.weight", True),
      "w_gate": ("mlp.gate_proj.weight", True),
      "w_up": ("mlp.up_proj.weight", True),
      "w_down": ("mlp.down_proj.weight", True),
  }
  if config.post_norms:  # Gemma 2/3: four norms per block
    names["post_attn_norm"] = ("post_attention_layernorm.weight", False)
    names["mlp_norm"] = ("pre_feedforward_layernorm.weight", False)
    names["post_mlp_norm"] = ("post_feedforward_layernorm.weight", False)
  else:
    names["mlp_norm"] = ("post_attention_layernorm.weight", False)
  if config.qkv_bias:
    names.update(bq=("self_attn.q_proj.bias", False), bk=("self_attn.k_proj.bias", False),
                 bv=("self_attn.v_proj.bias", False))
  if config.qk_norm:
    names.update(q_norm=("self_attn.q_norm.weight", False), k_norm=("self_attn.k_norm.weight", False))
  return names


def _find_prefix(files: SafetensorsFiles) -> str:
  """The name prefix of the decoder (`model.`, `model.language_model.`, ...)."""
  candidates = sorted((n[:-len("embed_tokens.weight")] for n in files.names()
                       if n.endswith("embed_tokens.weight")), key=len)
  if not candidates:
    raise ValueError("missing tensor embed_tokens.weight: no token embedding in the checkpoint")
  return candidates[0]


def _ignored_hf_tensor(name: str) -> bool:
  """Tensors of a Hugging Face checkpoint that the text decoder does not use."""
  return (name.endswith("rotary_emb.inv_freq")
          or name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                              "model.multi_modal_projector.", "model.audio_tower.",
                              "model.embed_vision.", "model.embed_audio.")))


# Gemma 4's per-layer weights: specjax name -> (Hugging Face name inside a layer, transpose?).
_GEMMA4_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "post_attn_norm": ("post_attention_layernorm.weight", False),
    "mlp_norm": ("pre_feedforward_layernorm.weight", False),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
    "ple_gate": ("per_layer_input_gate.weight", True),
    "ple_proj": ("per_layer_projection.weight", True),
    "ple_norm": ("post_per_layer_input_norm.weight", False),
    "layer_scalar": ("layer_scalar", False),
}


def gemma4_layer_plan(config: ModelConfig, prefix: str, layer: int, k_eq_v: bool,
                      names=frozenset()) -> dict[str, tuple[str, bool]]:
  """specjax weight of one Gemma 4 layer -> (Hugging Face tensor name, transpose?). A global
  layer with `attention_k_eq_v` has no `v_proj`: its values are its key projection's output
  (before the key norm), so `wv` reads `k_proj` (a copy; same product)."""
  plan = {}
  for name in layer_param_shapes(config, layer):
    hf_name, transpose = _GEMMA4_LAYER_NAMES[name]
    if name == "wv" and k_eq_v and config.is_global(layer):
      hf_name = _GEMMA4_LAYER_NAMES["wk"][0]
    plan[name] = (f"{prefix}layers.{layer}.{hf_name}", transpose)
  return plan


def _from_hf_per_layer(path, files: SafetensorsFiles, config: ModelConfig, hf: dict, dtype,
                       progress) -> Model:
  """`from_hf` for a `per_layer_only` config (Gemma 4): weights read into one dict per layer,
  each checked against the shapes its layer implies (`layer_param_shapes`)."""
  prefix = _find_prefix(files)
  text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
  k_eq_v = bool(text.get("attention_k_eq_v"))
  c = config
  top = {"embed": (prefix + "embed_tokens.weight", False), "final_norm": (prefix + "norm.weight", False)}
  top_shapes = {"embed": (c.vocab_size, c.embed_dim), "final_norm": (c.embed_dim,)}
  if not c.tie_embeddings:
    heads = sorted((n for n in files.names() if n.endswith("lm_head.weight")), key=len)
    top["lm_head"] = (heads[0] if heads else "lm_head.weight", True)
    top_shapes["lm_head"] = (c.embed_dim, c.vocab_size)
  if c.per_layer_input_dim:
    width = c.num_layers * c.per_layer_input_dim
    top.update(embed_per_layer=(prefix + "embed_tokens_per_layer.weight", False),
               per_layer_projection=(prefix + "per_layer_model_projection.weight", True),
               per_layer_norm=(prefix + "per_layer_projection_norm.weight", False))
    top_shapes.update(embed_per_layer=(c.per_layer_vocab_size, width),
                      per_layer_projection=(c.embed_dim, width),
                      per_layer_norm=(c.per_layer_input_dim,))
  layers = [gemma4_layer_plan(c, prefix, i, k_eq_v) for i in range(c.num_layers)]
  wanted = [entry for entry in top.values()] + [e for plan in layers for e in plan.values()]
  missing = sorted({n for n, _ in wanted if n not in files})
  if missing:
    shown = missing[:8] + (["..."] if len(missing) > 8 else [])
    raise ValueError(f"{path}: missing tensors {shown} for {c.family} with {c.num_layers} layers")
  used = {n for n, _ in wanted}
  if c.tie_embeddings:
    used |= {n for n in files.names() if n.endswith("lm_head.weight")}
  # Published files may keep the key/value weights of KV-shared layers, which never run.
  shared = {f"{prefix}layers.{i}.self_attn.{w}" for i in range(c.num_cache_layers, c.num_layers)
            for w in ("k_proj.weight", "v_proj.weight", "k_norm.weight", "v_norm.weight")}
  unused = sorted(n for n in files.names()
                  if n not in used and n not in shared and not _ignored_hf_tensor(n))
  if unused:
    shown = unused[:8] + (["..."] if len(unused) > 8 else [])
    raise ValueError(f"{path}: tensors the {c.family} import does not understand (an "
                     f"unsupported feature?): {shown}")
  target_dtype = jnp.dtype(dtype) if dtype is not None else files.dtype(top["embed"][0])
  total, done = len(wanted), 0

  def read(name, hf_name, transpose, shape):
    nonlocal done
    found = files.shape(hf_name)
    found = tuple(found[::-1] if transpose else found)
    if found != tuple(shape):
      raise ValueError(f"{path}: shape mismatch: {hf_name} is {found} (as {name}), the config "
                       f"implies {tuple(shape)}")
    tensor = files.get(hf_name)
    out = np.ascontiguousarray(tensor.T if transpose else tensor).astype(target_dtype)
    done += 1
    if progress is not None:
      progress(done, total, hf_name)
    return jnp.asarray(out)

  params = {name: read(name, *top[name], top_shapes[name]) for name in top}
  params["layers"] = tuple(
      {name: read(name, hf_name, transpose, layer_param_shapes(c, i)[name])
       for name, (hf_name, transpose) in plan.items()} for i, plan in enumerate(layers))
  return Model(params, config)



def from_hf(path: str | os.PathLike, dtype=None, sharding=None,
            progress: Callable[[int, int, str], None] | None = None) -> Model:
  """Imports a Hugging Face checkpoint directory (config.json + safetensors).

  Supported `model_type`s: llama (incl. Llama 3.x `llama3` RoPE scaling), mistral, qwen2 (q/k/v
  bias), qwen3 (q/k norm), gemma, gemma2 (soft-capping, alternating sliding windows, post norms),
  gemma3_text and the text part of gemma3 (q/k norm, local/global RoPE, linear RoPE scaling),
  gemma4_text and the text part of gemma4 (dense: wider global heads, proportional RoPE,
  `attention_k_eq_v`, KV-shared layers, per-layer embeddings, layer scalars; a Gemma 4 model runs
  in the unstacked layout only, `Model.per_layer_only`; mixture-of-experts layers are refused).
  Hugging Face's Llama rotate-half RoPE layout is the built-in decoder's, so q/k weights are only
  transposed, never permuted.

  Args:
    path: the checkpoint directory (`model.safetensors` or a sharded
      `model.safetensors.index.json`).
    dtype: cast floating-point weights to this dtype; None keeps the checkpoint's dtype.
    sharding: where the weights go; as for `load` (None, a Sharding, a pytree of shardings or a
      Mesh).
    progress: called as `progress(done, total, name)` after each weight is read.

  Returns:
    The `specjax.Model`.

  Raises:
    FileNotFoundError: `path` or its config.json does not exist.
    ValueError: unsupported architecture/feature, corrupt files, missing or mis-shaped tensors.
  """
  path = pathlib.Path(path)
  if not path.is_dir():
    raise FileNotFoundError(f"no checkpoint directory at {path}")
  config_path = path / "config.json"
  if not config_path.is_file():
    raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint")
  hf = read_json(config_path)
  try:
    config = hf_config_to_model_config(hf)
  except KeyError as error:
    raise ValueError(f"{config_path} lacks the field {error.args[0]!r}") from None
  files = SafetensorsFiles(safetensors_files(path))
  if config.per_layer_only:
    if sharding is not None:
      raise ValueError(f"{config.family}: sharded loading is not supported for a model whose "
                       "layers differ in shape (it runs unstacked, on one device)")
    return _from_hf_per_layer(path, files, config, hf, dtype, progress)
  prefix = _find_prefix(files)
  # specjax name -> list of (Hugging Face name, transpose?): one entry, or one per layer.
  layer_names = hf_layer_names(config)
  plan: dict[str, list[tuple[str, bool]]] = {
      "embed": [(prefix + "embed_tokens.weight", False)],
      "final_norm": [(prefix + "norm.weight", False)],
  }
  if not config.tie_embeddings:
    heads = sorted((n for n in files.names() if n.endswith("lm_head.weight")), key=len)
    plan["lm_head"] = [(heads[0] if heads else "lm_head.weight", True)]
  for name, (hf_name, transpose) in layer_names.items():
    plan["layers/" + name] = [(f"{prefix}layers.{i}.{hf_name}", transpose)
                              for i in range(config.num_layers)]

  missing = [hf_name for entries in plan.values() for hf_name, _ in entries
             if hf_name not in files]
  if missing:
    shown = missing[:8] + (["..."] if len(missing) > 8 else [])
    raise ValueError(f"{path}: missing tensors {shown} for {config.family} with "
                     f"{config.num_layers} layers")
  used = {hf_name for entries in plan.values() for hf_name, _ in entries}
  if config.tie_embeddings:
    used |= {n for n in files.names() if n.endswith("lm_head.weight")}
  unused = sorted(n for n in files.names() if n not in used and not _ignored_hf_tensor(n))
  if unused:
    shown = unused[:8] + (["..."] if len(unused) > 8 else [])
    raise ValueError(f"{path}: tensors the {config.family} import does not understand (an "
                     f"unsupported feature?): {shown}")

  expected = expected_shapes(config)
  found = {}
  for name, entries in plan.items():
    shape = files.shape(entries[0][0])
    shape = shape[::-1] if entries[0][1] else shape
    shapes = {files.shape(hf_name) for hf_name, _ in entries}
    if len(shapes) > 1:
      raise ValueError(f"{path}: shape mismatch: the layers' {entries[0][0]} have shapes "
                       f"{sorted(shapes)}")
    found[name] = (len(entries),) + shape if name.startswith("layers/") else shape
  check_param_shapes(found, config, str(path))

  target_dtype = jnp.dtype(dtype) if dtype is not None else files.dtype(plan["embed"][0][0])
  abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0)).params)
  shardings = None if sharding is None else flatten(resolve_sharding(sharding, abstract))
  total = sum(len(entries) for entries in plan.values())
  done = 0
  flat = {}
  for name, entries in plan.items():
    out = np.empty(expected[name], target_dtype)
    target = out if name.startswith("layers/") else out[None]
    for i, (hf_name, transpose) in enumerate(entries):
      tensor = files.get(hf_name)
      target[i] = tensor.T if transpose else tensor  # one vectorised copy (and cast) per tensor
      done += 1
      if progress is not None:
        progress(done, total, hf_name)
    flat[name] = put(out, None if shardings is None else shardings[name])
    del out, target
  return Model(nest_params(flat), config)


def copy_tokenizer_files(source: str | os.PathLike, target: str | os.PathLike) -> list[str]:
  """Copies the tokenizer files found in `source` (tokenizer.json, its configs, ...) to `target`."""
  import shutil

  from specjax.io.tokenizer import TOKENIZER_FILES

  source, target = pathlib.Path(source), pathlib.Path(target)
  copied = []
  for name in TOKENIZER_FILES + ("tokenizer.model",):
    if (source / name).is_file():
      shutil.copyfile(source / name, target / name)
      copied.append(name)
  return copied


def convert_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype=None,
               overwrite: bool = False,
               progress: Callable[[int, int, str], None] | None = None) -> Model:
  """Converts a Hugging Face checkpoint directory into a specjax (Orbax) checkpoint.

  The tokenizer files found beside the weights (tokenizer.json, tokenizer_config.json, ...) are
  copied too, so `load_tokenizer(out_dir)` works on the result.

  Args:
    hf_dir: the Hugging Face directory (config.json + safetensors).
    out_dir: the specjax checkpoint directory to write.
    dtype: cast floating-point weights to this dtype; None keeps the checkpoint's.
    overwrite: replace an existing `out_dir`.
    progress: called as `progress(done, total, name)` while weights are read.

  Returns:
    The converted model.
  """
  if pathlib.Path(out_dir).exists() and not overwrite:
    raise ValueError(f"{out_dir} already exists (pass overwrite=True / --overwrite to replace it)")
  model = from_hf(hf_dir, dtype=dtype, progress=progress)
  save(model, out_dir, overwrite=overwrite)
  copy_tokenizer_files(hf_dir, out_dir)
  return model
