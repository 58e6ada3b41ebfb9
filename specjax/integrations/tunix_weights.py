"""tunix's nnx policies as `specjax.Model`s: the architecture read once, the weights converted in
pure jnp wherever they are (inside the caller's `jax.jit`, traced: no host round trip).

tunix's decoders (`tunix.models.qwen2`, `qwen3`, `llama3`) are the Llama-family layer specjax's
own decoder computes: RMSNorm (`w * x / sqrt(mean(x^2) + eps)` in float32), rotate-half RoPE with
`theta ** (2i / D)` timescales and no scaling (the theta tunix's forward uses: `FAMILIES`),
grouped-query attention scaled by `head_dim ** -0.5`, a SwiGLU MLP, q/k/v biases (Qwen2) or
per-head q/k RMSNorms (Qwen3), a tied or separate output projection. Their einsum weights differ
from specjax's canonical ones only in shape:

  tunix (nnx state path)                      specjax (`params["layers"][i]`)
  attn.q_proj.w          [E, N, H]            wq      [E, N * H]
  attn.k_proj.w, v_proj  [E, K, H]            wk, wv  [E, K * H]
  attn.o_proj.w          [N, H, E]            wo      [N * H, E]
  attn.q_bias, k_bias, v_bias                 bq, bk, bv
  attn.q_norm.w, k_norm.w [H]                 q_norm, k_norm
  input_layernorm.w, post_attention_layernorm.w   attn_norm, mlp_norm
  mlp.gate_proj.kernel, up_proj, down_proj    w_gate, w_up, w_down
  embedder.input_embedding [V, E]; final_norm.w; lm_head.w [E, V]  embed, final_norm, lm_head

so the conversion is reshapes of row-major arrays (no copy) and a cast to the policy's compute
dtype. The layers come out per layer (`Model.unstacked` layout: an unrolled loop, each layer's
weights their own buffers, as tunix's modules hold them); `as_platform_model` packs them for the
CPU kernels on CPU, still in jnp.

Nothing here imports tunix: a module is recognised by the module its class lives in, and its
`config` is read by field name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from specjax.models.transformer import Model

__all__ = ["FAMILIES", "as_platform_model", "compute_dtype", "family_of", "model_config",
           "policy_params", "to_specjax", "to_tunix"]

# tunix's model module -> (specjax family, the config field saying the embedding is tied, whether
# its attention rotates by `config.rope_theta`). tunix 0.1.7's Qwen3 and Llama 3 attention call
# their module's `apply_rope` without a theta, so they rotate by that function's default (1e6)
# whatever the config says; the policy being trained is what tunix computes, so that is the theta
# taken here (`_rope_theta`; tests/integrations/test_tunix.py holds the logits to tunix's).
FAMILIES = {
    "tunix.models.qwen2.model": ("qwen2", "use_tied_embedding", True),
    "tunix.models.qwen3.model": ("qwen3", "use_tied_embedding", False),
    "tunix.models.llama3.model": ("llama", "weight_tying", False),
}


def _rope_theta(module) -> float:
  """The RoPE base tunix's forward of `module` rotates by (see `FAMILIES`)."""
  name = type(module).__module__
  if FAMILIES[name][2]:
    return float(module.config.rope_theta)
  import inspect
  import sys
  return float(inspect.signature(sys.modules[name].apply_rope).parameters["rope_theta"].default)


def family_of(module) -> str:
  """The specjax family of a tunix policy module ("qwen2", "qwen3", "llama").

  Raises:
    ValueError: a module of another kind, naming the supported ones.
  """
  name = type(module).__module__
  if name not in FAMILIES:
    raise ValueError(f"{type(module).__name__} (from {name}) is not a supported tunix policy: "
                     f"specjax converts {', '.join(sorted(FAMILIES))}")
  return FAMILIES[name][0]


def model_config(module, max_len: int) -> ModelConfig:
  """The `specjax.ModelConfig` of a tunix policy module, with context `max_len`.

  `use_flash_attention` (tunix's TPU prefill kernel) computes the same attention as the dense
  path, so it needs nothing here.

  Raises:
    ValueError: an unsupported module, or a mixture-of-experts policy (`num_experts`), which
      specjax's decoder does not compute.
  """
  family = family_of(module)
  c = module.config
  if getattr(c, "num_experts", None):
    raise ValueError(f"a {family} policy with num_experts={c.num_experts} (mixture of experts) "
                     "is not supported by specjax's decoder")
  tied = bool(getattr(c, FAMILIES[type(module).__module__][1]))
  return ModelConfig(
      vocab_size=int(c.vocab_size), embed_dim=int(c.embed_dim), num_layers=int(c.num_layers),
      num_heads=int(c.num_heads), num_kv_heads=int(c.num_kv_heads), head_dim=int(c.head_dim),
      mlp_dim=int(c.hidden_dim), max_len=int(max_len), rope_theta=_rope_theta(module),
      norm_eps=float(c.norm_eps), tie_embeddings=tied, qkv_bias=family == "qwen2",
      qk_norm=family == "qwen3", family=family)


def compute_dtype(module):
  """The dtype tunix's forward computes in (`config.dtype` where the config has one)."""
  dtype = getattr(module.config, "dtype", None)
  return None if dtype is None else jnp.dtype(dtype)


def policy_params(state) -> dict:
  """A tunix policy's nnx state (`nnx.state(module)`, any filter) as a plain nested dict of arrays
  (`nnx.to_pure_dict`): the pytree that crosses `jax.jit` into `to_specjax`."""
  from flax import nnx  # tunix's models are nnx modules; flax comes with tunix
  return nnx.to_pure_dict(state)


def to_specjax(params: dict, config: ModelConfig, dtype=None) -> Model:
  """A tunix policy's weights (`policy_params`) as a `specjax.Model` in the per-layer layout.

  Pure jnp reshapes and (with `dtype`) casts: call it inside a jitted step on traced weights, and
  the model is built there with no host round trip.

  Args:
    params: the policy's weights as a nested dict (`policy_params`).
    config: `model_config(module, max_len)`.
    dtype: cast every weight to this (the policy's compute dtype, `compute_dtype`); None: as is.

  Raises:
    ValueError: a missing weight, naming its path (the state is not a whole policy's).
  """
  cast = (lambda x: x) if dtype is None else (lambda x: jnp.asarray(x).astype(dtype))
  c = config
  e, d = c.embed_dim, c.head_dim

  def find(tree, *path):
    node = tree
    for key in path:
      if not isinstance(node, dict) or key not in node:
        where = ".".join(str(k) for k in path)
        raise ValueError(f"the policy state has no weight {where!r} (pass the whole nnx.Param "
                         "state of the policy)")
      node = node[key]
    return node

  get = lambda tree, *path: cast(find(tree, *path))

  def layer(i: int) -> dict:
    lp = find(params, "layers", i)
    attn = lambda *path: get(lp, "attn", *path)
    out = {
        "attn_norm": get(lp, "input_layernorm", "w"),
        "wq": attn("q_proj", "w").reshape(e, c.num_heads * d),
        "wk": attn("k_proj", "w").reshape(e, c.num_kv_heads * d),
        "wv": attn("v_proj", "w").reshape(e, c.num_kv_heads * d),
        "wo": attn("o_proj", "w").reshape(c.num_heads * d, e),
        "mlp_norm": get(lp, "post_attention_layernorm", "w"),
        "w_gate": get(lp, "mlp", "gate_proj", "kernel"),
        "w_up": get(lp, "mlp", "up_proj", "kernel"),
        "w_down": get(lp, "mlp", "down_proj", "kernel"),
    }
    if c.qkv_bias:
      out.update(bq=attn("q_bias"), bk=attn("k_bias"), bv=attn("v_bias"))
    if c.qk_norm:
      out.update(q_norm=attn("q_norm", "w"), k_norm=attn("k_norm", "w"))
    return out

  model_params = {"embed": get(params, "embedder", "input_embedding"),
                  "layers": tuple(layer(i) for i in range(c.num_layers)),
                  "final_norm": get(params, "final_norm", "w")}
  if not c.tie_embeddings:
    model_params["lm_head"] = get(params, "lm_head", "w")
  return Model(model_params, config)


def as_platform_model(model: Model, platform: str | None = None) -> Model:
  """`model` (per-layer, from `to_specjax`) in the layout to run on `platform` (default: JAX's
  default backend), built in jnp so it works on traced weights: on CPU `Model.for_platform("cpu")`
  (fused projections in the CPU kernels' panels: a packed copy of the weights); elsewhere per
  layer as tunix holds them (no copy: stacking for `lax.scan` would copy every weight)."""
  platform = platform or jax.default_backend()
  return model.for_platform("cpu") if platform == "cpu" else model



def to_tunix(model: Model) -> dict:
  """The inverse of `to_specjax`: a `specjax.Model`'s weights (any layout of the Qwen2 / Qwen3 /
  Llama family) as the nested dict of a tunix policy's `nnx.Param` state, so a checkpoint specjax
  reads (GGUF, Hugging Face) loads into tunix's module of the same shape:

      state = nnx.state(module, nnx.Param)
      nnx.replace_by_pure_dict(state, to_tunix(model))
      nnx.update(module, state)
  """
  c = model.config
  e, d = c.embed_dim, c.head_dim
  layers = model.without_fused_projections().unstacked().params["layers"]

  def layer(lp: dict) -> dict:
    attn = {"q_proj": {"w": lp["wq"].reshape(e, c.num_heads, d)},
            "k_proj": {"w": lp["wk"].reshape(e, c.num_kv_heads, d)},
            "v_proj": {"w": lp["wv"].reshape(e, c.num_kv_heads, d)},
            "o_proj": {"w": lp["wo"].reshape(c.num_heads, d, e)}}
    if c.qkv_bias:
      attn.update(q_bias=lp["bq"], k_bias=lp["bk"], v_bias=lp["bv"])
    if c.qk_norm:
      attn.update(q_norm={"w": lp["q_norm"]}, k_norm={"w": lp["k_norm"]})
    return {"input_layernorm": {"w": lp["attn_norm"]}, "attn": attn,
            "post_attention_layernorm": {"w": lp["mlp_norm"]},
            "mlp": {"gate_proj": {"kernel": lp["w_gate"]}, "up_proj": {"kernel": lp["w_up"]},
                    "down_proj": {"kernel": lp["w_down"]}}}

  params = model.without_fused_projections().params
  out = {"embedder": {"input_embedding": jnp.asarray(params["embed"])},
         "layers": {i: layer(lp) for i, lp in enumerate(layers)},
         "final_norm": {"w": params["final_norm"]}}
  if not c.tie_embeddings:
    out["lm_head"] = {"w": params["lm_head"]}
  return out
