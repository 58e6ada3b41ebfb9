"""`SpecjaxRollout`: exact speculative rollouts for tunix's RL trainers (GRPO, PPO, ...).

    from specjax.integrations.tunix import SpecjaxRollout
    cluster_config = rl_cluster_lib.ClusterConfig(rollout_engine=SpecjaxRollout, ...)
    # or functools.partial(SpecjaxRollout, drafter="int4", num_draft=6)

tunix's `RLCluster` builds the engine with `rollout_actor=` (the policy, a tunix nnx module:
Qwen2, Qwen3 or Llama 3), `tokenizer=`, `mesh=` and `rollout_config=`, calls `generate` for the
rollouts, `get_per_token_logps` for old-policy log-probabilities and `update_params` after each
training step (`RLCluster.sync_weights`, under JAX's transfer guard).

**Two jitted programs, both on the policy's weights as tunix holds them.** The weights program
(`_build`) turns the traced weights into a `specjax.Model` (`tunix_weights.to_specjax`: reshapes
and a cast; on CPU then packed into the CPU kernels' panels, `Model.for_platform`) and builds the
drafter from it, by default the policy's own int8 copy (`specjax.self_drafter(policy, bits=8)`:
quantized in jnp). It runs whenever the weights changed since the last rollout (after
`update_params`, or when a trainer sharing the variables wrote new arrays), so the copy never goes
stale, and its outputs serve every rollout of one weight version (micro-batches, evaluation). The
rollout program (`_rollout`) runs `specjax.decode`'s draft/verify loop with them (off CPU it
converts tunix's arrays itself, in place, keeping no second copy of the policy). `update_params`
only swaps the arrays the programs are called with: no host round trip of the weights, one
compiled program each for every training step.

**Exact.** Every drafter gives the policy's own sampling distribution (`specjax.decode`'s rule with
the drafter's own q), so the rollouts are on-policy samples: what the policy gradient assumes. The
log-probabilities (`RolloutConfig.return_logprobs`) come from the verify's own target logits
(`decode(..., return_logprobs=True)`), in tunix's form: `log_softmax(logits / T)[token]` over the
whole vocabulary, T = 1 when greedy, no top-k / top-p, one 1-D array per sample aligned with its
tokens.

**RolloutConfig.** Honoured: `temperature` (0 = greedy), `top_p` (None or 1 = off), `top_k` (None
or <= 0 = off), `seed` (an int or a key; None: a new key per call, `fold_in(key(0), call)`),
`max_tokens_to_generate`, `max_prompt_length` (prompts left-padded to it, or to the next power of
two of the longest prompt when longer, as tunix's sampler does), `kv_cache_size` (prompt width +
new tokens must fit, as tunix's sampler requires), `eos_tokens` (None: the tokenizer's; ids
outside the vocabulary never match and are dropped), `return_logprobs` and `data_type` (the
weights are cast to it). Differences from tunix's vanilla sampler: it samples greedily whenever
`top_p` is None, whatever the temperature; here the temperature decides, as in tunix's vLLM engine.
Its rows share one key per call; here each row has its own stream (`fold_in(key, row)`), so a
row's tokens do not depend on its batch neighbours. Refused with a ValueError naming the field:
parallelism settings other than the defaults (the engine runs on the mesh it is given),
`rollout_vllm_sampling_kwargs` (sampling fields specjax does not know), fields of a `RolloutConfig`
subclass that tunix does not define, and keyword arguments to `generate` (a beam search, `min_p`,
...), which no exact sampler of the policy's distribution can honour here.

**Drafters** (`drafter=`): "int8" (default) or "int4" (the policy's own quantized copy, rebuilt
for every weight version); `specjax.NGramDrafter()` / `specjax.SuffixDrafter(...)` (no weights:
agentic rollouts with repeated tool output); a separate draft model (a tunix nnx module of a
supported family, or a `specjax.Model`), which training does not update; or a function `policy
(specjax.Model, traced) -> drafter` called inside the drafter program.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix.generate import tokenizer_adapter
from tunix.generate import utils as sampler_utils
from tunix.rl import common as rl_common
from tunix.rl import reshard
from tunix.rl.rollout import base_rollout

from specjax.core.sampling import Sampling
from specjax.drafters import ModelDrafter, as_drafter
from specjax.drafters.model import default_group
from specjax.integrations import tunix_weights
from specjax.integrations.tunix_config import check_rollout_config, field_error, sampling_of
from specjax.loop.decode import decode
from specjax.models.quant import quantize
from specjax.models.transformer import Model

__all__ = ["SpecjaxRollout", "check_rollout_config", "sampling_of"]

@dataclasses.dataclass(frozen=True)
class _DrafterSpec:
  """How the weights program (`_build`) builds the drafter from the traced policy (hashable:
  static).

  `build(policy, extra)` runs inside the program; `extra` (the drafter's own arrays: a draft
  model's weights, a suffix corpus) is an argument of the program, never a constant in it."""

  kind: str  # "self", "fixed" (a drafter pytree), "model" (a tunix draft module), "callable"
  bits: int = 8
  config: Any = None  # a tunix draft module's specjax config
  dtype: Any = None
  fn: Callable | None = None

  def build(self, canonical: Model, policy: Model, extra):
    """The drafter, from the policy as converted (`canonical`, per layer) and as it runs
    (`policy`, `tunix_weights.as_platform_model`)."""
    if self.kind == "self":  # `self_drafter(policy)`, quantized before the CPU packing (cheaper)
      copy = quantize(canonical, self.bits, default_group(canonical, self.bits))
      return ModelDrafter(tunix_weights.as_platform_model(copy), share_prompt=True)
    if self.kind == "fixed":
      return extra
    if self.kind == "model":
      draft = tunix_weights.to_specjax(extra, self.config, self.dtype)
      return ModelDrafter(tunix_weights.as_platform_model(draft))
    return self.fn(policy)


def _drafter_spec(drafter, max_len: int) -> tuple[_DrafterSpec, Any]:
  """`(spec, extra)` for the engine's `drafter=` argument (see the module docstring)."""
  if isinstance(drafter, str):
    bits = {"int8": 8, "int4": 4}.get(drafter)
    if bits is None:
      raise ValueError(f"drafter={drafter!r}: the named drafters are 'int8' and 'int4' (the "
                       "policy's own quantized copy); pass a drafter, a draft model or a function "
                       "for anything else")
    return _DrafterSpec("self", bits=bits), None
  if isinstance(drafter, nnx.Module):
    config = tunix_weights.model_config(drafter, max_len)
    state = nnx.state(drafter, nnx.Param)
    return (_DrafterSpec("model", config=config, dtype=tunix_weights.compute_dtype(drafter)),
            tunix_weights.policy_params(state))
  if isinstance(drafter, Model):
    return _DrafterSpec("fixed"), ModelDrafter(drafter)
  if callable(drafter) and not hasattr(drafter, "propose"):
    return _DrafterSpec("callable", fn=drafter), None
  return _DrafterSpec("fixed"), as_drafter(drafter)


def _policy(params, config, dtype) -> Model:
  return tunix_weights.as_platform_model(tunix_weights.to_specjax(params, config, dtype))


def _policy_and_canonical(params, config, dtype) -> tuple[Model, Model]:
  canonical = tunix_weights.to_specjax(params, config, dtype)
  return tunix_weights.as_platform_model(canonical), canonical


@functools.partial(jax.jit, static_argnames=("config", "dtype", "spec", "keep_policy"))
def _build(params, extra, *, config, dtype, spec: _DrafterSpec, keep_policy: bool):
  """The weights program: from the traced weights, the policy (`_policy`) and the drafter built
  from it (by default its int8 copy, quantized in jnp). Returns `(policy or None, drafter)`:
  the policy only with `keep_policy` (on CPU, where its layout is a packed copy worth keeping
  for every rollout of these weights; elsewhere the rollout program reads tunix's arrays in
  place)."""
  policy, canonical = _policy_and_canonical(params, config, dtype)
  return (policy if keep_policy else None), spec.build(canonical, policy, extra)


@functools.partial(jax.jit, static_argnames=("config", "dtype", "num_draft", "sampling",
                                             "max_new_tokens", "eos_ids", "logprobs"))
def _rollout(policy, drafter, tokens, lengths, rng, *, config, dtype, num_draft: int,
             sampling: Sampling, max_new_tokens: int, eos_ids, logprobs: bool):
  """The rollout program: `specjax.decode` of the policy (a `specjax.Model` from `_build`, or
  tunix's weights, converted here) with the drafter `_build` made from the same weights."""
  if not isinstance(policy, Model):
    policy = _policy(policy, config, dtype)
  return decode(policy, drafter, tokens, rng, lengths=lengths, max_new_tokens=max_new_tokens,
                num_draft=num_draft, sampling=sampling, eos_id=eos_ids, pad_id=0,
                return_logprobs=logprobs)


class SpecjaxRollout(base_rollout.BaseRollout):
  """A tunix rollout engine that samples with exact speculative decoding (module docstring).

  Args:
    rollout_actor: the policy, a tunix nnx module (`tunix.models.qwen2` / `qwen3` / `llama3`).
    tokenizer: the tokenizer (wrapped in tunix's `TokenizerAdapter` where it is not one).
    mesh: the rollout mesh (kept as `self.mesh`; the program runs where the weights are).
    rollout_config: the training `RolloutConfig` (its `kv_cache_size` sets the context the
      program is compiled for; each call's config is checked again).
    drafter: "int8" (default), "int4", a specjax drafter, a draft model or a function (module
      docstring).
    num_draft: draft tokens per round (`k`).

  Raises:
    ValueError: an unsupported policy (another architecture, LoRA adapters, mixture of
      experts), a bad drafter or a `RolloutConfig` setting it cannot honour, naming it.
  """

  def __init__(self, rollout_actor=None, tokenizer=None, mesh=None, rollout_config=None, *,
               drafter="int8", num_draft: int = 4, **kwargs):
    if kwargs:
      raise ValueError(f"SpecjaxRollout got unknown argument(s) {', '.join(sorted(kwargs))}")
    if rollout_actor is None or tokenizer is None:
      raise ValueError("SpecjaxRollout needs rollout_actor= (the tunix policy) and tokenizer=")
    if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
      raise ValueError(f"num_draft must be a positive int, got {num_draft!r}")
    if nnx.state(rollout_actor, nnx.LoRAParam):
      raise ValueError("SpecjaxRollout does not convert LoRA policies yet: merge the adapters "
                       "into the base weights, or use tunix's vanilla engine")
    self.mesh = mesh
    self.num_draft = num_draft
    self.tokenizer = (tokenizer if isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter)
                      else tokenizer_adapter.TokenizerAdapter(tokenizer))
    self._config = rollout_config or base_rollout.RolloutConfig()
    check_rollout_config(self._config)
    self._max_len = int(self._config.kv_cache_size)
    tunix_weights.model_config(rollout_actor, self._max_len)  # the architecture is supported
    self._actor = rollout_actor  # its class and config; its weights are never written here
    # The policy's weights as tunix's vanilla engine holds them: the module's own variables (so a
    # trainer that shares them with the rollout, `RLCluster`'s colocated case, is read live), until
    # `update_params` replaces them with new ones.
    self._graphdef, self._state, self._rest = nnx.split(rollout_actor, nnx.Param, ...)
    placed = _on_mesh(tunix_weights.policy_params(self._state), mesh)
    if placed is not None:  # a rollout mesh of its own: a copy of the weights there, synced by
      self._replace(placed)  # `RLCluster.sync_weights` (`update_params`) after each step
    self._spec, self._extra = _drafter_spec(drafter, self._max_len)
    self._built = None  # (program key, the weights' arrays, `_build`'s outputs from them)
    self.drafter_builds = 0  # weight versions seen: how many times `_build` ran
    self._calls = 0
    self.last_stats: dict | None = None  # the last call's `DecodeStats.summary()`

  # --- BaseRollout ---------------------------------------------------------------------------

  def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
               **kwargs) -> base_rollout.RolloutOutput:
    """Samples one completion per prompt (see the module docstring for what is honoured).

    Returns:
      tunix's `RolloutOutput`: `text`, `tokens` (new tokens up to the first EOS, which is left
      out), `left_padded_prompt_tokens` `[B, max_prompt_length]`, `logprobs` (with
      `return_logprobs`, aligned with `tokens`) and `logits` (empty: never returned).

    Raises:
      ValueError: a setting it cannot honour, naming the field; prompts that do not fit
        `kv_cache_size`.
    """
    check_rollout_config(rollout_config, kwargs)
    if isinstance(prompts, str):
      prompts = [prompts]
    if not prompts:
      raise ValueError("SpecjaxRollout.generate needs at least one prompt")
    pad = self.pad_id()
    rows = [self._tokenize(p) for p in prompts]
    if min(len(r) for r in rows) == 0:
      raise ValueError("a prompt tokenized to no tokens (and the tokenizer has no BOS)")
    width = int(rollout_config.max_prompt_length)
    longest = max(len(r) for r in rows)
    if longest > width:  # as tunix's sampler: the next power of two of the longest prompt
      width = sampler_utils.next_power_of_2(longest)
    new = int(rollout_config.max_tokens_to_generate)
    if width + new > rollout_config.kv_cache_size:
      raise field_error("kv_cache_size", rollout_config.kv_cache_size,
                         f"the prompt width {width} plus max_tokens_to_generate {new} do not fit")
    left = np.array([sampler_utils.pad_to_length(np.asarray(r, np.int32), width, pad, left=True)
                     for r in rows], np.int32)
    right = np.zeros((len(rows), width), np.int32)
    for b, r in enumerate(rows):
      right[b, :len(r)] = r
    lengths = np.array([len(r) for r in rows], np.int32)

    config = tunix_weights.model_config(self._actor, max(self._max_len,
                                                         int(rollout_config.kv_cache_size)))
    dtype = (jnp.dtype(rollout_config.data_type) if rollout_config.data_type is not None
             else tunix_weights.compute_dtype(self._actor))
    eos = self._eos_ids(rollout_config, config.vocab_size)
    params = tunix_weights.policy_params(self._state)  # the current values, no copy
    policy, drafter = self._built_for(params, config, dtype)
    out = _rollout(params if policy is None else policy, drafter, jnp.asarray(right),
                   jnp.asarray(lengths),
                   self._key(rollout_config.seed), config=config, dtype=dtype,
                   num_draft=self.num_draft, sampling=sampling_of(rollout_config),
                   max_new_tokens=new, eos_ids=eos, logprobs=bool(rollout_config.return_logprobs))
    tokens, counts = np.asarray(out.tokens), np.asarray(out.num_tokens)
    logprobs = None if out.logprobs is None else np.asarray(out.logprobs)
    self.last_stats = out.stats.summary()
    eos_set = set(eos or ())
    cut_tokens, cut_logprobs = [], []
    for b in range(len(rows)):
      n = int(counts[b])
      if n and int(tokens[b, n - 1]) in eos_set:  # tunix's tokens stop before the first EOS
        n -= 1
      cut_tokens.append(tokens[b, :n])
      if logprobs is not None:
        cut_logprobs.append(logprobs[b, :n])
    return base_rollout.RolloutOutput(
        text=[self.tokenizer.decode(t.tolist()) for t in cut_tokens], logits=[],
        tokens=cut_tokens, left_padded_prompt_tokens=left,
        logprobs=cut_logprobs if logprobs is not None else None)

  def get_per_token_logps(self, prompt_tokens: jax.Array,
                          completion_tokens: jax.Array) -> jax.Array:
    """The policy's per-token log-probabilities of `completion_tokens` after the left-padded
    `prompt_tokens`: tunix's own `compute_per_token_logps` on the current weights (as its vanilla
    engine computes them)."""
    graphdef, state = nnx.split(self.model())
    return rl_common.compute_per_token_logps(
        graphdef, state, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        pad_id=self.pad_id(), eos_id=self.eos_id(), stop_gradient=True, return_logits=False)

  def update_params(self, params, filter_types: Optional[Tuple[Any, ...]] = None) -> None:
    """Takes the trainer's new weights (the whole policy's, or the subset `filter_types`
    selects: its `nnx.Param` state), resharded like the rollout's and cast to its dtypes.
    Nothing is converted or copied to the host here: the next `generate` call's program converts
    the weights and rebuilds the drafter from them."""
    del filter_types  # the state holds what it holds; its paths say where each weight goes
    new = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    new_flat = _flat(new)
    old_flat = _flat(tunix_weights.policy_params(self._state))
    unknown = sorted(set(new_flat) - set(old_flat))
    if unknown:
      raise ValueError(f"update_params got weights the policy does not have: {unknown[:3]}")
    moved = [k for k in new_flat
             if getattr(new_flat[k], "sharding", None) != getattr(old_flat[k], "sharding", None)]
    if moved:  # onto the rollout's shardings (device to device), as tunix's vanilla engine does
      target = {k: old_flat[k] for k in moved}
      source = {k: new_flat[k] for k in moved}
      if all(isinstance(x.sharding, jax.sharding.NamedSharding) for x in target.values()):
        new_flat.update(reshard.reshard_pytree(source, target))
      else:
        new_flat.update({k: jax.device_put(x, target[k].sharding) for k, x in source.items()})
    merged = dict(old_flat)
    for key, value in new_flat.items():
      old = old_flat[key]
      merged[key] = value if value.dtype == old.dtype else value.astype(old.dtype)
    self._replace(_unflat(merged))

  def _replace(self, params: dict) -> None:
    """Holds `params` (a nested dict) in new variables (a clone), never writing the old ones: the
    module given at construction, and a trainer sharing its variables, keep theirs."""
    module = nnx.clone(self.model())
    state = nnx.state(module, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(module, state)
    self._graphdef, self._state, self._rest = nnx.split(module, nnx.Param, ...)

  def pad_id(self) -> int:
    return self.tokenizer.pad_id()

  def eos_id(self) -> int:
    return self.tokenizer.eos_id()

  def model(self) -> nnx.Module:
    """The policy with the engine's current weights (an nnx module over its variables: the
    module given at construction until `update_params`)."""
    return nnx.merge(self._graphdef, self._state, self._rest)

  @property
  def params(self) -> dict:
    """The current weights as a nested dict of arrays (what the rollout program reads)."""
    return tunix_weights.policy_params(self._state)

  # --- helpers -------------------------------------------------------------------------------

  def _built_for(self, params: dict, config, dtype):
    """`(policy or None, drafter)` for the weights `params`: built by `_build` (one jitted
    program on the traced weights) when they changed since the last call (`update_params`, or a
    trainer that shares the variables and wrote new arrays into them), else the ones built
    then."""
    leaves = jax.tree.leaves(params)
    key = (config, dtype)
    cached = self._built
    if cached is not None and cached[0] == key and len(cached[1]) == len(leaves) and all(
        a is b for a, b in zip(cached[1], leaves)):
      return cached[2]
    self._built = None  # the old version's buffers go before the new ones are made
    built = _build(params, self._extra, config=config, dtype=dtype, spec=self._spec,
                   keep_policy=jax.default_backend() == "cpu")
    self._built = (key, leaves, built)  # the leaves kept: their ids stay theirs
    self.drafter_builds += 1
    return built

  def _tokenize(self, text: str) -> list[int]:
    """tunix's sampler's tokenization: BOS (where the tokenizer has one), the text, no doubled
    BOS."""
    ids = list(self.tokenizer.encode(text))
    bos = self.tokenizer.bos_id()
    return list(self.tokenizer.dedup_bos_ids(([bos] if bos else []) + ids))

  def _eos_ids(self, config, vocab_size: int) -> tuple[int, ...] | None:
    ids = config.eos_tokens if config.eos_tokens else [self.eos_id()]
    kept = tuple(int(i) for i in np.ravel(ids) if 0 <= int(i) < vocab_size)
    return kept or None  # ids the policy cannot emit never stop a row

  def _key(self, seed) -> jax.Array:
    if seed is None:
      self._calls += 1
      return jax.random.fold_in(jax.random.key(0), self._calls)
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
      return jax.random.key(int(seed))
    if isinstance(seed, (jax.Array, np.ndarray)):
      if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) and seed.shape == ():
        return seed
      if seed.dtype == jnp.uint32 and seed.shape == (2,):  # a raw `jax.random.PRNGKey`
        return jax.random.wrap_key_data(seed)
      if seed.shape == () and jnp.issubdtype(seed.dtype, jnp.integer):
        return jax.random.key(int(seed))
    raise field_error("seed", seed, "must be None, an int or a PRNG key")


def _on_mesh(params: dict, mesh) -> dict | None:
  """`params` placed on `mesh` where some weight lies elsewhere (each keeps its partition spec
  where `mesh` has its axes, else is replicated), or None where every weight is there already
  (or no mesh is given)."""
  if mesh is None:
    return None
  leaves, tree = jax.tree.flatten(params)

  def placed(x):
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh == mesh:
      return None
    spec = jax.sharding.PartitionSpec()
    if isinstance(sharding, jax.sharding.NamedSharding) and all(
        name in mesh.axis_names for part in sharding.spec if part is not None
        for name in (part if isinstance(part, tuple) else (part,))):
      spec = sharding.spec
    return jax.sharding.NamedSharding(mesh, spec)

  targets = [placed(x) for x in leaves]
  if all(t is None for t in targets):
    return None
  return jax.tree.unflatten(tree, [x if t is None else jax.device_put(x, t)
                                   for x, t in zip(leaves, targets)])


def _flat(tree: dict, prefix: tuple = ()) -> dict[tuple, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, prefix + (key,)))
    else:
      out[prefix + (key,)] = value
  return out


def _unflat(flat: dict[tuple, Any]) -> dict:
  out: dict = {}
  for path, value in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out
