"""The exact tree verify with the vocabulary split over a mesh: per-node decisions from slices.

`specjax.verify.tree_rule` decides, at every extended node `n` of a draft tree, something that does
not depend on the path reaching `n` (`specjax.kernels.tree_common.NodeResults`): the
target's sample `y_n` ("match"), or the sibling loop over `n`'s children and the residual race
("iid", "without_replacement"). Everything vocabulary-sized in those decisions is a reduction over
the vocabulary (a threshold search, a normaliser, a mass, a Gumbel race), so it splits exactly:

* `node_results_over(ops, ...)` computes `NodeResults` over a vocab-ops object:
  `FusedLocalVocab()` on a whole vocabulary, `ShardedTreeVocab` (a
  `specjax.verify.sharded.ShardedVocab`) on one device's slice inside `shard_map`. Top-k and top-p
  thresholds are `warp_logits`' radix search, one collective per round; the normalisers are sums
  over the slices; the sibling loop's four masses per node and rank (`r(t)`, `s(t)`,
  `sum max(r - s, 0)`, `sum s` without `t`) are local partial sums combined in one `psum`; a race
  is each slice's best (value, global id), gathered and combined as `first_argmax` orders them (a
  NaN, else the largest value, then the smallest id). The Gumbel noise is keyed by the global
  vocabulary id (`specjax.core.sampling`'s counter streams), so every slice draws the
  single-device numbers for its own entries.
* `sharded_verify_tree` runs it inside `jax.shard_map` with rows split over the batch axes and
  the logits' vocabulary over the vocab axes (`specjax.verify.sharded.mesh_layout`), then walks
  the `[B, N + 1]` decisions (`tree_rule.walk_node_results`). No device holds a row's whole
  vocabulary.

Memory: as the fused kernels do tile by tile, every pass over the vocabulary (a threshold round, a
normaliser, a sibling rank, the races) recomputes the warped probabilities from the raw logits
and per-node scalars, and the residuals after rejected siblings by replaying their elementwise
updates (`tree_common.replay`); each pass is one reduction that computes its own input (see
`FusedLocalVocab`). So besides its inputs the verify stores no `[B_local, N + 1, V_local]` array
but, for the sampled rules, the children's draft logits gathered per node.

The elementwise steps are the reference's (`tree_common.residual_step`, `remove_step`,
`log_weights`, the ratio test `tree_rule.accepts`); only the order of float32 additions inside
vocabulary sums differs from one device's, which can move a decision only when a comparison sits
within rounding of its boundary, as with the fused kernels and the sharded chain verify.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from specjax.core.sampling import Sampling, radix_threshold
from specjax.parallel.rules import DEFAULT_RULES, ShardingRules
from specjax.trees import structure as trees
from specjax.trees.structure import Tree
from specjax.verify import tree_rule
from specjax.kernels.tree_common import (EXACT_STEPS, NodeResults, children_draft_logits,
                                         log_weights, node_inputs, node_noise,
                                         node_results, replay, sampled_rule)
from specjax.verify.rule import LocalVocab
from specjax.verify.sharded import ShardedVocab, mesh_layout, pad_vocab
from specjax.verify.two_rounds import combine_argmax

__all__ = ["FusedLocalVocab", "ShardedTreeVocab", "node_results_over", "sharded_verify_tree"]


_INT32_MAX = jnp.iinfo(jnp.int32).max
_NEG_INF = float("-inf")


def _add(a, b):
  return tuple(u + v for u, v in zip(a, b))


def _better(a, b):
  """The first-argmax order on `(value, id)` pairs: a NaN first (the smaller id among NaNs), then
  the larger value, then the smaller id. A total order, so any reduction tree gives the answer
  of `first_argmax`."""
  (a_value, a_id), (b_value, b_id) = a, b
  a_nan, b_nan = jnp.isnan(a_value), jnp.isnan(b_value)
  first = a_id < b_id
  take_a = jnp.where(a_nan | b_nan, a_nan & (~b_nan | first),
                     (a_value > b_value) | ((a_value == b_value) & first))
  return jnp.where(take_a, a_value, b_value), jnp.where(take_a, a_id, b_id)


def _best_of_each(a, b):
  pairs = [_better(a[i:i + 2], b[i:i + 2]) for i in range(0, len(a), 2)]
  return tuple(x for pair in pairs for x in pair)


class FusedLocalVocab(LocalVocab):
  """The whole vocabulary on one device, each statistic one reduction that computes its input.

  `LocalVocab`'s reductions give the same answers, but some read their input several times
  (`first_argmax`: a max, then a min over the ids where it sits; `sum_at_least`: a sum per
  threshold over a broadcast), so a compiler stores a computed input whole (a race's noisy scores,
  the scaled logits of a threshold round) rather than compute it again. Here every statistic is
  one reduction, several results at once where several are needed (`races`, `partial_sums`):
  nothing vocabulary-sized is stored.
  """

  def races(self, *scores: jax.Array) -> tuple[jax.Array, ...]:
    """The first argmax of each of `scores` (`[..., V]` each, same shape), in one reduction."""
    return tuple(arg for _, arg in self.max_and_argmax_each(*scores))

  def max_and_argmax_each(self, *scores: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """`(max, first argmax)` of each of `scores`, in one reduction over `(value, id)` pairs."""
    axis = scores[0].ndim - 1
    ids = jax.lax.broadcasted_iota(jnp.int32, scores[0].shape, axis)
    operands = tuple(x for score in scores for x in (score.astype(jnp.float32), ids))
    init = (jnp.float32(_NEG_INF), jnp.int32(_INT32_MAX)) * len(scores)
    out = jax.lax.reduce(operands, init, _best_of_each, (axis,))
    return [(out[i], out[i + 1]) for i in range(0, len(out), 2)]

  def max_and_argmax(self, x):
    return self.max_and_argmax_each(x)[0]

  def argmax(self, x):
    return self.races(x)[0]

  def sum_at_least(self, x, weights, thresholds):
    """`LocalVocab.sum_at_least` as one reduction with an operand per threshold."""
    num = thresholds.shape[-1]
    if weights is None:
      parts = tuple(jnp.where(x >= thresholds[..., j:j + 1], 1, 0).astype(jnp.int32)
                    for j in range(num))
      zero = jnp.int32(0)
    else:
      parts = tuple(jnp.where(x >= thresholds[..., j:j + 1], weights, 0.0) for j in range(num))
      zero = jnp.float32(0)
    return jnp.stack(jax.lax.reduce(parts, (zero,) * num, _add, (x.ndim - 1,)), axis=-1)

  def partial_sums(self, *xs: jax.Array) -> jax.Array:
    """`[..., len(xs)]` this slice's sums of each of `xs` over the last axis, in one reduction."""
    zeros = (jnp.float32(0),) * len(xs)
    sums = jax.lax.reduce(tuple(x.astype(jnp.float32) for x in xs), zeros, _add,
                          (xs[0].ndim - 1,))
    return jnp.stack(sums, axis=-1)

  def combine_sums(self, partial: jax.Array) -> jax.Array:
    """The whole vocabulary's sums from every slice's `partial_sums` (one slice: themselves)."""
    return partial


class ShardedTreeVocab(ShardedVocab):
  """`ShardedVocab` over `FusedLocalVocab` slices, with the tree verify's combined statistics.

  Args:
    axes: the mesh axes the vocabulary is split over (inside the `shard_map`).
    vocab: the full vocabulary size.
  """

  def __init__(self, axes: tuple[str, ...], vocab: int):
    super().__init__(axes, vocab, FusedLocalVocab())

  def races(self, *scores: jax.Array) -> tuple[jax.Array, ...]:
    """The global first argmax of each of `scores` (`[..., Vl]` slices): one local reduction,
    then every slice's winners (value, global id) in one `all_gather`, combined as
    `first_argmax` (`combine_argmax`: a NaN, else the largest value, then the smallest id)."""
    local = self.local.max_and_argmax_each(*scores)
    values = jnp.stack([best for best, _ in local], axis=-1)  # [..., K]
    ids = jnp.stack([arg for _, arg in local], axis=-1) + self.offset(scores[0])
    got = jax.lax.all_gather(jnp.stack([values, _as_float(ids)], axis=-1), self.axes,
                             axis=-1, tiled=False)  # [..., K, 2, S]
    return self.combine_races(got[..., 0, :], _as_int(got[..., 1, :]))

  def combine_races(self, values: jax.Array, ids: jax.Array) -> tuple[jax.Array, ...]:
    """`[..., K, S]` every slice's winners of `K` races -> the `K` global winners."""
    winners = combine_argmax(values, ids)  # [..., K]
    return tuple(winners[..., k] for k in range(winners.shape[-1]))

  def partial_sums(self, *xs: jax.Array) -> jax.Array:
    return self.local.partial_sums(*xs)

  def combine_sums(self, partial: jax.Array) -> jax.Array:
    return jax.lax.psum(partial, self.axes)


def _as_float(ids):
  return jax.lax.bitcast_convert_type(ids.astype(jnp.int32), jnp.float32)


def _as_int(x):
  return jax.lax.bitcast_convert_type(x, jnp.int32)


def _tied(x: jax.Array, *loop_values) -> jax.Array:
  """`x`, made to depend on values of the enclosing loop's iteration: what is computed from it
  stays in the loop body (fused into the body's reductions) instead of being hoisted out of the
  loop as an invariant and stored whole."""
  return jax.lax.optimization_barrier((x, loop_values))[0] if loop_values else x


class _Warp(NamedTuple):
  """One set of logits warped by `Sampling`, as per-node scalars over the raw logits `raw`:
  `x = raw / T` is kept where `x >= floor` (`warp_logits`), the distribution is
  `exp(kept - top) / total`."""

  raw: jax.Array  # [B, N + 1, Vl] raw logits (the slice)
  temperature: float
  floor: jax.Array  # [B, N + 1]
  top: jax.Array  # [B, N + 1] the largest scaled logit (always kept)
  total: jax.Array  # [B, N + 1] sum of exp(kept - top) over the whole vocabulary

  def scaled(self, *loop_values):
    return _scaled(_tied(self.raw, *loop_values), self.temperature)

  def kept(self, *loop_values):
    x = self.scaled(*loop_values)
    return jnp.where(x >= self.floor[..., None], x, _NEG_INF)

  def probabilities(self, *loop_values):
    return jnp.exp(self.kept(*loop_values) - self.top[..., None]) / self.total[..., None]


def _scaled(raw, temperature: float):
  return raw.astype(jnp.float32) / jnp.float32(temperature)


def _warp(ops, raw: jax.Array, sampling: Sampling) -> _Warp:
  """`warp_logits(raw, sampling, ops)` and its softmax normaliser, as per-node scalars.

  The thresholds are `warp_logits`' (`top_k_threshold`, then `top_p_threshold` over the top-k
  survivors): the same radix search over the same predicates, one reduction (and collective) per
  round, but each round recomputes the scaled logits from `raw` instead of reading a stored copy.
  The normaliser's maximum is `top`: both thresholds lie at or below the largest logit, which is
  therefore kept.
  """
  vocab = getattr(ops, "vocab", None) or raw.shape[-1]
  warp = _Warp(raw, sampling.temperature, None, None, None)
  top = ops.max(warp.scaled())
  floor = jnp.full_like(top, _NEG_INF)
  if sampling.top_k is not None and sampling.top_k < vocab:
    floor = radix_threshold(floor, top, lambda t: ops.sum_at_least(
        warp.scaled(t), None, t) >= sampling.top_k)
  warp = warp._replace(floor=floor, top=top)
  if sampling.top_p is not None and sampling.top_p < 1.0:
    weights = lambda *loop: jnp.exp(warp.kept(*loop) - top[..., None])  # 0 where dropped
    needed = jnp.float32(sampling.top_p) * ops.sum(weights())
    floor = radix_threshold(floor, top, lambda t: ops.sum_at_least(
        warp.kept(t), weights(t), t) >= needed[..., None])
    warp = warp._replace(floor=floor)
  return warp._replace(total=ops.sum(jnp.exp(warp.kept() - top[..., None])))


def node_results_over(ops, target_logits: jax.Array, tree: Tree, *, rule: str,
                      sampling: Sampling, seeds: jax.Array, positions: jax.Array,
                      max_children: int | None = None) -> NodeResults:
  """What the tree rule decides at every extended node, over a vocabulary slice.

  Nothing `[B, N + 1, Vl]` is stored but the children's draft logits gathered per node (sampled
  rules; see the module doc).

  Args:
    ops: the vocabulary statistics: `FusedLocalVocab()` when `target_logits` holds the whole
      vocabulary, `ShardedTreeVocab` inside a `shard_map` that splits it (`ShardedVocab`'s
      `ids`, `max`, `sum`, `sum_at_least`, and `races`, `partial_sums`, `combine_sums`).
    target_logits: `[B, N + 1, Vl]` raw target logits after the root and every node (this
      device's vocabulary slice; entries past the vocabulary `-inf`).
    tree: the draft tree; `tree.logits` `[B, N, Vl]` (the same slice) for the sampled rules.
    rule: "match", "iid" or "without_replacement"; greedy always matches the argmax.
    sampling: applied identically to target and draft logits.
    seeds: `[B]` uint32 row seeds; positions: `[B]` int32 position of a child of the root.
    max_children: static bound `M` on siblings (sampled rules); default `N`.

  Returns:
    `NodeResults` `[B, N + 1]` each, the same on every slice and equal to the reference's
    decisions (`specjax.kernels.tree_common`): `token` ("match": `y_n`; sampled: the
    residual race), `p_token` (the race over `p_n`), `accepted` (the accepted child's node
    index, -1 if none).
  """
  if rule not in tree_rule.RULES:
    raise ValueError(f"rule must be one of {tree_rule.RULES}, got {rule!r}")
  batch, num_nodes = tree.tokens.shape
  if target_logits.ndim != 3 or target_logits.shape[:2] != (batch, num_nodes + 1):
    raise ValueError(f"target_logits must be [B, N + 1, V] = [{batch}, {num_nodes + 1}, V], "
                     f"got {target_logits.shape}")
  seeds = jnp.asarray(seeds, jnp.uint32)
  positions = jnp.asarray(positions, jnp.int32)
  none = jnp.full((batch, num_nodes + 1), -1, jnp.int32)
  if sampling.greedy:
    (y,) = ops.races(target_logits)
    return NodeResults(y, y, none)
  sampled = sampled_rule(rule, sampling)
  if sampled and tree.logits is None:
    raise ValueError(f"rule {rule!r} needs the draft logits the children were drawn from")
  num_children = max_children or num_nodes
  inputs = node_inputs(tree, seeds, positions, num_children, sampled)
  ids = ops.ids(target_logits)  # [Vl] global vocabulary ids of the slice
  ext = jnp.arange(num_nodes + 1, dtype=jnp.int32)[None, :, None]
  columns = inputs.columns

  def noise(purpose):  # [B, N + 1, Vl]: the node's stream, by global id
    return node_noise(columns[:, :, 0:1], columns[:, :, 1:2], ext, ids, purpose)

  target = _warp(ops, target_logits, sampling)
  if not sampled:  # "match": y_n = argmax(warped p_n + G_n), every node at once
    (y,) = ops.races(target.kept() + noise(trees.PURPOSE_TREE_SAMPLE))
    return NodeResults(y, y, none)

  draft = _warp(ops, children_draft_logits(tree, inputs), sampling)  # q of n's children
  without_replacement = rule == "without_replacement"
  child_tokens = inputs.child_tokens  # [B, N + 1, M], -1: no such child

  def current(state):
    """`(p, q, r, s)` after the ranks rejected so far (`state`; later ranks: not yet)."""
    rejected, mass_r, mass_s, _ = state
    p, q = target.probabilities(*state), draft.probabilities(*state)
    steps = [(rejected[..., i:i + 1], mass_r[..., i:i + 1], mass_s[..., i:i + 1],
              child_tokens[..., i:i + 1]) for i in range(num_children)]
    return (p, q) + replay(p, q, ids, steps, without_replacement, EXACT_STEPS)

  def sibling(j, state):
    """Rank `j` at every node: the ratio test against `(r, s)` after the rejected ranks < j."""
    rejected, mass_r, mass_s, accepted_rank = state
    _, _, r, s = current(state)
    token = jax.lax.dynamic_index_in_dim(child_tokens, j, axis=2, keepdims=False)
    u = jax.lax.dynamic_index_in_dim(inputs.uniforms, j, axis=2, keepdims=False)
    is_token = ids == token[..., None]
    # `tree_common.sibling_sums`' four sums (r(t), s(t), sum max(r - s, 0), sum s without t),
    # each device's in one reduction, then one collective.
    sums = ops.combine_sums(ops.partial_sums(
        jnp.where(is_token, r, 0.0), jnp.where(is_token, s, 0.0), jnp.maximum(r - s, 0.0),
        jnp.where(is_token, 0.0, s)))
    r_at, s_at, new_mass_r, new_mass_s = (sums[..., i] for i in range(4))
    searching = (token >= 0) & (accepted_rank < 0)
    accepted = searching & tree_rule.accepts(u, r_at, s_at)
    lane = jnp.arange(num_children, dtype=jnp.int32) == j
    set_lane = lambda x, value: jnp.where(lane, value[..., None], x)
    return (set_lane(rejected, searching & ~accepted), set_lane(mass_r, new_mass_r),
            set_lane(mass_s, new_mass_s), jnp.where(accepted, j, accepted_rank))

  shape = child_tokens.shape
  state = (jnp.zeros(shape, bool), jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
           none)
  state = jax.lax.fori_loop(0, num_children, sibling, state)
  # The residual race over log r (after every rejected rank) and the race over log p_n, with the
  # same noise, in one reduction.
  p, _, r, _ = current(state)
  g = noise(trees.PURPOSE_TREE_RESIDUAL)
  token, p_token = ops.races(log_weights(r) + g, log_weights(p) + g)
  return node_results(token, p_token, state[3], inputs)


def sharded_verify_tree(target_logits: jax.Array, tree: Tree, *, rule: str, sampling: Sampling,
                        seeds: jax.Array, positions: jax.Array, max_depth: int,
                        max_children: int | None = None, mesh,
                        rules: ShardingRules | None = None,
                        sharded_vocab=None) -> tree_rule.TreeVerifyResult:
  """`tree_rule.verify_tree` on `mesh`: rows over the batch axes, the vocabulary over the vocab
  axes, each device deciding on its slice (`node_results_over`) and walking the decisions.

  Args:
    target_logits: `[B, N + 1, V]` raw target logits.
    tree: the draft tree; `tree.logits` `[B, N, V]` for the sampled rules.
    rule, sampling, seeds, positions, max_depth, max_children: as `tree_rule.verify_tree`.
    mesh: a `Mesh` or `AbstractMesh`.
    rules: logical-to-mesh rules (default `DEFAULT_RULES`).
    sharded_vocab: the class combining the slices (default `ShardedTreeVocab`; replace only to
      prove that an equality test can fail).

  Returns:
    `TreeVerifyResult(path [B, D], num_accepted [B], tokens [B, D + 1])`, equal to
    `tree_rule.verify_tree`'s on one device. A vocabulary that does not divide the shard count is
    padded with `-inf` (never sampled, never the argmax).
  """
  rules = DEFAULT_RULES if rules is None else rules
  vocab = target_logits.shape[-1]
  batch_spec, vocab_axes, shards = mesh_layout(mesh, rules, tree.tokens.shape[0])
  vocab_spec = None if not vocab_axes else vocab_axes[0] if len(vocab_axes) == 1 else vocab_axes
  logits_spec = PartitionSpec(batch_spec, None, vocab_spec)
  node_spec = PartitionSpec(batch_spec, None)
  row_spec = PartitionSpec(batch_spec)
  has_draft = tree.logits is not None
  tree = Tree(tree.tokens, tree.parents, tree.depths, tree.valid,
              pad_vocab(tree.logits, shards) if has_draft else None)
  tree_spec = Tree(node_spec, node_spec, node_spec, node_spec, logits_spec if has_draft else None)
  match = sampling.greedy or rule == "match"

  def body(target, tree, seeds, positions):
    if vocab_axes:
      ops = (sharded_vocab or ShardedTreeVocab)(vocab_axes, vocab)
    else:
      ops = FusedLocalVocab()
    nodes = node_results_over(ops, target, tree, rule=rule, sampling=sampling, seeds=seeds,
                              positions=positions, max_children=max_children)
    return tuple(tree_rule.walk_node_results(tree, nodes, match=match, max_depth=max_depth))

  run = jax.shard_map(body, mesh=mesh,
                      in_specs=(logits_spec, tree_spec, row_spec, row_spec),
                      out_specs=(node_spec, row_spec, node_spec), check_vma=False)
  out = run(pad_vocab(target_logits, shards), tree, jnp.asarray(seeds, jnp.uint32),
            jnp.asarray(positions, jnp.int32))
  return tree_rule.TreeVerifyResult(*out)
