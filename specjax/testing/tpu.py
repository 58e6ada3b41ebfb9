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
  * `GEMMA4_TEXT` and `gemma4_config(text, num_layers)`: Gemma 4 text decoders at real widths,
    test-sized (window and global layers, KV sharing), as `sj.from_hf` builds them;
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

__all__ = ["GEMMA4_TEXT", "REAL_CONFIGS", "TOPOLOGIES", "Compiled", "TpuCompileError",
           "abstract_like", "abstract_model", "abstract_tokens", "compile_call", "gemma4_config",
           "libtpu_available", "topology_devices", "topology_mesh"]

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


# Gemma 4 text decoders, as `gemma4_text` config.json fields (what `sj.from_hf` reads): E2B's
# widths (hidden 1536, the `backbone_hidden_size` `transformers`' `Gemma4AssistantConfig` defaults
# to for gemma-4-e2b-it; MLP 6144, twice as wide on KV-shared layers; 8 query heads over 1
# key/value head; head width 256 on window layers, 512 on global ones with proportional RoPE over
# a quarter of it; 256-wide per-layer embeddings over the whole vocabulary; window 512; logits
# soft-capped at 30), its 262,144-token vocabulary. The published config.json was not fetched
# here: these are widths of public descriptions, not checked against the file.
GEMMA4_TEXT = {
    "gemma-4-e2b": dict(
        model_type="gemma4_text", vocab_size=262_144, hidden_size=1536, intermediate_size=6144,
        num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
        hidden_size_per_layer_input=256, vocab_size_per_layer_input=262_144,
        use_double_wide_mlp=True, sliding_window=512, final_logit_softcapping=30.0,
        max_position_embeddings=131_072),
}


def gemma4_config(text: dict, num_layers: int = 4, vocab_size: int | None = None) -> ModelConfig:
  """The `ModelConfig` `sj.from_hf` builds from Gemma 4 text fields `text` with `num_layers`
  (even) layers, window and global alternating, the second half KV-shared: both kinds have a
  layer with keys and values of its own (the store layer a Gemma 4 assistant reads) and a layer
  that shares them. `vocab_size` replaces the vocabulary (and the per-layer embeddings' rows)."""
  from specjax.io.hf import hf_config_to_model_config  # pylint: disable=import-outside-toplevel
  if num_layers < 4 or num_layers % 2:
    raise ValueError(f"gemma4_config needs an even number of layers >= 4, got {num_layers}")
  fields = dict(text, num_hidden_layers=num_layers, num_kv_shared_layers=num_layers // 2,
                layer_types=["sliding_attention", "full_attention"] * (num_layers // 2))
  if vocab_size is not None:
    fields.update(vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size)
  return hf_config_to_model_config(fields)


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
                 static_argnames=(), effort: float | None = None, **kwargs) -> Compiled:
  """`jax.jit(fn).lower(*args, **kwargs).compile()` for TPU (inside `specjax.parallel.mesh.use_mesh(mesh)` when
  given).

  `effort`: XLA's `exec_time_optimization_effort` for this compile (-1.0 to 1.0; None keeps
  JAX's setting, 0). A negative effort spends less of the compiler's time on the program's
  speed: the partitioner, memory fitting and every Mosaic kernel's VMEM and layout checks still
  run, and the buffers come out within 5% of the default's (a 2-layer decode on one v5e chip:
  1.370 against 1.367 GiB; at B = 64 on v6e (2, 2): 1.007 against 0.960 GiB).

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
    options = None if effort is None else {"exec_time_optimization_effort": float(effort)}
    compiled = lowered.compile(options)
  except Exception as error:  # pylint: disable=broad-except  # XlaRuntimeError, JaxRuntimeError
    if "RESOURCE_EXHAUSTED" in str(error) or "Mosaic" in str(error) or "tpu" in str(error).lower():
      raise TpuCompileError(str(error)) from error
    raise
  return Compiled(compiled, compiled.memory_analysis())
