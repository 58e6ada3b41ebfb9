"""Compiling specjax for TPU on a host without one: the TPU compiler that `libtpu` ships.

`pip install "jax[tpu]==<jax version>"` installs `libtpu`, and with it
`jax.experimental.topologies.get_topology_desc` describes the devices of a TPU slice that is not
attached. `jax.jit(f).lower(*abstract arguments).compile()` then runs XLA:TPU and Mosaic (the
Pallas kernels' compiler) ahead of time: VMEM budgets, block shapes, layouts and HBM capacity are
checked as on the TPU itself. `jax.export` never gets that far (it stops at StableHLO).

Nothing is executed: the arguments are `jax.ShapeDtypeStruct`s carrying `NamedSharding`s on a mesh
of the abstract devices, so a 28-layer model at a 152k vocabulary costs no memory here.

This module is the compile tier's toolkit (tests/tpu, benchmarks/tpu_report.py):
  * `TOPOLOGIES` and `topology_mesh(name, shape)`: the slices the tier covers;
  * `REAL_CONFIGS`: public `config.json` values of the models the issue names;
  * `abstract_model(config, mesh, dtype)`: a `specjax.Model` of `ShapeDtypeStruct`s;
  * `compile_call(fn, *args)`: lower and compile, returning `Compiled` with the memory and cost
    analyses, or raising `TpuCompileError` with the compiler's own message.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax.models.config import ModelConfig, RopeScaling

__all__ = ["REAL_CONFIGS", "TOPOLOGIES", "Compiled", "TpuCompileError", "abstract_like",
           "abstract_model", "abstract_tokens", "compile_call", "libtpu_available",
           "topology_devices", "topology_mesh"]

# The slices the tier compiles for: name -> (topology name, the mesh shape used on it).
# "v5e-1": one v5e chip, Colab's TPU (16 GiB HBM). "v5e-4x4": 16 chips on 4 hosts.
TOPOLOGIES = {
    "v5e-1": ("v5e:2x2", (1, 1)),
    "v5e-1x4": ("v5e:2x2", (1, 4)),
    "v6e-2x2": ("v6e:2x2", (2, 2)),
    "v5p-1x4": ("v5p:2x2x1", (1, 4)),
    "v5e-4x4": ("v5e:4x4", (4, 4)),
}


def libtpu_available() -> bool:
  """Whether the TPU compiler (`libtpu`) is installed."""
  try:
    import libtpu  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    return False
  return True


@functools.lru_cache(maxsize=None)
def topology_devices(topology: str) -> tuple:
  """The abstract devices of a TPU topology ("v5e:2x2", "v5p:2x2x1", "v5e:4x4", ...)."""
  # libtpu looks for a TPU host's metadata; these keep it from warning about their absence.
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # Several processes (pytest-xdist workers) may each load libtpu to compile: without this the
  # second one stops at libtpu's single-process lockfile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  return tuple(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def topology_mesh(name: str, shape: tuple[int, ...] | None = None) -> jax.sharding.Mesh:
  """A `("data", "model")` mesh on the devices of `TOPOLOGIES[name]` (or of a raw topology name
  with an explicit `shape`)."""
  from specjax.parallel.mesh import make_mesh  # pylint: disable=import-outside-toplevel
  if name in TOPOLOGIES:
    topology, default_shape = TOPOLOGIES[name]
    shape = shape or default_shape
  else:
    topology = name
  count = 1
  for size in shape:
    count *= size
  return make_mesh(shape, devices=topology_devices(topology)[:count])


# --------------------------------------------------------------------------------------------
# Real architectures (public config.json values).
# --------------------------------------------------------------------------------------------

REAL_CONFIGS = {
    "qwen2.5-coder-1.5b": ModelConfig(
        vocab_size=151_936, embed_dim=1536, num_layers=28, num_heads=12, num_kv_heads=2,
        head_dim=128, mlp_dim=8960, max_len=32_768, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True,
        tie_embeddings=False, family="qwen2"),
    "qwen2.5-coder-0.5b": ModelConfig(
        vocab_size=151_936, embed_dim=896, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, mlp_dim=4864, max_len=32_768, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True,
        tie_embeddings=True, family="qwen2"),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128_256, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, mlp_dim=14_336, max_len=131_072, rope_theta=500_000.0,
        rope_scaling=RopeScaling(), norm_eps=1e-5, family="llama"),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128_256, embed_dim=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, mlp_dim=8192, max_len=131_072, rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=32.0), norm_eps=1e-5, tie_embeddings=True,
        family="llama"),
    "gemma-3-1b": ModelConfig(
        vocab_size=262_144, embed_dim=1152, num_layers=26, num_heads=4, num_kv_heads=1,
        head_dim=256, mlp_dim=6912, max_len=32_768, rope_theta=1e6, rope_local_theta=10_000.0,
        norm_eps=1e-6, norm_offset=1.0, activation="gelu_tanh", tie_embeddings=True,
        scale_embeddings=True, qk_norm=True, post_norms=True, query_pre_attn_scalar=256,
        sliding_window=512, sliding_window_pattern=6, family="gemma3"),
}


def with_layers(config: ModelConfig, num_layers: int = 2) -> ModelConfig:
  """`config` at its real widths and vocabulary with fewer layers (compile time)."""
  return dataclasses.replace(config, num_layers=num_layers)


# --------------------------------------------------------------------------------------------
# Abstract arguments.
# --------------------------------------------------------------------------------------------

def abstract_like(tree, shardings) -> Any:
  """`ShapeDtypeStruct`s of `tree`'s leaves carrying `shardings` (a matching tree, or one
  sharding for every leaf)."""
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings),
                        tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def abstract_model(config: ModelConfig, mesh: jax.sharding.Mesh, dtype=jnp.bfloat16, *,
                   rules=None):
  """A stacked-layer `specjax.Model` whose leaves are `ShapeDtypeStruct`s sharded as `sj.shard`
  would place them on `mesh` (no memory is allocated)."""
  from specjax.models.transformer import init_params  # pylint: disable=import-outside-toplevel
  from specjax.parallel.mesh import param_shardings  # pylint: disable=import-outside-toplevel
  shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0), dtype))
  return dataclasses.replace(shapes, params=abstract_like(
      shapes.params, param_shardings(shapes, mesh, rules)))


def abstract_tokens(mesh: jax.sharding.Mesh, batch: int, length: int):
  """`(tokens [B, T] int32, rng key)` as abstract arguments: rows over "data" where they divide."""
  data = mesh.shape.get("data", 1)
  rows = P("data", None) if batch % data == 0 else P()
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=NamedSharding(mesh, rows))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))
  return tokens, key


# --------------------------------------------------------------------------------------------
# Compiling.
# --------------------------------------------------------------------------------------------

class TpuCompileError(RuntimeError):
  """The TPU compiler rejected a program; the message is the compiler's."""


@dataclasses.dataclass
class Compiled:
  """A program the TPU compiler accepted, with its analyses (per device)."""

  compiled: Any
  memory: Any  # `CompiledMemoryStats`

  @property
  def argument_bytes(self) -> int:
    return self.memory.argument_size_in_bytes

  @property
  def temp_bytes(self) -> int:
    return self.memory.temp_size_in_bytes

  @property
  def output_bytes(self) -> int:
    return self.memory.output_size_in_bytes

  @property
  def total_bytes(self) -> int:
    """Arguments + outputs + temporaries - aliased (HBM the program needs on one device)."""
    m = self.memory
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes + m.generated_code_size_in_bytes)

  def cost(self) -> dict:
    """`cost_analysis()` (flops, bytes accessed...): a loop body is counted once."""
    cost = self.compiled.cost_analysis()
    return dict(cost[0] if isinstance(cost, (list, tuple)) else cost)

  def text(self) -> str:
    return self.compiled.as_text()


def compile_call(fn: Callable, *args, mesh: jax.sharding.Mesh | None = None,
                 static_argnames=(), **kwargs) -> Compiled:
  """`jax.jit(fn).lower(*args, **kwargs).compile()` for TPU (inside `specjax.parallel.mesh.use_mesh(mesh)` when
  given).

  Raises:
    TpuCompileError: the compiler's message (VMEM or HBM exhausted, a Mosaic rule broken...).
  """
  from specjax.parallel.mesh import use_mesh  # pylint: disable=import-outside-toplevel
  jitted = jax.jit(fn, static_argnames=static_argnames)
  try:
    if mesh is None:
      lowered = jitted.lower(*args, **kwargs)
    else:
      with use_mesh(mesh):
        lowered = jitted.lower(*args, **kwargs)
    compiled = lowered.compile()
  except Exception as error:  # pylint: disable=broad-except  # XlaRuntimeError, JaxRuntimeError
    if "RESOURCE_EXHAUSTED" in str(error) or "Mosaic" in str(error) or "tpu" in str(error).lower():
      raise TpuCompileError(str(error)) from error
    raise
  return Compiled(compiled, compiled.memory_analysis())
