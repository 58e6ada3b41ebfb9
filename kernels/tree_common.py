"""Pieces shared by the tree verify kernels (`tree_verify` on TPU / interpret, `tree_verify_gpu`).

The tree rules of `specjax.verify.tree_rule` decide, at every extended node `n` of a draft tree,
something that does not depend on which path reached `n`:

* `"match"`: the target's sample `y_n` (`argmax p_n` when greedy; else the Gumbel race over the
  warped `p_n` with the node's own stream),
* `"iid"` / `"without_replacement"`: the sibling loop over `n`'s children (ratio test of child `j`
  against `r_j, s_j`, residual updates on rejection) and, when no child is accepted, the residual
  race over the final `r`; the race over `p_n` itself is kept too (the walk ends there when it
  stops at the depth bound).

So the kernels compute these per-node decisions for all `N + 1` nodes at once, tile by tile over the
vocabulary (`NodeResults`), and the walk down the tree, over tiny `[B, N]` arrays, stays in
`specjax.verify.tree_rule`. The residual after `j` rejected siblings is never stored: each
vocabulary pass replays the `j` elementwise updates (`replay`) from `p`, `q` and per-node scalars of
the earlier passes (which siblings were rejected, the masses that normalised `max(r - s, 0)` and `s`
without the rejected token), exactly the reference's elementwise operations.

This module holds the per-node tables the kernels read beside the logits (`node_inputs`), the static
pass schedule (`TreeSchedule`), the result type, and the elementwise steps (`TileSteps`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from specjax.core import sampling as sampling_lib
from specjax.trees import structure as trees
from specjax.kernels.common import ThresholdPasses
from specjax.core.sampling import Sampling

RULES = ("match", "iid", "without_replacement")
MAX_CHILDREN = 128  # sibling ranks are lanes of the TPU kernel's per-node state


class NodeResults(NamedTuple):
  """What the tree rule decides at every extended node, whichever path reaches it."""

  token: jax.Array  # [B, N + 1] int32: "match": y_n; sampled: the residual race at n
  p_token: jax.Array  # [B, N + 1] int32: "match": y_n; sampled: the race over p_n itself
  accepted: jax.Array  # [B, N + 1] int32: sampled: the accepted child's node index, -1 if none


class NodeInputs(NamedTuple):
  """The small per-node tables the kernels read (and the rank -> node map of the wrapper)."""

  columns: jax.Array  # [B, N + 1, 2] int32: row seed (bits), position of n's successor
  child_tokens: jax.Array  # [B, N + 1, M] int32: token of n's rank-j child, -1 if none
  uniforms: jax.Array  # [B, N + 1, M] float32: ratio-test uniform of n's rank-j child
  child_nodes: jax.Array  # [B, N + 1, M] int32: node index of n's rank-j child (0 if none)


def check_tree_args(target_logits, tree, rule: str, sampling: Sampling,
                    max_children: int | None) -> int:
  """Validates shapes and settings shared by the tree kernels; returns the sibling bound `M`."""
  if rule not in RULES:
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
  batch, num_nodes = tree.tokens.shape
  if target_logits.ndim != 3 or target_logits.shape[:2] != (batch, num_nodes + 1):
    raise ValueError(f"target_logits must be [B, N + 1, V] = [{batch}, {num_nodes + 1}, V], "
                     f"got {target_logits.shape}")
  if not jnp.issubdtype(target_logits.dtype, jnp.floating):
    raise ValueError(f"target_logits must be floating point, got {target_logits.dtype}")
  num_children = max_children or num_nodes  # the reference's default
  if sampled_rule(rule, sampling):
    if tree.logits is None:
      raise ValueError(f"rule {rule!r} needs the draft logits the children were drawn from")
    if tree.logits.shape != (batch, num_nodes, target_logits.shape[-1]):
      raise ValueError(f"tree.logits must be [B, N, V] = "
                       f"{(batch, num_nodes, target_logits.shape[-1])}, got {tree.logits.shape}")
    if not 1 <= num_children <= MAX_CHILDREN:
      raise ValueError(f"the tree kernels take at most {MAX_CHILDREN} siblings per node, got "
                       f"max_children={num_children} (pass the tree's bound, "
                       f"TreeSpec.max_children)")
  return num_children


def sampled_rule(rule: str, sampling: Sampling) -> bool:
  """Whether `rule` runs the sibling loop (greedy always matches the argmax)."""
  return rule != "match" and not sampling.greedy


def node_inputs(tree, seeds: jax.Array, positions: jax.Array, num_children: int,
                with_children: bool) -> NodeInputs:
  """The per-node tables, from the tree and the row streams (tiny `[B, N + 1, M]` arrays)."""
  batch, num_nodes = tree.tokens.shape
  ext = jnp.arange(num_nodes + 1, dtype=jnp.int32)
  node_positions = positions[:, None] + tree.ext_depths()  # [B, N + 1]
  seed_words = jax.lax.bitcast_convert_type(seeds, jnp.int32)
  columns = jnp.stack([jnp.broadcast_to(seed_words[:, None], node_positions.shape),
                       node_positions], axis=-1)
  if not with_children:
    empty = jnp.zeros((batch, num_nodes + 1, 1), jnp.int32)
    return NodeInputs(columns, empty - 1, empty.astype(jnp.float32), empty)
  ranks = trees.sibling_ranks(tree)  # [B, N]
  rank_ids = jnp.arange(num_children, dtype=jnp.int32)
  is_child = (tree.valid[:, None, None, :]
              & ((tree.parents + 1)[:, None, None, :] == ext[None, :, None, None])
              & (ranks[:, None, None, :] == rank_ids[None, None, :, None]))  # [B, N + 1, M, N]
  exists = jnp.any(is_child, axis=-1)
  child_nodes = jnp.argmax(is_child, axis=-1).astype(jnp.int32)  # [B, N + 1, M]
  tokens = jnp.take_along_axis(tree.tokens, child_nodes.reshape(batch, -1), axis=1)
  child_tokens = jnp.where(exists, tokens.reshape(child_nodes.shape), -1)
  # The reference's stream of the rank-j ratio test at node n (`uniform(seed, position, n, j)`).
  uniforms = sampling_lib.uniform(seeds[:, None, None], node_positions[..., None],
                                  ext[None, :, None], rank_ids[None, None, :],
                                  trees.PURPOSE_TREE_ACCEPT)
  return NodeInputs(columns, child_tokens.astype(jnp.int32), uniforms, child_nodes)


def children_draft_logits(tree, inputs: NodeInputs) -> jax.Array:
  """`[B, N + 1, V]` raw draft logits of each node's children (its first child's row; they share
  it), so that kernel row `n` holds both `p_n` and the `q` its children were drawn from."""
  first = inputs.child_nodes[:, :, 0]  # the rank-0 child (node 0 where there is none: unused)
  return jnp.take_along_axis(tree.logits, first[:, :, None], axis=1)


def tree_kernel_setup(target_logits, tree, rule: str, sampling: Sampling, seeds, positions,
                      max_children: int | None
                      ) -> tuple[TreeSchedule, NodeInputs, jax.Array | None]:
  """What both tree kernels derive from their arguments (after `check_tree_args`): the pass
  schedule, the per-node tables, and the children's draft logits (`children_draft_logits`; None
  unless the rule runs the sibling loop)."""
  num_children = check_tree_args(target_logits, tree, rule, sampling, max_children)
  schedule = tree_schedule(rule, sampling, target_logits.shape[-1], num_children)
  sampled = sampled_rule(rule, sampling)
  inputs = node_inputs(tree, jnp.asarray(seeds, jnp.uint32), jnp.asarray(positions, jnp.int32),
                       num_children, sampled)
  return schedule, inputs, children_draft_logits(tree, inputs) if sampled else None


def node_results(out_token, out_p_token, out_rank, inputs: NodeInputs) -> NodeResults:
  """Maps the kernels' accepted sibling rank (-1: none) to the accepted child's node index."""
  rank = jnp.maximum(out_rank, 0)
  node = jnp.take_along_axis(inputs.child_nodes, rank[..., None], axis=-1)[..., 0]
  return NodeResults(out_token, out_p_token, jnp.where(out_rank >= 0, node, -1))


# --------------------------------------------------------------------------------------------
# Pass schedule.
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TreeSchedule(ThresholdPasses):
  """Static pass layout: `[STATS] [TOP_K x 8] [TOP_P x 8] [SUM] [SIBLING x M] [RACE]`.

  Greedy is `[STATS]` (the running argmax). "match" at temperature > 0 needs no normaliser: a
  stats pass (the max) only when a threshold search follows, then the race. The sampled rules
  have every pass; SUM (the normaliser over the final kept set) only after a threshold.
  """

  greedy: bool
  sampled: bool  # the sibling loop of "iid" / "without_replacement"
  without_replacement: bool
  top_k: int | None  # active top-k (None when off or >= V)
  top_p: float | None  # active top-p (None when off or 1)
  num_children: int  # M sibling passes (sampled rules)

  @property
  def has_stats(self) -> bool:
    return self.greedy or self.sampled or self.has_threshold

  @property
  def first_top_k(self) -> int:
    return int(self.has_stats)

  @property
  def first_sibling(self) -> int:
    return self.sum_pass + (1 if self.sampled and self.has_threshold else 0)

  @property
  def race_pass(self) -> int:
    return self.first_sibling + (self.num_children if self.sampled else 0)


def tree_schedule(rule: str, sampling: Sampling, vocab: int, num_children: int) -> TreeSchedule:
  """The static pass schedule of `rule` under `sampling` over a vocabulary of `vocab`."""
  if sampling.greedy:
    return TreeSchedule(True, False, False, None, None, 0)
  top_k = sampling.top_k if sampling.top_k is not None and sampling.top_k < vocab else None
  top_p = sampling.top_p if sampling.top_p is not None and sampling.top_p < 1.0 else None
  sampled = rule != "match"
  return TreeSchedule(False, sampled, rule == "without_replacement", top_k, top_p,
                      num_children if sampled else 0)


# --------------------------------------------------------------------------------------------
# Elementwise steps (the reference's, applied to tiles).
# --------------------------------------------------------------------------------------------

def node_noise(seeds, positions, nodes, vocab_ids, purpose: int) -> jax.Array:
  """The Gumbel noise of node `n`'s race: `specjax.verify.tree_rule`'s stream
  `(seed, position, node, 0, vocab id, purpose)`."""
  return sampling_lib.gumbel(seeds, positions, nodes, 0, vocab_ids, purpose)


def residual_step(r, s, mass):
  """`tree_rule.residual` elementwise: `max(r - s, 0) / mass`, or `r` when `mass` is 0."""
  rest = jnp.maximum(r - s, 0.0)
  return jnp.where(mass > 0, rest / jnp.where(mass > 0, mass, 1.0), r)


def remove_step(s, is_token, mass):
  """`tree_rule.remove_rejected` elementwise: `s` without the token, `/ mass` (0 if no mass)."""
  s = jnp.where(is_token, 0.0, s)
  return jnp.where(mass > 0, s / jnp.where(mass > 0, mass, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class TileSteps:
  """The elementwise steps the kernels apply to every tile. The defaults are the exact ones;
  replacing one (a broken variant) exists only to prove that the equality tests can fail."""

  noise: Callable = node_noise
  residual: Callable = residual_step
  remove: Callable = remove_step


EXACT_STEPS = TileSteps()


def replay(p, q, vocab_ids, steps, without_replacement: bool, tile_steps: TileSteps):
  """`(r, s)` after the rejected siblings among `steps`, on a tile.

  Args:
    p, q: `[..., bv]` the target's and the children's warped probabilities.
    vocab_ids: `[..., bv]` (broadcastable) int32 ids of the tile's lanes.
    steps: per sibling rank, `(rejected [..., 1] bool, residual mass [..., 1], remaining mass
      of s [..., 1], token [..., 1])`; ranks not (yet) rejected leave `r` and `s` unchanged.
    without_replacement: also remove each rejected token from `s` (renormalised).
    tile_steps: the elementwise steps.
  """
  r, s = p, q
  for rejected, mass_r, mass_s, token in steps:
    new_r = tile_steps.residual(r, s, mass_r)  # uses s before the removal, as the reference
    if without_replacement:
      s = jnp.where(rejected, tile_steps.remove(s, vocab_ids == token, mass_s), s)
    r = jnp.where(rejected, new_r, r)
  return r, s


def sibling_sums(r, s, is_token):
  """The four per-node sums of a sibling pass over a tile, each `[..., 1]`: `r(t)`, `s(t)`,
  `sum max(r - s, 0)` and `sum s` without `t`."""
  total = lambda x: jnp.sum(x, axis=-1, keepdims=True)
  return (total(jnp.where(is_token, r, 0.0)), total(jnp.where(is_token, s, 0.0)),
          total(jnp.maximum(r - s, 0.0)), total(jnp.where(is_token, 0.0, s)))


def log_weights(w):
  """`log w` where `w > 0`, else `-inf` (the reference's race weights)."""
  return jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1.0)), float("-inf"))
