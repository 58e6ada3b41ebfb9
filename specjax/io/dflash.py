"""Reading published DFlash block drafters (the layout of z-lab/dflash's `DFlashDraftModel`).

A checkpoint directory holds `config.json` (a Qwen3-style config: `hidden_size`,
`num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`,
`intermediate_size`, `rms_norm_eps`, `rope_theta` (or `rope_parameters.rope_theta`),
`vocab_size`, `num_target_layers`, and `dflash_config: {mask_token_id, target_layer_ids}` with
`block_size` either at the top level (the first releases) or inside `dflash_config` (newer
files)) and safetensors weights named (PyTorch `Linear` weights are `[out, in]`):

  fc.weight                                  [H, n*H]   the n target taps, concatenated -> H
  hidden_norm.weight                         [H]        RMSNorm of the projected context
  layers.{i}.input_layernorm.weight          [H]
  layers.{i}.self_attn.{q,k,v,o}_proj.weight [heads*D, H] ([H, heads*D] for o_proj)
  layers.{i}.self_attn.{q,k}_norm.weight     [D]        per-head RMSNorm before RoPE
  layers.{i}.post_attention_layernorm.weight [H]
  layers.{i}.mlp.{gate,up}_proj.weight       [I, H];  layers.{i}.mlp.down_proj.weight [H, I]
  norm.weight                                [H]        the final norm

The drafter has no embedding and no output head of its own: it embeds with the target's
embedding and scores with the target's `lm_head`. `target_layer_ids` name target layers whose
*output* (before the final norm) the drafter reads, i.e. Hugging Face's `hidden_states[i + 1]`.

Not read (a clear error): DFlash2 files (`DFlash2DraftModel`: convolutions and a candidate
selector), sliding-window or causal drafter layers, RoPE scaling and attention biases.

`read_dflash` reads and checks such a directory into a `DFlashFile`; `specjax.drafters.dflash`
builds the drafter from it.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from specjax.io.safetensors import SafetensorsFiles, read_json, safetensors_files

__all__ = ["DFlashFile", "LAYER_TENSORS", "read_dflash"]

# Per-layer tensors, by their name after `layers.{i}.`.
LAYER_TENSORS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                 "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight", "post_attention_layernorm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_TOP_TENSORS = ("fc.weight", "hidden_norm.weight", "norm.weight")


@dataclasses.dataclass(frozen=True)
class DFlashFile:
  """A checked DFlash checkpoint: its architecture and its tensors (float32 NumPy arrays)."""

  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  vocab_size: int
  block_size: int
  mask_token_id: int
  target_layer_ids: tuple[int, ...]
  num_target_layers: int | None
  norm_eps: float
  rope_theta: float
  output_multiplier: float
  logit_softcap: float | None
  tensors: dict


def _field(config: dict, name: str, default=None):
  """`dflash_config[name]`, else the top-level `name`, else `default` (both layouts)."""
  inner = config.get("dflash_config") or {}
  if not isinstance(inner, dict):
    raise ValueError(f"dflash_config must be an object, got {type(inner).__name__}")
  return inner[name] if name in inner else config.get(name, default)


def _int(value, name: str, file) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{file}: {name} must be an int, got {value!r}")
  return int(value)


def read_dflash(path) -> DFlashFile:
  """Reads and checks a DFlash checkpoint directory.

  Raises:
    ValueError: a missing or corrupt (truncated) file, a missing tensor, a DFlash2 or otherwise
      unsupported variant, or shapes and fields that do not agree, naming the field.
  """
  path = pathlib.Path(path)
  config_file = path / "config.json"
  if not config_file.is_file():
    raise ValueError(f"{path} is not a DFlash checkpoint: no config.json")
  config = read_json(config_file)
  if not isinstance(config, dict):
    raise ValueError(f"{config_file} is not a JSON object")
  architectures = config.get("architectures") or []
  if "DFlash2DraftModel" in architectures:
    raise ValueError(f"{path} is a DFlash2 checkpoint (convolutions, candidate selector): only "
                     "the DFlashDraftModel layout is supported")
  ids = _field(config, "target_layer_ids")
  if not isinstance(ids, (list, tuple)) or not ids:
    raise ValueError(f"{config_file}: dflash_config.target_layer_ids must be a non-empty list of "
                     f"layer indices, got {ids!r}")
  target_layer_ids = tuple(_int(i, "dflash_config.target_layer_ids", config_file) for i in ids)
  mask = _field(config, "mask_token_id")
  if mask is None:
    raise ValueError(f"{config_file}: dflash_config.mask_token_id is missing")
  try:
    hidden = _int(config["hidden_size"], "hidden_size", config_file)
    num_layers = _int(config["num_hidden_layers"], "num_hidden_layers", config_file)
    num_heads = _int(config["num_attention_heads"], "num_attention_heads", config_file)
    num_kv_heads = _int(config.get("num_key_value_heads", num_heads), "num_key_value_heads",
                        config_file)
    head_dim = _int(config.get("head_dim") or hidden // num_heads, "head_dim", config_file)
    mlp = _int(config["intermediate_size"], "intermediate_size", config_file)
    vocab = _int(config["vocab_size"], "vocab_size", config_file)
  except KeyError as error:
    raise ValueError(f"{config_file} lacks the field {error.args[0]!r}") from None
  block_size = _int(_field(config, "block_size", 16), "block_size", config_file)
  if block_size < 2:
    raise ValueError(f"{config_file}: block_size must be >= 2 (the anchor and one draft), got "
                     f"{block_size}")
  mask_token_id = _int(mask, "dflash_config.mask_token_id", config_file)
  if not 0 <= mask_token_id < vocab:
    raise ValueError(f"{config_file}: dflash_config.mask_token_id {mask_token_id} is not a token "
                     f"id below vocab_size {vocab}")
  num_target = config.get("num_target_layers")
  num_target = None if num_target is None else _int(num_target, "num_target_layers", config_file)
  if any(i < 0 or (num_target is not None and i >= num_target) for i in target_layer_ids):
    raise ValueError(f"{config_file}: dflash_config.target_layer_ids {list(target_layer_ids)} "
                     f"must lie in 0..num_target_layers - 1 ({num_target})")
  layer_types = config.get("layer_types") or []
  if any(t != "full_attention" for t in layer_types) or config.get("is_causal"):
    raise ValueError(f"{config_file}: sliding-window or causal drafter layers (layer_types "
                     f"{layer_types}, is_causal {config.get('is_causal')}) are not supported")
  if config.get("attention_bias"):
    raise ValueError(f"{config_file}: attention_bias is not supported")
  rope = config.get("rope_parameters") or {}
  scaling = config.get("rope_scaling") or {}
  kind = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
  if kind not in (None, "default"):
    raise ValueError(f"{config_file}: rope type {kind!r} is not supported (default RoPE only)")
  theta = float(rope.get("rope_theta", config.get("rope_theta", 10_000.0)))
  softcap = _field(config, "final_logit_softcapping")

  files = SafetensorsFiles(safetensors_files(path))
  names = list(_TOP_TENSORS) + [f"layers.{i}.{name}" for i in range(num_layers)
                                for name in LAYER_TENSORS]
  missing = [name for name in names if name not in files]
  if missing:
    raise ValueError(f"{path} is not a complete DFlash checkpoint: missing "
                     f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
  extra = [name for name in files.names() if name not in names]
  if extra:
    raise ValueError(f"{path}: unexpected tensors {', '.join(sorted(extra)[:6])} (not the "
                     "DFlashDraftModel layout)")
  expected = {"fc.weight": (hidden, len(target_layer_ids) * hidden),
              "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
  per_layer = {"input_layernorm.weight": (hidden,),
               "self_attn.q_proj.weight": (num_heads * head_dim, hidden),
               "self_attn.k_proj.weight": (num_kv_heads * head_dim, hidden),
               "self_attn.v_proj.weight": (num_kv_heads * head_dim, hidden),
               "self_attn.o_proj.weight": (hidden, num_heads * head_dim),
               "self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,),
               "post_attention_layernorm.weight": (hidden,),
               "mlp.gate_proj.weight": (mlp, hidden), "mlp.up_proj.weight": (mlp, hidden),
               "mlp.down_proj.weight": (hidden, mlp)}
  for i in range(num_layers):
    expected.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
  tensors = {}
  for name, shape in expected.items():
    if tuple(files.shape(name)) != shape:
      what = ("fc.weight reads len(target_layer_ids) * hidden_size inputs"
              if name == "fc.weight" else "")
      raise ValueError(f"{name} has shape {tuple(files.shape(name))}, expected {shape} from "
                       f"{config_file} {what}".rstrip())
    tensors[name] = np.asarray(files.get(name), np.float32)
  return DFlashFile(
      hidden_size=hidden, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
      head_dim=head_dim, mlp_dim=mlp, vocab_size=vocab, block_size=block_size,
      mask_token_id=mask_token_id, target_layer_ids=target_layer_ids,
      num_target_layers=num_target, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
      rope_theta=theta, output_multiplier=float(_field(config, "output_multiplier", 1.0)),
      logit_softcap=None if softcap in (None, 0) else float(softcap), tensors=tensors)
