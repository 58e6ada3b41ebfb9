"""The Gemma 4 assistant network (`Gemma4AssistantForCausalLM`), in jnp.

One draft step of the published architecture, for a query at position `p` (the position of the
last token the target has not processed yet):

  x = pre_projection([embed_target(token) * sqrt(E_t); h])        E_t = the target's width
  for each layer (a Gemma 4 text layer whose keys and values are all shared):
    q = rope(q_norm(q_proj(input_norm(x))))                        queries only
    x = x + post_attn_norm(o_proj(attend(q, the target's K/V of the layer's kind)))
    x = x + post_mlp_norm(mlp(pre_mlp_norm(x)));  x = x * layer_scalar
  normed = norm(x)
  logits = head(normed)                         or, with ordered embeddings, only the tokens of
                                                the top-k centroids of `centroids(normed)` (the
                                                rest at `MASKED_LOGIT`: probability 0)
  h' = post_projection(normed)                  fed back with the drafted token at the next step

The keys and values are the target's, of the last layer of each kind (window or global) with
keys and values of its own (`ModelConfig.kv_store_layer`), at positions `0 .. p - 1`. Global
layers see all of them; window layers the last `sliding_window + 1` (Hugging Face's bidirectional
window mask, flipped onto the past). Attention is scaled by 1 (the q norm sets the scale), and the
logits are not soft-capped (`Gemma4AssistantForCausalLM` caps neither).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from specjax.models.config import RopeScaling
from specjax.models.layers import (_mlp_activation, apply_rope, attention_reference, rms_norm,
                                   rope_inv_freq, rope_tables)

__all__ = ["AssistantConfig", "AssistantNetwork", "MASKED_LOGIT", "assistant_step",
           "init_network", "ordered_logits", "window_visible"]

# The logit of a token outside the selected centroids: finite, so that temperature, top-k and
# top-p warp it like any other logit (`specjax.core.sampling.warp_logits` keeps top-k exact only
# over finite logits), and far enough below every real logit that its probability is exactly 0
# in float32 at any temperature above 1e-8.
MASKED_LOGIT = -1e30


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
  """A Gemma 4 assistant's architecture.

  Attributes:
    vocab_size: token ids (the target's).
    embed_dim: the assistant's own width (`text_config.hidden_size`).
    backbone_dim: the target's width (`backbone_hidden_size`).
    num_heads: query heads of every layer.
    layer_global: per layer, whether it is a global layer (else a window layer).
    head_dim / global_head_dim: head widths of window / global layers (the target's).
    num_kv_heads / global_kv_heads: the key/value heads of the target's window / global layers
      that the assistant's config declares (its queries are grouped by them).
    mlp_dim: MLP width.
    norm_eps: RMSNorm epsilon.
    activation: MLP gate activation ("gelu_tanh" for Gemma 4).
    sliding_window: window of the window layers (`text_config.sliding_window`).
    rope_local_theta / rope_theta / rope_scaling: RoPE of window / global layers.
    ordered_embeddings: logits restricted to the top centroids' tokens (`use_ordered_embeddings`).
    num_centroids / centroid_top_k: the centroid table's size and how many centroids are kept.
  """

  vocab_size: int
  embed_dim: int
  backbone_dim: int
  num_heads: int
  layer_global: tuple[bool, ...]
  head_dim: int
  global_head_dim: int
  mlp_dim: int
  num_kv_heads: int = 1
  global_kv_heads: int = 1
  norm_eps: float = 1e-6
  activation: str = "gelu_tanh"
  sliding_window: int = 512
  rope_local_theta: float = 10_000.0
  rope_theta: float = 1_000_000.0
  rope_scaling: RopeScaling | None = None
  ordered_embeddings: bool = False
  num_centroids: int = 2048
  centroid_top_k: int = 32

  def __post_init__(self):
    if self.ordered_embeddings:
      if self.vocab_size % self.num_centroids:
        raise ValueError(f"vocab_size ({self.vocab_size}) must be a multiple of num_centroids "
                         f"({self.num_centroids})")
      if not 1 <= self.centroid_top_k <= self.num_centroids:
        raise ValueError(f"centroid_intermediate_top_k must lie in 1..num_centroids, got "
                         f"{self.centroid_top_k}")

  @property
  def num_layers(self) -> int:
    return len(self.layer_global)

  def layer_head_dim(self, layer: int) -> int:
    return self.global_head_dim if self.layer_global[layer] else self.head_dim


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AssistantNetwork:
  """Weights (leaves) and architecture (static). Projections are `[in, out]`.

  params: `pre_projection [2 E_t, E]`, `post_projection [E, E_t]`, `final_norm [E]`,
  `head [V, E]` (the tied `embed_tokens`, or `lm_head`), with ordered embeddings
  `centroids [E, C]` and `token_ordering [V]` int32; `layers` a tuple of per-layer dicts
  (`attn_norm`, `wq`, `q_norm`, `wo`, `post_attn_norm`, `mlp_norm`, `w_gate`, `w_up`,
  `w_down`, `post_mlp_norm`, `layer_scalar [1]`).
  """

  params: dict
  config: AssistantConfig = dataclasses.field(metadata=dict(static=True))


def layer_shapes(c: AssistantConfig, layer: int) -> dict[str, tuple[int, ...]]:
  e, d = c.embed_dim, c.layer_head_dim(layer)
  return {"attn_norm": (e,), "wq": (e, c.num_heads * d), "q_norm": (d,),
          "wo": (c.num_heads * d, e), "post_attn_norm": (e,), "mlp_norm": (e,),
          "w_gate": (e, c.mlp_dim), "w_up": (e, c.mlp_dim), "w_down": (c.mlp_dim, e),
          "post_mlp_norm": (e,), "layer_scalar": (1,)}


def top_shapes(c: AssistantConfig) -> dict[str, tuple[int, ...]]:
  shapes = {"pre_projection": (2 * c.backbone_dim, c.embed_dim),
            "post_projection": (c.embed_dim, c.backbone_dim), "final_norm": (c.embed_dim,),
            "head": (c.vocab_size, c.embed_dim)}
  if c.ordered_embeddings:
    shapes.update(centroids=(c.embed_dim, c.num_centroids), token_ordering=(c.vocab_size,))
  return shapes


def init_network(config: AssistantConfig, rng: jax.Array, dtype=jnp.float32) -> AssistantNetwork:
  """Random weights (norms near 1, a random token ordering): for tests and training."""
  def draw(key, name, shape):
    if name == "token_ordering":
      return jax.random.permutation(key, config.vocab_size).astype(jnp.int32)
    if len(shape) == 2:
      return (jax.random.normal(key, shape) / math.sqrt(shape[0])).astype(dtype)
    return (1.0 + 0.1 * jax.random.normal(key, shape)).astype(dtype)
  shapes = top_shapes(config)
  keys = jax.random.split(rng, len(shapes) + config.num_layers)
  params = {name: draw(k, name, s) for k, (name, s) in zip(keys, shapes.items())}
  layers = []
  for i in range(config.num_layers):
    shapes = layer_shapes(config, i)
    sub = jax.random.split(keys[len(params) + i], len(shapes))
    layers.append({name: draw(k, name, s) for k, (name, s) in zip(sub, shapes.items())})
  params["layers"] = tuple(layers)
  return AssistantNetwork(params, config)


def window_visible(config: AssistantConfig, kv_lengths: jax.Array, num_slots: int):
  """`(global [B, S], window [B, S])` bool: which of the target's cache slots the assistant's
  global and window layers see, with `kv_lengths[b]` valid entries (positions `0 .. p - 1`):
  all of them, and the last `sliding_window + 1` of them."""
  slots = jnp.arange(num_slots, dtype=jnp.int32)[None]
  valid = slots < kv_lengths[:, None]
  return valid, valid & (slots >= kv_lengths[:, None] - 1 - config.sliding_window)


def ordered_logits(config: AssistantConfig, params: dict, normed: jax.Array) -> jax.Array:
  """`[B, V]` float32 logits over the tokens of the `centroid_top_k` best centroids of
  `normed [B, E]`, `MASKED_LOGIT` elsewhere (probability 0 under the drafter).
  Centroid `c`'s tokens are `token_ordering[c * V / C : (c + 1) * V / C]` (canonical ids)."""
  c = config
  per = c.vocab_size // c.num_centroids
  scores = jnp.einsum("be,ec->bc", normed, params["centroids"],
                      preferred_element_type=jnp.float32)
  _, top = jax.lax.top_k(scores, c.centroid_top_k)  # [B, k]
  clusters = params["token_ordering"].astype(jnp.int32).reshape(c.num_centroids, per)
  selected = clusters[top].reshape(normed.shape[0], -1)  # [B, k * per] canonical ids
  rows = jnp.take(params["head"], selected, axis=0)  # [B, k * per, E]
  values = jnp.einsum("be,bse->bs", normed, rows, preferred_element_type=jnp.float32)
  out = jnp.full((normed.shape[0], c.vocab_size), MASKED_LOGIT, jnp.float32)
  return out.at[jnp.arange(normed.shape[0])[:, None], selected].set(values)


def assistant_step(network: AssistantNetwork, embedded: jax.Array, hidden: jax.Array,
                   positions: jax.Array, kv: dict, visible: dict):
  """One draft step for every row.

  Args:
    network: the assistant.
    embedded: `[B, E_t]` the target's (scaled) embedding of the step's input token.
    hidden: `[B, E_t]` the target's final normed hidden state of the position before, or the
      previous step's `post_projection` output.
    positions: `[B]` int32 the query's position (the same at every step of a round).
    kv: `{True: (keys, values), False: (keys, values)}`, per kind (global / window), the target's
      `[B, KVH, S, D]` keys (normed, rotated) and values.
    visible: `{True: [B, S], False: [B, S]}` bool (`window_visible`).

  Returns:
    `(logits [B, V] float32, next hidden [B, E_t], normed [B, E])`.
  """
  c, p = network.config, network.params
  x = jnp.einsum("bi,io->bo", jnp.concatenate([embedded, hidden.astype(embedded.dtype)], -1),
                 p["pre_projection"])[:, None]  # [B, 1, E]
  b = x.shape[0]
  for i, lp in enumerate(p["layers"]):
    kind = c.layer_global[i]
    d = c.layer_head_dim(i)
    keys, values = kv[kind]
    kvh = keys.shape[1]
    h = rms_norm(x, lp["attn_norm"], c.norm_eps, 0.0)
    q = jnp.einsum("bte,eo->bto", h, lp["wq"]).reshape(b, 1, c.num_heads, d)
    q = rms_norm(q, lp["q_norm"], c.norm_eps, 0.0)
    inv_freq = (rope_inv_freq(d, c.rope_theta, c.rope_scaling) if kind
                else rope_inv_freq(d, c.rope_local_theta, None))
    sin, cos = rope_tables(positions[:, None], inv_freq)
    q = apply_rope(q, sin, cos).reshape(b, 1, kvh, c.num_heads // kvh, d)
    out = attention_reference(q, [keys], [values], [visible[kind][:, None, :]], scale=1.0,
                              softcap=None)  # [B, KVH, G, 1, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, 1, c.num_heads * d).astype(x.dtype)
    attn = jnp.einsum("bti,io->bto", out, lp["wo"])
    x = x + rms_norm(attn, lp["post_attn_norm"], c.norm_eps, 0.0)
    h = rms_norm(x, lp["mlp_norm"], c.norm_eps, 0.0)
    gate = _mlp_activation(jnp.einsum("bte,ef->btf", h, lp["w_gate"]), c.activation)
    mlp = jnp.einsum("btf,fe->bte", gate * jnp.einsum("bte,ef->btf", h, lp["w_up"]),
                     lp["w_down"])
    x = x + rms_norm(mlp, lp["post_mlp_norm"], c.norm_eps, 0.0)
    x = x * lp["layer_scalar"].astype(x.dtype)
  normed = rms_norm(x[:, 0], p["final_norm"], c.norm_eps, 0.0)
  if c.ordered_embeddings:
    logits = ordered_logits(c, p, normed)
  else:
    logits = jnp.einsum("be,ve->bv", normed, p["head"], preferred_element_type=jnp.float32)
  return logits, jnp.einsum("be,eo->bo", normed, p["post_projection"]), normed
