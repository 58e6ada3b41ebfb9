"""Sharding by logical axis names: meshes, parameter and cache layouts, a vocab-sharded verify.

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
    KV cache [L, B, S, KVH, D]   (layers, batch, length, kv_heads, -)

`embed` maps to `fsdp`, which a plain `(data, model)` mesh does not have, so by default it is not
sharded; a `(data, fsdp, model)` mesh adds ZeRO-3 style sharding of the embedding dimension.

**The fallback rule.** For each dimension, its logical name gives a tuple of mesh axes. Axes the
mesh does not have, and axes an earlier dimension of the same array already uses, are dropped.
Of what remains, the longest prefix whose total size divides the dimension is used; if none does,
the dimension is replicated. So a vocabulary of 50257 on a 4-way `model` axis is replicated, and
a batch of 6 on an 8-way `data` axis is replicated, and both still compute the right answer.

**Inside the forward pass** `constrain(x, logical_axes)` pins activations (`[B, T, E]` residual,
queries/keys/values, MLP hidden, logits, the cache) with `jax.lax.with_sharding_constraint`. It is
a no-op unless a mesh is active (`with specjax.sharding.use_mesh(mesh):` or `jax.set_mesh(mesh)`),
so the single-device program is unchanged. Without an active mesh, sharded parameters still work:
GSPMD propagates their shardings, it only does not pin the batch to `data`.

**Draft and target share one mesh.** Speculative decoding is sequential inside a round: the
drafter proposes `k` tokens, then the target scores them. Putting the drafter on its own sub-mesh
would leave those devices idle while the target runs (and the target's idle while the drafter
runs), and would move the draft tokens and the drafter's `[B, k, V]` logits between sub-meshes
every round. On one mesh both models are data parallel over the same batch rows and tensor
parallel over the same `model` axis, so draft logits arrive at verify already sliced by
vocabulary exactly like the target's, and every device works in every phase. Decoding is
memory-bandwidth bound, and tensor parallelism divides each model's weight reads per device.
For a drafter so small that its per-layer all-reduces cost more than its matmuls, shard it with
`ShardingRules(heads=None, kv_heads=None, mlp=None, vocab=None)` (replicated weights, still data
parallel): the result is the same, only the layout differs.

**Vocab-sharded verify.** `sharded_verify` is `specjax.sampling.verify_reference` under
`jax.shard_map`: each `model` shard holds a vocabulary slice of the target (and draft) logits,
computes partial maxima, sums of exponentials and Gumbel-race winners (the noise is indexed by
the *global* vocabulary id, so the race is the one the unsharded reference runs), and combines
them with `pmax` / `psum` / `pmin` over the vocab mesh axes. The top-k threshold comes from a
16-way search over the order-preserving integer keys of float32 with `psum`'d counts, and the
top-p threshold the same way with `psum`'d masses: 8 collectives each, no sort, no gather.
Full-vocabulary logits are never gathered on one device.

**Multi-host.** Nothing here is host-specific: `make_mesh` spans `jax.devices()` (every process's
devices after `jax.distributed.initialize()`), by default with processes along `data` and each
host's local devices along `model`, so tensor-parallel collectives stay on the fast intra-host
interconnect. `shard` builds global arrays from host-local copies with
`jax.make_array_from_callback`, so every process passes the same full weights and keeps only its
own shards.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from specjax.cache import KVCache
from specjax.sampling import (
    PURPOSE_ACCEPT, PURPOSE_RESIDUAL, Sampling, VerifyResult, float_to_key, gumbel, key_to_float,
    uniform)

MeshAxes = str | tuple[str, ...] | None
LogicalAxes = tuple[str | None, ...]

LOGICAL_AXES = ("batch", "vocab", "embed", "heads", "kv_heads", "mlp", "length", "layers")

# Logical axes of the activations pinned inside the forward pass.
RESIDUAL_AXES: LogicalAxes = ("batch", None, None)  # [B, T, E]
QUERY_AXES: LogicalAxes = ("batch", None, "heads", None)  # [B, T, H, D]
KEY_VALUE_AXES: LogicalAxes = ("batch", None, "kv_heads", None)  # [B, T, KVH, D]
MLP_AXES: LogicalAxes = ("batch", None, "mlp")  # [B, T, F]
LOGITS_AXES: LogicalAxes = ("batch", None, "vocab")  # [B, T, V]
CACHE_AXES: LogicalAxes = ("layers", "batch", "length", "kv_heads", None)  # [L, B, S, KVH, D]


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

# Replicated weights, batch still split over `data`: for drafters too small to tensor-parallelise.
DATA_PARALLEL_RULES = ShardingRules(vocab=None, heads=None, kv_heads=None, mlp=None)


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


def _path_name(path) -> str:
  parts = []
  for key in path:
    for attribute in ("key", "name", "idx"):
      if hasattr(key, attribute):
        parts.append(str(getattr(key, attribute)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def _params_of(model_or_params) -> Any:
  return model_or_params.params if hasattr(model_or_params, "params") else model_or_params


def param_specs(model_or_params, mesh: jax.sharding.Mesh,
                rules: ShardingRules | None = None) -> Any:
  """A pytree of `PartitionSpec`s matching the model's params (see `param_shardings`)."""
  rules = rules or DEFAULT_RULES
  mesh_shape = dict(mesh.shape)

  def spec(path, leaf):
    shape = tuple(leaf.shape)
    return rules.spec(logical_axes(_path_name(path), len(shape), rules), shape, mesh_shape)

  return jax.tree_util.tree_map_with_path(spec, _params_of(model_or_params))


def param_shardings(model_or_params, mesh: jax.sharding.Mesh,
                    rules: ShardingRules | None = None) -> Any:
  """The `NamedSharding` of every parameter.

  Args:
    model_or_params: a `specjax.Model`, or its `params` pytree; leaves may be arrays or
      `jax.ShapeDtypeStruct`s (an abstract model, e.g. to restore a checkpoint into).
    mesh: the device mesh.
    rules: logical-to-mesh rules; default `DEFAULT_RULES`.

  Returns:
    A pytree with the structure of `model.params` whose leaves are `NamedSharding`s.
  """
  specs = param_specs(model_or_params, mesh, rules)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def _put(value, sharding: jax.sharding.Sharding) -> jax.Array:
  """Places a value; on a multi-process mesh builds the global array from this host's copy."""
  if sharding.is_fully_addressable:
    return jax.device_put(value, sharding)
  host = np.asarray(value)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard(model, mesh: jax.sharding.Mesh, rules: ShardingRules | None = None):
  """Places a model's weights on a mesh by the logical-axis rules.

  Args:
    model: a `specjax.Model` (any dataclass pytree with a `params` field works).
    mesh: the device mesh, e.g. from `make_mesh`. With several processes, every process passes
      the same full weights and keeps only its own shards.
    rules: logical-to-mesh rules; default `DEFAULT_RULES`.

  Returns:
    The same model with every weight a `jax.Array` sharded over `mesh`.
  """
  shardings = param_shardings(model, mesh, rules)
  params = jax.tree.map(_put, model.params, shardings)
  return dataclasses.replace(model, params=params)


def cache_shardings(cache: KVCache, mesh: jax.sharding.Mesh,
                    rules: ShardingRules | None = None) -> KVCache:
  """`NamedSharding`s for a `KVCache` (arrays or `ShapeDtypeStruct`s): k/v `[L, B, S, KVH, D]`
  as `(layers, batch, length, kv_heads, -)`, lengths `[B]` as `(batch,)`."""
  rules = rules or DEFAULT_RULES
  mesh_shape = dict(mesh.shape)
  kv = NamedSharding(mesh, rules.spec(CACHE_AXES, cache.k.shape, mesh_shape))
  lengths = NamedSharding(mesh, rules.spec(("batch",), cache.lengths.shape, mesh_shape))
  return KVCache(k=kv, v=kv, lengths=lengths)


def shard_cache(cache: KVCache, mesh: jax.sharding.Mesh,
                rules: ShardingRules | None = None) -> KVCache:
  """Places a `KVCache` on a mesh (see `cache_shardings`)."""
  return jax.tree.map(_put, cache, cache_shardings(cache, mesh, rules))


def state_shardings(state, mesh: jax.sharding.Mesh, batch: int,
                    rules: ShardingRules | None = None) -> Any:
  """`NamedSharding`s for a decode-loop state pytree.

  `KVCache` nodes get `cache_shardings`, objects with `params` get `param_shardings`, every other
  array whose leading dimension is `batch` is split over the batch rule, and the rest (scalars,
  seeds, counters) is replicated.

  Args:
    state: the state pytree (arrays or `ShapeDtypeStruct`s).
    mesh: the device mesh.
    batch: the batch size, to recognise per-row arrays.
    rules: logical-to-mesh rules; default `DEFAULT_RULES`.

  Returns:
    A pytree of `NamedSharding`s with the structure of `state`.
  """
  rules = rules or DEFAULT_RULES
  mesh_shape = dict(mesh.shape)

  def leaf(x):
    shape = tuple(getattr(x, "shape", ()))
    axes = ("batch",) + (None,) * (len(shape) - 1) if shape and shape[0] == batch else \
        (None,) * len(shape)
    return NamedSharding(mesh, rules.spec(axes, shape, mesh_shape))

  def node(x):
    if isinstance(x, KVCache):
      return cache_shardings(x, mesh, rules)
    if dataclasses.is_dataclass(x) and hasattr(x, "params") and hasattr(x, "config"):
      return dataclasses.replace(x, params=param_shardings(x, mesh, rules))
    return jax.tree.map(leaf, x)

  is_node = lambda x: isinstance(x, KVCache) or (
      dataclasses.is_dataclass(x) and hasattr(x, "params") and hasattr(x, "config"))
  return jax.tree.map(lambda x: node(x) if is_node(x) else leaf(x), state, is_leaf=is_node)


# --------------------------------------------------------------------------------------------
# Meshes and the active-mesh context.
# --------------------------------------------------------------------------------------------

def make_mesh(shape: Sequence[int] | None = None,
              axis_names: Sequence[str] = ("data", "model"), *,
              devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A device mesh over the available devices (every process's, under `jax.distributed`).

  Args:
    shape: size of each mesh axis; one entry may be -1 (inferred). None: processes along the first
      axis, each process's local devices along the last (so on one host, `(1, n)`: all devices
      tensor parallel), 1 elsewhere.
    axis_names: e.g. `("data", "model")` or `("data", "fsdp", "model")`.
    devices: the devices to use; default `jax.devices()`.

  Returns:
    A `jax.sharding.Mesh` with `Auto` axes (GSPMD places what the rules leave open).

  Raises:
    ValueError: the shape does not multiply to the number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  count = len(devices)
  axis_names = tuple(axis_names)
  if shape is None:
    processes = len({d.process_index for d in devices})
    shape = [1] * len(axis_names)
    shape[0] = processes
    shape[-1] = count // processes if len(axis_names) > 1 else count
  shape = list(shape)
  if len(shape) != len(axis_names):
    raise ValueError(f"mesh shape {tuple(shape)} and axis names {axis_names} differ in length")
  if shape.count(-1) > 1:
    raise ValueError(f"at most one mesh dimension may be -1, got {tuple(shape)}")
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    shape[shape.index(-1)] = count // known if known and count % known == 0 else 0
  if any(s < 1 for s in shape) or math.prod(shape) != count:
    raise ValueError(f"mesh shape {tuple(shape)} needs {math.prod(shape)} devices, but "
                     f"{count} are available")
  return jax.make_mesh(tuple(shape), axis_names, axis_types=(AxisType.Auto,) * len(shape),
                       devices=devices)


_ACTIVE_RULES: contextvars.ContextVar[ShardingRules | None] = contextvars.ContextVar(
    "specjax_sharding_rules", default=None)


def active_rules() -> ShardingRules:
  """The rules set by `use_mesh` (or `use_rules`), else `DEFAULT_RULES`."""
  return _ACTIVE_RULES.get() or DEFAULT_RULES


@contextlib.contextmanager
def use_rules(rules: ShardingRules | None):
  """Sets the rules `constrain` uses (read when a function is traced)."""
  token = _ACTIVE_RULES.set(rules)
  try:
    yield
  finally:
    _ACTIVE_RULES.reset(token)


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh, rules: ShardingRules | None = None):
  """Activates a mesh (`jax.set_mesh`) and sharding rules for `sj.generate` / `sj.decode`.

  Inside, the forward pass pins activations and the KV cache to the layout the rules give. The
  mesh is part of the jit cache key; the rules are read at trace time, so use one set of rules
  per process (or call `jax.clear_caches()` after changing them).

  Example:
    mesh = sj.make_mesh((2, 4))
    target = sj.shard(target, mesh)
    with sj.sharding.use_mesh(mesh):
      out = sj.generate(target, ids, rng, max_new_tokens=32)
  """
  with jax.set_mesh(mesh), use_rules(rules):
    yield mesh


def _auto_mesh_shape() -> dict[str, int] | None:
  """Sizes of the `Auto` axes of the mesh active at trace time, or None without one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return None
  sizes = {name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes,
                                                  mesh.axis_types) if kind == AxisType.Auto}
  return sizes if any(size > 1 for size in sizes.values()) else None


def vocab_is_sharded() -> bool:
  """Whether the mesh active at trace time splits the vocabulary (under the active rules)."""
  mesh_shape = _auto_mesh_shape()
  if mesh_shape is None:
    return False
  return math.prod(mesh_shape.get(a, 1) for a in active_rules().mesh_axes("vocab")) > 1


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Pins `x` to the layout of its logical `axes` when a mesh is active; else returns `x`."""
  mesh_shape = _auto_mesh_shape()
  if mesh_shape is None:
    return x
  spec = active_rules().spec(axes, x.shape, mesh_shape)
  return jax.lax.with_sharding_constraint(x, spec)


# --------------------------------------------------------------------------------------------
# Vocab-sharded verify.
# --------------------------------------------------------------------------------------------

_SEARCH_RADIX = 16  # candidates per round of a threshold search, one collective each round
_SEARCH_ROUNDS = 8  # 16 ** 8 = 2 ** 32 keys: enough for any float32 interval

class _VocabShard:
  """Collectives over the vocabulary slice one device holds, indexed by global vocab id."""

  def __init__(self, axes: tuple[str, ...], local_vocab: int, vocab: int):
    self.axes = axes
    self.local_vocab = local_vocab
    index = jax.lax.axis_index(axes) if axes else 0
    self.offset = jnp.asarray(index, jnp.int32) * local_vocab
    self.ids = self.offset + jnp.arange(local_vocab, dtype=jnp.int32)  # global ids [Vl]
    self.valid = self.ids < vocab  # False on the padding of the last shard

  def max(self, x):
    m = jnp.max(x, axis=-1)
    return jax.lax.pmax(m, self.axes) if self.axes else m

  def sum(self, x):
    s = jnp.sum(x, axis=-1)
    return jax.lax.psum(s, self.axes) if self.axes else s

  def argmax(self, x):
    """Global first-occurrence argmax, as `jnp.argmax` over the full vocabulary."""
    local_max = jnp.max(x, axis=-1)
    local_arg = jnp.argmax(x, axis=-1).astype(jnp.int32) + self.offset
    if not self.axes:
      return local_arg
    best = jax.lax.pmax(local_max, self.axes)
    candidate = jnp.where(local_max == best, local_arg, jnp.iinfo(jnp.int32).max)
    return jax.lax.pmin(candidate, self.axes)

  def gather_at(self, x, ids):
    """`x[..., ids]` for global `ids` of shape `x.shape[:-1]`: the owning shard contributes."""
    local = ids - self.offset
    owned = (local >= 0) & (local < self.local_vocab)
    value = jnp.take_along_axis(x, jnp.clip(local, 0, self.local_vocab - 1)[..., None],
                                axis=-1)[..., 0]
    value = jnp.where(owned, value, 0.0)
    return jax.lax.psum(value, self.axes) if self.axes else value

  def softmax(self, x):
    m = jax.lax.stop_gradient(self.max(x))[..., None]
    unnormalized = jnp.exp(x - m)
    return unnormalized / self.sum(unnormalized)[..., None]

  def warp(self, logits, sampling: Sampling, vocab: int):
    """`specjax.sampling.warp_logits` on a vocabulary slice: the same thresholds, found with
    counts and masses summed over the shards."""
    x = logits.astype(jnp.float32) / jnp.float32(sampling.temperature)
    x = jnp.where(self.valid, x, -jnp.inf)
    if sampling.top_k is not None and sampling.top_k < vocab:
      count_at = lambda t: self.sum((x[..., None, :] >= t).astype(jnp.int32))
      kth = self.largest_holding(x, lambda t: count_at(t) >= sampling.top_k)
      x = jnp.where(x >= kth, x, -jnp.inf)
    if sampling.top_p is not None and sampling.top_p < 1.0:
      weights = jnp.exp(x - self.max(x)[..., None])  # 0 where x = -inf
      needed = (jnp.float32(sampling.top_p) * self.sum(weights))[..., None]
      mass_at = lambda t: self.sum(jnp.where(x[..., None, :] >= t, weights[..., None, :], 0.0))
      threshold = self.largest_holding(x, lambda t: mass_at(t) >= needed)
      x = jnp.where(x >= threshold, x, -jnp.inf)
    return x

  def largest_holding(self, x, holds_at):
    """`[..., 1]` the largest float32 `t` with `holds_at(t)`, for a predicate that only gets false
    as `t` grows and holds at `-inf` (`specjax.sampling.bisect_threshold`, across shards).

    Floats order like their `float_to_key` integer images, so a search over keys in
    `[key(-inf), key(max x)]` lands exactly on a value of `x`. Each round tests
    `_SEARCH_RADIX - 1` candidates with one collective (8 rounds instead of 32 halvings).

    Args:
      x: `[..., Vl]` this shard's values; only the global max is used.
      holds_at: maps `[..., R-1, 1]` float32 candidates to `[..., R-1]` bool, identical on every
        shard (its sums are `psum`s).
    """
    top = self.max(x)  # identical on every shard
    low = float_to_key(jnp.where(True, -jnp.inf, top))  # holds (keeps `top`'s sharding type)
    width = (jax.lax.bitcast_convert_type(float_to_key(top), jnp.uint32)
             - jax.lax.bitcast_convert_type(low, jnp.uint32) + 1)  # keys low + width: unknown
    steps = jnp.arange(1, _SEARCH_RADIX, dtype=jnp.uint32)

    def search_round(_, bounds):
      low, width = bounds
      step = (width + (_SEARCH_RADIX - 1)) // _SEARCH_RADIX
      offsets = jnp.minimum(step[..., None] * steps, width[..., None])  # [..., R-1]
      candidates = jax.lax.bitcast_convert_type(
          jax.lax.bitcast_convert_type(low, jnp.uint32)[..., None] + offsets, jnp.int32)
      open_ = offsets < width[..., None]
      good = open_ & holds_at(key_to_float(candidates)[..., None])
      best = jnp.max(jnp.where(good, offsets, 0), axis=-1)
      first_bad = jnp.min(jnp.where(open_ & ~good, offsets, width[..., None]), axis=-1)
      low = jax.lax.bitcast_convert_type(
          jax.lax.bitcast_convert_type(low, jnp.uint32) + best, jnp.int32)
      return low, first_bad - best

    low, _ = jax.lax.fori_loop(0, _SEARCH_ROUNDS, search_round, (low, width))
    return key_to_float(low)[..., None]

  def race(self, scores, seed, rows, positions, purpose: int):
    """`specjax.sampling.sample_race` with noise indexed by global vocabulary id."""
    noise = gumbel(seed, rows[..., None], positions[..., None], self.ids, purpose)
    return self.argmax(scores + noise)


def _leading_true(mask: jax.Array) -> jax.Array:
  return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _verify_shard(target_logits, draft_logits, draft_tokens, seed, positions, rows, *,
                  sampling: Sampling, vocab: int, axes: tuple[str, ...]):
  """`verify_reference` on one device's rows and vocabulary slice."""
  b, k = draft_tokens.shape
  shard = _VocabShard(axes, target_logits.shape[-1], vocab)
  index = jnp.arange(k + 1, dtype=jnp.int32)
  token_positions = positions[:, None] + index  # [b, k+1]

  if sampling.greedy:
    target_argmax = shard.argmax(target_logits)  # [b, k+1]
    num_accepted = _leading_true(draft_tokens == target_argmax[:, :k])
    final = jnp.take_along_axis(target_argmax, num_accepted[:, None], axis=1)[:, 0]
  else:
    p = shard.softmax(shard.warp(target_logits, sampling, vocab))  # [b, k+1, Vl]
    p_draft = shard.gather_at(p[:, :k], draft_tokens)  # [b, k]
    if draft_logits is None:
      q = (shard.ids == draft_tokens[..., None]).astype(jnp.float32)  # point mass
      q_draft = jnp.ones_like(p_draft)
    else:
      q = shard.softmax(shard.warp(draft_logits, sampling, vocab))  # [b, k, Vl]
      q_draft = shard.gather_at(q, draft_tokens)
    u = uniform(seed, rows[:, None], token_positions[:, :k], 0, PURPOSE_ACCEPT)
    num_accepted = _leading_true(u * q_draft < p_draft)
    p_n = jnp.take_along_axis(p, num_accepted[:, None, None], axis=1)[:, 0]  # [b, Vl]
    q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    q_n = jnp.take_along_axis(q_padded, num_accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    has_mass = shard.sum(residual)[:, None] > 0
    weights = jnp.where(has_mass, residual, p_n)
    scores = jnp.where(weights > 0, jnp.log(weights), -jnp.inf)
    final = shard.race(scores, seed, rows, positions + num_accepted, PURPOSE_RESIDUAL)

  tokens = jnp.where(index[None, :k] < num_accepted[:, None], draft_tokens, 0)
  tokens = jnp.concatenate([tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
  tokens = jnp.where(index[None] == num_accepted[:, None], final[:, None], tokens)
  return num_accepted, tokens


def _pad_vocab(x: jax.Array, multiple: int) -> jax.Array:
  extra = -x.shape[-1] % multiple
  if not extra:
    return x
  pad = jnp.full(x.shape[:-1] + (extra,), -jnp.inf, x.dtype)
  return jnp.concatenate([x, pad], axis=-1)


def sharded_warp_logits(logits: jax.Array, sampling: Sampling, *,
                        mesh: jax.sharding.Mesh | None = None,
                        rules: ShardingRules | None = None) -> jax.Array:
  """`specjax.sampling.warp_logits` with the vocabulary split over the mesh's vocab axes.

  Args:
    logits: `[..., V]` raw logits.
    sampling: temperature > 0, optional top-k / top-p.
    mesh: the mesh; None uses the active one.
    rules: logical-to-mesh rules; default the active rules.

  Returns:
    `[..., V]` float32 warped logits, sharded over the vocab axes (never gathered).
  """
  mesh, rules = _mesh_and_rules(mesh, rules)
  return _sharded_warp_logits(logits, sampling=sampling, mesh=mesh, rules=rules)


@functools.partial(jax.jit, static_argnames=("sampling", "mesh", "rules"))
def _sharded_warp_logits(logits, *, sampling, mesh, rules):
  vocab = logits.shape[-1]
  vocab_axes, vocab_spec, shards = _vocab_layout(mesh, rules)
  spec = PartitionSpec(*(None,) * (logits.ndim - 1), vocab_spec)

  def body(x):
    return _VocabShard(vocab_axes, x.shape[-1], vocab).warp(x, sampling, vocab)

  warped = jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec)(
      _pad_vocab(logits, shards))
  return warped[..., :vocab]


def _mesh_and_rules(mesh, rules):
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
      raise ValueError("a vocab-sharded computation needs a mesh: pass mesh= or run it inside "
                       "use_mesh(mesh)")
  return mesh, rules or active_rules()


def _vocab_layout(mesh, rules):
  """The vocab rule's mesh axes present in `mesh`, their `PartitionSpec` entry and total size."""
  mesh_shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
  axes = tuple(a for a in rules.mesh_axes("vocab") if a in mesh_shape)
  spec = None if not axes else axes[0] if len(axes) == 1 else axes
  return axes, spec, math.prod(mesh_shape[a] for a in axes)


def sharded_verify(target_logits: jax.Array, draft_logits: jax.Array | None,
                   draft_tokens: jax.Array, *, sampling: Sampling, seed: jax.Array,
                   positions: jax.Array, rows: jax.Array | None = None,
                   mesh: jax.sharding.Mesh | None = None,
                   rules: ShardingRules | None = None) -> VerifyResult:
  """`specjax.sampling.verify_reference` with the vocabulary split over the mesh.

  Rows are split over the batch rule's mesh axes and the vocabulary over the vocab rule's; each
  device sees only its `[B / data, k + 1, V / model]` slice of the logits, and the pieces are
  combined with `pmax` / `psum` / `pmin`. A vocabulary that does not divide the vocab axes is
  padded with `-inf` logits.

  Args:
    target_logits: `[B, k + 1, V]` target logits.
    draft_logits: `[B, k, V]` drafter logits, or None for a point-mass drafter.
    draft_tokens: `[B, k]` int32 proposals.
    sampling: applied identically to both models' logits.
    seed: `uint32[2]` seed for this round.
    positions: `[B]` int32 absolute position of each row's first draft token.
    rows: `[B]` int32 random-stream row ids (default `arange(B)`, the global row index).
    mesh: the mesh; None uses the active one (`use_mesh` / `jax.set_mesh`).
    rules: logical-to-mesh rules; default the active rules.

  Returns:
    `VerifyResult(num_accepted [B], tokens [B, k + 1])`, equal to `verify_reference`'s.
  """
  mesh, rules = _mesh_and_rules(mesh, rules)
  b = draft_tokens.shape[0]
  rows = jnp.arange(b, dtype=jnp.int32) if rows is None else rows
  return _sharded_verify(target_logits, draft_logits, draft_tokens, jnp.asarray(seed, jnp.uint32),
                         jnp.asarray(positions, jnp.int32), jnp.asarray(rows, jnp.int32),
                         sampling=sampling, mesh=mesh, rules=rules)


@functools.partial(jax.jit, static_argnames=("sampling", "mesh", "rules"))
def _sharded_verify(target_logits, draft_logits, draft_tokens, seed, positions, rows, *,
                    sampling, mesh, rules) -> VerifyResult:
  b, k = draft_tokens.shape
  vocab = target_logits.shape[-1]
  vocab_axes, vocab_spec, shards = _vocab_layout(mesh, rules)
  mesh_shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
  batch_spec = rules.spec(("batch",), (b,), {a: s for a, s in mesh_shape.items()
                                             if a not in vocab_axes})[0]
  logits_spec = PartitionSpec(batch_spec, None, vocab_spec)
  row_spec = PartitionSpec(batch_spec)
  operands = [_pad_vocab(target_logits, shards)]
  specs = [logits_spec]
  if draft_logits is not None:
    operands.append(_pad_vocab(draft_logits, shards))
    specs.append(logits_spec)
  operands += [draft_tokens.astype(jnp.int32), seed, positions, rows]
  specs += [PartitionSpec(batch_spec, None), PartitionSpec(), row_spec, row_spec]

  def body(*args):
    if draft_logits is None:
      args = (args[0], None) + args[1:]
    return _verify_shard(*args, sampling=sampling, vocab=vocab, axes=vocab_axes)

  run = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                      out_specs=(row_spec, PartitionSpec(batch_spec, None)))
  num_accepted, tokens = run(*operands)
  return VerifyResult(num_accepted, tokens)


def per_device_bytes(tree) -> int:
  """Bytes of `tree`'s arrays held by the first addressable device (the largest shard there)."""
  device = None
  total = 0
  for leaf in jax.tree.leaves(tree):
    shards = leaf.addressable_shards
    if device is None:
      device = shards[0].device
    total += sum(s.data.nbytes for s in shards if s.device == device)
  return total
