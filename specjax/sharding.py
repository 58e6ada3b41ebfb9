"""The vocabulary-sharded verify rule (moving to `specjax/parallel/verify.py`).

**Vocab-sharded verify.** `sharded_verify` is `specjax.sampling.verify_reference` under
`jax.shard_map`: each `model` shard holds a vocabulary slice of the target (and draft) logits,
computes partial maxima, sums of exponentials and Gumbel-race winners (the noise is indexed by
the *global* vocabulary id, so the race is the one the unsharded reference runs), and combines
them with `pmax` / `psum` / `pmin` over the vocab mesh axes. The top-k threshold comes from a
16-way search over the order-preserving integer keys of float32 with `psum`'d counts, and the
top-p threshold the same way with `psum`'d masses: 8 collectives each, no sort, no gather.
Full-vocabulary logits are never gathered on one device.

Mesh rules and placement moved to `specjax.parallel` (`rules`, `mesh`); the names below are
re-exported from there for importers that have not switched yet.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from specjax.parallel.mesh import (cache_shardings, make_mesh, param_shardings,  # noqa: F401
                                   param_specs, per_device_bytes, shard, shard_cache, use_mesh)
from specjax.parallel.rules import (CACHE_AXES, DEFAULT_RULES, KEY_VALUE_AXES,  # noqa: F401
                                    LOGICAL_AXES, LOGITS_AXES, MLP_AXES, QUERY_AXES,
                                    RESIDUAL_AXES, ShardingRules, active_rules, constrain,
                                    logical_axes, use_rules, vocab_is_sharded)
from specjax.sampling import (
    PURPOSE_ACCEPT, PURPOSE_RESIDUAL, Sampling, VerifyResult, float_to_key, gumbel, key_to_float,
    uniform)

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

  def race(self, scores, seeds, positions, purpose: int):
    """`specjax.sampling.sample_race` with noise indexed by global vocabulary id."""
    noise = gumbel(seeds[..., None], positions[..., None], self.ids, purpose)
    return self.argmax(scores + noise)


def _leading_true(mask: jax.Array) -> jax.Array:
  return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _verify_shard(target_logits, draft_logits, draft_tokens, seeds, positions, *,
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
    u = uniform(seeds[:, None], token_positions[:, :k], 0, PURPOSE_ACCEPT)
    num_accepted = _leading_true(u * q_draft < p_draft)
    p_n = jnp.take_along_axis(p, num_accepted[:, None, None], axis=1)[:, 0]  # [b, Vl]
    q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    q_n = jnp.take_along_axis(q_padded, num_accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    has_mass = shard.sum(residual)[:, None] > 0
    weights = jnp.where(has_mass, residual, p_n)
    scores = jnp.where(weights > 0, jnp.log(weights), -jnp.inf)
    final = shard.race(scores, seeds, positions + num_accepted, PURPOSE_RESIDUAL)

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
                   draft_tokens: jax.Array, *, sampling: Sampling, seeds: jax.Array,
                   positions: jax.Array, mesh: jax.sharding.Mesh | None = None,
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
    seeds: `[B]` uint32 per-row stream seeds (split with the rows, so streams stay global).
    positions: `[B]` int32 absolute position of each row's first draft token.
    mesh: the mesh; None uses the active one (`use_mesh` / `jax.set_mesh`).
    rules: logical-to-mesh rules; default the active rules.

  Returns:
    `VerifyResult(num_accepted [B], tokens [B, k + 1])`, equal to `verify_reference`'s.
  """
  mesh, rules = _mesh_and_rules(mesh, rules)
  return _sharded_verify(target_logits, draft_logits, draft_tokens,
                         jnp.asarray(seeds, jnp.uint32), jnp.asarray(positions, jnp.int32),
                         sampling=sampling, mesh=mesh, rules=rules)


@functools.partial(jax.jit, static_argnames=("sampling", "mesh", "rules"))
def _sharded_verify(target_logits, draft_logits, draft_tokens, seeds, positions, *,
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
  operands += [draft_tokens.astype(jnp.int32), seeds, positions]
  specs += [PartitionSpec(batch_spec, None), row_spec, row_spec]

  def body(*args):
    if draft_logits is None:
      args = (args[0], None) + args[1:]
    return _verify_shard(*args, sampling=sampling, vocab=vocab, axes=vocab_axes)

  run = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                      out_specs=(row_spec, PartitionSpec(batch_spec, None)))
  num_accepted, tokens = run(*operands)
  return VerifyResult(num_accepted, tokens)
