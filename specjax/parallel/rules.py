"""Logical axis names and the rules that map them onto mesh axes.

Every array dimension specjax shards has a *logical* name (`batch`, `vocab`, `embed`, `heads`,
`kv_heads`, `mlp`, `length`, `layers`). One `ShardingRules` object maps those names onto *mesh*
axes (`data`, `model`, optionally `fsdp`). Nothing else in the library names a mesh axis, so the
same code runs on one CPU device, 8 simulated CPU devices, a GPU or a multi-host TPU pod slice.

The default layout is data parallel over the batch and tensor parallel (Megatron style) over
attention heads, MLP hidden units and the vocabulary:

    embed [V, E]            (vocab, embed)          lm_head [E, V]       (embed, vocab)
    wq [L, E, H*D]          (layers, embed, heads)  wo [L, H*D, E]       (layers, heads, embed)
    wk, wv [L, E, KVH*D]    (layers, embed, kv_heads)
    w_gate, w_up [L, E, F]  (layers, embed, mlp)    w_down [L, F, E]     (layers, mlp, embed)
    norms                   replicated
    KV cache [L, B, KVH, S, D]   (layers, batch, kv_heads, length, -)

`embed` maps to `fsdp`, which a plain `(data, model)` mesh does not have, so by default it is not
sharded; a `(data, fsdp, model)` mesh adds ZeRO-3 style sharding of the embedding dimension.

**The fallback rule.** For each dimension, its logical name gives a tuple of mesh axes. Axes the
mesh does not have, and axes an earlier dimension of the same array already uses, are dropped.
Of what remains, the longest prefix whose total size divides the dimension is used; if none does,
the dimension is replicated. So a vocabulary of 50257 on a 4-way `model` axis is replicated, and
a batch of 6 on an 8-way `data` axis is replicated, and both still compute the right answer.

**Inside the forward pass** `constrain(x, logical_axes)` pins activations (`[B, T, E]` residual,
queries/keys/values, MLP hidden, logits, the cache) with `jax.lax.with_sharding_constraint`. It is a
no-op unless a mesh is active, so the single-device program is unchanged. The rules it reads are set
by `rules_scope` *inside* a traced function whose static arguments include the rules
(`specjax.decode`, `specjax.generate` and the stream pass them as a static `rules=`
argument), so a change of rules is a change of the jit cache key, never a stale compiled program.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Sequence

import jax
from jax.sharding import AxisType, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
LogicalAxes = tuple[str | None, ...]

LOGICAL_AXES = ("batch", "vocab", "embed", "heads", "kv_heads", "mlp", "length", "layers")

# Logical axes of the activations pinned inside the forward pass.
RESIDUAL_AXES: LogicalAxes = ("batch", None, None)  # [B, T, E]
QUERY_AXES: LogicalAxes = ("batch", None, "heads", None)  # [B, T, H, D]
KEY_VALUE_AXES: LogicalAxes = ("batch", None, "kv_heads", None)  # [B, T, KVH, D]
MLP_AXES: LogicalAxes = ("batch", None, "mlp")  # [B, T, F]
LOGITS_AXES: LogicalAxes = ("batch", None, "vocab")  # [B, T, V]
CACHE_AXES: LogicalAxes = ("layers", "batch", "kv_heads", "length", None)  # [L, B, KVH, S, D]


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Maps each logical axis to mesh axes: a mesh axis name, a tuple of them, or None.

  Attributes:
    batch: rows of a batch (data parallel).
    vocab: vocabulary dimension of the embedding, the output head and the logits.
    embed: the residual-stream width of weights (FSDP when mapped; activations never shard it).
    heads: query heads (and the fused `heads * head_dim` dimension of `wq` / `wo`).
    kv_heads: key/value heads, in the weights and in the KV cache.
    mlp: hidden units of the MLP.
    length: the sequence dimension of the KV cache.
    layers: the stacked-layer axis.
    param_axes: extra `(name, logical_axes)` pairs for parameter names the built-in table does
      not know (user models); `logical_axes` lists one entry per dimension, without the leading
      `layers` axis of stacked weights.
  """

  batch: MeshAxes = ("data", "fsdp")
  vocab: MeshAxes = "model"
  embed: MeshAxes = "fsdp"
  heads: MeshAxes = "model"
  kv_heads: MeshAxes = "model"
  mlp: MeshAxes = "model"
  length: MeshAxes = None
  layers: MeshAxes = None
  param_axes: tuple[tuple[str, LogicalAxes], ...] = ()

  def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
    """The mesh axes a logical axis maps to, as a tuple (empty = replicated)."""
    if logical is None:
      return ()
    if logical not in LOGICAL_AXES:
      raise ValueError(f"unknown logical axis {logical!r}; expected one of {LOGICAL_AXES}")
    value = getattr(self, logical)
    if value is None:
      return ()
    return (value,) if isinstance(value, str) else tuple(value)

  def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int],
           mesh_shape: dict[str, int]) -> PartitionSpec:
    """The `PartitionSpec` of an array, applying the fallback rule of the module docstring.

    Args:
      logical_axes: one logical name (or None) per dimension.
      shape: the array's shape.
      mesh_shape: mesh axis name -> size, of the axes that may be used.

    Returns:
      A `PartitionSpec` with one entry per dimension.
    """
    if len(logical_axes) != len(shape):
      raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    entries = []
    for logical, size in zip(logical_axes, shape):
      axes = [a for a in self.mesh_axes(logical) if a in mesh_shape and a not in used]
      while axes and size % math.prod(mesh_shape[a] for a in axes):
        axes.pop()
      used.update(axes)
      entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*entries)


DEFAULT_RULES = ShardingRules()

# --------------------------------------------------------------------------------------------
# Parameter names -> logical axes.
# --------------------------------------------------------------------------------------------

# One entry per dimension of an unstacked weight; stacked weights get a leading `layers` axis.
# Kernels are `[in, out]` (specjax, Flax Linen/NNX `Dense`); Hugging Face names are included for
# models imported under their original module names.
_PARAM_AXES: dict[str, LogicalAxes] = {
    "embed": ("vocab", "embed"),
    "embed_tokens": ("vocab", "embed"),
    "wte": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "wq": ("embed", "heads"),
    "q_proj": ("embed", "heads"),
    "wk": ("embed", "kv_heads"),
    "k_proj": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "v_proj": ("embed", "kv_heads"),
    "wo": ("heads", "embed"),
    "o_proj": ("heads", "embed"),
    "bq": ("heads",),
    "bk": ("kv_heads",),
    "bv": ("kv_heads",),
    "w_gate": ("embed", "mlp"),
    "gate_proj": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "down_proj": ("mlp", "embed"),
}


_QUANTIZED_PARTS = ("values", "scales", "offsets")  # `specjax.models.quant.QuantizedWeight`'s leaves
_STORED_OUT_IN = ("embed", "embed_tokens", "wte")  # float tables already `[out, in]` (`[V, E]`)


def logical_axes(name: str, ndim: int, rules: ShardingRules = DEFAULT_RULES) -> LogicalAxes:
  """The logical axes of a parameter from its name.

  Args:
    name: the parameter's path, components joined by "/" (e.g. "layers/wq",
      "model/layers_3/self_attn/q_proj/kernel").
    ndim: its rank.
    rules: `rules.param_axes` entries take precedence over the built-in table.

  Returns:
    One logical axis (or None) per dimension. The nearest path component found in the table
    decides; a `bias` under a projection takes the projection's output axis; anything with "norm"
    in its name, and anything unknown, is replicated. A weight with one more dimension than its
    table entry is taken to be stacked over layers.
  """
  components = [c for c in name.split("/") if c]
  if any("norm" in c for c in components):
    return (None,) * ndim
  if len(components) > 1 and components[-1] in _QUANTIZED_PARTS:
    # A `QuantizedWeight`'s integers and scales lie `[out, in]` (`in` packed or grouped): they
    # take the axes of the float weight they replace, in that order.
    axes = logical_axes("/".join(components[:-1]), ndim, rules)
    transposed = components[-2] not in _STORED_OUT_IN
    return axes[:-2] + axes[-2:][::-1] if transposed and ndim >= 2 else axes
  table = {**_PARAM_AXES, **dict(rules.param_axes)}
  axes = None
  for component in reversed(components):
    if component in table:
      axes = tuple(table[component])
      break
  if axes is None:
    return (None,) * ndim
  if components[-1] == "bias" and len(axes) > 1:
    axes = axes[-1:]
  if ndim == len(axes) + 1:
    axes = ("layers",) + axes
  if ndim != len(axes):
    return (None,) * ndim
  return axes


_ACTIVE_RULES: contextvars.ContextVar[ShardingRules | None] = contextvars.ContextVar(
    "specjax_sharding_rules", default=None)


def active_rules() -> ShardingRules:
  """The rules set by `use_mesh` (or `use_rules`), else `DEFAULT_RULES`."""
  return _ACTIVE_RULES.get() or DEFAULT_RULES


@contextlib.contextmanager
def use_rules(rules: ShardingRules | None):
  """Sets the rules `constrain` uses (read when a function is traced).

  The library's jitted entry points read the rules set here *at call time* and pass them on as a
  static argument (so they are part of the jit cache key); `rules_scope` then re-enters them
  while tracing.
  """
  token = _ACTIVE_RULES.set(rules)
  try:
    yield
  finally:
    _ACTIVE_RULES.reset(token)


def auto_mesh_shape() -> dict[str, int] | None:
  """Sizes of the `Auto` axes of the mesh active at trace time, or None without one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return None
  sizes = {name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes,
                                                  mesh.axis_types) if kind == AxisType.Auto}
  return sizes if any(size > 1 for size in sizes.values()) else None


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Pins `x` to the layout of its logical `axes` when a mesh is active; else returns `x`."""
  mesh_shape = auto_mesh_shape()
  if mesh_shape is None:
    return x
  spec = active_rules().spec(axes, x.shape, mesh_shape)
  return jax.lax.with_sharding_constraint(x, spec)


rules_scope = use_rules  # used inside traced functions, with rules from a static argument
