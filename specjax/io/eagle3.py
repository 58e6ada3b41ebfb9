"""Reading public EAGLE-3 draft heads (the layout of SafeAILab EAGLE, SpecForge and vLLM).

A checkpoint directory holds `config.json` (a Llama-style config: `hidden_size`,
`num_attention_heads`, `num_key_value_heads`, `head_dim`, `intermediate_size`, `rms_norm_eps`,
`rope_theta`, `vocab_size` (the target's), `draft_vocab_size`, optionally
`eagle_aux_hidden_state_layer_ids`, top level or under `eagle_config`) and safetensors weights
named (PyTorch `Linear` weights are `[out, in]`):

  fc.weight                              [H, n*H]  the n target taps, concatenated -> H
  midlayer.input_layernorm.weight        [H]       norm of the token embedding
  midlayer.hidden_norm.weight            [H]       norm of the feature
  midlayer.self_attn.{q,k,v}_proj.weight [heads*D, 2H] over [norm(embed) | norm(feature)]
  midlayer.self_attn.o_proj.weight       [H, heads*D]
  midlayer.post_attention_layernorm.weight [H]
  midlayer.mlp.{gate,up}_proj.weight     [I, H];  midlayer.mlp.down_proj.weight [H, I]
  norm.weight                            [H]
  lm_head.weight                         [N, H]    over the draft vocabulary
  d2t                                    [N] int   target id of draft id i is i + d2t[i]
  t2d                                    [V] bool  which target ids are in the draft vocabulary
  embed_tokens.weight                    [V, H]    optional; else the target's embedding is used
  mask_hidden                            [1, n*H] or [1, H]  vLLM's P-EAGLE layout only (below)

vLLM's P-EAGLE layout (parallel drafting, vLLM >= 0.16) is this one with `"parallel_drafting":
true` and a `ptd_token_id` in `config.json` and the `mask_hidden` tensor: the head drafts several
tokens in one forward, each slot after the last verified pair reading the embedding of
`ptd_token_id` and `mask_hidden` (in the taps' format, projected by `fc`, or already at width H)
in place of a (feature, token) pair.

The layer's residual is the (projected) feature; its output, before `norm`, is the feature the
head feeds itself when it drafts on. Taps are the residual stream *entering* the listed target
layers (default `(2, L // 2, L - 3)` for an `L`-layer target), as in vLLM.

`read_eagle3` reads and checks such a directory into NumPy arrays; `specjax.drafters.eagle.eagle3` builds
the `EagleHead` and the `EagleDrafter` (`specjax.drafters.load_eagle3`) from them.
"""

from __future__ import annotations

import pathlib

import numpy as np

from specjax.io.safetensors import SafetensorsFiles, read_json, safetensors_files

__all__ = ["eagle3_taps", "read_eagle3"]

_REQUIRED = ("fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
             "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
             "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
             "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
             "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
             "lm_head.weight")


def eagle3_taps(config: dict, num_target_layers: int) -> tuple[int, ...]:
  """The target layers whose incoming residual stream the head reads."""
  ids = config.get("eagle_aux_hidden_state_layer_ids")  # top level (vLLM) or in eagle_config
  if ids is None:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
  if ids is None:
    ids = (2, num_target_layers // 2, num_target_layers - 3)
  taps = tuple(int(i) for i in ids)
  if not taps or any(not 0 <= i <= num_target_layers for i in taps):
    raise ValueError(f"EAGLE-3 taps {taps} do not fit a target with {num_target_layers} layers")
  return taps


def read_eagle3(path) -> tuple[dict, dict[str, np.ndarray]]:
  """Reads and checks an EAGLE-3 checkpoint directory.

  Returns:
    `(config, tensors)`: the parsed `config.json` and float32 / int64 / bool NumPy arrays by
    name, with `d2t` and `t2d` filled in (identity / all true) when the head has no reduced vocab.

  Raises:
    ValueError: a missing or corrupt file, a missing tensor, or shapes that do not agree.
  """
  path = pathlib.Path(path)
  config_file = path / "config.json"
  if not config_file.is_file():
    raise ValueError(f"{path} is not an EAGLE-3 checkpoint: no config.json")
  config = read_json(config_file)
  files = SafetensorsFiles(safetensors_files(path))
  missing = [name for name in _REQUIRED if name not in files]
  if missing:
    raise ValueError(f"{path} is not an EAGLE-3 checkpoint: missing {', '.join(missing)}")
  tensors = {name: np.asarray(files.get(name), np.float32) for name in files.names()
             if name not in ("d2t", "t2d")}
  try:
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads", num_heads))
    head_dim = int(config.get("head_dim") or hidden // num_heads)
    mlp = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
  except (KeyError, TypeError, ValueError) as error:
    raise ValueError(f"{config_file} lacks a usable field: {error!r}") from None
  draft_vocab = tensors["lm_head.weight"].shape[0]
  if int(config.get("draft_vocab_size") or draft_vocab) != draft_vocab:
    raise ValueError(f"draft_vocab_size {config.get('draft_vocab_size')} != lm_head rows "
                     f"{draft_vocab}")
  taps_width = tensors["fc.weight"].shape[1]
  expected = {
      "midlayer.input_layernorm.weight": (hidden,), "midlayer.hidden_norm.weight": (hidden,),
      "midlayer.self_attn.q_proj.weight": (num_heads * head_dim, 2 * hidden),
      "midlayer.self_attn.k_proj.weight": (num_kv_heads * head_dim, 2 * hidden),
      "midlayer.self_attn.v_proj.weight": (num_kv_heads * head_dim, 2 * hidden),
      "midlayer.self_attn.o_proj.weight": (hidden, num_heads * head_dim),
      "midlayer.post_attention_layernorm.weight": (hidden,),
      "midlayer.mlp.gate_proj.weight": (mlp, hidden), "midlayer.mlp.up_proj.weight": (mlp, hidden),
      "midlayer.mlp.down_proj.weight": (hidden, mlp), "norm.weight": (hidden,),
      "lm_head.weight": (draft_vocab, hidden), "fc.weight": (hidden, taps_width),
  }
  if "embed_tokens.weight" in tensors:
    expected["embed_tokens.weight"] = (vocab, hidden)
  for name, shape in expected.items():
    if tensors[name].shape != shape:
      raise ValueError(f"{name} has shape {tensors[name].shape}, expected {shape} from "
                       f"{config_file}")
  if taps_width % hidden:
    raise ValueError(f"fc.weight input width {taps_width} is not a multiple of {hidden}")
  if "d2t" in files:
    d2t = np.asarray(files.get("d2t"), np.int64).reshape(-1)
    ids = np.arange(d2t.shape[0]) + d2t
    if d2t.shape[0] != draft_vocab or ids.min() < 0 or ids.max() >= vocab or np.any(
        np.diff(ids) <= 0):
      raise ValueError(f"d2t does not map the {draft_vocab} draft ids onto distinct, increasing "
                       f"target ids below {vocab}")
  else:
    if draft_vocab != vocab:
      raise ValueError(f"lm_head has {draft_vocab} rows but the checkpoint has no d2t map")
    d2t = np.zeros((draft_vocab,), np.int64)
    ids = np.arange(draft_vocab)
  if config.get("parallel_drafting"):
    ptd = config.get("ptd_token_id")
    if not isinstance(ptd, int) or not 0 <= ptd < vocab:
      raise ValueError(f"{config_file} asks for parallel drafting but its ptd_token_id {ptd!r} is "
                       f"not a token id below {vocab}")
    if "mask_hidden" not in tensors:
      raise ValueError(f"{path} asks for parallel drafting but has no mask_hidden tensor")
    mask = tensors["mask_hidden"].reshape(-1)
    if mask.shape[0] not in (taps_width, hidden):
      raise ValueError(f"mask_hidden has {mask.shape[0]} values, expected {taps_width} (the "
                       f"taps' format) or {hidden}")
    tensors["mask_hidden"] = mask
  t2d = np.zeros((vocab,), bool)
  t2d[ids] = True
  if "t2d" in files:
    stored = np.asarray(files.get("t2d")).astype(bool).reshape(-1)
    if stored.shape != (vocab,) or np.any(stored != t2d):
      raise ValueError("t2d disagrees with d2t")
  tensors["d2t"], tensors["t2d"] = d2t, t2d
  return config, tensors
