"""Meshes and placement: `make_mesh`, `shard`, parameter and cache shardings, `use_mesh`, and
the mesh handling every jitted entry point shares (`call_context`).

**Mesh kinds.** `make_mesh` builds `Auto` axes (GSPMD places what the rules leave open).
`jax.make_mesh` builds `Explicit` axes by default (JAX 0.10), under which every op must know its
output sharding; the built-in forward and verify are written for `Auto` axes. `call_context`
therefore views the weights' mesh (or the active one) with every axis `Auto` for the duration of a
call: the same devices and the same layout, so the arrays are re-typed without a copy, and the
tokens equal the single-device run on Explicit, Auto and mixed meshes alike.

**Draft and target share one mesh.** Speculative decoding is sequential inside a round: the
drafter proposes `k` tokens, then the target scores them. Putting the drafter on its own sub-mesh
would leave those devices idle while the target runs (and the target's idle while the drafter
runs), and would move the draft tokens and the drafter's `[B, k, V]` logits between sub-meshes
every round. On one mesh both models are data parallel over the same batch rows and tensor
parallel over the same `model` axis, so draft logits arrive at verify already sliced by
vocabulary exactly like the target's, and every device works in every phase. For a drafter so
small that its per-layer all-reduces cost more than its matmuls, shard it with
`ShardingRules(heads=None, kv_heads=None, mlp=None, vocab=None)` (replicated weights, still data
parallel): the result is the same, only the layout differs.

**Multi-host.** Nothing here is host-specific: `make_mesh` spans `jax.devices()` (every process's
devices after `jax.distributed.initialize()`), by default with processes along `data` and each
host's local devices along `model`, so tensor-parallel collectives stay on the fast intra-host
interconnect. `shard` builds global arrays from host-local copies with
`jax.make_array_from_callback`, so every process passes the same full weights and keeps only its
own shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from specjax.core.cache import KVCache
from specjax.parallel.rules import (CACHE_AXES, DEFAULT_RULES, ShardingRules, active_rules,
                                    logical_axes, use_rules)


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
    The same model with every weight a `jax.Array` sharded over `mesh`. A `specjax.Model` comes
    back in its stacked layout (one `lax.scan` over layers, a `layers` axis to shard), whatever
    layout it had (`Model.for_platform()` picks the unstacked one on CPU).
  """
  if hasattr(model, "stacked"):
    model = model.stacked()
  shardings = param_shardings(model, mesh, rules)
  params = jax.tree.map(_put, model.params, shardings)
  return dataclasses.replace(model, params=params)


def cache_shardings(cache: KVCache, mesh: jax.sharding.Mesh,
                    rules: ShardingRules | None = None) -> KVCache:
  """`NamedSharding`s for a `KVCache` (arrays or `ShapeDtypeStruct`s): k/v `[L, B, KVH, S, D]`
  as `(layers, batch, kv_heads, length, -)`, lengths `[B]` as `(batch,)`."""
  rules = rules or DEFAULT_RULES
  mesh_shape = dict(mesh.shape)
  layers = len(cache.k) if cache.per_layer else cache.k.shape[0]
  kv = NamedSharding(mesh, rules.spec(CACHE_AXES, (layers,) + cache.layer_shape, mesh_shape))
  if cache.per_layer:  # a tuple of per-layer [B, KVH, S, D] buffers (an unstacked model's cache)
    kv = tuple(NamedSharding(mesh, PartitionSpec(*kv.spec[1:])) for _ in cache.k)
  lengths = NamedSharding(mesh, rules.spec(("batch",), cache.lengths.shape, mesh_shape))
  return KVCache(k=kv, v=kv, lengths=lengths)


def shard_cache(cache: KVCache, mesh: jax.sharding.Mesh,
                rules: ShardingRules | None = None) -> KVCache:
  """Places a `KVCache` on a mesh (see `cache_shardings`)."""
  return jax.tree.map(_put, cache, cache_shardings(cache, mesh, rules))


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


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh, rules: ShardingRules | None = None):
  """Activates a mesh (`jax.set_mesh`) and sharding rules for `sj.generate` / `sj.decode`.

  Inside, the forward pass pins activations and the KV cache to the layout the rules give. The
  mesh and the rules are both part of the entry points' jit cache keys (the rules as a static
  argument), so changing either recompiles rather than reusing a stale program. `jax.set_mesh`
  alone works too (with the default rules).

  Example:
    mesh = sj.make_mesh((2, 4))
    target = sj.shard(target, mesh)
    with sj.parallel.use_mesh(mesh):
      out = sj.generate(target, ids, rng, max_new_tokens=32)
  """
  with jax.set_mesh(mesh), use_rules(rules):
    yield mesh


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


def _ambient_mesh() -> jax.sharding.Mesh | None:
  """The concrete mesh set by `jax.set_mesh` / `use_mesh`, or None."""
  try:
    mesh = jax.sharding.get_mesh()
  except ValueError:  # called inside a trace (under jax.jit / jax.export): only the abstract
    return None       # mesh is active there, and the verify reads it itself
  if mesh is None or getattr(mesh, "empty", False) or not mesh.axis_names:
    return None
  return mesh


def _leaf_meshes(tree) -> set:
  meshes = set()
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
      meshes.add(sharding.mesh)
  return meshes


def as_auto(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """The same mesh (devices, names, shape) with every axis `Auto`."""
  if all(kind == AxisType.Auto for kind in mesh.axis_types):
    return mesh
  return mesh.update(axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _mesh_mismatch(described: list[str]) -> ValueError:
  return ValueError("the target, the drafter, the prompts and the active mesh must share one "
                    f"device mesh (shard every model with the same mesh), got {len(described)}: "
                    + "; ".join(described))


def check_meshes(trees, ambient: jax.sharding.Mesh | None = None) -> jax.sharding.Mesh | None:
  """The one mesh the arrays of `trees` (and the active mesh) live on, or None without one.

  Raises:
    ValueError: arrays on different device meshes, or a mesh with `Manual` axes, before
      anything is traced (inside a `shard_map` the library runs on per-device arrays with
      `check_vma=False`; see `_check_manual`).
  """
  meshes = {as_auto(m) for m in _leaf_meshes(trees)}
  if ambient is not None:
    meshes.add(as_auto(ambient))
  if len(meshes) > 1:
    raise _mesh_mismatch([f"{dict(m.shape)} on devices {[d.id for d in m.devices.flat]}"
                          for m in meshes])
  for mesh in _leaf_meshes(trees) | ({ambient} if ambient is not None else set()):
    if any(kind == AxisType.Manual for kind in mesh.axis_types):
      raise ValueError(f"specjax got arrays or an active mesh with Manual axes "
                       f"({mesh.axis_types}): inside jax.shard_map call it on the per-device "
                       "arrays with check_vma=False, outside it pass arrays on an Auto or "
                       "Explicit mesh")
  return meshes.pop() if meshes else None


def _retype(tree, mesh: jax.sharding.Mesh, views: jax.sharding.Mesh | None = None):
  """Arrays of `tree` on another view of `mesh` (same devices and shape, other axis types)
  re-typed onto `mesh`, without data movement. With `views`, only arrays on that view move."""
  def leaf(x):
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh == mesh:
      return x
    if as_auto(sharding.mesh) != as_auto(mesh) or (views is not None and sharding.mesh != views):
      return x
    return jax.device_put(x, NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind))
  return jax.tree.map(leaf, tree)


def traced_mesh(trees) -> jax.sharding.AbstractMesh | None:
  """The mesh that the tracers among `trees` carry in their types, or None.

  Inside a caller's `jax.jit` with no `jax.set_mesh`, nothing is active, but every argument's
  type still names the mesh its array lives on (`jax.typeof(x).sharding.mesh`; an array placed
  by `shard` with Auto axes too, with an open spec). Reading it there lets the library's program
  be partitioned like the caller's arrays (the verify's `shard_map` around the fused kernel,
  which GSPMD cannot partition itself) instead of failing in the compiler.

  Raises:
    ValueError: tracers on different meshes.
  """
  meshes = {}
  for leaf in jax.tree.leaves(trees):
    if not isinstance(leaf, jax.core.Tracer):
      continue
    mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty or mesh.size == 1:
      continue
    meshes.setdefault(as_auto(mesh), mesh)
  if len(meshes) > 1:
    raise _mesh_mismatch([str(dict(m.shape)) for m in meshes])
  return next(iter(meshes.values())) if meshes else None


def _check_manual(trees) -> None:
  """Inside the caller's `shard_map` each device runs the library on its own rows, which works
  with `check_vma=False`; under the default `check_vma=True` the decode loop's carry would mix
  per-device and replicated types and fail deep inside the trace, so say so first."""
  abstract = jax.sharding.get_abstract_mesh()
  if abstract is None or abstract.empty or AxisType.Manual not in abstract.axis_types:
    return
  for leaf in jax.tree.leaves(trees):
    if not isinstance(leaf, jax.core.Tracer):
      continue
    aval = jax.typeof(leaf)
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10; `vma` before
    varying = getattr(manual, "varying", None) if manual is not None else getattr(aval, "vma",
                                                                                   None)
    if varying:
      raise ValueError(
          "specjax inside jax.shard_map needs check_vma=False (each device decodes its own rows; "
          "the decode loop mixes per-device and replicated values, which the varying-axes check "
          f"rejects): an argument varies over {sorted(varying)}")


class CallContext(NamedTuple):
  """What `call_context` yields."""

  rules: ShardingRules | None  # the rules in force (None = the defaults): a static jit argument
  inputs: Any  # the inputs, every array on the `Auto` view of the mesh
  mesh: jax.sharding.Mesh | None  # the mesh as the caller made it (None without one)

  def output(self, tree):
    """`tree`'s arrays re-typed back onto the caller's mesh (its own axis types), no copy."""
    return tree if self.mesh is None else _retype(tree, self.mesh, views=as_auto(self.mesh))


@contextlib.contextmanager
def call_context(inputs):
  """The mesh handling shared by `decode`, `generate` and `decode_stream`.

  Validates that the arrays of `inputs` (models, drafter, prompts, keys) and the active mesh agree
  on one mesh, views that mesh with `Auto` axes (Explicit and mixed meshes included), re-types the
  arrays onto it, activates it when a mesh was active, and reads the sharding rules for the jitted
  function's static `rules=` argument. Called inside the caller's own `jax.jit` with no mesh
  active, it activates the abstract mesh the arguments' types carry (`traced_mesh`), so the
  program is partitioned as with `jax.set_mesh`. Results go back to the caller's mesh with
  `CallContext.output`, so they compose with the caller's own Explicit-mesh code.

  Yields:
    A `CallContext`.

  Raises:
    ValueError: inputs on different meshes, or called inside `shard_map` (see `check_meshes`).
  """
  ambient = _ambient_mesh()
  mesh = check_meshes(inputs, ambient)
  rules = active_rules()
  rules = None if rules == DEFAULT_RULES else rules
  _check_manual(inputs)
  if mesh is None:
    abstract = jax.sharding.get_abstract_mesh()
    inside = None if abstract is not None and not abstract.empty else traced_mesh(inputs)
    if inside is None:  # no mesh, or the caller's jax.set_mesh (the verify reads it itself)
      yield CallContext(rules, inputs, None)
      return
    # Inside the caller's jit without jax.set_mesh: the mesh the arguments' types name.
    with jax.sharding.use_abstract_mesh(inside):
      yield CallContext(rules, inputs, None)
    return
  original = ambient if ambient is not None else next(iter(_leaf_meshes(inputs)))
  context = CallContext(rules, _retype(inputs, mesh), original)
  with jax.set_mesh(mesh):  # also without an ambient mesh: the verify's shard_map reads it
    yield context


def under_auto_axes(fn):
  """`fn`, or `fn` under `jax.sharding.auto_axes` when it is traced on a mesh with Explicit axes.

  Outside a trace `call_context` re-types Explicit inputs onto the mesh's Auto view. Inside the
  caller's own `jax.jit` under `jax.set_mesh(jax.make_mesh(...))` the inputs are tracers with
  Explicit types that cannot be re-typed; `auto_axes` runs the library's program with Auto axes
  there instead (the partitioner places its gathers and the verify's shard_map) and hands the
  results back replicated, as Explicit arrays the caller's program can use.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
    return fn
  return jax.sharding.auto_axes(fn, out_sharding=PartitionSpec())
