"""Import of public EAGLE-3 draft heads (the layout of SafeAILab EAGLE, SpecForge and vLLM).

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

The layer's residual is the (projected) feature; its output, before `norm`, is the feature the
head feeds itself when it drafts on. Taps are the residual stream *entering* the listed target
layers (default `(2, L // 2, L - 3)` for an `L`-layer target), as in vLLM.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np

from specjax.drafters import eagle
from specjax.drafters.heads import EagleDrafter
from specjax.io.safetensors import SafetensorsFiles, safetensors_files

__all__ = ["eagle3_taps", "load_eagle3", "load_eagle3_head", "read_eagle3"]

_LAYER = "midlayer."
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
  try:
    config = json.loads(config_file.read_text())
  except json.JSONDecodeError as error:
    raise ValueError(f"corrupt {config_file}: {error}") from None
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
  t2d = np.zeros((vocab,), bool)
  t2d[ids] = True
  if "t2d" in files:
    stored = np.asarray(files.get("t2d")).astype(bool).reshape(-1)
    if stored.shape != (vocab,) or np.any(stored != t2d):
      raise ValueError("t2d disagrees with d2t")
  tensors["d2t"], tensors["t2d"] = d2t, t2d
  return config, tensors


def load_eagle3_head(path, num_target_layers: int, *, dtype=jnp.float32):
  """An EAGLE-3 checkpoint as an `EagleHead` (plus its own embedding table, if it ships one).

  Args:
    path: the checkpoint directory.
    num_target_layers: the target's layer count (for the default taps).
    dtype: floating-point dtype of the weights.

  Returns:
    `(head, embed)`: the head and the checkpoint's `[V, H]` `embed_tokens` or None.

  Raises:
    ValueError: see `read_eagle3`; also RoPE scaling, which the head does not implement, and a
      target width different from the head's.
  """
  config, w = read_eagle3(path)
  scaling = config.get("rope_scaling")
  if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
    raise ValueError(f"EAGLE-3 heads with rope_scaling {scaling} are not supported")
  hidden = int(config["hidden_size"])
  if int(config.get("target_hidden_size") or hidden) != hidden:
    raise ValueError(f"target_hidden_size {config['target_hidden_size']} != hidden_size {hidden}: "
                     "specjax heads work at the target's width")
  num_taps = w["fc.weight"].shape[1] // hidden
  taps = tuple(sorted(eagle3_taps(config, num_target_layers)))  # fc reads them in layer order
  if len(taps) != num_taps:
    raise ValueError(f"fc.weight reads {num_taps} features but the config names taps {taps}")
  num_heads = int(config["num_attention_heads"])
  head_config = eagle.HeadConfig(
      embed_dim=hidden, num_heads=num_heads,
      num_kv_heads=int(config.get("num_key_value_heads", num_heads)),
      head_dim=int(config.get("head_dim") or hidden // num_heads),
      mlp_dim=int(config["intermediate_size"]), num_taps=num_taps, taps=taps,
      draft_vocab_size=w["lm_head.weight"].shape[0], vocab_size=int(config["vocab_size"]),
      norm_eps=float(config.get("rms_norm_eps", 1e-6)),
      rope_theta=float(config.get("rope_theta", 10_000.0)),
      max_len=int(config.get("max_position_embeddings", 2048)))
  t = lambda name: jnp.asarray(w[name].T, dtype)  # PyTorch Linear [out, in] -> [in, out]
  v = lambda name: jnp.asarray(w[name], dtype)
  params = {
      "fc": t("fc.weight"),
      "input_norm": v(_LAYER + "input_layernorm.weight"),
      "hidden_norm": v(_LAYER + "hidden_norm.weight"),
      "layer": {
          "wq": t(_LAYER + "self_attn.q_proj.weight"), "wk": t(_LAYER + "self_attn.k_proj.weight"),
          "wv": t(_LAYER + "self_attn.v_proj.weight"), "wo": t(_LAYER + "self_attn.o_proj.weight"),
          "mlp_norm": v(_LAYER + "post_attention_layernorm.weight"),
          "w_gate": t(_LAYER + "mlp.gate_proj.weight"), "w_up": t(_LAYER + "mlp.up_proj.weight"),
          "w_down": t(_LAYER + "mlp.down_proj.weight"),
      },
      "final_norm": v("norm.weight"),
      "lm_head": t("lm_head.weight"),
      "d2t": jnp.asarray(w["d2t"], jnp.int32),
  }
  embed = v("embed_tokens.weight") if "embed_tokens.weight" in w else None
  return eagle.EagleHead(params, head_config), embed


def load_eagle3(path, target, *, dtype=jnp.float32) -> EagleDrafter:
  """An EAGLE-3 checkpoint as a drafter for `target` (a `specjax.Model`).

  The head embeds tokens with the checkpoint's `embed_tokens` when it has one, else with the
  target's embedding.

  Raises:
    ValueError: a malformed checkpoint, or one whose vocabulary or width does not fit `target`.
  """
  tc = target.config
  head, embed = load_eagle3_head(path, tc.num_layers, dtype=dtype)
  c = head.config
  if (c.vocab_size, c.embed_dim) != (tc.vocab_size, tc.embed_dim):
    raise ValueError(f"EAGLE-3 head (vocab {c.vocab_size}, hidden {c.embed_dim}) does not fit the "
                     f"target (vocab {tc.vocab_size}, hidden {tc.embed_dim})")
  return EagleDrafter(head, target.params["embed"] if embed is None else embed.astype(dtype))
