"""What `SpecjaxRollout` honours of a tunix `RolloutConfig`, and what it refuses before compiling
(`specjax.integrations.tunix`'s docstring lists both): `sampling_of` and `check_rollout_config`."""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp
import numpy as np

from tunix.rl.rollout import base_rollout

from specjax.core.sampling import Sampling

__all__ = ["check_rollout_config", "field_error", "sampling_of"]

# RolloutConfig fields that must keep their defaults: the engine runs on the mesh it is given.
_PARALLELISM_DEFAULTS = {"tensor_parallel_size": -1, "data_parallel_size": -1,
                         "expert_parallel_size": 1}
_KNOWN_FIELDS = frozenset(f.name for f in dataclasses.fields(base_rollout.RolloutConfig))
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def field_error(name: str, value, why: str) -> ValueError:
  return ValueError(f"RolloutConfig.{name}={value!r}: {why}")


def sampling_of(config: base_rollout.RolloutConfig) -> Sampling:
  """The `specjax.Sampling` of a `RolloutConfig` (temperature, top-k, top-p).

  Raises:
    ValueError: naming the field (`RolloutConfig.temperature`, `top_p`, `top_k`).
  """
  t = config.temperature
  if isinstance(t, bool) or not isinstance(t, numbers.Real) or not np.isfinite(t) or t < 0:
    raise field_error("temperature", t, "must be a finite number >= 0 (0 = greedy)")
  top_p = config.top_p
  if top_p is not None:
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
      raise field_error("top_p", top_p, "must be None or in (0, 1]")
    top_p = None if top_p >= 1 else float(top_p)
  top_k = config.top_k
  if top_k is not None:
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
      raise field_error("top_k", top_k, "must be None or an int (<= 0: all tokens)")
    top_k = int(top_k) if top_k > 0 else None
  if float(t) == 0.0:
    return Sampling()
  return Sampling(temperature=float(t), top_k=top_k, top_p=top_p)


def check_rollout_config(config, kwargs: dict | None = None) -> None:
  """Refuses the settings this engine cannot honour, naming the field (see the module docstring).

  Raises:
    ValueError: naming the field or keyword argument.
  """
  if kwargs:
    names = ", ".join(sorted(kwargs))
    raise ValueError(f"SpecjaxRollout.generate got {names}: unsupported (it samples exactly from "
                     "the policy's distribution under RolloutConfig's temperature / top_k / "
                     "top_p; a beam search or another sampling rule is not that)")
  if not isinstance(config, base_rollout.RolloutConfig):
    raise ValueError(f"rollout_config must be a tunix RolloutConfig, got {type(config).__name__}")
  extra = sorted(f.name for f in dataclasses.fields(config)
                 if f.name not in _KNOWN_FIELDS and getattr(config, f.name) is not None)
  if extra:
    raise ValueError(f"RolloutConfig field(s) {', '.join(extra)} unknown to SpecjaxRollout: it "
                     "honours temperature, top_p, top_k, seed, max_tokens_to_generate, "
                     "max_prompt_length, kv_cache_size, eos_tokens, return_logprobs and data_type")
  sampling_of(config)
  for name in ("max_tokens_to_generate", "max_prompt_length", "kv_cache_size"):
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
      raise field_error(name, value, "must be a positive int")
  for name, default in _PARALLELISM_DEFAULTS.items():
    if getattr(config, name) != default:
      raise field_error(name, getattr(config, name),
                         f"SpecjaxRollout runs on the rollout mesh it is given; leave it at "
                         f"{default}")
  if config.rollout_vllm_sampling_kwargs:
    raise field_error("rollout_vllm_sampling_kwargs", config.rollout_vllm_sampling_kwargs,
                       "vLLM sampling fields are not honoured by SpecjaxRollout")
  if config.data_type is not None and jnp.dtype(config.data_type) not in map(jnp.dtype, _DTYPES):
    raise field_error("data_type", config.data_type, "must be None, float32, bfloat16 or float16")
  eos = config.eos_tokens
  if eos is not None and (isinstance(eos, (str, bytes)) or not all(
      isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in np.ravel(eos))):
    raise field_error("eos_tokens", eos, "must be None or a sequence of ints")
