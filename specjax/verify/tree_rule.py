"""Exact verification of a draft tree, in pure jnp (the tree counterpart of the chain rule).

The target has scored the extended block `[root, node_1 .. node_N]` (see `specjax.trees.structure`),
giving a distribution `p_n` after every extended node `n` (warped by the same `Sampling` as the
draft). Three rules keep the emitted tokens distributed exactly as the target alone would produce
them:

* `"match"` (deterministic children: static, n-gram, top-m / EAGLE-2): **sample-then-match**. Draw
  `y_n ~ p_n` at every node at once, each with its own stream; from the root, descend while `y` of
  the current node equals one of its children; emit the path plus `y` of the last node. The
  emitted token at every step is exactly `y ~ p`, whatever the children are, so no sibling loop
  and no draft probabilities are needed. Greedy: `y_n = argmax p_n` (token-identical to
  `specjax.generate`).
* `"iid"` (children drawn i.i.d. from `q`, SpecInfer): `r <- p`; for each child `c` in order accept
  with probability `min(1, r(c) / q(c))`, else `r <- normalize(max(r - q, 0))`; no child
  accepted: sample `r`.
* `"without_replacement"` (children drawn without replacement, recursive rejection sampling):
  `r <- p, s <- q`; accept `c` with probability `min(1, r(c) / s(c))`, else
  `r <- normalize(max(r - s, 0))`, `s(c) <- 0`, `s <- normalize(s)`. When `s` has no mass left
  (every token of q's support was drawn and rejected) it stays zero and `r` is kept.

Random numbers come from `specjax.core.sampling`'s counter hash keyed by the row seed, the absolute
position of the token being decided, the extended index of the node whose successor is decided, the
sibling rank, and a purpose from `specjax.trees.structure.PURPOSE_TREE_*`, disjoint from the
drafting stream. The same stopping-time argument as the chain rule's (see `specjax.core.sampling`)
makes reuse of positions past the emitted ones in the next round exact: nothing emitted depends on
them.

The vocabulary-sized work can also run fused over vocabulary tiles (`verify_tree(..., impl=)`,
`specjax.kernels.tree_verify`): what each rule decides at a node (`y_n`; the sibling loop and
the residual race) does not depend on the path that reaches it, so the kernel decides at every node
at once, with the same streams and elementwise steps, and the walk over those `[B, N + 1]` decisions
stays here (`_descend_match`, `_descend_sampled`): identical tokens.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.trees import structure as trees
from specjax.kernels.tree_verify import tree_node_results
from specjax.kernels.tree_verify_gpu import tree_node_results_gpu
from specjax.core.sampling import Sampling, first_argmax, gumbel, uniform, warp_logits
from specjax.trees.structure import Tree

RULES = ("match", "iid", "without_replacement")
IMPLS = ("reference", "pallas", "auto", "kernel", "interpret")


class TreeVerifyResult(NamedTuple):
  path: jax.Array  # [B, D] int32 accepted node indices by depth (0 past num_accepted)
  num_accepted: jax.Array  # [B] int32 in [0, D]
  tokens: jax.Array  # [B, D + 1] int32: path tokens, then the correction or bonus, then 0


def accepts(u: jax.Array, r_c: jax.Array, s_c: jax.Array) -> jax.Array:
  """The ratio test `u < r(c) / s(c)` without dividing (s = 0 < r accepts)."""
  return u * s_c < r_c


def residual(r: jax.Array, s: jax.Array) -> jax.Array:
  """`normalize(max(r - s, 0))` over the last axis; `r` itself where nothing is left."""
  rest = jnp.maximum(r - s, 0.0)
  mass = jnp.sum(rest, axis=-1, keepdims=True)
  return jnp.where(mass > 0, rest / jnp.where(mass > 0, mass, 1.0), r)


def remove_rejected(s: jax.Array, token: jax.Array) -> jax.Array:
  """Without replacement: `s(token) <- 0`, renormalised; zero when no mass is left."""
  s = jnp.where(jnp.arange(s.shape[-1])[None] == token[:, None], 0.0, s)
  mass = jnp.sum(s, axis=-1, keepdims=True)
  return jnp.where(mass > 0, s / jnp.where(mass > 0, mass, 1.0), 0.0)


def _race(log_weights, seeds, positions, nodes, purpose):
  """Gumbel-max over `[B, ..., V]` with streams keyed by position and node (rank 0)."""
  vocab_ids = jnp.arange(log_weights.shape[-1], dtype=jnp.int32)
  noise = gumbel(seeds[..., None], positions[..., None], nodes[..., None], 0, vocab_ids, purpose)
  return first_argmax(log_weights + noise)


def _emit(tree: Tree, path, count, final, max_depth):
  index = jnp.arange(max_depth + 1, dtype=jnp.int32)
  path_tokens = jnp.take_along_axis(tree.tokens, path, axis=1)  # [B, D]
  tokens = jnp.concatenate([path_tokens, jnp.zeros_like(path_tokens[:, :1])], axis=1)
  tokens = jnp.where(index[None] < count[:, None], tokens, 0)
  tokens = jnp.where(index[None] == count[:, None], final[:, None], tokens)
  path = jnp.where(index[None, :max_depth] < count[:, None], path, 0)
  return TreeVerifyResult(path.astype(jnp.int32), count.astype(jnp.int32), tokens)


def verify_tree(target_logits: jax.Array, tree: Tree, *, rule: str, sampling: Sampling,
                seeds: jax.Array, positions: jax.Array, max_depth: int,
                max_children: int | None = None, impl="reference") -> TreeVerifyResult:
  """The exact accept/reject walk down a draft tree.

  Args:
    target_logits: `[B, N + 1, V]` target logits after the root and after every node.
    tree: the draft tree (`N` nodes); `tree.logits` is required by the sampled rules.
    rule: "match", "iid" or "without_replacement" (`TreeSpec.rule`); greedy always matches argmax.
    sampling: applied identically to target and draft logits.
    seeds: `[B]` uint32 row seeds; positions: `[B]` int32 position of a child of the root
      (the row's length).
    max_depth: static bound `D` on node depths (the output width).
    max_children: static bound on siblings (sampled rules); default `N`.
    impl: who does the vocabulary-sized work, with identical results: "reference" (this module's
      jnp); "pallas" (the fused kernel `specjax.kernels.tree_verify`: Mosaic on TPU, Triton
      on GPU, the Pallas interpreter on CPU); "auto" (the kernel on TPU and GPU, the reference on
      CPU). The choice follows the platform the computation is lowered for. As in
      `specjax.verify.dispatch`, "kernel" is "pallas" without a CPU branch (lowering it for CPU
      raises) and "interpret" the TPU kernel in the Pallas interpreter on any platform. Or a
      callable with the signature of `tree_verify.tree_node_results` (e.g. that kernel in a chosen
      interpret mode), whose per-node decisions are walked here.

  Returns:
    `TreeVerifyResult(path [B, D], num_accepted [B], tokens [B, D + 1])`.
  """
  if rule not in RULES:
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
  if not (callable(impl) or impl in IMPLS):
    raise ValueError(f"impl must be one of {IMPLS} or a callable, got {impl!r}")
  seeds = jnp.asarray(seeds, jnp.uint32)
  positions = jnp.asarray(positions, jnp.int32)
  if impl != "reference":
    return _verify_with_kernel(target_logits, tree, rule, sampling, seeds, positions, max_depth,
                               max_children, impl)
  return _verify_reference(target_logits, tree, rule, sampling, seeds, positions, max_depth,
                           max_children)


def _verify_reference(target_logits, tree, rule, sampling, seeds, positions, max_depth,
                      max_children):
  if sampling.greedy or rule == "match":
    return _verify_match(target_logits, tree, sampling, seeds, positions, max_depth)
  if tree.logits is None:
    raise ValueError(f"rule {rule!r} needs the draft logits the children were drawn from")
  return _verify_sampled(target_logits, tree, rule == "without_replacement", sampling, seeds,
                         positions, max_depth, max_children or tree.num_nodes)


def _verify_match(target_logits, tree, sampling, seeds, positions, max_depth):
  if sampling.greedy:
    return _descend_match(tree, first_argmax(target_logits), max_depth)  # y: [B, N + 1]
  # Sampled: only the nodes the walk visits are sampled (at most D + 1 per row, not N + 1: the
  # warp and the race are the vocabulary-sized work), each with its own stream, so the tokens are
  # those of sampling every node first.
  depths = tree.ext_depths()

  def sample_at(cur):
    logits = jnp.take_along_axis(target_logits, cur[:, None, None], axis=1)[:, 0]  # [B, V]
    depth = jnp.take_along_axis(depths, cur[:, None], axis=1)[:, 0]
    return _race(warp_logits(logits, sampling), seeds, positions + depth, cur,
                 trees.PURPOSE_TREE_SAMPLE)

  return _walk_match(tree, sample_at, max_depth)


def _descend_match(tree, y, max_depth):
  """Sample-then-match given every extended node's sample `y [B, N + 1]`."""
  return _walk_match(tree, lambda cur: jnp.take_along_axis(y, cur[:, None], axis=1)[:, 0],
                     max_depth)


def _walk_match(tree, sample_at, max_depth):
  """Sample-then-match: from the root, move to the first child whose token equals the sample at
  the current node (`sample_at(cur [B]) -> [B]`, `cur` an extended index), while there is one;
  then emit the sample at the node the walk ended on."""
  batch = tree.tokens.shape[0]
  cur = jnp.zeros((batch,), jnp.int32)  # extended index of the current node
  alive = jnp.ones((batch,), bool)
  count = jnp.zeros((batch,), jnp.int32)
  path = []
  for _ in range(max_depth):
    y = sample_at(cur)
    candidates = tree.valid & (tree.parents + 1 == cur[:, None]) & (tree.tokens == y[:, None])
    found = alive & jnp.any(candidates, axis=1)
    nxt = jnp.argmax(candidates, axis=1).astype(jnp.int32)  # the first matching child
    cur = jnp.where(found, nxt + 1, cur)
    count = count + found
    alive = found
    path.append(nxt)
  return _emit(tree, jnp.stack(path, axis=1), count, sample_at(cur), max_depth)


def _verify_sampled(target_logits, tree, without_replacement, sampling, seeds, positions,
                    max_depth, max_children):
  batch, ext, vocab = target_logits.shape
  p = jax.nn.softmax(warp_logits(target_logits, sampling), axis=-1)  # [B, N + 1, V]
  q = jax.nn.softmax(warp_logits(tree.logits, sampling), axis=-1)  # [B, N, V]
  # The barrier keeps XLA from constant-folding the (often constant) tree structure per row.
  tree = jax.lax.optimization_barrier(tree)
  ranks = trees.sibling_ranks(tree)
  node_parents = tree.parents + 1  # extended parent of every node
  depths = tree.ext_depths()

  def children_q(cur):
    """q of `cur`'s children (they share it): the first child's stored draft distribution."""
    first = tree.valid & (node_parents == cur[:, None])
    return jnp.take_along_axis(q, jnp.argmax(first, axis=1)[:, None, None], axis=1)[:, 0]

  def at(x, index):
    return jnp.take_along_axis(x, index[:, None, None], axis=1)[:, 0]

  def sibling(j, carry):
    cur, r, s, moved, nxt, alive = carry
    candidates = tree.valid & (node_parents == cur[:, None]) & (ranks == j)
    exists = alive & ~moved & jnp.any(candidates, axis=1)
    child = jnp.argmax(candidates, axis=1).astype(jnp.int32)
    token = jnp.take_along_axis(tree.tokens, child[:, None], axis=1)[:, 0]
    child_position = positions + jnp.take_along_axis(depths, cur[:, None], axis=1)[:, 0]
    u = uniform(seeds, child_position, cur, j, trees.PURPOSE_TREE_ACCEPT)
    r_c = jnp.take_along_axis(r, token[:, None], axis=1)[:, 0]
    s_c = jnp.take_along_axis(s, token[:, None], axis=1)[:, 0]
    accepted = exists & accepts(u, r_c, s_c)
    rejected = exists & ~accepted
    r = jnp.where(rejected[:, None], residual(r, s), r)
    if without_replacement:
      s = jnp.where(rejected[:, None], remove_rejected(s, token), s)
    return cur, r, s, moved | accepted, jnp.where(accepted, child, nxt), alive

  def level(carry, _):
    cur, r, s, alive, count = carry
    none = jnp.zeros((batch,), bool)
    zero = jnp.zeros((batch,), jnp.int32)
    _, r, s, moved, nxt, _ = jax.lax.fori_loop(0, max_children, sibling,
                                               (cur, r, s, none, zero, alive))
    cur = jnp.where(moved, nxt + 1, cur)
    r = jnp.where(moved[:, None], at(p, cur), r)
    s = jnp.where(moved[:, None], children_q(cur), s)
    return (cur, r, s, moved, count + moved), nxt

  cur = jnp.zeros((batch,), jnp.int32)
  carry = (cur, p[:, 0], children_q(cur), jnp.ones((batch,), bool), cur)
  (cur, r, _, _, count), path = jax.lax.scan(level, carry, None, length=max_depth)
  final_position = positions + jnp.take_along_axis(depths, cur[:, None], axis=1)[:, 0]
  log_r = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)), -jnp.inf)
  final = _race(log_r, seeds, final_position, cur, trees.PURPOSE_TREE_RESIDUAL)
  return _emit(tree, path.T, count, final, max_depth)


# --------------------------------------------------------------------------------------------
# The kernels' per-node decisions, walked (every impl but "reference").
# --------------------------------------------------------------------------------------------

def _verify_with_kernel(target_logits, tree, rule, sampling, seeds, positions, max_depth,
                        max_children, impl):
  match = sampling.greedy or rule == "match"
  kwargs = dict(rule="match" if match else rule, sampling=sampling, max_children=max_children)

  def walk(node_fn):
    def run(target_logits, tree, seeds, positions):
      nodes = node_fn(target_logits, tree, seeds=seeds, positions=positions, **kwargs)
      return walk_node_results(tree, nodes, match=match, max_depth=max_depth)
    return run

  args = (target_logits, tree, seeds, positions)
  interpreted = walk(functools.partial(tree_node_results, interpret=True))
  if callable(impl) or impl == "interpret":
    return (interpreted if impl == "interpret" else walk(impl))(*args)
  mosaic = walk(functools.partial(tree_node_results, interpret=False))
  triton = walk(functools.partial(tree_node_results_gpu, interpret=False))
  branches = dict(tpu=mosaic, cuda=triton, rocm=triton)
  if impl == "pallas":
    branches["cpu"] = interpreted
  elif impl == "auto":
    branches["cpu"] = lambda *args: _verify_reference(*args[:2], rule, sampling, *args[2:],
                                                      max_depth, max_children)
  return jax.lax.platform_dependent(*args, **branches)


def walk_node_results(tree: Tree, nodes, *, match: bool, max_depth: int) -> TreeVerifyResult:
  """The walk down the tree given every extended node's decisions (`tree_common.NodeResults`,
  `[B, N + 1]` each, from a kernel or `specjax.verify.tree_sharded.node_results_over`): the
  sample-then-match walk over `nodes.token` when `match` (greedy, or the "match" rule), else the
  sibling rules' walk (`nodes.accepted`, then the residual or `p` race of the last node)."""
  if match:
    return _descend_match(tree, nodes.token, max_depth)
  return _descend_sampled(tree, nodes, max_depth)


def _descend_sampled(tree, nodes, max_depth):
  """The sibling rules' walk given every node's decisions (`tree_common.NodeResults`): move to
  the accepted child while there is one; emit the residual race of the last node, or the race
  over its `p` when the walk ends at the depth bound (the reference's `r` is `p` there)."""
  batch = nodes.token.shape[0]
  cur = jnp.zeros((batch,), jnp.int32)
  alive = jnp.ones((batch,), bool)
  count = jnp.zeros((batch,), jnp.int32)
  path = []
  for _ in range(max_depth):
    nxt = jnp.take_along_axis(nodes.accepted, cur[:, None], axis=1)[:, 0]
    moved = alive & (nxt >= 0)
    cur = jnp.where(moved, nxt + 1, cur)
    count = count + moved
    alive = moved
    path.append(jnp.maximum(nxt, 0))
  at_cur = lambda x: jnp.take_along_axis(x, cur[:, None], axis=1)[:, 0]
  final = jnp.where(count == max_depth, at_cur(nodes.p_token), at_cur(nodes.token))
  return _emit(tree, jnp.stack(path, axis=1), count, final, max_depth)
