"""Published Gemma 4 assistant checkpoints as drafters (`load_gemma4_assistant`).

A directory holds `config.json` (`model_type: "gemma4_assistant"`: `backbone_hidden_size`,
`use_ordered_embeddings`, `num_centroids`, `centroid_intermediate_top_k`, `tie_word_embeddings`
and a `gemma4_text` `text_config` whose every layer shares its keys and values) and safetensors
weights named as `transformers`' `Gemma4AssistantForCausalLM` saves them (PyTorch `Linear`
weights `[out, in]`):

  pre_projection.weight                       [E, 2 E_t]   [target embedding; target hidden] -> E
  post_projection.weight                      [E_t, E]
  model.embed_tokens.weight                   [V, E]       the (tied) output head
  model.layers.{i}.self_attn.{q,o}_proj.weight, self_attn.q_norm.weight
  model.layers.{i}.{input,post_attention,pre_feedforward,post_feedforward}_layernorm.weight
  model.layers.{i}.mlp.{gate,up,down}_proj.weight, model.layers.{i}.layer_scalar
  model.norm.weight
  masked_embedding.centroids.weight           [C, E]       with use_ordered_embeddings
  masked_embedding.token_ordering             [V]          (int)
  lm_head.weight                              [V, E]       only when tie_word_embeddings is false

Refused with a clear error: another `model_type`, per-layer embeddings, MoE or double-wide MLPs,
a layer with keys and values of its own, attention biases, missing / unexpected / mis-shaped
tensors; and (`check_target`) a target whose family, width, vocabulary or head widths do not fit.
"""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np

from specjax.drafters.gemma4_assistant import network as assistant
from specjax.drafters.gemma4_assistant.drafter import (Gemma4AssistantDrafter,
                                                       check_assistant_target)
from specjax.io.hf import gemma4_text_fields
from specjax.io.safetensors import SafetensorsFiles, read_json, safetensors_files
from specjax.models.config import RopeScaling

__all__ = ["assistant_config", "load_gemma4_assistant", "load_gemma4_assistant_network"]

# specjax layer weight -> (checkpoint name after `model.layers.{i}.`, transposed)
_LAYER = {"attn_norm": ("input_layernorm.weight", False),
          "wq": ("self_attn.q_proj.weight", True), "q_norm": ("self_attn.q_norm.weight", False),
          "wo": ("self_attn.o_proj.weight", True),
          "post_attn_norm": ("post_attention_layernorm.weight", False),
          "mlp_norm": ("pre_feedforward_layernorm.weight", False),
          "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
          "w_down": ("mlp.down_proj.weight", True),
          "post_mlp_norm": ("post_feedforward_layernorm.weight", False),
          "layer_scalar": ("layer_scalar", False)}


def assistant_config(hf: dict) -> assistant.AssistantConfig:
  """The `AssistantConfig` of a `gemma4_assistant` config.json (a dict).

  Raises:
    ValueError: naming the field that is missing or not supported.
  """
  if hf.get("model_type") != "gemma4_assistant":
    raise ValueError(f"not a Gemma 4 assistant: model_type {hf.get('model_type')!r} (expected "
                     "'gemma4_assistant')")
  text = hf.get("text_config")
  if not isinstance(text, dict):
    raise ValueError("gemma4_assistant: config.json has no text_config")
  layers = int(text.get("num_hidden_layers", 0))
  # Every layer of an assistant attends the target's keys and values (`Gemma4AssistantConfig`).
  text = dict(text, num_kv_shared_layers=text.get("num_kv_shared_layers") or layers)
  for field in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
    if text.get(field):
      raise ValueError(f"gemma4_assistant: text_config.{field} must be 0, got {text[field]}")
  text.setdefault("hidden_size_per_layer_input", 0)
  for field in ("enable_moe_block", "use_double_wide_mlp"):
    if text.get(field):
      raise ValueError(f"gemma4_assistant: text_config.{field}=True is not supported")
  fields = gemma4_text_fields(text)
  if int(fields["num_kv_shared_layers"]) != layers:
    raise ValueError(f"gemma4_assistant: every layer must share its keys and values "
                     f"(num_kv_shared_layers {fields['num_kv_shared_layers']}, {layers} layers)")
  local = dict(fields["rope_parameters"].get("sliding_attention") or {})
  full = dict(fields["rope_parameters"].get("full_attention") or {})
  if local.get("rope_type", "default") not in ("default", "proportional") or (
      local.get("partial_rotary_factor", 1.0) != 1.0 or local.get("factor", 1.0) != 1.0):
    raise ValueError(f"gemma4_assistant: RoPE {local} on window layers is not supported")
  if full.get("rope_type", "default") not in ("default", "proportional"):
    raise ValueError(f"gemma4_assistant: rope_type {full.get('rope_type')!r} on global layers is "
                     "not supported")
  partial, factor = float(full.get("partial_rotary_factor", 1.0)), float(full.get("factor", 1.0))
  if full.get("rope_type", "default") == "default" and partial != 1.0:
    raise ValueError("gemma4_assistant: partial_rotary_factor with rope_type 'default' is not "
                     "supported")
  activation = fields.get("hidden_activation") or fields.get("hidden_act")
  if activation not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
    raise ValueError(f"gemma4_assistant: MLP activation {activation!r} is not supported")
  try:
    return assistant.AssistantConfig(
        vocab_size=int(fields["vocab_size"]), embed_dim=int(fields["hidden_size"]),
        backbone_dim=int(hf.get("backbone_hidden_size", 1536)),
        num_heads=int(fields["num_attention_heads"]),
        layer_global=tuple(t == "full_attention" for t in fields["layer_types"]),
        head_dim=int(fields["head_dim"]), global_head_dim=int(fields["_global_head_dim"]),
        mlp_dim=int(fields["intermediate_size"]),
        num_kv_heads=int(fields["num_key_value_heads"]),
        global_kv_heads=int(fields["_global_kv_heads"]), norm_eps=float(fields["rms_norm_eps"]),
        sliding_window=int(fields["sliding_window"]),
        rope_local_theta=float(local.get("rope_theta", 10_000.0)),
        rope_theta=float(full.get("rope_theta", 1_000_000.0)),
        rope_scaling=None if partial == 1.0 and factor == 1.0 else RopeScaling(
            kind="proportional", factor=factor, partial_rotary_factor=partial),
        ordered_embeddings=bool(hf.get("use_ordered_embeddings", False)),
        num_centroids=int(hf.get("num_centroids", 2048)),
        centroid_top_k=int(hf.get("centroid_intermediate_top_k", 32)))
  except KeyError as error:
    raise ValueError(f"gemma4_assistant: config.json lacks the field {error.args[0]!r}") from None


def load_gemma4_assistant_network(path, *, dtype=jnp.float32) -> assistant.AssistantNetwork:
  """A `gemma4_assistant` checkpoint directory as an `AssistantNetwork` (float weights cast to
  `dtype`; `token_ordering` int32).

  Raises:
    FileNotFoundError: no directory or no config.json.
    ValueError: an unsupported config, or missing / unexpected / mis-shaped tensors.
  """
  path = pathlib.Path(path)
  if not (path / "config.json").is_file():
    raise FileNotFoundError(f"{path} has no config.json: not a Gemma 4 assistant checkpoint")
  hf = read_json(path / "config.json")
  c = assistant_config(hf)
  files = SafetensorsFiles(safetensors_files(path))
  tied = bool(hf.get("tie_word_embeddings", True))
  top = {"pre_projection": ("pre_projection.weight", True),
         "post_projection": ("post_projection.weight", True),
         "final_norm": ("model.norm.weight", False),
         "head": ("model.embed_tokens.weight" if tied else "lm_head.weight", False)}
  if c.ordered_embeddings:
    top.update(centroids=("masked_embedding.centroids.weight", True),
               token_ordering=("masked_embedding.token_ordering", False))
  plans = [{name: (f"model.layers.{i}.{hf_name}", transpose)
            for name, (hf_name, transpose) in _LAYER.items()} for i in range(c.num_layers)]
  wanted = list(top.values()) + [entry for plan in plans for entry in plan.values()]
  missing = sorted({n for n, _ in wanted if n not in files})
  if missing:
    raise ValueError(f"{path}: missing tensors {missing[:8]} for a gemma4_assistant with "
                     f"{c.num_layers} layers")
  used = {n for n, _ in wanted} | {"lm_head.weight", "model.embed_tokens.weight"}
  unused = sorted(n for n in files.names() if n not in used)
  if unused:
    raise ValueError(f"{path}: tensors the gemma4_assistant import does not understand (keys and "
                     f"values of its own? an unsupported feature?): {unused[:8]}")

  def read(name, hf_name, transpose, shape):
    found = tuple(files.shape(hf_name))
    found = found[::-1] if transpose else found
    if found != tuple(shape):
      raise ValueError(f"{path}: shape mismatch: {hf_name} is {found} (as {name}), the config "
                       f"implies {tuple(shape)}")
    tensor = np.asarray(files.get(hf_name))
    tensor = tensor.T if transpose else tensor
    if name == "token_ordering":
      return jnp.asarray(tensor.astype(np.int32))
    return jnp.asarray(np.ascontiguousarray(tensor).astype(dtype))

  shapes = assistant.top_shapes(c)
  params = {name: read(name, *entry, shapes[name]) for name, entry in top.items()}
  params["layers"] = tuple(
      {name: read(name, *entry, assistant.layer_shapes(c, i)[name]) for name, entry in plan.items()}
      for i, plan in enumerate(plans))
  if c.ordered_embeddings:
    ordering = np.asarray(params["token_ordering"])
    if sorted(ordering.tolist()) != list(range(c.vocab_size)):
      raise ValueError(f"{path}: masked_embedding.token_ordering is not a permutation of the "
                       f"{c.vocab_size} token ids")
  return assistant.AssistantNetwork(params, c)


def load_gemma4_assistant(path, target, *, dtype=None,
                          confidence: float | None = None) -> Gemma4AssistantDrafter:
  """A published Gemma 4 assistant (config.json + safetensors) drafting for `target`.

  Args:
    path: the checkpoint directory (`gemma4_assistant`, as `transformers` saves it).
    target: the Gemma 4 `specjax.Model` it was trained for (`sj.from_hf`): its embedding is the
      assistant's input embedding, and its store layers' keys and values are what it attends.
    dtype: the weights' dtype (default: the target's).
    confidence: an optional confidence stop (`Gemma4AssistantDrafter.confidence`).

  Returns:
    The `Gemma4AssistantDrafter`.

  Raises:
    ValueError: an unsupported or broken checkpoint, or a target it does not fit (its family,
      width, vocabulary, head widths), before anything is compiled.
  """
  tc = target.config
  network = load_gemma4_assistant_network(path, dtype=dtype or target.dtype)
  kinds = tuple(kind for kind in (True, False) if kind in network.config.layer_global)
  if not str(tc.family).startswith("gemma4"):
    check_assistant_target(network.config, tc, ())
  sources = tuple(tc.kv_store_layer(kind) for kind in kinds)
  for kind, layer in zip(kinds, sources):
    if layer is None:
      raise ValueError(f"the assistant has {'global' if kind else 'window'} layers, the target "
                       "has none with keys and values of its own")
  check_assistant_target(network.config, tc, sources)
  embed = target.params["embed"]
  return Gemma4AssistantDrafter(network, jnp.asarray(embed), sources, confidence=confidence)
