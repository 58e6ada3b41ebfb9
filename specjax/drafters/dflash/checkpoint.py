"""Published DFlash checkpoints as drafters (`load_dflash`), and drafters saved in that layout
(`save_dflash`), so that a drafter trained here loads exactly as z-lab's files do.

`specjax.io.dflash.read_dflash` reads and checks the directory; this module maps its tensors onto a
`DFlashNetwork` (PyTorch `Linear` weights `[out, in]` transposed to `[in, out]`) and wraps it in
a `DFlashDrafter` with the target's embedding and output projection.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.dflash import network as dflash
from specjax.drafters.dflash.drafter import DFlashDrafter
from specjax.io.dflash import read_dflash
from specjax.models import quant
from specjax.models.cpu import panels

__all__ = ["load_dflash", "load_dflash_network", "save_dflash", "target_tables"]

# specjax layer weight -> (checkpoint name after `layers.{i}.`, transposed)
_LAYER = {"input_norm": ("input_layernorm.weight", False),
          "wq": ("self_attn.q_proj.weight", True), "wk": ("self_attn.k_proj.weight", True),
          "wv": ("self_attn.v_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
          "q_norm": ("self_attn.q_norm.weight", False),
          "k_norm": ("self_attn.k_norm.weight", False),
          "mlp_norm": ("post_attention_layernorm.weight", False),
          "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
          "w_down": ("mlp.down_proj.weight", True)}


def load_dflash_network(path, *, dtype=jnp.float32) -> dflash.DFlashNetwork:
  """A DFlash checkpoint directory as a `DFlashNetwork` (see `specjax.io.dflash`).

  Raises:
    ValueError: a malformed checkpoint (`read_dflash`).
  """
  f = read_dflash(path)
  config = dflash.DFlashConfig(
      embed_dim=f.hidden_size, num_layers=f.num_layers, num_heads=f.num_heads,
      num_kv_heads=f.num_kv_heads, head_dim=f.head_dim, mlp_dim=f.mlp_dim,
      vocab_size=f.vocab_size, block_size=f.block_size, mask_token_id=f.mask_token_id,
      target_layer_ids=f.target_layer_ids, num_target_layers=f.num_target_layers,
      norm_eps=f.norm_eps, rope_theta=f.rope_theta, output_multiplier=f.output_multiplier,
      logit_softcap=f.logit_softcap)
  w = f.tensors
  get = lambda name, transpose: jnp.asarray(w[name].T if transpose else w[name], dtype)
  layers = tuple({key: get(f"layers.{i}.{name}", transpose)
                  for key, (name, transpose) in _LAYER.items()} for i in range(f.num_layers))
  params = {"fc": get("fc.weight", True), "hidden_norm": get("hidden_norm.weight", False),
            "norm": get("norm.weight", False), "layers": layers}
  return dflash.DFlashNetwork(params, config)


def _dense(w, name: str):
  if panels.is_panels(w):
    return panels.dense(w)
  if quant.is_quantized(w):
    raise ValueError(f"the target's {name} is quantized: the DFlash drafter reads a float "
                     "embedding and output projection (load the target in float)")
  return w


def target_tables(target) -> tuple[jax.Array, jax.Array]:
  """The target's `([V, H] embedding, [H, V] output projection)` as float arrays (a tied model's
  projection is its embedding, transposed), whatever layout the target's weights lie in."""
  params = target.params
  embed = jnp.asarray(_dense(params["embed"], "embedding"))
  if "lm_head" in params:
    head = jnp.asarray(_dense(params["lm_head"], "lm_head"))
    if head.shape != (embed.shape[1], embed.shape[0]):  # a [V, H] layout
      head = head.T
  else:
    head = embed.T
  return embed, head


def load_dflash(path, target, *, mode: str = "argmax", dtype=jnp.float32,
                confidence: float | None = None) -> DFlashDrafter:
  """A published DFlash checkpoint directory as a drafter for `target` (a `specjax.Model`).

  Args:
    path: the checkpoint directory (config.json + safetensors, `specjax.io.dflash`).
    target: the target model it was trained for.
    mode: "argmax" (point-mass drafts) or "sampled" (drafts from the marginals at T > 0); trees:
      `decode(..., tree=TreeSpec(builder="ddtree", ...))` with this drafter.
    dtype: the drafter's weights' dtype.
    confidence: see `DFlashDrafter`.

  Raises:
    ValueError: a malformed checkpoint, or a target whose vocabulary, width or layer count does
      not fit it (naming the field).
  """
  network = load_dflash_network(path, dtype=dtype)
  embed, head = target_tables(target)
  c = network.config
  if embed.shape[0] != c.vocab_size:
    raise ValueError(f"the DFlash checkpoint's vocab_size ({c.vocab_size}) does not match the "
                     f"target's vocabulary ({embed.shape[0]})")
  if embed.shape[1] != c.embed_dim:
    raise ValueError(f"the DFlash checkpoint's hidden_size ({c.embed_dim}) does not match the "
                     f"target's embed_dim ({embed.shape[1]})")
  if c.num_target_layers is None:  # unstated: the target's, so that its last layer is known
    network = dflash.DFlashNetwork(network.params, dataclasses.replace(
        c, num_target_layers=int(target.config.num_layers)))
    if max(c.target_layer_ids) >= target.config.num_layers:
      raise ValueError(f"target_layer_ids {list(c.target_layer_ids)} name layers past the "
                       f"target's {target.config.num_layers}")
  drafter = DFlashDrafter(network, embed.astype(dtype), head.astype(dtype), mode=mode,
                          confidence=confidence)
  drafter.check_target(target)
  return drafter


def save_dflash(network: dflash.DFlashNetwork, path, *, dtype: str = "float32",
                layout: str = "nested") -> pathlib.Path:
  """Writes `network` as a published DFlash checkpoint directory (`specjax.io.dflash`).

  Args:
    network: the drafter's network.
    path: the directory (created).
    dtype: "float32" or "bfloat16" tensors.
    layout: "nested" (`block_size` inside `dflash_config`, newer files) or "top" (at the top
      level, the first releases).

  Returns:
    The directory.
  """
  from safetensors.numpy import save_file
  import ml_dtypes
  if layout not in ("nested", "top"):
    raise ValueError(f"layout must be 'nested' or 'top', got {layout!r}")
  c = network.config
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
  arr = lambda x, transpose: np.ascontiguousarray(
      (np.asarray(x, np.float32).T if transpose else np.asarray(x, np.float32)).astype(np_dtype))
  p = network.params
  tensors = {"fc.weight": arr(p["fc"], True), "hidden_norm.weight": arr(p["hidden_norm"], False),
             "norm.weight": arr(p["norm"], False)}
  for i, layer in enumerate(p["layers"]):
    for key, (name, transpose) in _LAYER.items():
      tensors[f"layers.{i}.{name}"] = arr(layer[key], transpose)
  save_file(tensors, str(path / "model.safetensors"))
  inner = {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)}
  config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": c.embed_dim, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "intermediate_size": c.mlp_dim, "vocab_size": c.vocab_size,
            "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype,
            "dflash_config": inner}
  if c.num_target_layers is not None:
    config["num_target_layers"] = c.num_target_layers
  if layout == "nested":
    inner["block_size"] = c.block_size
  else:
    config["block_size"] = c.block_size
  (path / "config.json").write_text(json.dumps(config, indent=2))
  return path
