"""The DFlash block drafter's network: Qwen3-style layers whose keys and values read the target.

Published by z-lab (`DFlashDraftModel`; the tensor layout is in `specjax.io.dflash`). Per row:

* **Context.** The target's layer outputs at `target_layer_ids` (residual streams before the final
  norm; for the target's last layer, Hugging Face's `hidden_states[L]`, the normed final state),
  concatenated in that order, projected by `fc` (n*H -> H, no bias) and normed by
  `hidden_norm`: one context vector `c_t` per committed position `t`.
* **Block.** `[anchor, MASK x (B - 1)]` at absolute positions `L - 1 .. L + B - 2`, embedded with
  the target's embedding (no scaling), where the anchor is the row's last token (`token_{L-1}`,
  whose target features are not known yet) and MASK is `mask_token_id`.
* **Layers.** Pre-RMSNorm decoder layers (q / k RMSNorm per head, SwiGLU) in which the context
  enters through keys and values only: `K = k_norm(k_proj([c; x]))`, `V = v_proj([c; x])`, RoPE on
  keys at their own absolute positions, queries from the block alone. A block query sees every
  committed context entry and every block entry (bidirectional inside the block).
* **Output.** The final `norm`, then the target's `lm_head` (times `output_multiplier`, with an
  optional tanh soft-cap) at block slots `1 .. B - 1`: the marginals `q_i` of `token_{L-1+i}`.

A context entry's keys and values depend on `c_t` and its position only (not on the layers'
hidden states), so they are computed once per committed token (`context_kv`) and cached.

Weights are `[in, out]` (PyTorch `Linear` transposed), one dict per layer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.models.layers import apply_rope, attention_reference, rms_norm, rope_inv_freq, \
    rope_tables

__all__ = ["DFlashConfig", "DFlashNetwork", "block_hidden", "context_kv", "gather_features",
           "init_network", "output_logits", "project_context"]


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """The drafter's architecture (static: hashable, part of the jit cache key).

  Attributes:
    embed_dim: the width `H` (the target's).
    num_layers, num_heads, num_kv_heads, head_dim, mlp_dim: the drafter's layers.
    vocab_size: the target's vocabulary.
    block_size: `B`: the anchor plus `B - 1` mask slots; a round drafts at most `B - 1` tokens.
    mask_token_id: the id whose target embedding fills the mask slots.
    target_layer_ids: target layers whose output the context reads, in `fc`'s input order.
    num_target_layers: the target's layer count the checkpoint was trained for (None: unstated).
    norm_eps, rope_theta: as in the target's config.
    output_multiplier, logit_softcap: applied to the logits (1 and None in DFlash v1 files).
  """

  embed_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  vocab_size: int
  block_size: int
  mask_token_id: int
  target_layer_ids: tuple[int, ...]
  num_target_layers: int | None = None
  norm_eps: float = 1e-6
  rope_theta: float = 10_000.0
  output_multiplier: float = 1.0
  logit_softcap: float | None = None

  def __post_init__(self):
    for name in ("embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                 "vocab_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DFlashConfig.{name} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"DFlashConfig.num_heads ({self.num_heads}) must be a multiple of "
                       f"num_kv_heads ({self.num_kv_heads})")
    if not isinstance(self.block_size, int) or self.block_size < 2:
      raise ValueError(f"DFlashConfig.block_size must be an int >= 2, got {self.block_size!r}")
    if not 0 <= self.mask_token_id < self.vocab_size:
      raise ValueError(f"DFlashConfig.mask_token_id {self.mask_token_id} is not below vocab_size "
                       f"{self.vocab_size}")
    object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
    if not self.target_layer_ids or min(self.target_layer_ids) < 0:
      raise ValueError(f"DFlashConfig.target_layer_ids must be non-empty layer indices, got "
                       f"{self.target_layer_ids}")

  def _is_last(self, i: int) -> bool:
    return self.num_target_layers is not None and i == self.num_target_layers - 1

  @property
  def taps(self) -> tuple[int, ...]:
    """The target forward's taps: the residual stream entering layer `i + 1` is layer `i`'s
    output (`specjax.models.transformer.forward`). The target's last layer is not a tap: see
    `reads_final`."""
    return tuple(i + 1 for i in self.target_layer_ids if not self._is_last(i))

  @property
  def reads_final(self) -> bool:
    """Whether `target_layer_ids` names the target's last layer. The published drafters read
    Hugging Face's `hidden_states[i + 1]`, and for the last layer that entry is the final
    *normed* hidden state, which is what this drafter then reads there."""
    return any(self._is_last(i) for i in self.target_layer_ids)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashNetwork:
  """The drafter's weights (`params`: `fc [n*H, H]`, `hidden_norm [H]`, `norm [H]`, `layers`: a
  tuple of per-layer dicts) and its static config."""

  params: dict
  config: DFlashConfig = dataclasses.field(metadata=dict(static=True))


def init_network(config: DFlashConfig, rng: jax.Array, scale: float = 0.02) -> DFlashNetwork:
  """Random weights (normal * `scale`; norms at 1): a drafter to train or to test with."""
  e, d, i = config.embed_dim, config.head_dim, config.mlp_dim
  shapes = {"wq": (e, config.num_heads * d), "wk": (e, config.num_kv_heads * d),
            "wv": (e, config.num_kv_heads * d), "wo": (config.num_heads * d, e),
            "w_gate": (e, i), "w_up": (e, i), "w_down": (i, e)}
  keys = jax.random.split(rng, config.num_layers + 1)
  layers = []
  for layer_key in keys[1:]:
    sub = jax.random.split(layer_key, len(shapes))
    layer = {name: scale * jax.random.normal(k, shape, jnp.float32)
             for k, (name, shape) in zip(sub, shapes.items())}
    layer.update(input_norm=jnp.ones((e,)), mlp_norm=jnp.ones((e,)), q_norm=jnp.ones((d,)),
                 k_norm=jnp.ones((d,)))
    layers.append(layer)
  n = len(config.target_layer_ids)
  params = {"fc": scale * jax.random.normal(keys[0], (n * e, e), jnp.float32),
            "hidden_norm": jnp.ones((e,)), "norm": jnp.ones((e,)), "layers": tuple(layers)}
  return DFlashNetwork(params, config)


def _norm(x, weight, config: DFlashConfig):
  return rms_norm(x, weight, config.norm_eps, 0.0)


def _heads(x, weight, count: int, config: DFlashConfig):
  """`x [B, T, H] @ weight` split into `[B, T, count, D]`."""
  out = jnp.einsum("bte,eo->bto", x, weight.astype(x.dtype), preferred_element_type=jnp.float32)
  return out.reshape(x.shape[:2] + (count, config.head_dim)).astype(x.dtype)


def _rope(positions, config: DFlashConfig):
  return rope_tables(positions, rope_inv_freq(config.head_dim, config.rope_theta, None))


def gather_features(config: DFlashConfig, taps: jax.Array | None,
                    hidden: jax.Array | None) -> jax.Array:
  """The context's inputs `[n, B, T, H]` in `target_layer_ids` order from a target forward's
  `taps` (`config.taps`) and final normed `hidden` state (where `config.reads_final`)."""
  if config.taps and taps is None or config.reads_final and hidden is None:
    raise ValueError("the target forward returned no taps / final hidden state for the DFlash "
                     "drafter")
  parts, next_tap = [], 0
  for i in config.target_layer_ids:
    if config._is_last(i):
      parts.append(hidden)
    else:
      parts.append(taps[next_tap])
      next_tap += 1
  return jnp.stack(parts)


def project_context(network: DFlashNetwork, taps: jax.Array) -> jax.Array:
  """The target's taps `[n, B, T, H]` (in `target_layer_ids` order) -> context `[B, T, H]`:
  `hidden_norm(fc(concat(taps)))`."""
  p, config = network.params, network.config
  n, batch, length, width = taps.shape
  stacked = jnp.moveaxis(taps, 0, 2).reshape(batch, length, n * width)  # [c_0 | c_1 | ...]
  fused = jnp.einsum("bti,io->bto", stacked, p["fc"].astype(stacked.dtype),
                     preferred_element_type=jnp.float32).astype(taps.dtype)
  return _norm(fused, p["hidden_norm"], config)


def context_kv(network: DFlashNetwork, context: jax.Array, positions: jax.Array):
  """Every layer's keys and values of context entries `[B, T, H]` at `positions [B, T]`:
  `(keys, values)` each `[N, B, T, KVH, D]` (keys normed per head, then rotated)."""
  config = network.config
  sin, cos = _rope(positions, config)
  keys, values = [], []
  for layer in network.params["layers"]:
    k = _norm(_heads(context, layer["wk"], config.num_kv_heads, config), layer["k_norm"], config)
    keys.append(apply_rope(k, sin, cos))
    values.append(_heads(context, layer["wv"], config.num_kv_heads, config))
  return jnp.stack(keys), jnp.stack(values)


def block_hidden(network: DFlashNetwork, block: jax.Array, positions: jax.Array,
                 cache_keys: jax.Array, cache_values: jax.Array, visible: jax.Array, *,
                 causal: bool = False) -> jax.Array:
  """The drafter's forward over embedded blocks.

  Args:
    network: the drafter.
    block: `[B, T, H]` the embedded block (`[anchor, MASK, ..]`).
    positions: `[B, T]` int32 absolute positions of the block's slots.
    cache_keys, cache_values: `[N, B, S, KVH, D]` the context entries' keys and values
      (`context_kv`).
    visible: `[B, S]` bool: which context entries the block sees (the committed ones).
    causal: a block slot sees only earlier block slots. False for DFlash (bidirectional); True
      only to show that a parity test tells the two apart.

  Returns:
    `[B, T, H]` the hidden states after the final norm.
  """
  config = network.config
  sin, cos = _rope(positions, config)
  batch, length, _ = block.shape
  groups = config.num_heads // config.num_kv_heads
  inner = jnp.ones((length, length), bool)
  if causal:
    inner = jnp.tril(inner)
  inner = jnp.broadcast_to(inner, (batch, length, length))
  outer = jnp.broadcast_to(visible[:, None, :], (batch, length, visible.shape[1]))
  x = block
  for index, layer in enumerate(network.params["layers"]):
    h = _norm(x, layer["input_norm"], config)
    q = apply_rope(_norm(_heads(h, layer["wq"], config.num_heads, config), layer["q_norm"],
                         config), sin, cos)
    k = apply_rope(_norm(_heads(h, layer["wk"], config.num_kv_heads, config), layer["k_norm"],
                         config), sin, cos)
    v = _heads(h, layer["wv"], config.num_kv_heads, config)
    q = q.reshape(batch, length, config.num_kv_heads, groups, config.head_dim)
    to_cache = lambda a: jnp.moveaxis(a, 2, 1)  # [B, S, KVH, D] -> [B, KVH, S, D]
    out = attention_reference(
        q, [to_cache(cache_keys[index]), to_cache(k)],
        [to_cache(cache_values[index]), to_cache(v)], [outer, inner],
        scale=config.head_dim ** -0.5, softcap=None)  # [B, KVH, G, T, D]
    out = jnp.moveaxis(out, 3, 1).reshape(batch, length, config.num_heads * config.head_dim)
    x = x + jnp.einsum("bti,io->bto", out.astype(x.dtype), layer["wo"].astype(x.dtype),
                       preferred_element_type=jnp.float32).astype(x.dtype)
    h = _norm(x, layer["mlp_norm"], config)
    gate = jnp.einsum("bte,ei->bti", h, layer["w_gate"].astype(h.dtype),
                      preferred_element_type=jnp.float32)
    up = jnp.einsum("bte,ei->bti", h, layer["w_up"].astype(h.dtype),
                    preferred_element_type=jnp.float32)
    x = x + jnp.einsum("bti,ie->bte", (jax.nn.silu(gate) * up).astype(x.dtype),
                       layer["w_down"].astype(x.dtype),
                       preferred_element_type=jnp.float32).astype(x.dtype)
  return _norm(x, network.params["norm"], config)


def output_logits(config: DFlashConfig, hidden: jax.Array, head: jax.Array) -> jax.Array:
  """`hidden [..., H]` through the target's output projection `head [H, V]` -> float32 logits."""
  logits = jnp.einsum("...e,ev->...v", hidden, head.astype(hidden.dtype),
                      preferred_element_type=jnp.float32)
  if config.output_multiplier != 1.0:
    logits = logits * config.output_multiplier
  if config.logit_softcap is not None:
    logits = config.logit_softcap * jnp.tanh(logits / config.logit_softcap)
  return logits
