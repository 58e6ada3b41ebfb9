"""The built-in decoder: Llama, Mistral, Qwen2/3 and Gemma 2/3 from one config.

Models are plain registered dataclasses rather than Flax modules. A `Model` is a pytree whose leaves
are the weights (a nested dict; see the two layer layouts below) and whose
static part is the hashable `ModelConfig`. That keeps three things simple that speculative decoding
leans on: a model crosses `jax.jit` as an ordinary argument (weights are never baked into the HLO),
sharding is a tree map over parameter names, and the forward pass is a pure function that takes the
cache in and gives it back. Flax NNX and Linen models plug in through `specjax.models.adapter`.

The forward pass handles a block of `T` tokens per row starting at per-row offsets. Queries attend
causally within the block and to every cache slot before their own position; slots at or past a
row's position are masked, so stale entries left behind by a rollback are never read.

Two layouts of the same weights, same math: *stacked* (`params["layers"]` a dict of `[L, ...]`
arrays, one `lax.scan`, a `[L, B, KVH, S, D]` cache): one compiled layer body and a `layers` axis
to shard, right for TPU/GPU; and *unstacked* (`model.unstacked()`: a tuple of per-layer dicts, an
unrolled loop, a tuple of per-layer `[B, KVH, S, D]` cache buffers updated in place): on XLA:CPU
the scan copies every layer's weights out of the stacked arrays on every step, the loop does not.
On CPU the unstacked layers also fuse their projections (`with_fused_projections`: one q/k/v and
one gate/up matrix per layer), since a batch-1 step is a chain of small matrix-vector products.
`model.for_platform()` picks one once, at load. The forward pass reads the same for every layout:
how a weight lies is its leaf type (a float array, a quantized weight, the CPU layout's panels or
row-major copies), and `specjax.models.weights` dispatches each product on it.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.kernels.cpu import kernel as cpu_gemv
from specjax.core.cache import KVBlock, KVCache, head_pack
from specjax.models.cache_write import write_stacked
from specjax.models.cpu import layout as cpu_layout
from specjax.models.cpu import panels as panel_layout
from specjax.models import quant
from specjax.models import weights
from specjax.parallel.rules import (CACHE_AXES, KEY_VALUE_AXES, LOGITS_AXES, MLP_AXES,
                                    QUERY_AXES, RESIDUAL_AXES, constrain)
from specjax.models.config import ModelConfig
from specjax.models.layers import (_mlp_activation, _softcap, apply_rope, attention, rms_norm,
                                   rope_inv_freq, rope_tables)

__all__ = ["ForwardOutput", "Model", "apply_rope", "attention", "check_taps", "forward",
           "init_params", "rms_norm", "rope_inv_freq", "rope_tables"]

# A stacked model's cache slots are a multiple of this (`Model.init_cache`): the TPU write
# kernel's alignment for 8-, 16- and 32-bit caches (`specjax.kernels.kv_write.alignment`).
CACHE_SLOT_MULTIPLE = 32


class ForwardOutput(NamedTuple):
  """What a target forward returns (the model protocol every drafter and loop codes against).

  Attributes:
    logits: `[B, T, V]` float32.
    hidden: `[B, T, E]` final hidden states (after the last norm) when asked, else None.
    taps: `[n, B, T, E]` the residual stream entering each requested layer, else None.
    cache: the updated cache (`lengths = starts + T`), or None for a cache-free pass or a
      deferred write.
    block_kv: with `write_cache=False`, the block's keys/values (`specjax.core.cache.KVBlock`) for
      the caller to write (`specjax.core.cache.write_kv_block`); else None.
  """

  logits: jax.Array
  hidden: jax.Array | None = None
  taps: jax.Array | None = None
  cache: KVCache | None = None
  block_kv: KVBlock | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Model:
  """A decoder-only language model: weights (pytree leaves) plus architecture (static).

  Attributes:
    params: nested dict of weights; per-layer weights `params["layers"]` are either stacked on a
      leading `num_layers` axis (a dict of arrays, run by `lax.scan`) or a tuple of per-layer
      dicts (run by an unrolled loop; see `unstacked`). Both give the same numbers.
    config: the architecture; hashable, so it is part of the jit cache key.
    cpu_kernel: whether the CPU layout's products go through the hand-written kernel
      `specjax.kernels.cpu.kernel` rather than XLA's dot (same products up to float32 summation
      order): weights in panels (`specjax.models.cpu.panels`) at every block size, row-major ones
      (`specjax.models.cpu.rows`) in blocks of up to `rows.KERNEL_ROWS` rows; the forward pass
      reads it through `specjax.models.weights.Ops`. Static, so a model with and one without it
      compile apart; `with_fused_projections` turns it on where the kernel builds.
  """

  params: dict
  config: ModelConfig = dataclasses.field(metadata=dict(static=True))
  cpu_kernel: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def max_len(self) -> int:
    return self.config.max_len

  # Rotary positions are computed, not looked up: a call past `max_len` (a round's drafts near the
  # end of the context, never emitted) stays finite, so `decode` runs to the full context.
  finite_past_max_len = True

  @property
  def dtype(self):
    return self.params["embed"].dtype

  def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache of at least `max_len` slots per row. A stacked model's (the layout TPU
    runs) holds `max_len` rounded up to a multiple of `CACHE_SLOT_MULTIPLE`, so that its writes
    take the TPU write kernel's aligned windows (`specjax.models.cache_write`); the extra slots
    are never valid, so they are masked like any unwritten slot. It also stores heads narrower
    than 128 lanes two or more to a row (`specjax.core.cache.head_pack`: no lane padding on
    TPU)."""
    cfg = self.config
    if cfg.per_layer_only:  # one buffer per layer with keys and values of its own, its own shape
      return KVCache.create_layers(
          [(cfg.layer_kv_heads(i), cfg.layer_head_dim(i)) for i in range(cfg.num_cache_layers)],
          batch, max_len, dtype or self.dtype)
    if self.is_stacked:
      max_len = -(-max_len // CACHE_SLOT_MULTIPLE) * CACHE_SLOT_MULTIPLE
    pack = head_pack(cfg.num_kv_heads, cfg.head_dim) if self.is_stacked else 1
    return KVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim,
                          dtype or self.dtype, per_layer=not self.is_stacked, pack=pack)

  def __call__(self, tokens, starts, cache=None, *, taps=(), return_hidden=False,
               positions=None, block_mask=None, write_cache=True,
               logits_at=None) -> ForwardOutput:
    return forward(self, tokens, starts, cache, taps=taps, return_hidden=return_hidden,
                   positions=positions, block_mask=block_mask, write_cache=write_cache,
                   logits_at=logits_at)

  @property
  def defers_cache_writes(self) -> bool:
    """This model's forward takes `write_cache=False` (the verify switch relies on it)."""
    return True

  @property
  def selects_logit_rows(self) -> bool:
    """This model's forward takes `logits_at` (a prefill then scores only the rows it samples)."""
    return True

  @property
  def is_stacked(self) -> bool:
    """Whether per-layer weights are stacked on a leading axis (run by `lax.scan`)."""
    return not isinstance(self.params["layers"], (tuple, list))

  def unstacked(self) -> "Model":
    """The same model with `params["layers"]` a tuple of per-layer weight dicts, run by an
    unrolled Python loop: each layer's weights are their own buffers, so no step slices them out
    of a stacked array (on XLA:CPU the scan copies every layer's weights every step). Same math."""
    if not self.is_stacked:
      return self
    layers = self.params["layers"]
    per_layer = tuple({name: jax.tree.map(lambda w: w[i], w) for name, w in layers.items()}
                      for i in range(self.config.num_layers))
    return dataclasses.replace(self, params=dict(self.params, layers=per_layer))

  def stacked(self) -> "Model":
    """The same model with per-layer weights stacked on a leading `num_layers` axis (one
    `lax.scan` over layers: one compiled layer body, and a `layers` axis to shard)."""
    if self.is_stacked:
      return self
    if self.config.per_layer_only:
      raise ValueError(f"{self.config.family}: the layers differ in shape or wiring (per-layer "
                       "head widths, KV sharing, per-layer embeddings), so this model runs only "
                       "in the unstacked layout")
    params = self.without_fused_projections().params
    layers = params["layers"]
    stacked = {name: jax.tree.map(lambda *ws: jnp.stack(ws), *[lp[name] for lp in layers])
               for name in layers[0]}
    return dataclasses.replace(self, params=dict(params, layers=stacked), cpu_kernel=False)

  def for_platform(self, platform: str | None = None) -> "Model":
    """The layout that runs fastest on `platform` (default: JAX's default backend): on CPU
    unstacked layers with fused projections (`with_fused_projections`), and, where the CPU kernel
    is not built, an `[E, V]` copy of a tied output projection (`with_output_copy`); elsewhere
    stacked layers (`lax.scan`: TPU/GPU compile time, sharding) and no copy."""
    platform = platform or jax.default_backend()
    if self.config.per_layer_only:  # the unstacked layout is its only one
      model = self.unstacked()
      return model.with_output_copy() if platform == "cpu" else model.without_output_copy()
    if platform == "cpu":
      fused = self.unstacked().with_fused_projections()
      # The kernel reads a tied embedding's panels as the output projection; XLA's dot wants the
      # `[E, V]` copy.
      return fused if fused.cpu_kernel else fused.with_output_copy()
    return self.stacked().without_output_copy()

  def with_fused_projections(self, cpu_kernel: bool | None = None) -> "Model":
    """An unstacked model in the CPU layout (`specjax.models.cpu.layout`): per layer, the
    query/key/value projections fused into one matrix and gate/up into one, each kept once. Same
    math; `stacked()` and `without_fused_projections()` restore the canonical weights.

    `cpu_kernel` (default: whether `specjax.kernels.cpu.kernel` builds on this machine) keeps the
    projections, and a tied model's embedding (its output projection), in the kernel's panels
    (`specjax.models.cpu.panels`), read by the kernel at every block size; False keeps row-major
    `[out, in]` copies for XLA's dot. Weights in 2 MiB pages (`cpu_layout.fuse_params`)."""
    if self.is_stacked:
      raise ValueError("with_fused_projections needs the unstacked layout (call unstacked() first)")
    if self.config.per_layer_only:
      raise ValueError(f"{self.config.family}: fused projections are not built for layers that "
                       "differ in shape; use the unstacked layout as it is")
    if cpu_kernel is None:
      cpu_kernel = cpu_gemv.available()
    return dataclasses.replace(self, params=cpu_layout.fuse_params(self.params, bool(cpu_kernel)),
                               cpu_kernel=bool(cpu_kernel))

  def without_fused_projections(self) -> "Model":
    """Splits fused projections (see `with_fused_projections`) back into their named parts."""
    if self.is_stacked:
      return self
    return dataclasses.replace(self, params=cpu_layout.split_params(self.params, self.config),
                               cpu_kernel=False)

  def with_output_copy(self) -> "Model":
    """A tied model with `params["lm_head"] = embed.T` materialised (same logits up to float32
    summation order). XLA:CPU contracts `[B, T, E] x [E, V]` faster than the embedding as it lies
    (`[V, E]`, contracting its minor axis; docs/benchmarks.md, "The tied output projection's
    `[E, V]` copy"); it costs one more `V x E` buffer."""
    if (not self.config.tie_embeddings or "lm_head" in self.params
        or quant.is_quantized(self.params["embed"])):  # a quantized table is read as it lies
      return self
    lm_head = jnp.asarray(panel_layout.dense(self.params["embed"])).T.copy()
    return dataclasses.replace(self, params=dict(self.params, lm_head=lm_head))

  def without_output_copy(self) -> "Model":
    """Drops the `[E, V]` copy of a tied model's output projection (see `with_output_copy`)."""
    if not self.config.tie_embeddings or "lm_head" not in self.params:
      return self
    return dataclasses.replace(self, params={k: v for k, v in self.params.items() if k != "lm_head"})

  def astype(self, dtype) -> "Model":
    """The same model with floating-point weights cast to `dtype`."""
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return dataclasses.replace(self, params=jax.tree.map(cast, self.params))


def init_params(config: ModelConfig, rng: jax.Array, dtype=jnp.float32) -> Model:
  """Random initialisation (scaled normal), the starting point for training and for tests."""
  c = config
  e, d, L = c.embed_dim, c.head_dim, c.num_layers
  keys = iter(jax.random.split(rng, 16))

  def dense(shape, fan_in):
    return (jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

  norm_init = jnp.zeros if c.norm_offset else jnp.ones
  layers = {
      "attn_norm": norm_init((L, e), dtype),
      "wq": dense((L, e, c.num_heads * d), e),
      "wk": dense((L, e, c.num_kv_heads * d), e),
      "wv": dense((L, e, c.num_kv_heads * d), e),
      "wo": dense((L, c.num_heads * d, e), c.num_heads * d * 2 * L),
      "mlp_norm": norm_init((L, e), dtype),
      "w_gate": dense((L, e, c.mlp_dim), e),
      "w_up": dense((L, e, c.mlp_dim), e),
      "w_down": dense((L, c.mlp_dim, e), c.mlp_dim * 2 * L),
  }
  if c.qkv_bias:
    layers["bq"] = jnp.zeros((L, c.num_heads * d), dtype)
    layers["bk"] = jnp.zeros((L, c.num_kv_heads * d), dtype)
    layers["bv"] = jnp.zeros((L, c.num_kv_heads * d), dtype)
  if c.qk_norm:
    layers["q_norm"] = norm_init((L, d), dtype)
    layers["k_norm"] = norm_init((L, d), dtype)
  if c.post_norms:
    layers["post_attn_norm"] = norm_init((L, e), dtype)
    layers["post_mlp_norm"] = norm_init((L, e), dtype)
  params = {
      "embed": dense((c.vocab_size, e), e),
      "layers": layers,
      "final_norm": norm_init((e,), dtype),
  }
  if not c.tie_embeddings:
    params["lm_head"] = dense((e, c.vocab_size), e)
  if c.per_layer_only:  # one dict per layer, each of its own shapes
    params["layers"] = tuple(_layer_params(c, i, jax.random.fold_in(rng, i), dtype)
                             for i in range(L))
  if c.per_layer_input_dim:
    width = L * c.per_layer_input_dim
    params["embed_per_layer"] = dense((c.per_layer_vocab_size, width), c.per_layer_input_dim)
    params["per_layer_projection"] = dense((e, width), e)
    params["per_layer_norm"] = norm_init((c.per_layer_input_dim,), dtype)
  return Model(params, config)


def layer_param_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
  """The weight shapes of one layer of a `per_layer_only` config (`[in, out]` projections)."""
  c = config
  e, d, kvh, f = c.embed_dim, c.layer_head_dim(layer), c.layer_kv_heads(layer), c.layer_mlp_dim(layer)
  shapes = {"attn_norm": (e,), "wq": (e, c.num_heads * d), "wo": (c.num_heads * d, e),
            "mlp_norm": (e,), "w_gate": (e, f), "w_up": (e, f), "w_down": (f, e)}
  if c.kv_source(layer) == layer:
    shapes.update(wk=(e, kvh * d), wv=(e, kvh * d))
  if c.qkv_bias:
    shapes["bq"] = (c.num_heads * d,)
    if c.kv_source(layer) == layer:
      shapes.update(bk=(kvh * d,), bv=(kvh * d,))
  if c.qk_norm:
    shapes["q_norm"] = (d,)
    if c.kv_source(layer) == layer:
      shapes["k_norm"] = (d,)
  if c.post_norms:
    shapes.update(post_attn_norm=(e,), post_mlp_norm=(e,))
  if c.per_layer_input_dim:
    p = c.per_layer_input_dim
    shapes.update(ple_gate=(e, p), ple_proj=(p, e), ple_norm=(e,))
  if c.layer_scalar:
    shapes["layer_scalar"] = (1,)
  return shapes


def _layer_params(config: ModelConfig, layer: int, rng: jax.Array, dtype) -> dict:
  """Random weights of one layer of a `per_layer_only` config."""
  shapes = layer_param_shapes(config, layer)
  keys = dict(zip(shapes, jax.random.split(rng, len(shapes))))
  out = {}
  for name, shape in shapes.items():
    if len(shape) == 2:
      out[name] = (jax.random.normal(keys[name], shape, jnp.float32)
                   / math.sqrt(shape[0])).astype(dtype)
    elif name == "layer_scalar" or not config.norm_offset:
      out[name] = jnp.ones(shape, dtype)
    else:
      out[name] = jnp.zeros(shape, dtype)
  return out


def _per_layer_inputs(ops, params: dict, c: ModelConfig, tokens: jax.Array,
                      embedded: jax.Array) -> jax.Array:
  """Gemma 4's per-layer inputs `[B, T, L, P]`: the token's per-layer embedding (scaled by
  `sqrt(P)`) plus the normed projection of the (scaled) input embedding, times `2 ** -0.5`."""
  b, t = tokens.shape
  shape = (b, t, c.num_layers, c.per_layer_input_dim)
  token_part = weights.embed(params["embed_per_layer"], tokens)
  token_part = token_part * jnp.asarray(math.sqrt(c.per_layer_input_dim), token_part.dtype)
  context = ops.matmul(embedded, params["per_layer_projection"]) * (c.embed_dim ** -0.5)
  context = rms_norm(context.reshape(shape), params["per_layer_norm"], c.norm_eps, c.norm_offset)
  return (context + token_part.reshape(shape)) * (2.0 ** -0.5)


def check_taps(taps, num_layers: int) -> tuple[int, ...]:
  """`taps` as a tuple of ints in `0..num_layers`; ValueError (before tracing) otherwise."""
  try:
    taps = tuple(operator.index(i) for i in taps)
  except TypeError:
    raise ValueError(f"taps must be a sequence of layer indices, got {taps!r}") from None
  bad = [i for i in taps if not 0 <= i <= num_layers]
  if bad:
    raise ValueError(f"taps must lie in 0..{num_layers} (num_layers), got {bad}")
  return taps


def forward(model: Model, tokens: jax.Array, starts: jax.Array, cache: KVCache | None = None,
            *, taps=(), return_hidden: bool = False, positions: jax.Array | None = None,
            block_mask: jax.Array | None = None, write_cache: bool = True,
            logits_at: jax.Array | None = None) -> ForwardOutput:
  """Runs the decoder on a block of tokens per row.

  Args:
    model: the model.
    tokens: `[B, T]` int32 token ids.
    starts: `[B]` int32 position of each row's first token (its cache offset).
    cache: the KV cache, or None for a cache-free causal pass over `tokens` (training).
    taps: layer indices `i` in `0..L` whose incoming residual stream to return (`i == L` is the
      stream after the last layer, before the final norm), in the order given.
    return_hidden: also return the final hidden states (for draft heads).
    positions: `[B, T]` int32 position of each block token (default `starts + arange(T)`); a draft
      tree scores its nodes at `starts + depth`.
    block_mask: `[B, T, T]` bool, which block tokens each block token may see (a tree's ancestor
      mask); default causal. The cache before `starts` stays visible to every token.
    write_cache: False leaves the cache unwritten (it is only read) and returns the block's
      keys/values as `block_kv` instead: a forward inside one branch of a `lax.switch` then never
      updates the cache there, which would make XLA copy every layer's buffer into the branch.
    logits_at: `[B, n]` int32 block indices: only those rows go through the output projection
      (`logits` is then `[B, n, V]`; `hidden` and `taps` stay whole). A prefill that samples from
      its last prompt token reads the projection once instead of once per prompt token.

  Returns:
    `ForwardOutput(logits [B, T, V] float32, hidden [B, T, E] or None, taps [n, B, T, E] or None,
    cache)`, where the returned cache holds the block's keys/values at slots
    `starts .. starts + T - 1` and `lengths = starts + T`.
  """
  c = model.config
  ops = weights.Ops.of(model)  # each weight's product, by its leaf type (`specjax.models.weights`)
  p = model.params
  taps = check_taps(taps, c.num_layers)
  b, t = tokens.shape
  # A prefill inside jit starts at a constant 0: the masks over the empty cache are then
  # compile-time constants that XLA folds with its slow evaluator (a reduce per layer, minutes for a
  # batch of 64 on CPU). The barrier keeps the positions opaque; it costs nothing at run time.
  starts = jax.lax.optimization_barrier(jnp.asarray(starts, jnp.int32))
  q_pos = starts[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
  if positions is not None:
    q_pos = jnp.asarray(positions, jnp.int32)

  x = weights.embed(p["embed"], tokens)
  if c.scale_embeddings:
    x = x * jnp.asarray(math.sqrt(c.embed_dim), x.dtype)
  x = constrain(x, RESIDUAL_AXES)  # constrain() is a no-op unless a mesh is active

  global_rope = rope_tables(q_pos, rope_inv_freq(c.global_head_dim or c.head_dim, c.rope_theta,
                                                  c.rope_scaling))
  local_theta = c.rope_local_theta or c.rope_theta
  local_rope = rope_tables(q_pos, rope_inv_freq(c.head_dim, local_theta,
                                                 None if c.rope_local_theta else c.rope_scaling))
  per_layer_inputs = None
  if c.per_layer_input_dim:  # Gemma 4's per-layer embeddings: `[B, T, L, P]`
    per_layer_inputs = _per_layer_inputs(ops, p, c, tokens, x)

  unstacked = not model.is_stacked
  if cache is None:
    cache_k = cache_v = slot_pos = slot_valid = None
  else:
    # Work in the model's cache layout (per-layer buffers for an unrolled model, stacked for the
    # scan); a cache in the other layout is converted here and back at the end (a copy).
    work = cache.unstacked() if unstacked else cache.stacked()
    if unstacked:
      cache_k = tuple(constrain(k, CACHE_AXES[1:]) for k in work.k)
      cache_v = tuple(constrain(v, CACHE_AXES[1:]) for v in work.v)
    else:
      cache_k, cache_v = constrain(work.k, CACHE_AXES), constrain(work.v, CACHE_AXES)
    slot_pos = jnp.broadcast_to(jnp.arange(cache.max_len, dtype=jnp.int32), (b, cache.max_len))
    # Cache slots before a row's start hold earlier tokens; the rest is stale or empty.
    slot_valid = (slot_pos < starts[:, None])[:, None, :]  # [B, 1, S]

  def block(x, lp, window, layer_k, layer_v, layer=None, shared_kv=None, per_layer_input=None,
            stacked_cache=None):
    # `layer` (the unrolled loop's index) gives a `per_layer_only` model's per-layer head width
    # and RoPE; `shared_kv` is the block's `(k, v)` of the layer a KV-shared layer attends.
    h = rms_norm(x, lp["attn_norm"], c.norm_eps, c.norm_offset)

    def project_out(a, name, post_norm):  # an output projection, then its post-norm if any
      out = ops.output(a, lp, name)
      return rms_norm(out, lp[post_norm], c.norm_eps, c.norm_offset) if c.post_norms else out

    if layer is None or not c.per_layer_only:
      head_dim, kv_heads = c.head_dim, c.num_kv_heads
      is_local = window > 0
      sin = jnp.where(is_local, local_rope[0], global_rope[0])
      cos = jnp.where(is_local, local_rope[1], global_rope[1])
    else:
      head_dim, kv_heads = c.layer_head_dim(layer), c.layer_kv_heads(layer)
      sin, cos = local_rope if not c.is_global(layer) else global_rope
    if shared_kv is None:
      q, k, v = ops.qkv(h, lp, c)
      k = k.reshape(b, t, kv_heads, head_dim)
      v = v.reshape(b, t, kv_heads, head_dim)
    else:
      q = ops.query(h, lp)
    q = q.reshape(b, t, c.num_heads, head_dim)
    if c.qk_norm:
      q = rms_norm(q, lp["q_norm"], c.norm_eps, c.norm_offset)
    if c.qk_norm and shared_kv is None:
      k = rms_norm(k, lp["k_norm"], c.norm_eps, c.norm_offset)
    if c.v_norm and shared_kv is None:  # a norm without a scale
      v = rms_norm(v, jnp.ones((), jnp.float32), c.norm_eps, 0.0)
    q = apply_rope(constrain(q, QUERY_AXES), sin, cos)
    if shared_kv is None:
      k, v = constrain(k, KEY_VALUE_AXES), constrain(v, KEY_VALUE_AXES)
      k = apply_rope(k, sin, cos)
    else:
      k, v = shared_kv
    segments = [(k.swapaxes(1, 2), v.swapaxes(1, 2), q_pos, block_mask)]  # the block, causally
    if layer_k is not None:
      segments.insert(0, (layer_k, layer_v, slot_pos, slot_valid))
    # The block is causal over itself unless a tree's mask or positions say otherwise.
    attn = ops.attention(q, segments, q_pos, window, c,
                         causal_block=block_mask is None and positions is None,
                         stacked_cache=stacked_cache)
    x = x + project_out(attn, "wo", "post_attn_norm")
    h = rms_norm(x, lp["mlp_norm"], c.norm_eps, c.norm_offset)
    gate, up = ops.gate_up(h, lp, c)
    hidden = constrain(_mlp_activation(gate, c.activation) * up, MLP_AXES)
    x = x + project_out(hidden, "w_down", "post_mlp_norm")
    if per_layer_input is not None:  # Gemma 4's per-layer embedding enters the residual stream
      gate = _mlp_activation(ops.matmul(x, lp["ple_gate"]), c.activation) * per_layer_input
      x = x + rms_norm(ops.matmul(gate, lp["ple_proj"]), lp["ple_norm"], c.norm_eps,
                       c.norm_offset)
    if c.layer_scalar:
      x = x * lp["layer_scalar"].astype(x.dtype)
    return constrain(x, RESIDUAL_AXES), k, v, attn

  layers = p["layers"]
  inner = sorted({i for i in taps if i < c.num_layers})  # taps taken inside the loop
  tapped = {}
  new_cache = block_kv = None
  if unstacked:  # one weight dict and one cache buffer per layer, an unrolled Python loop
    # Each layer reads its own cache buffer and writes its block into it after attending (the
    # block itself is attended as its own segment), so every buffer is updated in place.
    # A KV-shared layer (`config.kv_source`) attends its source layer's buffer as that layer left
    # it (written or not: the new slots lie past `starts`, masked) and its block's keys/values.
    new_k, new_v = [], []
    blocks = {}
    for i, (lp, window) in enumerate(zip(layers, c.layer_windows())):
      if i in inner:
        tapped[i] = x
      source = c.kv_source(i)
      current_k = new_k if cache is not None and write_cache and source != i else cache_k
      current_v = new_v if cache is not None and write_cache and source != i else cache_v
      layer_kv = (None, None) if cache is None else (current_k[source], current_v[source])
      layer_input = None if per_layer_inputs is None else per_layer_inputs[:, :, i]
      x, k, v, attn = block(x, lp, jnp.int32(window), *layer_kv, layer=i,
                            shared_kv=blocks.get(source) if source != i else None,
                            per_layer_input=layer_input)
      if source != i:  # a KV-shared layer writes nothing
        continue
      blocks[i] = (k, v)
      if cache is not None and not write_cache:
        new_k.append(k)
        new_v.append(v)
      elif cache is not None:  # written after the layer's attention has read the buffer
        written_k, written_v = cpu_layout.write_after(attn, layer_kv, (k, v), starts)
        new_k.append(constrain(written_k, CACHE_AXES[1:]))
        new_v.append(constrain(written_v, CACHE_AXES[1:]))
    if cache is not None and not write_cache:
      block_kv = KVBlock(tuple(new_k), tuple(new_v))
    elif cache is not None:
      new_cache = KVCache(tuple(new_k), tuple(new_v), starts + t)
  else:  # stacked: one lax.scan over the leading layer axis
    # The cache is only read inside the scan; each layer's new keys/values come out as a small
    # [L, B, T, KVH, D] block that is written once, after the scan, in place.
    # Requested taps go into a small [n, B, T, E] carry: slot n (out of range) drops the write.
    slots = jnp.asarray([inner.index(i) if i in inner else len(inner)
                         for i in range(c.num_layers)], jnp.int32)
    # The stacked cache is a loop invariant and each layer indexes it: a custom call that reads
    # the cache (TPU's cache attention, `specjax.models.layers`) then takes the whole buffer and
    # the layer index, where a per-layer slice (a scanned-over input) could be copied into its own
    # buffer.
    def scan_body(carry, xs):
      x, buffer = carry
      lp, window, slot, layer = xs
      if inner:
        buffer = buffer.at[slot].set(x, mode="drop")
      layer_k = layer_v = stacked = None
      if cache_k is not None:
        layer_k = jax.lax.dynamic_index_in_dim(cache_k, layer, keepdims=False)
        layer_v = jax.lax.dynamic_index_in_dim(cache_v, layer, keepdims=False)
        stacked = (cache_k, cache_v, layer, starts)
      x, k, v, _ = block(x, lp, window, layer_k, layer_v, stacked_cache=stacked)
      return (x, buffer), (k, v)
    buffer = jnp.zeros((len(inner),) + x.shape, x.dtype)
    windows = jnp.asarray(c.layer_windows(), jnp.int32)
    (x, buffer), (block_k, block_v) = jax.lax.scan(
        scan_body, (x, buffer), (layers, windows, slots, jnp.arange(c.num_layers,
                                                                    dtype=jnp.int32)))
    tapped = {i: buffer[n] for n, i in enumerate(inner)}
    if cache is not None and not write_cache:
      block_kv = KVBlock(block_k, block_v)
    elif cache is not None:
      new_k = constrain(write_stacked(cache_k, block_k, starts), CACHE_AXES)
      new_v = constrain(write_stacked(cache_v, block_v, starts), CACHE_AXES)
      new_cache = KVCache(new_k, new_v, starts + t)
  if new_cache is not None and new_cache.per_layer != cache.per_layer:
    new_cache = new_cache.unstacked() if cache.per_layer else new_cache.stacked()
  tapped[c.num_layers] = x
  tap_out = jnp.stack([tapped[i] for i in taps]) if taps else None

  x = rms_norm(x, p["final_norm"], c.norm_eps, c.norm_offset)
  normed = x
  if logits_at is not None:
    x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32)[..., None], axis=1)
  logits = constrain(_softcap(ops.logits(x, p, c), c.final_logit_softcap), LOGITS_AXES)
  return ForwardOutput(logits, normed if return_hidden else None, tap_out, new_cache, block_kv)
