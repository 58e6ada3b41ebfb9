"""Public EAGLE-3 draft heads as specjax heads and drafters: `load_eagle3_head`, `load_eagle3`.

`specjax.io.eagle3.read_eagle3` reads and checks the checkpoint directory (its layout is described
there); this module maps its tensors onto an `EagleHead` (PyTorch `Linear` weights `[out, in]`
transposed to `[in, out]`) and wraps the head in an `EagleDrafter` for a target.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.drafters.eagle import network as eagle
from specjax.drafters.eagle.drafter import EagleDrafter
from specjax.io.eagle3 import eagle3_taps, read_eagle3

__all__ = ["load_eagle3", "load_eagle3_head"]

_LAYER = "midlayer."
DEFAULT_MAX_DRAFT = 8  # P-EAGLE checkpoints: drafts a round (the paper's K)


def load_eagle3_head(path, num_target_layers: int, *, dtype=jnp.float32, target_embed=None,
                     max_draft: int = DEFAULT_MAX_DRAFT):
  """An EAGLE-3 checkpoint as an `EagleHead` (plus its own embedding table, if it ships one).

  A checkpoint in vLLM's P-EAGLE layout (`parallel_drafting`, `specjax.io.eagle3`) becomes a
  parallel head with `parallel_reads_first=False` and `max_draft - 1` placeholder slots, each
  the embedding of `ptd_token_id` (from the checkpoint's `embed_tokens`, else `target_embed`)
  and `mask_hidden` (projected by `fc` when it is in the taps' format).

  Args:
    path: the checkpoint directory.
    num_target_layers: the target's layer count (for the default taps).
    dtype: floating-point dtype of the weights.
    target_embed: `[V, H]` the target's embedding (P-EAGLE checkpoints without `embed_tokens`).
    max_draft: P-EAGLE checkpoints: the most drafts a round (vLLM's `num_speculative_tokens`;
      every slot is the same placeholder, so any number works).

  Returns:
    `(head, embed)`: the head and the checkpoint's `[V, H]` `embed_tokens` or None.

  Raises:
    ValueError: see `read_eagle3`; also RoPE scaling, which the head does not implement, a
      target width different from the head's, a P-EAGLE checkpoint without an embedding for its
      `ptd_token_id`, or `max_draft < 2`.
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
  if config.get("parallel_drafting"):
    if not isinstance(max_draft, int) or max_draft < 2:
      raise ValueError(f"max_draft must be an int >= 2 for a parallel-drafting head, got "
                       f"{max_draft!r}")
    table = embed if embed is not None else target_embed
    if table is None:
      raise ValueError("a P-EAGLE checkpoint without embed_tokens needs the target's embedding "
                       "(target_embed) for its ptd_token_id")
    slots = max_draft - 1
    mask = jnp.asarray(w["mask_hidden"], dtype)
    if mask.shape[0] != hidden:  # the taps' format: through fc, as the target's taps are
      mask = mask @ params["fc"]
    row = jnp.asarray(table[int(config["ptd_token_id"])], dtype)  # [H]
    params["parallel_embed"] = jnp.tile(row, (slots, 1))
    params["parallel_feature"] = jnp.tile(mask, (slots, 1))
    head_config = dataclasses.replace(head_config, parallel=slots, parallel_reads_first=False)
  return eagle.EagleHead(params, head_config), embed


def load_eagle3(path, target, *, dtype=jnp.float32,
                max_draft: int = DEFAULT_MAX_DRAFT) -> EagleDrafter:
  """An EAGLE-3 checkpoint as a drafter for `target` (a `specjax.Model`).

  The head embeds tokens with the checkpoint's `embed_tokens` when it has one, else with the
  target's embedding. A checkpoint in vLLM's P-EAGLE layout drafts up to `max_draft` tokens a
  round in one forward (`load_eagle3_head`).

  Raises:
    ValueError: a malformed checkpoint, or one whose vocabulary or width does not fit `target`.
  """
  tc = target.config
  head, embed = load_eagle3_head(path, tc.num_layers, dtype=dtype,
                                 target_embed=target.params["embed"], max_draft=max_draft)
  c = head.config
  if (c.vocab_size, c.embed_dim) != (tc.vocab_size, tc.embed_dim):
    raise ValueError(f"EAGLE-3 head (vocab {c.vocab_size}, hidden {c.embed_dim}) does not fit the "
                     f"target (vocab {tc.vocab_size}, hidden {tc.embed_dim})")
  return EagleDrafter(head, target.params["embed"] if embed is None else embed.astype(dtype))
