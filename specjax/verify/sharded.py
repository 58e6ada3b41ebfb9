"""The verify rule under a mesh: `jax.shard_map` over the batch axes, and over the vocabulary.

Rows are independent, so the rule (the jnp reference or the fused Pallas kernel, which cannot be
partitioned automatically) runs inside `jax.shard_map` on each device's rows. The per-row stream
seeds are split with the rows, so every row draws the same numbers as on one device.

Where the mesh also splits the vocabulary, each device holds a `[B / data, k + 1, V / model]` slice
and `specjax.verify.rule.verify_rule` runs over `ShardedVocab`: maxima, sums, threshold-search
counts and race winners are reduced on the slice and combined with `pmax` / `psum` / one
`all_gather` of (maximum, id) pairs per argmax, so full-vocabulary logits are never gathered.
Sampling with top-k runs `specjax.verify.candidates` (one collective round), sampling without
top-k or top-p `specjax.verify.two_rounds` (two). The local reductions are jnp, or Pallas kernels
(`specjax.kernels.vocab_reduce`) on TPU. A vocabulary that does not divide the vocabulary
axes is padded with `-inf` logits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from specjax.parallel.rules import DEFAULT_RULES, ShardingRules
from specjax.verify.candidates import candidate_verify, uses_candidates
from specjax.verify.rule import LocalVocab, verify_rule
from specjax.verify.two_rounds import combine_argmax, two_round_verify, uses_two_rounds
from specjax.core.sampling import Sampling, VerifyResult, warp_logits


class ShardedVocab:
  """A vocabulary slice per device inside `shard_map`; reductions combined over `axes`.

  Args:
    axes: the mesh axes the vocabulary is split over (inside the `shard_map`).
    vocab: the full vocabulary size.
    local: the reductions over this device's slice (`LocalVocab()`, or Pallas kernels).
  """

  def __init__(self, axes: tuple[str, ...], vocab: int, local=None):
    self.axes = tuple(axes)
    self.vocab = vocab
    self.local = LocalVocab() if local is None else local

  def offset(self, x):
    """The global id of this device's first vocabulary entry (`x`: its `[..., Vl]` slice)."""
    return jax.lax.axis_index(self.axes).astype(jnp.int32) * x.shape[-1]

  def ids(self, x):
    return self.offset(x) + jnp.arange(x.shape[-1], dtype=jnp.int32)

  def max(self, x):
    return jax.lax.pmax(self.local.max(x), self.axes)

  def sum(self, x):
    return jax.lax.psum(self.local.sum(x), self.axes)

  def sum_at_least(self, x, weights, thresholds):
    return jax.lax.psum(self.local.sum_at_least(x, weights, thresholds), self.axes)

  def argmax(self, x):
    """Global first-occurrence argmax, in one collective: every shard's (maximum, its first id)
    gathered, then the best value with the smallest id (`combine_argmax`)."""
    local_max, local_arg = self.local.max_and_argmax(x)
    ids = jax.lax.bitcast_convert_type(local_arg + self.offset(x), jnp.float32)
    got = jax.lax.all_gather(jnp.stack([local_max, ids], axis=-1), self.axes, axis=-1,
                             tiled=False)  # [..., 2, S]
    return combine_argmax(got[..., 0, :], jax.lax.bitcast_convert_type(got[..., 1, :], jnp.int32))

  def gather_at(self, x, ids):
    local = ids - self.offset(x)
    owned = (local >= 0) & (local < x.shape[-1])
    value = self.local.gather_at(x, jnp.clip(local, 0, x.shape[-1] - 1))
    return jax.lax.psum(jnp.where(owned, value, 0.0), self.axes)


def _candidate_rule(target, draft, tokens, *, ops: ShardedVocab, fallback, **kwargs):
  return candidate_verify(target, draft, tokens, axes=ops.axes, vocab=ops.vocab,
                          offset=ops.offset(target), fallback=fallback, **kwargs)


def _two_round_rule(target, draft, tokens, *, ops: ShardedVocab, **kwargs):
  return two_round_verify(target, draft, tokens, axes=ops.axes, vocab=ops.vocab,
                          offset=ops.offset(target), local=ops.local, **kwargs)


def _pad_vocab(x: jax.Array, multiple: int) -> jax.Array:
  extra = -x.shape[-1] % multiple
  if not extra:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)], constant_values=-jnp.inf)


def pad_vocab(x: jax.Array, multiple: int) -> jax.Array:
  """`x [..., V]` padded with `-inf` to a multiple of `multiple` (the vocabulary shard count):
  padded entries are never the argmax and have probability 0."""
  return _pad_vocab(x, multiple)


def mesh_layout(mesh, rules: ShardingRules, batch: int):
  """`(batch_spec, vocab_axes, vocab_shards)` of the verify under `mesh`.

  The batch is split over the batch rule's mesh axes (those that divide it), the vocabulary over
  the vocab rule's axes of size > 1.
  """
  mesh_shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
  vocab_axes = tuple(a for a in rules.mesh_axes("vocab") if mesh_shape.get(a, 1) > 1)
  batch_spec = rules.spec(("batch",), (batch,),
                          {a: s for a, s in mesh_shape.items() if a not in vocab_axes})[0]
  return batch_spec, vocab_axes, math.prod(mesh_shape[a] for a in vocab_axes)


def sharded_verify(target_logits: jax.Array, draft_logits: jax.Array | None,
                   draft_tokens: jax.Array, *, sampling: Sampling, seeds: jax.Array,
                   positions: jax.Array, mesh, rules: ShardingRules | None = None,
                   local_rule=None, vocab_ops=None, num_drafted=None) -> VerifyResult:
  """The verify rule on `mesh`: rows split over the batch axes, the vocabulary over the vocab axes.

  Args:
    target_logits: `[B, k + 1, V]` target logits.
    draft_logits: `[B, k, V]` drafter logits, or None for a point-mass drafter.
    draft_tokens: `[B, k]` int32 proposals.
    sampling: applied identically to both models' logits.
    seeds: `[B]` uint32 per-row stream seeds (split with the rows, so streams stay global).
    positions: `[B]` int32 absolute position of each row's first draft token.
    mesh: a `Mesh` or `AbstractMesh`.
    rules: logical-to-mesh rules (default `DEFAULT_RULES`).
    local_rule: the rule each device runs on its rows when the vocabulary is not split (a
      function with `verify_reference`'s signature, e.g. a fused kernel); default the reference.
    vocab_ops: the local reductions of `ShardedVocab` when the vocabulary is split (default jnp).
    num_drafted: `[B]` int32 drafts per row (split with the rows); None = all `k`.

  Returns:
    `VerifyResult(num_accepted [B], tokens [B, k + 1])`, equal to `verify_reference`'s.
  """
  rules = DEFAULT_RULES if rules is None else rules
  batch = draft_tokens.shape[0]
  vocab = target_logits.shape[-1]
  batch_spec, vocab_axes, shards = mesh_layout(mesh, rules, batch)
  vocab_spec = None if not vocab_axes else vocab_axes[0] if len(vocab_axes) == 1 else vocab_axes
  logits_spec = PartitionSpec(batch_spec, None, vocab_spec)
  row_spec = PartitionSpec(batch_spec)
  token_spec = PartitionSpec(batch_spec, None)
  has_draft = draft_logits is not None
  operands = [_pad_vocab(target_logits, shards)]
  specs = [logits_spec]
  if has_draft:
    operands.append(_pad_vocab(draft_logits, shards))
    specs.append(logits_spec)
  operands += [draft_tokens.astype(jnp.int32), jnp.asarray(seeds, jnp.uint32),
               jnp.asarray(positions, jnp.int32)]
  specs += [token_spec, row_spec, row_spec]
  if num_drafted is not None:
    operands.append(jnp.asarray(num_drafted, jnp.int32))
    specs.append(row_spec)

  if vocab_axes:
    ops = ShardedVocab(vocab_axes, vocab, vocab_ops)
    rule = functools.partial(verify_rule, ops)
    if uses_candidates(sampling, vocab):  # one all-gather of candidates, not one per statistic
      rule = functools.partial(_candidate_rule, ops=ops, fallback=rule)
    elif uses_two_rounds(sampling, vocab):  # two all-gathers, not one collective per statistic
      rule = functools.partial(_two_round_rule, ops=ops)
  else:
    rule = local_rule or functools.partial(verify_rule, LocalVocab())

  def body(*args):
    if not has_draft:
      args = (args[0], None) + args[1:]
    target, draft, tokens, row_seeds, row_positions, *counts = args
    extra = dict(num_drafted=counts[0]) if counts else {}
    result = rule(target, draft, tokens, sampling=sampling, seeds=row_seeds,
                  positions=row_positions, **extra)
    return result.num_accepted, result.tokens

  run = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=(row_spec, token_spec),
                      check_vma=False)
  num_accepted, tokens = run(*operands)
  return VerifyResult(num_accepted, tokens)


def sharded_warp_logits(logits: jax.Array, sampling: Sampling, *, mesh,
                        rules: ShardingRules | None = None) -> jax.Array:
  """`specjax.core.sampling.warp_logits` with the vocabulary split over the mesh's vocab axes.

  Args:
    logits: `[..., V]` raw logits.
    sampling: temperature > 0, optional top-k / top-p.
    mesh: the mesh.
    rules: logical-to-mesh rules (default `DEFAULT_RULES`).

  Returns:
    `[..., V]` float32 warped logits, sharded over the vocab axes (never gathered).
  """
  rules = DEFAULT_RULES if rules is None else rules
  vocab = logits.shape[-1]
  _, vocab_axes, shards = mesh_layout(mesh, rules, 1)
  vocab_spec = None if not vocab_axes else vocab_axes[0] if len(vocab_axes) == 1 else vocab_axes
  spec = PartitionSpec(*(None,) * (logits.ndim - 1), vocab_spec)
  ops = ShardedVocab(vocab_axes, vocab) if vocab_axes else LocalVocab()
  warped = jax.shard_map(lambda x: warp_logits(x, sampling, ops), mesh=mesh, in_specs=(spec,),
                         out_specs=spec, check_vma=False)(_pad_vocab(logits, shards))
  return warped[..., :vocab]
