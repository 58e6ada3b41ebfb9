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
  """Llama 3.1-style frequency-dependent RoPE scaling (`rope_type: "llama3"`) or linear scaling."""

  kind: Literal["llama3", "linear"] = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


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
