"""Quantized weights as a leaf type, and `quantize(model)`.

A `QuantizedWeight` replaces one float matrix of a `specjax.Model`: symmetric integers per group of
`group` input columns (int8, or int4 packed two to a byte) and one float32 scale per group,
stored `[..., out, in]` so that each group is contiguous. It knows its own product
(`QuantizedWeight.matmul`): on CPU the hand-written kernel (`specjax.kernels.cpu.kernel`) reads the
integers at their narrow width, so a batch-1 step reads 1/4 (int8) or about 1/7 (int4) of the
float32 bytes, and quantizes the rows of x per group too (integer dot products; where the kernel
is not built, `cpu_gemv.quant_reference` does the same arithmetic in jnp); on TPU/GPU the product
is `einsum(x, dequantize(w))` with float x, whose convert and scale XLA fuses into the dot.
No float copy of the weights is kept. The layer body does not branch on the backend or the leaf
type: `specjax.models.weights` dispatches its products on the leaf it holds.

Quantization: per group, `scale = max|w| / (2^(bits-1) - 1)`, `q = round(w / scale)` (int8:
-127..127; int4: -7..7, stored as q + 8). Asymmetric int4 (`asymmetric=True`) adds a float32
offset per group: `w = scale * q + offset` with `q` in -8..7, `scale = (max w - min w) / 15`, so
a group's sixteen levels span its own range. That is the shape of the 4-bit GGUF blocks with a
minimum (Q4_1, and Q4_K's 32-weight sub-blocks): a weight dequantized from one of those is
reproduced up to float32 rounding, so the copy of a model shipped at 4 bits reads the same 4-bit
values the target was built from. It costs one more float per group (6 bits a weight at group 32,
against 5 symmetric). Exactness of speculative decoding does not depend on it:
a quantized copy of the target is a draft model like any other, whose q is its own distribution.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax.kernels.cpu import kernel as cpu_gemv
from specjax.models.cpu import host_memory
from specjax.models.cpu import panels
from specjax.models.cpu import rows

__all__ = ["BITS", "QuantizedWeight", "abstract_quantized", "dequantize_model", "is_quantized",
           "quantization_of", "quantize", "quantize_weight"]

BITS = (8, 4)  # supported widths


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A quantized `[..., out, in]` matrix (a pytree leaf type: `values` and `scales` are leaves).

  Attributes:
    values: int8 `[..., out, in]` (bits 8) or uint8 `[..., out, in / 2]` (bits 4: in each run of
      32 weights, byte j holds weight j in its low nibble and weight j + 16 in its high nibble,
      each stored as q + 8).
    scales: float32 `[..., out, in / group]`.
    bits: 8 or 4 (static).
    group: input columns per scale, a multiple of 32 (static).
    offsets: None, or (bits 4) float32 `[..., out, in / group]`: `w = scale * q + offset`.
  """

  values: jax.Array
  scales: jax.Array
  bits: int = dataclasses.field(metadata=dict(static=True))
  group: int = dataclasses.field(metadata=dict(static=True))
  offsets: jax.Array | None = None

  @property
  def in_features(self) -> int:
    return self.values.shape[-1] * (8 // self.bits)

  @property
  def shape(self) -> tuple[int, ...]:
    """The float matrix's shape, `[..., out, in]`."""
    return self.values.shape[:-1] + (self.in_features,)

  @property
  def dtype(self):
    return self.scales.dtype

  @property
  def nbytes(self) -> int:
    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(self))

  @property
  def asymmetric(self) -> bool:
    return self.offsets is not None

  def map_rows(self, fn) -> "QuantizedWeight":
    """The same matrix with `fn` applied to each leaf's `[..., out, :]` rows (every leaf keeps
    `out` at axis -2): a row selection, a reorder."""
    return jax.tree.map(fn, self)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The float `[..., out, in]` matrix these integers and scales stand for."""
    return cpu_gemv.dequantize(self.values, self.scales, bits=self.bits, group=self.group,
                               dtype=dtype, offsets=self.offsets)

  def matmul(self, x: jax.Array) -> jax.Array:
    """`x [..., in] -> [..., out]` (contracting `in`); a single (2-D) weight."""
    if self.values.ndim != 2:
      raise ValueError(f"matmul needs a single 2-D weight, got values {self.values.shape}")
    if x.shape[-1] != self.in_features:
      raise ValueError(f"x's last axis {x.shape[-1]} != the weight's input size "
                       f"{self.in_features}")
    return cpu_gemv.quant_matvec(x, self.values, self.scales, bits=self.bits, group=self.group,
                                 offsets=self.offsets)


def _check(bits, group, in_features: int | None = None, asymmetric: bool = False) -> None:
  if bits not in BITS:
    raise ValueError(f"bits must be one of {BITS} (int8 or int4), got {bits!r}")
  if asymmetric not in (True, False):
    raise ValueError(f"asymmetric must be a bool, got {asymmetric!r}")
  if asymmetric and bits != 4:
    raise ValueError(f"asymmetric quantization is int4 only (bits 4), got bits {bits}")
  if not isinstance(group, int) or group <= 0 or group % 32:
    raise ValueError(f"group must be a positive multiple of 32, got {group!r}")
  if in_features is not None and in_features % group:
    raise ValueError(f"group {group} does not divide the weight's input size {in_features}")


def quantize_weight(w, bits: int = 8, group: int = 32, *, asymmetric: bool = False
                    ) -> QuantizedWeight:
  """Quantizes a float `[..., out, in]` matrix (groups along `in`). Pure `jax.numpy` (one jitted
  program per shape and setting): it runs on concrete weights at load and on traced ones inside a
  caller's `jax.jit` (a policy's copy built in its own training or RL step) alike, and on CPU its
  integers, scales and offsets are bit for bit those of the same arithmetic in float32 numpy
  (IEEE division, round half to even; see `_divide`). `asymmetric` (int4): a scale and an offset
  per group (see the module docstring). Only shapes are validated, never values.

  Raises:
    ValueError: unsupported `bits`, a `group` that is not a positive multiple of 32, or one that
      does not divide `in`; `asymmetric` with bits 8.
  """
  if not isinstance(w, jax.Array):  # numpy or nested lists; a jax array or tracer stays as it is
    w = jnp.asarray(w)
  if w.ndim < 2:
    raise ValueError(f"quantize_weight needs a matrix, got shape {w.shape}")
  _check(bits, group, w.shape[-1], asymmetric)
  values, scales, offsets = _quantize_arrays(w, bits, group, asymmetric)
  return QuantizedWeight(values, scales, bits, group, offsets)


def _quantize_columns(w, bits: int, group: int, asymmetric: bool) -> QuantizedWeight:
  """`quantize_weight(w.T)` of a canonical `[..., in, out]` matrix, without a float transpose
  (`_quantize_arrays(columns=True)`)."""
  if not isinstance(w, jax.Array):
    w = jnp.asarray(w)
  _check(bits, group, w.shape[-2], asymmetric)
  values, scales, offsets = _quantize_arrays(w, bits, group, asymmetric, columns=True)
  return QuantizedWeight(values, scales, bits, group, offsets)


def _divide(a: jax.Array, b) -> jax.Array:
  """`a / b` (b broadcast to `a`'s shape) as IEEE float32 division: XLA's simplifier rewrites a
  division by a broadcast or a constant into a product with its reciprocal (`a * (1 / b)`), which
  rounds differently from the quotient in many cases (4-26% of the quotients measured on XLA:CPU),
  so the divisor is materialised behind an optimization barrier, where no rewrite sees it. Costs
  one temporary of `a`'s size."""
  return a / jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape))


@functools.partial(jax.jit, static_argnames=("bits", "group", "asymmetric", "columns"))
def _quantize_arrays(w, bits: int, group: int, asymmetric: bool, columns: bool = False):
  """`(values, scales, offsets or None)` of `quantize_weight` (arguments checked there).

  `columns`: `w` is `[..., in, out]` (a canonical weight) and the result is that of its
  transpose, `[..., out, in]`, with the same integers and scales. The groups are reduced and
  divided where they lie, and only the int8 integers and the scales are transposed: a float32
  transpose ahead of the arithmetic took about 2.5 times as long on XLA:CPU as this path (a
  policy's int8 copy rebuilt at every weight version, inside an RL step)."""
  w = w.astype(jnp.float32)
  top = 2 ** (bits - 1) - 1  # 127 or 7
  axis = -2 if columns else -1  # the axis the groups run along, in `w`
  shape = w.shape
  grouped = (w.reshape(shape[:-2] + (shape[-2] // group, group, shape[-1])) if columns
             else w.reshape(shape[:-1] + (shape[-1] // group, group)))

  def per_group(x):  # a group statistic, broadcast back over its group
    return jnp.expand_dims(x, axis)

  offsets = None
  if asymmetric:  # levels -8..7 over [min, max]: offset = min + 8 * scale
    low, high = grouped.min(axis=axis), grouped.max(axis=axis)
    scales = _divide(high - low, 15.0)
    safe = jnp.where(scales > 0, scales, 1.0)
    q = jnp.clip(jnp.round(_divide(grouped - per_group(low), per_group(safe))), 0, 15) - 8
    offsets = low + 8 * scales
  else:
    scales = _divide(jnp.abs(grouped).max(axis=axis), float(top))  # a scale per group
    safe = jnp.where(scales > 0, scales, 1.0)
    q = jnp.clip(jnp.round(_divide(grouped, per_group(safe))), -top, top)
  q = q.astype(jnp.int8).reshape(shape)  # -127..127 or -8..7: exact in int8
  if columns:  # `[..., in, out]` -> `[..., out, in]`: int8 integers, and the small scales
    q, scales = jnp.swapaxes(q, -1, -2), jnp.swapaxes(scales, -1, -2)
    offsets = None if offsets is None else jnp.swapaxes(offsets, -1, -2)
    shape = shape[:-2] + (shape[-1], shape[-2])
  if bits == 8:
    values = q
  else:
    runs = (q + 8).astype(jnp.uint8).reshape(shape[:-1] + (shape[-1] // 32, 2, 16))
    values = (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(shape[:-1] + (shape[-1] // 2,))
  return values, scales, offsets


def _traced(w) -> bool:
  """Whether any leaf of `w` is a tracer (a weight inside a caller's `jax.jit`)."""
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(w))


def is_quantized(w) -> bool:
  return isinstance(w, QuantizedWeight)


# Which float matrices `quantize` replaces, and how each lies: canonical per-layer weights are
# `[in, out]` (transposed to `[out, in]` here); the CPU layout's step copies `<name>_t` already
# are `[out, in]`, and their column halves are dropped (a quantized weight has one copy).
_CANONICAL = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_CPU_FUSED = ("wqkv", "wo", "w_gate_up", "w_down")


def _quantize_layers(layers, bits, group, stacked: bool, asymmetric: bool):
  def one(lp: dict) -> dict:
    out = dict(lp)
    if "wqkv_t" in lp:  # the CPU layout
      for name in _CPU_FUSED:
        out[name + "_t"] = quantize_weight(panels.dense(lp[name + "_t"]), bits, group,
                                           asymmetric=asymmetric)
        out.pop(name + "_halves", None)
    else:
      for name in _CANONICAL:  # `[in, out]`: quantized as its transpose, `[out, in]`
        out[name] = _quantize_columns(lp[name], bits, group, asymmetric)
    return out

  return one(layers) if stacked else tuple(one(lp) for lp in layers)


def indivisible(config, group: int) -> dict[str, int]:
  """The model dimensions that `quantize` groups (the input sizes of its matrices) which `group`
  does not divide, by name: empty where every one is a whole number of groups."""
  sizes = {"embed_dim": config.embed_dim, "mlp_dim": config.mlp_dim,
           "num_heads * head_dim": config.num_heads * config.head_dim}
  return {name: size for name, size in sizes.items() if size % group}


def quantize(model, bits: int = 8, group: int = 32, *, embeddings: bool = True,
             asymmetric: bool = False, embed_bits: int | None = None):
  """A copy of `model` whose projection matrices (and, with `embeddings`, the embedding table and
  output projection) are `QuantizedWeight`s; norms, biases and the architecture are unchanged.

  The layout is kept: a stacked model stays stacked (TPU/GPU: XLA dequantizes inside the dot), a
  model in the CPU layout (`for_platform("cpu")`) keeps its fused projections with one quantized
  copy each (read by the CPU kernel). It runs in `jax.numpy` (`quantize_weight`), so it takes
  concrete weights at load and traced ones inside a caller's `jax.jit` (the current policy's copy,
  built in a training or RL step), in every layout, with the same integers and scales either way;
  its checks read shapes and the config, never weight values. A concrete copy of an unstacked
  model is placed in 2 MiB pages (`host_memory.weights_on_huge_pages`); a traced one is left to
  the caller's program.

  Args:
    model: a `specjax.Model` with float weights.
    bits: 8 or 4.
    group: input columns per scale, a positive multiple of 32 dividing every quantized matrix's
      input size.
    embeddings: also quantize the embedding table and output projection (the largest single
      matrix of a small model).
    asymmetric: int4 with a scale and an offset per group (see the module docstring): lossless
      on weights dequantized from Q4_1 / Q4_K blocks of the same group.
    embed_bits: None (as `bits`) or 8 or 4: the embedding table's and output projection's width
      (symmetric at 8; `asymmetric` applies at 4). A model shipped with 4-bit layers often keeps
      its embedding at 8 bits (SmolLM2's GGUF: Q4_1 layers, a Q8_0 embedding, which int8 at
      group 32 reproduces), and the output projection is where 4 bits cost the most acceptance.

  Raises:
    ValueError: unsupported `bits` or `group`, a group that does not divide a dimension,
      `asymmetric` with bits 8, or an already quantized model.
  """
  if not (hasattr(model, "params") and hasattr(model, "config") and hasattr(model, "is_stacked")):
    raise ValueError(f"quantize needs a specjax.Model, got {type(model).__name__}")
  _check(bits, group, asymmetric=asymmetric)
  embed_bits = bits if embed_bits is None else embed_bits
  _check(embed_bits, group)
  embed_asymmetric = asymmetric and embed_bits == 4
  if any(isinstance(leaf, QuantizedWeight) for leaf in jax.tree.leaves(
      model.params, is_leaf=lambda x: isinstance(x, QuantizedWeight))):
    raise ValueError("the model is already quantized")
  c = model.config
  bad = indivisible(c, group)
  if bad:
    raise ValueError(f"group {group} does not divide the model's {bad}")
  p = dict(model.params)
  p["layers"] = _quantize_layers(p["layers"], bits, group, model.is_stacked, asymmetric)
  if embeddings:
    # [V, E]: out = V, in = E
    p["embed"] = quantize_weight(panels.dense(p["embed"]), embed_bits, group,
                                 asymmetric=embed_asymmetric)
    if "lm_head" in p:
      if c.tie_embeddings:
        del p["lm_head"]  # the CPU layout's float copy of the tied embedding: one copy is kept
      else:  # [E, V] -> [V, E] (the CPU layout's panels hold [V, E] already)
        head = p["lm_head"]
        p["lm_head"] = (quantize_weight(panels.dense(head), embed_bits, group,
                                        asymmetric=embed_asymmetric) if panels.is_panels(head)
                        else _quantize_columns(head, embed_bits, group, embed_asymmetric))
  if not model.is_stacked:  # the CPU layout: quantized weights in 2 MiB pages, as float ones are
    # (concrete ones: traced weights are the caller's program's buffers)
    p = jax.tree.map(
        lambda w: host_memory.weights_on_huge_pages(w) if isinstance(w, QuantizedWeight)
        and not _traced(w) else w, p, is_leaf=lambda x: isinstance(x, QuantizedWeight))
  return dataclasses.replace(model, params=p)


def dequantize_model(model):
  """The float model a quantized one stands for (its `QuantizedWeight`s dequantized, in the same
  layout and orientation as `quantize` found them). The CPU layout's column halves are not rebuilt:
  call `without_fused_projections()` then `for_platform()` for them."""
  p = dict(model.params)

  def layer(lp: dict) -> dict:
    out = dict(lp)
    for name, w in lp.items():
      if isinstance(w, QuantizedWeight):
        dense = w.dequantize()
        if name.endswith("_t"):  # the CPU layout's `[out, in]` copy, row-major
          out[name] = rows.RowMajorWeight(dense)
        else:  # a canonical `[in, out]` matrix
          out[name] = jnp.swapaxes(dense, -1, -2)
    return out

  p["layers"] = layer(p["layers"]) if model.is_stacked else tuple(layer(lp) for lp in p["layers"])
  if isinstance(p["embed"], QuantizedWeight):
    p["embed"] = p["embed"].dequantize()
  if isinstance(p.get("lm_head"), QuantizedWeight):
    p["lm_head"] = p["lm_head"].dequantize().T
  return dataclasses.replace(model, params=p)


def quantization_of(model) -> dict | None:
  """`{"bits", "group", "embeddings", "asymmetric", "embed_bits"}` of a model made by `quantize`,
  or None for a float model (what `specjax.io.save` records so that `specjax.io.load` can rebuild
  the leaf types)."""
  is_leaf = lambda x: isinstance(x, QuantizedWeight)
  found = [leaf for leaf in jax.tree.leaves(model.params["layers"], is_leaf=is_leaf)
           if isinstance(leaf, QuantizedWeight)]
  heads = [w for w in (model.params["embed"], model.params.get("lm_head"))
           if isinstance(w, QuantizedWeight)]
  if not found:
    if heads:
      raise ValueError("a model with a quantized embedding but float layers cannot be described")
    return None
  if len({(w.bits, w.group, w.asymmetric) for w in found}) != 1:
    raise ValueError("a model whose weights mix quantization settings cannot be described")
  bits, group, asymmetric = found[0].bits, found[0].group, found[0].asymmetric
  embed_bits = heads[0].bits if heads else bits
  if any((w.bits, w.group, w.asymmetric) != (embed_bits, group, asymmetric and embed_bits == 4)
         for w in heads):
    raise ValueError("a model whose weights mix quantization settings cannot be described")
  return {"bits": bits, "group": group, "embeddings": bool(heads), "asymmetric": asymmetric,
          "embed_bits": embed_bits}


def abstract_quantized(abstract_params: dict, bits: int, group: int, embeddings: bool,
                       asymmetric: bool = False, embed_bits: int | None = None) -> dict:
  """The shapes `quantize` gives the canonical stacked parameters `abstract_params` (a tree of
  `jax.ShapeDtypeStruct`s), as `QuantizedWeight`s of `ShapeDtypeStruct`s: the restore target of
  a quantized checkpoint."""
  _check(bits, group, asymmetric=asymmetric)

  embed_bits = bits if embed_bits is None else embed_bits

  def q(leaf, transpose: bool, bits: int = bits, asymmetric: bool = asymmetric) -> QuantizedWeight:
    shape = tuple(leaf.shape)  # [..., out, in] once transposed
    if transpose:
      shape = shape[:-2] + (shape[-1], shape[-2])
    values = jax.ShapeDtypeStruct(shape[:-1] + (shape[-1] * bits // 8,),
                                  jnp.int8 if bits == 8 else jnp.uint8)
    scales = jax.ShapeDtypeStruct(shape[:-1] + (shape[-1] // group,), jnp.float32)
    return QuantizedWeight(values, scales, bits, group, scales if asymmetric else None)

  p = dict(abstract_params)
  layers = dict(p["layers"])
  for name in _CANONICAL:
    layers[name] = q(layers[name], True)
  p["layers"] = layers
  if embeddings:
    embed_asymmetric = asymmetric and embed_bits == 4
    p["embed"] = q(p["embed"], False, embed_bits, embed_asymmetric)
    if "lm_head" in p:
      p["lm_head"] = q(p["lm_head"], True, embed_bits, embed_asymmetric)
  return p
