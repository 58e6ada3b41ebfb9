"""`verify_tokens`: the one front door of the exact accept/reject rule, mesh-aware.

`impl` picks the implementation: "reference" (`specjax.verify.rule.verify_reference`, jnp), "kernel"
(the fused Pallas kernel compiled for the platform the computation is lowered for), "interpret" (the
kernel in Pallas interpret mode, for CPU tests), "auto" (the kernel where lowered for TPU or GPU,
the reference on CPU; it follows the lowering platform, so exporting for TPU from a CPU machine
picks the kernel), or a callable with `verify_reference`'s signature, used as the rule itself.

Under a mesh (passed, or the one active at trace time) the rule runs inside `jax.shard_map`:
rows over the batch axes (each device runs the fused kernel on its rows: Mosaic kernels cannot be
partitioned automatically), and where the vocabulary is split, `verify_rule` over `ShardedVocab`
with Pallas local reductions on TPU, combined with collectives. `verify_tree` does the same for
draft trees, with `specjax.verify.tree_sharded` where the vocabulary is split. Seeds travel with
their rows, so every implementation under every mesh returns the single-device tokens.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from specjax.verify import tree_rule, tree_sharded
from specjax.verify.local import VERIFY_IMPLS, local_verify, local_vocab_ops
from specjax.verify import sharded as parallel_verify
from specjax.parallel.rules import ShardingRules, active_rules
from specjax.verify.rule import check_shapes, verify_reference
from specjax.core.sampling import Sampling, VerifyResult
from specjax.trees.structure import Tree, TreeSpec


def check_verify_impl(impl, *, tree: bool = False):
  """`impl` if it names an implementation (of the tree rule: `tree`) or is callable; else a
  ValueError."""
  names = tree_rule.IMPLS if tree else VERIFY_IMPLS
  if not (callable(impl) or impl in names):
    raise ValueError(f"verify_impl must be one of {names} or a callable, got {impl!r}")
  return impl


def _active_mesh():
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or all(size == 1 for size in mesh.axis_sizes):
    return None
  return mesh


def verify_tokens(target_logits: jax.Array, draft_logits: jax.Array | None,
                  draft_tokens: jax.Array, *, sampling: Sampling, seeds: jax.Array,
                  positions: jax.Array, num_drafted: jax.Array | None = None, impl="auto",
                  mesh=None, rules: ShardingRules | None = None) -> VerifyResult:
  """Runs the accept/reject rule with the chosen implementation, on one device or a mesh.

  Args:
    target_logits: `[B, k + 1, V]` raw target logits.
    draft_logits: `[B, k, V]` raw draft logits, or None for a point-mass drafter.
    draft_tokens: `[B, k]` int32 proposals.
    sampling: static sampling settings, applied to both models' logits.
    seeds: `[B]` uint32 per-row stream seeds (`specjax.core.sampling.row_seeds`).
    positions: `[B]` int32 absolute position of each row's first draft token.
    num_drafted: `[B]` int32 drafts each row really proposes (the rest are not drafts and the
      token at that slot is the bonus, see `specjax.verify.rule.verify_rule`); None = all `k`. A
      callable `impl` gets it as a keyword only when it is given.
    impl: "auto" | "reference" | "kernel" | "interpret" | a rule callable (see module doc).
    mesh: the mesh the rows (and vocabulary) are split over; None = the mesh active at trace
      time (`jax.sharding.get_abstract_mesh()`), if any.
    rules: logical-to-mesh rules (which mesh axes hold the batch and the vocabulary); None = the
      active rules.

  Returns:
    `VerifyResult(num_accepted [B], tokens [B, k + 1])`, the same tokens whichever `impl` runs.

  Raises:
    ValueError: an unknown `impl`, or arguments whose shapes disagree
      (`specjax.verify.rule.check_shapes`), before anything is traced under a mesh.
  """
  check_verify_impl(impl)
  check_shapes(target_logits, draft_logits, draft_tokens, seeds, positions, num_drafted)
  kwargs = dict(sampling=sampling, seeds=seeds, positions=positions)
  if num_drafted is not None:
    kwargs["num_drafted"] = num_drafted
  if callable(impl):
    return impl(target_logits, draft_logits, draft_tokens, **kwargs)
  mesh = _active_mesh() if mesh is None else mesh
  if impl == "reference":
    local = verify_reference
  else:
    def local(target_logits, draft_logits, draft_tokens, **kwargs):
      return local_verify(target_logits, draft_logits, draft_tokens, impl=impl, **kwargs)
  if mesh is None:
    return local(target_logits, draft_logits, draft_tokens, **kwargs)
  return parallel_verify.sharded_verify(
      target_logits, draft_logits, draft_tokens, mesh=mesh,
      rules=active_rules() if rules is None else rules, local_rule=local,
      vocab_ops=local_vocab_ops(impl), **kwargs)


def verify_tree(target_logits: jax.Array, tree: Tree, *, spec: TreeSpec, sampling: Sampling,
                seeds: jax.Array, positions: jax.Array, impl="auto", mesh=None,
                rules: ShardingRules | None = None) -> tree_rule.TreeVerifyResult:
  """The exact tree rule (`specjax.verify.tree_rule.verify_tree`) with the chosen implementation,
  on one device or a mesh.

  Args:
    target_logits: `[B, N + 1, V]` raw target logits after the root and after every node.
    tree: the scored `Tree`; spec: its `TreeSpec` (the rule, depth and sibling bound).
    sampling, seeds, positions: as for `verify_tokens` (`positions`: each row's length).
    impl: "auto" | "reference" | "pallas" | "kernel" | "interpret" | a callable (see
      `specjax.verify.tree_rule.verify_tree`).
    mesh: the mesh; None = the one active at trace time, if any. Under a mesh the rule runs
      inside `jax.shard_map`. Where the mesh splits the vocabulary, each device decides every
      node on its rows' vocabulary slice and the slices combine with collectives
      (`specjax.verify.tree_sharded`, for every named `impl`: its reductions compute their own
      inputs, where a Pallas call's operands would be stored whole); no device holds a row's
      whole vocabulary. Where only the rows are split, and always with a callable `impl`
      (it needs whole rows), each device runs `impl` on its rows (the fused kernel cannot be
      partitioned automatically).
    rules: logical-to-mesh rules (which mesh axes hold the batch and the vocabulary); None = the
      active rules.

  Returns:
    `TreeVerifyResult(path [B, D], num_accepted [B], tokens [B, D + 1])`, the same whichever
    `impl` and mesh.
  """
  check_verify_impl(impl, tree=True)

  def run(logits, tree, seeds, positions):
    return tree_rule.verify_tree(logits, tree, rule=spec.rule, sampling=sampling, seeds=seeds,
                                 positions=positions, max_depth=spec.depth,
                                 max_children=spec.max_children, impl=impl)

  mesh = _active_mesh() if mesh is None else mesh
  if mesh is None:
    return run(target_logits, tree, seeds, positions)
  rules = active_rules() if rules is None else rules
  batch_spec, vocab_axes, _ = parallel_verify.mesh_layout(mesh, rules, tree.tokens.shape[0])
  if vocab_axes and not callable(impl):
    return tree_sharded.sharded_verify_tree(
        target_logits, tree, rule=spec.rule, sampling=sampling, seeds=seeds, positions=positions,
        max_depth=spec.depth, max_children=spec.max_children, mesh=mesh, rules=rules)
  rows = PartitionSpec(batch_spec)
  body = lambda *args: tuple(run(*args))
  out = jax.shard_map(body, mesh=mesh, in_specs=(rows,) * 4, out_specs=(rows,) * 3,
                      check_vma=False)(target_logits, tree, seeds, positions)
  return tree_rule.TreeVerifyResult(*out)
