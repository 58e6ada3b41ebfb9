"""Architecture configuration of the built-in decoder family.

One frozen, hashable dataclass describes every supported architecture: Llama, Mistral, Qwen2/3
and the Gemma variants differ only in the fields below, never in code paths that are copied.
Because it is hashable it is the static half of a `specjax.Model` pytree: two models with the same
config share one compiled program.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Activation = Literal["silu", "gelu_tanh"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.1-style frequency-dependent RoPE scaling (`rope_type: "llama3"`), linear scaling, or
  Gemma 4's proportional RoPE (`"proportional"`: the first `partial_rotary_factor` of the head's
  frequency pairs rotate, the rest have frequency 0, every frequency divided by `factor`)."""

  kind: Literal["llama3", "linear", "proportional"] = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  partial_rotary_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer.

  Attributes:
    vocab_size: number of token ids.
    embed_dim: width of the residual stream.
    num_layers: decoder blocks.
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention when smaller than `num_heads`).
    head_dim: width of one head.
    mlp_dim: hidden width of the gated MLP.
    max_len: the context length the model supports (prompt + generated tokens).
    rope_theta: RoPE base frequency.
    rope_scaling: optional RoPE frequency scaling.
    rope_local_theta: base frequency for sliding-window layers (Gemma 3); None = `rope_theta`.
    norm_eps: RMSNorm epsilon.
    norm_offset: RMSNorm scales by `(norm_offset + w)`: 0 for Llama, 1 for Gemma.
    activation: gate activation of the MLP: SwiGLU ("silu") or GeGLU ("gelu_tanh").
    tie_embeddings: the output projection is the transposed input embedding.
    scale_embeddings: multiply embeddings by sqrt(embed_dim) (Gemma).
    qkv_bias: biases on the q/k/v projections (Qwen2).
    qk_norm: RMSNorm on each query and key head before RoPE (Qwen3, Gemma 3).
    post_norms: extra RMSNorms after attention and after the MLP (Gemma 2/3).
    attn_logit_softcap: tanh soft-capping of attention scores (Gemma 2).
    final_logit_softcap: tanh soft-capping of output logits (Gemma 2).
    query_pre_attn_scalar: attention scale is this ** -0.5; None = head_dim ** -0.5.
    sliding_window: window of local-attention layers; None = every layer is global.
    sliding_window_pattern: every `pattern`-th layer (1-based) is global, the rest local;
      1 = all layers use the window (Mistral).
    global_head_dim: head width of the global (non-window) layers when it differs from
      `head_dim` (Gemma 4); None = `head_dim`.
    global_kv_heads: key/value heads of the global layers when they differ (Gemma 4); None =
      `num_kv_heads`.
    v_norm: RMSNorm without a scale on each value head (Gemma 4).
    kv_shared_layers: the last this many layers compute queries only and attend to the keys and
      values of the last earlier layer of their kind (window or global) that has its own (Gemma 4
      `num_kv_shared_layers`); the cache holds the first `num_layers - kv_shared_layers` only.
    per_layer_input_dim: width of Gemma 4's per-layer embeddings (PLE); 0 = none.
    per_layer_vocab_size: rows of the per-layer embedding table (PLE).
    layer_scalar: each layer's output is multiplied by its own learned scalar (Gemma 4).
    double_wide_mlp: the KV-shared layers' MLPs are twice `mlp_dim` wide (Gemma 4).
    bos_id / eos_id / pad_id: special ids the tokenizer and decoding agree on.
    family: a label ("llama", "qwen2", "gemma2", ...) for messages and export.
  """

  vocab_size: int
  embed_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  max_len: int = 2048
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  rope_local_theta: float | None = None
  norm_eps: float = 1e-6
  norm_offset: float = 0.0
  activation: Activation = "silu"
  tie_embeddings: bool = False
  scale_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  post_norms: bool = False
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  query_pre_attn_scalar: float | None = None
  sliding_window: int | None = None
  sliding_window_pattern: int = 1
  global_head_dim: int | None = None
  global_kv_heads: int | None = None
  v_norm: bool = False
  kv_shared_layers: int = 0
  per_layer_input_dim: int = 0
  per_layer_vocab_size: int = 0
  layer_scalar: bool = False
  double_wide_mlp: bool = False
  bos_id: int | None = None
  eos_id: int | None = None
  pad_id: int = 0
  family: str = "llama"

  def __post_init__(self):
    positive = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "mlp_dim", "max_len")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if self.activation not in ("silu", "gelu_tanh"):
      raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {self.activation!r}")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
    if self.sliding_window_pattern < 1:
      raise ValueError("sliding_window_pattern must be >= 1")
    for name in ("global_head_dim", "global_kv_heads"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"ModelConfig.{name} must be a positive int or None, got {value!r}")
    if self.num_heads % (self.global_kv_heads or self.num_kv_heads):
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of global_kv_heads "
                       f"({self.global_kv_heads})")
    if (self.global_head_dim or 2) % 2:
      raise ValueError(f"global_head_dim must be even for RoPE, got {self.global_head_dim}")
    if not 0 <= self.kv_shared_layers < self.num_layers:
      raise ValueError(f"kv_shared_layers must lie in 0..num_layers - 1, got "
                       f"{self.kv_shared_layers}")
    if self.kv_shared_layers:
      owners = self.layer_windows()[:self.num_layers - self.kv_shared_layers]
      for window in set(self.layer_windows()[self.num_layers - self.kv_shared_layers:]):
        if (window > 0) not in {w > 0 for w in owners}:
          raise ValueError("kv_shared_layers: a shared layer's kind (window or global) has no "
                           "earlier layer with keys and values of its own")
    if self.per_layer_input_dim < 0 or (self.per_layer_input_dim and
                                        self.per_layer_vocab_size < 1):
      raise ValueError("per_layer_input_dim must be >= 0, with per_layer_vocab_size >= 1")

  @property
  def attention_scale(self) -> float:
    base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
    return float(base) ** -0.5

  def layer_windows(self) -> tuple[int, ...]:
    """Per-layer attention window; 0 means global (no window)."""
    if self.sliding_window is None:
      return (0,) * self.num_layers
    return tuple(0 if (i + 1) % self.sliding_window_pattern == 0 and self.sliding_window_pattern > 1
                 else self.sliding_window for i in range(self.num_layers))

  def is_global(self, layer: int) -> bool:
    """Whether `layer` attends globally (no window)."""
    return self.layer_windows()[layer] == 0

  def layer_kv_heads(self, layer: int) -> int:
    """Key/value heads of `layer` (`global_kv_heads` on global layers where set)."""
    return (self.global_kv_heads or self.num_kv_heads) if self.is_global(layer) else (
        self.num_kv_heads)

  def layer_head_dim(self, layer: int) -> int:
    """Head width of `layer` (`global_head_dim` on global layers where set)."""
    return (self.global_head_dim or self.head_dim) if self.is_global(layer) else self.head_dim

  def layer_mlp_dim(self, layer: int) -> int:
    """MLP width of `layer` (twice `mlp_dim` on KV-shared layers with `double_wide_mlp`)."""
    return self.mlp_dim * (2 if self.double_wide_mlp and self.kv_source(layer) != layer else 1)

  @property
  def num_cache_layers(self) -> int:
    """Layers with keys and values of their own: the first `num_layers - kv_shared_layers`."""
    return self.num_layers - self.kv_shared_layers

  def kv_source(self, layer: int) -> int:
    """The layer whose keys and values `layer` attends: itself, or for a KV-shared layer the last
    layer of its kind (window or global) before the shared ones."""
    owners = self.num_cache_layers
    if layer < owners:
      return layer
    kind = self.is_global(layer)
    return max(i for i in range(owners) if self.is_global(i) == kind)

  def kv_store_layer(self, is_global: bool) -> int | None:
    """The last layer of a kind (global or window) with keys and values of its own: the layer a
    Gemma 4 assistant reads (`transformers`' "store" layer); None when there is none."""
    layers = [i for i in range(self.num_cache_layers) if self.is_global(i) == is_global]
    return layers[-1] if layers else None

  @property
  def per_layer_only(self) -> bool:
    """Whether the layers differ in shape or wiring (Gemma 4: global head widths, KV sharing,
    per-layer embeddings, layer scalars), so that the model runs only in the unstacked layout
    (`Model.unstacked`): one weight dict and one cache buffer per layer."""
    return bool(self.global_head_dim not in (None, self.head_dim)
                or self.global_kv_heads not in (None, self.num_kv_heads)
                or self.kv_shared_layers or self.per_layer_input_dim or self.layer_scalar
                or self.double_wide_mlp or self.v_norm)

  def num_params(self) -> int:
    """Parameter count (embedding counted once when tied)."""
    e, d = self.embed_dim, self.head_dim
    attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += d * (self.num_heads + 2 * self.num_kv_heads)
    mlp = 3 * e * self.mlp_dim
    norms = e * (4 if self.post_norms else 2) + (2 * d if self.qk_norm else 0)
    total = self.num_layers * (attn + mlp + norms) + self.vocab_size * e + e
    if not self.tie_embeddings:
      total += self.vocab_size * e
    return total


def gemma_style(config: ModelConfig, **overrides) -> ModelConfig:
  """The Gemma 2 variant of a config: scaled embeddings, (1 + w) norms, GeGLU, post norms,
  soft-capping and alternating sliding-window layers."""
  fields = dict(scale_embeddings=True, norm_offset=1.0, activation="gelu_tanh", post_norms=True,
                attn_logit_softcap=50.0, final_logit_softcap=30.0, tie_embeddings=True,
                sliding_window=16, sliding_window_pattern=2, family="gemma2")
  fields.update(overrides)
  return dataclasses.replace(config, **fields)
