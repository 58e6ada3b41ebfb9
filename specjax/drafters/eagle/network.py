"""The EAGLE-3 draft head (and its MTP shape): one decoder layer on the target's own features.

A head reads, at every position, a *feature* of the target (EAGLE-3: the residual stream entering
three target layers, concatenated and projected by `fc`; MTP: the target's final normed hidden
state, projected by an `fc` that starts as the identity) together with the embedding of the token
that follows it, and predicts the token after that:

```
slot t:  [input_norm(embed(token_{t+1})) | hidden_norm(feature_t)]  -> one decoder layer
         -> hidden_out_t (stands in for feature_{t+1})  -> final_norm -> lm_head -> token_{t+2}
```

The layer's residual is the feature itself, as in EAGLE-3. The head keeps its own one-layer KV
cache (slot `t` holds the pair `(feature_t, token_{t+1})`, rotated at position `t`), embeds tokens
with the *target's* embedding table (passed in at call time, never stored), and predicts over a
reduced draft vocabulary of `N` target ids: draft id `i` is target id `i + d2t[i]`
(`to_target_logits` maps draft logits onto the full vocabulary with `-inf` elsewhere, so a draft
sampled from them can never leave the draft vocabulary).

A head is a registered dataclass pytree (`params` leaves, a hashable `HeadConfig` static), like
`specjax.Model`; every function here is pure and jit-friendly. The drafter protocol around it
lives in `specjax.drafters.eagle.drafter`, its training in `specjax.training.heads`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.cache import KVCache
from specjax.io.orbax import read_tree_metadata, restore_tree, save_tree
from specjax.models.cache_write import write_stacked
from specjax.models.config import ModelConfig
from specjax.models.cpu import panels as panel_layout
from specjax.models.transformer import (Model, apply_rope, attention, rms_norm, rope_inv_freq,
                                        rope_tables)

__all__ = ["EagleHead", "HeadConfig", "head_config_for", "head_forward", "init_head",
           "init_placeholders", "load_head", "project_features", "save_head", "to_target_logits"]

HEAD_KIND = "eagle_head"


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """Architecture of an `EagleHead` (hashable: the static half of the pytree).

  Attributes:
    embed_dim: the target's residual width `E` (the head works at the same width).
    num_heads: query heads of the head's attention.
    num_kv_heads: key/value heads.
    head_dim: width of one attention head.
    mlp_dim: hidden width of the gated MLP.
    num_taps: how many `E`-wide target features `fc` concatenates: 3 for EAGLE-3, 1 for MTP.
    taps: the target layers whose incoming residual stream is read (EAGLE-3: `(2, L//2, L-3)`);
      `()` = the target's final normed hidden state (MTP).
    draft_vocab_size: `N`, the size of the reduced draft vocabulary.
    vocab_size: `V`, the target's vocabulary.
    norm_eps: RMSNorm epsilon.
    rope_theta: RoPE base frequency of the head's attention.
    max_len: the longest sequence the head is meant for (sizes caches by default).
    parallel: `P` >= 0 placeholder slots (P-EAGLE-style parallel drafting): 0 = a sequential
      head; `P` > 0 = the head drafts a round with one forward, its slots reading learned
      placeholders in place of a (feature, token) pair (`specjax.drafters.eagle.parallel`).
    parallel_reads_first: with `parallel`: the drafting forward's first slot is the pair
      (stored output, first draft) and the placeholders follow it (True: specjax's own heads,
      up to `P + 2` drafts a round, later drafts conditioned on the first), or every slot is a
      placeholder, right after the last verified pair (False: vLLM's P-EAGLE layout, which
      `specjax.drafters.load_eagle3` imports; up to `P + 1` drafts, none conditioned on another).
  """

  embed_dim: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  num_taps: int
  taps: tuple[int, ...]
  draft_vocab_size: int
  vocab_size: int
  norm_eps: float = 1e-5
  rope_theta: float = 10_000.0
  max_len: int = 2048
  parallel: int = 0
  parallel_reads_first: bool = True

  def __post_init__(self):
    object.__setattr__(self, "taps", tuple(int(i) for i in self.taps))
    for name in ("embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "num_taps",
                 "draft_vocab_size", "vocab_size", "max_len"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"HeadConfig.{name} must be a positive int, got {value!r}")
    if self.taps and len(self.taps) != self.num_taps:
      raise ValueError(f"HeadConfig.taps {self.taps} must list num_taps ({self.num_taps}) layers")
    if not self.taps and self.num_taps != 1:
      raise ValueError("a head without taps reads the final hidden state: num_taps must be 1")
    if self.draft_vocab_size > self.vocab_size:
      raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds the target's "
                       f"vocab_size ({self.vocab_size})")
    if not isinstance(self.parallel, (int, np.integer)) or self.parallel < 0:
      raise ValueError(f"HeadConfig.parallel must be an int >= 0, got {self.parallel!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads})")

  @property
  def layer_config(self) -> ModelConfig:
    """A one-layer `ModelConfig` with the head's attention shape (for `attention`, caches)."""
    return ModelConfig(vocab_size=self.draft_vocab_size, embed_dim=self.embed_dim, num_layers=1,
                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       head_dim=self.head_dim, mlp_dim=self.mlp_dim, max_len=self.max_len,
                       rope_theta=self.rope_theta, norm_eps=self.norm_eps)


def head_config_for(target: ModelConfig, *, kind: str = "eagle3", draft_vocab_size: int,
                    max_len: int | None = None, parallel: int = 0) -> HeadConfig:
  """The head shape that matches a target: its attention and MLP widths, EAGLE-3 or MTP taps.

  Args:
    target: the target's `ModelConfig`.
    kind: "eagle3" (taps `(2, L//2, L-3)`) or "mtp" (the final normed hidden state).
    draft_vocab_size: `N`.
    max_len: defaults to the target's.
    parallel: placeholder slots of a parallel-drafting head (`HeadConfig.parallel`), 0 = none.
  """
  L = target.num_layers
  if kind == "eagle3":
    if L < 4:
      raise ValueError(f"EAGLE-3 taps (2, L//2, L-3) need at least 4 target layers, got {L}")
    taps = (2, L // 2, L - 3)
  elif kind == "mtp":
    taps = ()
  else:
    raise ValueError(f"kind must be 'eagle3' or 'mtp', got {kind!r}")
  return HeadConfig(embed_dim=target.embed_dim, num_heads=target.num_heads,
                    num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                    mlp_dim=target.mlp_dim, num_taps=len(taps) or 1, taps=taps,
                    draft_vocab_size=draft_vocab_size, vocab_size=target.vocab_size,
                    norm_eps=target.norm_eps, rope_theta=target.rope_theta,
                    max_len=max_len or target.max_len, parallel=parallel)


class _DraftVocabHead:
  """Mixin for a head dataclass of `params` (with `d2t [N] int32`) and a static `config`, over a
  reduced draft vocabulary (`EagleHead`, `specjax.drafters.medusa.network.MedusaHeads`)."""

  @property
  def draft_ids(self) -> jax.Array:
    """`[N]` int32 target id of every draft id (sorted)."""
    d2t = self.params["d2t"]
    return jnp.arange(d2t.shape[0], dtype=jnp.int32) + d2t.astype(jnp.int32)

  def astype(self, dtype):
    """The same head with floating-point weights cast to `dtype` (`d2t` stays int32)."""
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return type(self)(jax.tree.map(cast, self.params), self.config)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EagleHead(_DraftVocabHead):
  """An EAGLE-3 / MTP draft head: weights (pytree leaves) plus `HeadConfig` (static).

  `params`: `fc [num_taps*E, E]`, `input_norm [E]`, `hidden_norm [E]`, `layer` {`wq [2E, H*D]`,
  `wk [2E, KVH*D]`, `wv [2E, KVH*D]`, `wo [H*D, E]`, `mlp_norm [E]`, `w_gate [E, F]`,
  `w_up [E, F]`, `w_down [F, E]`}, `final_norm [E]`, `lm_head [E, N]`, `d2t [N] int32`; a
  parallel head (`config.parallel = P > 0`) also `parallel_embed [P, E]` and
  `parallel_feature [P, E]`, the placeholders that stand in for a slot's token embedding and
  feature.
  """

  params: dict
  config: HeadConfig = dataclasses.field(metadata=dict(static=True))

  def init_cache(self, batch: int, max_len: int | None = None, dtype=None) -> KVCache:
    """An empty one-layer cache (`specjax.loop.KVCache`, one layer, the target cache's layout)."""
    c = self.config
    return KVCache.create(1, batch, max_len or c.max_len, c.num_kv_heads, c.head_dim,
                          dtype or self.params["fc"].dtype)

  def num_params(self) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))


def _check_draft_ids(draft_ids, vocab_size: int, size: int) -> np.ndarray:
  ids = np.asarray(draft_ids).astype(np.int64).reshape(-1)
  if ids.shape[0] != size:
    raise ValueError(f"draft_ids has {ids.shape[0]} ids, config.draft_vocab_size is {size}")
  if ids.min() < 0 or ids.max() >= vocab_size or np.any(np.diff(ids) <= 0):
    raise ValueError(f"draft_ids must be strictly increasing target ids in [0, {vocab_size})")
  return ids


def target_output_head(target: Model) -> jax.Array:
  """`[E, V]` the target's output projection (the transposed embedding when tied)."""
  p = target.params
  if target.config.tie_embeddings and "lm_head" not in p:
    return p["embed"].T
  head = p["lm_head"]  # `[E, V]`, or the CPU layout's panels of `[V, E]` (`.T`: `[E, V]`)
  return head.T if panel_layout.is_panels(head) else head


def init_head(config: HeadConfig, target: Model, rng: jax.Array, draft_ids) -> EagleHead:
  """A fresh head for `target`, its LM head initialised from the target's output rows.

  Args:
    config: the head's shape (`embed_dim` and `vocab_size` must match the target).
    target: the target model (only its output projection is read).
    rng: initialisation key.
    draft_ids: `[N]` strictly increasing target ids of the draft vocabulary.

  Returns:
    An `EagleHead` in float32. `fc` is random for EAGLE-3 and the identity for MTP; `wo` and
    `w_down` start small so the layer starts near the identity on its feature.
  """
  tc = target.config
  if (tc.embed_dim, tc.vocab_size) != (config.embed_dim, config.vocab_size):
    raise ValueError(f"head (E={config.embed_dim}, V={config.vocab_size}) does not fit the "
                     f"target (E={tc.embed_dim}, V={tc.vocab_size})")
  ids = _check_draft_ids(draft_ids, config.vocab_size, config.draft_vocab_size)
  c = config
  e, d, f = c.embed_dim, c.head_dim, c.mlp_dim
  keys = iter(jax.random.split(rng, 8))

  def dense(shape, fan_in, scale=1.0):
    return jax.random.normal(next(keys), shape, jnp.float32) * (scale / math.sqrt(fan_in))

  if c.num_taps == 1:
    fc = jnp.eye(e, dtype=jnp.float32)
  else:
    fc = dense((c.num_taps * e, e), c.num_taps * e)
  ones = jnp.ones((e,), jnp.float32)
  layer = {
      "wq": dense((2 * e, c.num_heads * d), 2 * e),
      "wk": dense((2 * e, c.num_kv_heads * d), 2 * e),
      "wv": dense((2 * e, c.num_kv_heads * d), 2 * e),
      "wo": dense((c.num_heads * d, e), c.num_heads * d, 0.1),
      "mlp_norm": jnp.ones_like(ones),
      "w_gate": dense((e, f), e),
      "w_up": dense((e, f), e),
      "w_down": dense((f, e), f, 0.1),
  }
  lm_head = jnp.asarray(target_output_head(target), jnp.float32)[:, ids]
  params = {"fc": fc, "input_norm": ones, "hidden_norm": jnp.ones_like(ones), "layer": layer,
            "final_norm": jnp.asarray(target.params["final_norm"], jnp.float32), "lm_head": lm_head,
            "d2t": jnp.asarray(ids - np.arange(ids.shape[0]), jnp.int32)}
  if c.parallel:
    params.update(init_placeholders(rng, c.parallel, e))
  return EagleHead(params, config)


def init_placeholders(rng: jax.Array, parallel: int, embed_dim: int) -> dict:
  """A parallel head's `parallel_embed` and `parallel_feature` (`[P, E]` each), as `init_head`
  draws them: unit-scale vectors (the slot's input norms rescale them either way) from their own
  key, `fold_in(rng, 1)`, so the other weights are those of a sequential head with `rng`."""
  embed_key, feature_key = jax.random.split(jax.random.fold_in(rng, 1))
  return {"parallel_embed": jax.random.normal(embed_key, (parallel, embed_dim), jnp.float32),
          "parallel_feature": jax.random.normal(feature_key, (parallel, embed_dim), jnp.float32)}


def project_features(head: EagleHead, source: jax.Array) -> jax.Array:
  """The head's input features from the target's taps or final hidden state.

  Args:
    head: the head.
    source: `[n, B, T, E]` taps in `head.config.taps` order (EAGLE-3), or `[B, T, E]` the final
      normed hidden state (MTP; `[1, B, T, E]` is accepted too).

  Returns:
    `[B, T, E]` = `concat(taps) @ fc`.
  """
  c = head.config
  if source.ndim == 3:
    source = source[None]
  if source.ndim != 4 or source.shape[0] != c.num_taps or source.shape[-1] != c.embed_dim:
    raise ValueError(f"expected {c.num_taps} feature(s) of width {c.embed_dim} "
                     f"([n, B, T, E]), got shape {source.shape}")
  n, b, t, e = source.shape
  stacked = jnp.moveaxis(source, 0, 2).reshape(b, t, n * e)  # [B, T, n*E], taps in order
  fc = head.params["fc"]
  return jnp.einsum("btf,fe->bte", stacked.astype(fc.dtype), fc)


def head_qkv(head: EagleHead, embed: jax.Array | None, tokens: jax.Array, features: jax.Array,
             positions: jax.Array):
  """The layer's rotated queries/keys/values for pairs `(features, tokens)` at `positions`.

  `tokens` are `[B, T]` ids embedded with `embed`, or (`embed=None`) `[B, T, E]` already
  embedded (a parallel head's placeholders: `specjax.drafters.eagle.parallel`).

  Returns:
    `q [B, T, H, D]`, `k [B, T, KVH, D]`, `v [B, T, KVH, D]`.
  """
  c = head.config
  p = head.params
  lp = p["layer"]
  b, t = tokens.shape[:2]
  x_embed = (tokens if embed is None else embed[tokens]).astype(features.dtype)  # [B, T, E]
  joint = jnp.concatenate([rms_norm(x_embed, p["input_norm"], c.norm_eps, 0.0),
                           rms_norm(features, p["hidden_norm"], c.norm_eps, 0.0)], axis=-1)
  q = jnp.einsum("btf,fg->btg", joint, lp["wq"]).reshape(b, t, c.num_heads, c.head_dim)
  k = jnp.einsum("btf,fg->btg", joint, lp["wk"]).reshape(b, t, c.num_kv_heads, c.head_dim)
  v = jnp.einsum("btf,fg->btg", joint, lp["wv"]).reshape(b, t, c.num_kv_heads, c.head_dim)
  sin, cos = rope_tables(positions, rope_inv_freq(c.head_dim, c.rope_theta, None))
  return apply_rope(q, sin, cos), apply_rope(k, sin, cos), v


def head_finish(head: EagleHead, features: jax.Array, attn: jax.Array):
  """The rest of the layer after attention: residual, MLP, the draft logits.

  Args:
    features: `[B, T, E]` the layer's residual input.
    attn: `[B, T, H*D]` attention output.

  Returns:
    `(draft_logits [B, T, N] float32, hidden_out [B, T, E])`.
  """
  c = head.config
  p = head.params
  lp = p["layer"]
  x = features + jnp.einsum("btf,fe->bte", attn, lp["wo"])
  h = rms_norm(x, lp["mlp_norm"], c.norm_eps, 0.0)
  gate = jax.nn.silu(jnp.einsum("bte,ef->btf", h, lp["w_gate"]))
  x = x + jnp.einsum("btf,fe->bte", gate * jnp.einsum("bte,ef->btf", h, lp["w_up"]), lp["w_down"])
  logits = jnp.einsum("bte,en->btn", rms_norm(x, p["final_norm"], c.norm_eps, 0.0), p["lm_head"],
                      preferred_element_type=jnp.float32)
  return logits, x


def head_forward(head: EagleHead, embed: jax.Array, tokens: jax.Array, features: jax.Array,
                 starts: jax.Array, cache: KVCache | None = None):
  """Runs the head over a block of `T` pairs per row.

  Args:
    head: the head.
    embed: `[V, E]` the target's input embedding table.
    tokens: `[B, T]` int32; `tokens[:, j]` is the token that FOLLOWS the feature `features[:, j]`
      (or, with `embed=None`, `[B, T, E]` their embeddings: see `head_qkv`).
    features: `[B, T, E]` projected target features (`project_features`) or the head's own
      `hidden_out` of the previous step when drafting on.
    starts: `[B]` int32 slot (= position) of each row's first pair.
    cache: the head's one-layer cache, or None for a cache-free causal pass.

  Returns:
    `(draft_logits [B, T, N] float32, hidden_out [B, T, E], cache)`: logits for the token after
    `tokens[:, j]`; `hidden_out[:, j]` the head's guess of the target feature at the position of
    `tokens[:, j]` (fed back with the next token); the cache with the block written at
    `starts .. starts + T - 1` and `lengths = starts + T` (None if no cache was given).
  """
  c = head.config
  b, t = tokens.shape[:2]
  if features.shape != (b, t, c.embed_dim):
    raise ValueError(f"features must be [B, T, E] = {(b, t, c.embed_dim)}, got {features.shape}")
  starts = jnp.asarray(starts, jnp.int32)
  q_pos = starts[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
  q, k, v = head_qkv(head, embed, tokens, features, q_pos)
  segments = [(k.swapaxes(1, 2), v.swapaxes(1, 2), q_pos, None)]  # the block itself, causally
  if cache is not None:
    slot_pos = jnp.broadcast_to(jnp.arange(cache.max_len, dtype=jnp.int32), (b, cache.max_len))
    slot_valid = (slot_pos < starts[:, None])[:, None, :]  # [B, 1, S]
    segments.insert(0, (cache.k[0], cache.v[0], slot_pos, slot_valid))  # [B, KVH, S, D]
  attn = attention(q, segments, q_pos, jnp.int32(0), c.layer_config)
  logits, hidden_out = head_finish(head, features, attn)
  if cache is not None:
    cache = KVCache(write_stacked(cache.k, k[None], starts),
                    write_stacked(cache.v, v[None], starts), starts + t)
  return logits, hidden_out, cache


def to_target_logits(head: EagleHead, draft_logits: jax.Array) -> jax.Array:
  """Draft-vocabulary logits `[..., N]` -> target-vocabulary logits `[..., V]`, `-inf` outside."""
  full = jnp.full(draft_logits.shape[:-1] + (head.config.vocab_size,), -jnp.inf,
                  draft_logits.dtype)
  return full.at[..., head.draft_ids].set(draft_logits)


# ---------------------------------------------------------------------------------------------
# Save / load


def _abstract(config: HeadConfig) -> dict:
  """The params tree of a head with `config`, as `ShapeDtypeStruct`s (float32)."""
  c = config
  e, d, f, n = c.embed_dim, c.head_dim, c.mlp_dim, c.draft_vocab_size
  s = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)
  return {"fc": s(c.num_taps * e, e), "input_norm": s(e), "hidden_norm": s(e),
          "layer": {"wq": s(2 * e, c.num_heads * d), "wk": s(2 * e, c.num_kv_heads * d),
                    "wv": s(2 * e, c.num_kv_heads * d), "wo": s(c.num_heads * d, e),
                    "mlp_norm": s(e), "w_gate": s(e, f), "w_up": s(e, f), "w_down": s(f, e)},
          "final_norm": s(e), "lm_head": s(e, n), "d2t": s(n, dtype=jnp.int32),
          **({"parallel_embed": s(c.parallel, e), "parallel_feature": s(c.parallel, e)}
             if c.parallel else {})}


def config_to_dict(config: HeadConfig) -> dict:
  return {**dataclasses.asdict(config), "taps": list(config.taps)}


def config_from_dict(data: dict) -> HeadConfig:
  known = {f.name for f in dataclasses.fields(HeadConfig)}
  unknown = sorted(set(data) - known)
  if unknown:
    raise ValueError(f"unknown HeadConfig fields {unknown}")
  return HeadConfig(**{**data, "taps": tuple(data.get("taps", ()))})


def save_head(head: EagleHead, path: str | os.PathLike, *, overwrite: bool = False,
              dtype=None) -> pathlib.Path:
  """Saves a head (Orbax, config in the metadata record); `dtype` casts the float weights."""
  if not isinstance(head, EagleHead):
    raise ValueError(f"save_head expects an EagleHead, got {type(head).__name__}")
  if dtype is not None:
    head = head.astype(dtype)
  dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(head.params) if x.dtype != jnp.int32})
  return save_tree(path, head.params, {"kind": HEAD_KIND, "config": config_to_dict(head.config),
                                       "dtype": dtypes[0]}, overwrite=overwrite)


def _head_metadata(path: pathlib.Path, kind: str, name: str, a_name: str) -> dict:
  """The metadata of the checkpoint at `path`: FileNotFoundError without a directory, ValueError
  where it records none or a kind other than `kind` (the messages call it `name` / `a_name`)."""
  if not path.is_dir():
    raise FileNotFoundError(f"no {name} checkpoint directory at {path}")
  metadata = read_tree_metadata(path)
  if metadata.get("kind") != kind:
    raise ValueError(f"{path} is not {a_name} checkpoint (kind {metadata.get('kind')!r})")
  return metadata


def load_head(path: str | os.PathLike, dtype=jnp.float32) -> EagleHead:
  """Loads a head written by `save_head`, float weights cast to `dtype`.

  Raises:
    FileNotFoundError: no directory at `path`.
    ValueError: not a head checkpoint, or an incomplete/corrupt one.
  """
  path = pathlib.Path(path)
  metadata = _head_metadata(path, HEAD_KIND, "head", "an EAGLE/MTP head")
  config = config_from_dict(metadata["config"])
  stored = jnp.dtype(metadata.get("dtype", "float32"))
  abstract = jax.tree.map(
      lambda s: s if s.dtype == jnp.int32 else jax.ShapeDtypeStruct(s.shape, stored),
      _abstract(config))
  params, _ = restore_tree(path, abstract)
  return EagleHead(params, config).astype(dtype)
