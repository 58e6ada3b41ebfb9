"""Adapters: a Flax NNX or Linen module plus its parameters as a specjax model.

`specjax.decode` and `specjax.generate` need a pytree with `__call__(tokens, starts,
cache) -> ForwardOutput`, `init_cache(batch, max_len)`, `vocab_size` and `max_len`. The adapters
below give that to any Flax module that maps `(tokens [B, T], starts [B], cache: KVCache)` to
`(logits [B, T, V], cache)` (see `specjax.models.flax_decoder` for a template). Their pytree leaves
are the user's parameters and everything else is static, so an adapted model crosses `jax.jit` as an
argument: inside a jitted training-eval step, build it from the current (traced) params and call
`specjax.decode` -- the step compiles once, whatever the parameter values.

    decoder = NNXDecoder(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(decoder)

    @jax.jit
    def eval_step(state, draft_state, tokens, rng):
      target = NNXModel(graphdef, state, spec)
      draft = NNXModel(draft_graphdef, draft_state, draft_spec)
      return sj.decode(target, draft, tokens, rng, max_new_tokens=16)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.core.cache import KVCache
from specjax.models.transformer import ForwardOutput


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """What specjax must know about a module that it cannot read from the parameters.

  Attributes:
    vocab_size: number of token ids (draft and target must agree).
    max_len: the longest sequence (prompt + new tokens) the module supports.
    num_layers: layers with a key/value cache.
    num_kv_heads: key/value heads per layer.
    head_dim: width of one head.
    dtype: cache dtype.
    finite_past_max_len: whether the module's outputs stay finite when it is called at positions
      `>= max_len` (rotary positions, or a learned table that clips its index as
      `specjax.models.flax_decoder` does). A round scores `k` drafts after each row's last token,
      so near the end of the context it calls the model at positions up to
      `prompt + max_new_tokens + k - 1`; those drafts are never emitted, but a NaN there reaches
      the row's emitted positions through attention. True: `decode` runs to the full context,
      like `generate`. False (the default, for a module specjax cannot inspect): `decode`
      reserves the last round's positions inside the context and refuses, before compiling, a
      call whose `prompt + max_new_tokens + k` exceeds `max_len`.
  """

  vocab_size: int
  max_len: int
  num_layers: int
  num_kv_heads: int
  head_dim: int
  dtype: Any = jnp.float32
  finite_past_max_len: bool = False

  @classmethod
  def from_config(cls, config, dtype=jnp.float32, *,
                  finite_past_max_len: bool = False) -> "CacheSpec":
    """From a config with `vocab_size, max_len, num_layers, num_heads, head_dim` fields."""
    return cls(config.vocab_size, config.max_len, config.num_layers,
               getattr(config, "num_kv_heads", config.num_heads), config.head_dim, dtype,
               finite_past_max_len)


class _Protocol:
  """`vocab_size`, `max_len`, `init_cache` and `__call__` from `spec` and `_apply`."""

  spec: CacheSpec

  @property
  def vocab_size(self) -> int:
    return self.spec.vocab_size

  @property
  def max_len(self) -> int:
    return self.spec.max_len

  @property
  def finite_past_max_len(self) -> bool:
    return self.spec.finite_past_max_len

  def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
    s = self.spec
    return KVCache.create(s.num_layers, batch, max_len, s.num_kv_heads, s.head_dim,
                          dtype or s.dtype)

  def __call__(self, tokens, starts, cache=None, *, taps=(), return_hidden=False) -> ForwardOutput:
    if return_hidden or tuple(taps):
      raise ValueError("adapted Flax models do not expose hidden states or taps")
    if cache is None:
      cache = self.init_cache(tokens.shape[0], tokens.shape[1])
    logits, cache = self._apply(tokens, jnp.asarray(starts, jnp.int32), cache)
    return ForwardOutput(logits, None, None, cache)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NNXModel(_Protocol):
  """A Flax NNX module as a specjax model: `nnx.split` graphdef (static) + state (leaves).

  Attributes:
    graphdef: from `nnx.split(module)`; hashable, part of the jit cache key.
    state: the module's state (its parameters): the pytree leaves.
    spec: the cache layout and vocabulary.
  """

  graphdef: Any = dataclasses.field(metadata=dict(static=True))
  state: Any
  spec: CacheSpec = dataclasses.field(metadata=dict(static=True))

  def _apply(self, tokens, starts, cache):
    from flax import nnx
    return nnx.merge(self.graphdef, self.state)(tokens, starts, cache)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinenModel(_Protocol):
  """A Flax Linen module as a specjax model: the module (static) + its params (leaves).

  Attributes:
    module: the Linen module; `module.apply(params, tokens, starts, cache)` is the forward.
    params: the variables passed to `apply` (e.g. `{"params": ...}`): the pytree leaves.
    spec: the cache layout and vocabulary.
  """

  module: Any = dataclasses.field(metadata=dict(static=True))
  params: Any
  spec: CacheSpec = dataclasses.field(metadata=dict(static=True))

  def _apply(self, tokens, starts, cache):
    return self.module.apply(self.params, tokens, starts, cache)


def from_nnx(module, spec: CacheSpec) -> NNXModel:
  """Splits an NNX module into an `NNXModel` (call again after training steps, or keep the
  graphdef and build `NNXModel(graphdef, state, spec)` from new state inside your jitted step)."""
  from flax import nnx
  graphdef, state = nnx.split(module)
  return NNXModel(graphdef, state, spec)


def from_linen(module, params, spec: CacheSpec) -> LinenModel:
  """Wraps a Linen module and its variables as a `LinenModel`."""
  return LinenModel(module, params, spec)
