"""Fused tree verify over vocabulary tiles (Pallas; TPU Mosaic and interpret mode).

One `pallas_call` turns the target logits of an extended draft tree `[B, N + 1, V]` (and, for the
sampled rules, the draft logits the children were drawn from) into `NodeResults`: the per-node
decisions of `specjax.verify.tree_rule` (see `tree_common`), from which `tree_rule.verify_tree`
walks the tree. No `[B, N + 1, V]` probability array is written: every quantity is a per-node scalar
accumulated tile by tile, and every vocabulary-sized draw is a Gumbel-max race whose noise is the
counter hash of the node's own stream, computed in the kernel.

The grid is `(B / block_b, num_passes, num_vocab_tiles)`; a program owns `block_b` rows with all
their `N + 1` nodes (blocks `[block_b, N + 1, block_v]`; a partial last row block computes garbage
in its missing rows, never written back). The static pass schedule (`TreeSchedule`):

  STATS     running argmax (greedy: the only pass), or online max / log-sum-exp
  TOP_K     `RADIX_ROUNDS` = 8 counting passes, RADIX - 1 = 15 candidate thresholds per pass
  TOP_P     8 mass passes over the top-k survivors, between the top-k threshold and the max
  SUM       the normaliser over the final kept set (sampled rules, after a threshold)
  SIBLING   sampled rules, one pass per sibling rank j: replay the updates of the rejected ranks
            < j, accumulate r(t_j), s(t_j), sum max(r - s, 0) and sum s without t_j; at the last
            tile, the ratio test `u * s(t_j) < r(t_j)` of every node's rank-j child
  RACE      "match": y_n = argmax(warped p_n + G_n); sampled: the races over log r and log p_n

so greedy "match" is 1 pass, "match" at temperature 1 pass, with top-k and top-p 1 + 16 + 1; the
sampled rules `2 + M` passes, `3 + 16 + M` with both thresholds. As in `fused_verify`, a
vocabulary that fits one tile is fetched from HBM once (the block index never changes); the
defaults (`tree_block_sizes`) make the tile hold the whole vocabulary where VMEM allows.

The sampled rules read the draft logits gathered per node (`[B, N + 1, V]`: row `n` is the `q` of
`n`'s children, a copy of raw logits made by XLA before the call) so that one block row holds both
distributions of a node. Decisions agree token for token with the reference; only the order of
float32 additions inside vocabulary sums differs, which can move a decision only when a comparison
sits within rounding of its boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax.core import sampling as sampling_lib
from specjax.trees import structure as trees
from specjax.kernels.blocks import (CHUNK_TEMPORARIES, DEFAULT_MAX_BLOCK_B,
                                    INTERPRET_MAX_BLOCK_B, INTERPRET_VMEM_BUDGET, LANES,
                                    SUBLANES, BlockSizes, Chunk, compile_device_kind,
                                    over_chunks, vmem_budget_for, vmem_limit_for)
from specjax.kernels.common import replaces, tile_argmax
from specjax.kernels.tree_common import (EXACT_STEPS, NodeResults, TileSteps, TreeSchedule,
                                         log_weights, node_results, replay, sibling_sums,
                                         tree_kernel_setup)
from specjax.kernels.tree_passes import column, set_column, threshold_passes
from specjax.core.sampling import Sampling

_NEG_INF = float("-inf")
# Per-node scratch, [block_b, N + 1, 128] each, values replicated across lanes; "count" / "mass"
# hold one threshold-search candidate per lane, the sibling state one rank per lane.
_STATS = ("max", "sum", "base", "width", "top_k_key", "count", "mass")
_GREEDY_STATS = ("max", "argmax")
_SIBLING = ("rejected", "mass_r", "mass_s", "sums", "accepted")
_RACE = ("best", "token", "best_p", "token_p")
_INT_STATE = ("argmax", "base", "width", "top_k_key", "count", "rejected", "accepted", "token",
              "token_p")


def _scratch_names(schedule: TreeSchedule) -> tuple[tuple[str, ...], ...]:
  """(names per logits set..., sibling names, race names) of the schedule's scratch."""
  if schedule.greedy:
    return (_GREEDY_STATS,), (), ()
  stats = _STATS if schedule.has_threshold or schedule.sampled else ("max",)
  if not schedule.sampled:
    return (stats,), (), _RACE[:2]
  return (stats, stats), _SIBLING, _RACE


def _scratch_bytes(schedule: TreeSchedule, block_b: int, num_rows: int) -> int:
  sets, sibling, race = _scratch_names(schedule)
  count = sum(len(names) for names in sets) + len(sibling) + len(race)
  return count * block_b * (-(-num_rows // SUBLANES) * SUBLANES) * LANES * 4


def tree_block_sizes(vocab: int, num_rows: int, dtype, schedule: TreeSchedule, *,
                     batch: int, interpret=False, device_kind: str | None = None) -> BlockSizes:
  """Default tiles: `BlockSizes.get_default`'s rule (the whole vocabulary resident first, then
  rows) over `num_rows` target rows (and as many draft rows for the sampled rules), in the VMEM
  left once the per-node scratch is counted."""
  if interpret:
    budget, max_block_b = INTERPRET_VMEM_BUDGET, INTERPRET_MAX_BLOCK_B
  else:
    budget, max_block_b = vmem_budget_for(device_kind), DEFAULT_MAX_BLOCK_B
    if _scratch_bytes(schedule, max_block_b, num_rows) > budget // 2:
      max_block_b = 1
    budget -= _scratch_bytes(schedule, max_block_b, num_rows)
  # get_default counts k + 1 target rows and k draft rows: k = num_rows covers both sets. The
  # sampled rules replay every earlier sibling on each chunk: a few temporaries per child more.
  return BlockSizes.get_default(vocab, num_rows, dtype, batch=batch,
                                has_draft_logits=schedule.sampled, vmem_budget=budget,
                                max_block_b=max_block_b, chunked=not interpret,
                                temporaries=CHUNK_TEMPORARIES + 4 * schedule.num_children)


# --------------------------------------------------------------------------------------------
# Public wrapper.
# --------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("rule", "sampling", "max_children", "block_sizes",
                                             "interpret", "device_kind", "tile_steps"))
def tree_node_results(target_logits: jax.Array, tree: trees.Tree, *, rule: str,
                      sampling: Sampling, seeds: jax.Array, positions: jax.Array,
                      max_children: int | None = None, block_sizes: BlockSizes | None = None,
                      interpret=False, device_kind: str | None = None,
                      tile_steps: TileSteps = EXACT_STEPS) -> NodeResults:
  """The per-node decisions of `specjax.verify.tree_rule.verify_tree`, fused over vocabulary tiles.

  Args:
    target_logits: `[B, N + 1, V]` raw target logits after the root and every node.
    tree: the draft tree; `tree.logits` `[B, N, V]` is required by the sampled rules.
    rule: "match", "iid" or "without_replacement"; greedy always matches the argmax.
    sampling: static; applied identically to target and draft logits.
    seeds: `[B]` uint32 row seeds; positions: `[B]` int32 position of a child of the root.
    max_children: static bound `M` on siblings (sampled rules); default `N`.
    block_sizes: `BlockSizes` (default `tree_block_sizes`).
    interpret: False (Mosaic, TPU), True or `pltpu.InterpretParams()` (the interpreters).
    device_kind: the TPU kind whose VMEM sizes the blocks (default: the local TPU, else v4).
    tile_steps: the elementwise steps (replace only to prove a test can fail).

  Returns:
    `NodeResults` `[B, N + 1]` each.
  """
  schedule, inputs, q_logits = tree_kernel_setup(target_logits, tree, rule, sampling, seeds,
                                                 positions, max_children)
  batch, num_rows, vocab = target_logits.shape
  if device_kind is None and not interpret:
    device_kind = compile_device_kind()
  if block_sizes is None:
    block_sizes = tree_block_sizes(vocab, num_rows, target_logits.dtype, schedule, batch=batch,
                                   interpret=interpret, device_kind=device_kind)
  out = _tree_verify_impl(target_logits, q_logits, inputs, schedule=schedule, sampling=sampling,
                          block_v=block_sizes.tile(vocab), block_b=block_sizes.rows(batch),
                          block_c=block_sizes.chunk(vocab),
                          interpret=interpret, tile_steps=tile_steps,
                          vmem_limit=None if interpret else vmem_limit_for(device_kind))
  return node_results(out[..., 0], out[..., 1], out[..., 2], inputs)


def _tree_verify_impl(target_logits, q_logits, inputs, *, schedule: TreeSchedule,
                      sampling: Sampling, block_v: int, block_b: int, block_c: int | None,
                      interpret, tile_steps,
                      vmem_limit: int | None):
  batch, num_rows, vocab = target_logits.shape
  num_tiles = pl.cdiv(vocab, block_v)
  num_children = inputs.child_tokens.shape[-1]

  def logits_spec():
    return pl.BlockSpec((block_b, num_rows, block_v), lambda b, p, j: (b, 0, j))

  def row_spec(width):
    return pl.BlockSpec((block_b, num_rows, width), lambda b, p, j: (b, 0, 0))

  in_specs = [row_spec(2), logits_spec()]
  operands = [inputs.columns, target_logits]
  if schedule.sampled:
    in_specs += [row_spec(num_children), row_spec(num_children), logits_spec()]
    operands += [inputs.child_tokens, inputs.uniforms, q_logits]
  set_names, sibling_names, race_names = _scratch_names(schedule)
  scratch = [pltpu.VMEM((block_b, num_rows, LANES),
                        jnp.int32 if name in _INT_STATE else jnp.float32)
             for names in (*set_names, sibling_names, race_names) for name in names]
  kernel = functools.partial(_tree_verify_kernel, sampling=sampling, schedule=schedule,
                             vocab=vocab, block_v=block_v, block_c=block_c, num_tiles=num_tiles,
                             tile_steps=tile_steps)
  logits_bytes = sum(x.size * x.dtype.itemsize for x in (target_logits, q_logits)
                     if x is not None)
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(batch, block_b), schedule.num_passes, num_tiles),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((block_b, num_rows, LANES), lambda b, p, j: (b, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((batch, num_rows, LANES), jnp.int32),
      scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary"),
          vmem_limit_bytes=vmem_limit),
      cost_estimate=pl.CostEstimate(
          flops=8 * schedule.num_passes * target_logits.size * (2 if schedule.sampled else 1),
          transcendentals=(4 + schedule.num_children) * target_logits.size,
          bytes_accessed=logits_bytes * (1 if num_tiles == 1 else schedule.num_passes)),
      interpret=interpret,
      name="tree_verify",
  )(*operands)


# --------------------------------------------------------------------------------------------
# Kernel body.
# --------------------------------------------------------------------------------------------

def _set_lane(ref, lane_ids, lane, value):
  """Writes `value` [bb, rows, 1] into lane `lane` (traced) of `ref`, keeping the others."""
  ref[...] = jnp.where(lane_ids == lane, value.astype(ref.dtype), ref[...])


def _tree_verify_kernel(columns_ref, target_ref, *refs, sampling: Sampling,
                        schedule: TreeSchedule, vocab: int, block_v: int, block_c: int | None,
                        num_tiles: int,
                        tile_steps: TileSteps):
  if schedule.sampled:
    child_tokens_ref, uniforms_ref, draft_ref, out_ref, *scratch = refs
  else:
    (out_ref, *scratch), child_tokens_ref, uniforms_ref, draft_ref = refs, None, None, None
  set_names, sibling_names, race_names = _scratch_names(schedule)
  stats_sets = []
  for names in set_names:
    stats_sets.append(dict(zip(names, scratch[:len(names)])))
    scratch = scratch[len(names):]
  sibling = dict(zip(sibling_names, scratch[:len(sibling_names)]))
  race = dict(zip(race_names, scratch[len(sibling_names):]))
  row_sets = list(zip([target_ref, draft_ref], stats_sets))
  over_chunks(functools.partial(
      _chunk_body, columns_ref, child_tokens_ref, uniforms_ref, out_ref, row_sets, stats_sets,
      sibling, race, pass_id=pl.program_id(1), sampling=sampling, schedule=schedule,
      tile_steps=tile_steps),
              tile=pl.program_id(2), num_tiles=num_tiles, block_v=block_v, block_c=block_c,
              vocab=vocab)


def _chunk_body(columns_ref, child_tokens_ref, uniforms_ref, out_ref, row_sets, stats_sets,
                sibling, race, chunk: Chunk, *, pass_id, sampling: Sampling,
                schedule: TreeSchedule, tile_steps: TileSteps):
  """Every pass's work on one chunk of the current vocabulary tile (`over_chunks`); `pass_id` is
  read outside the chunk loop (the interpreter resolves program ids there only)."""
  race_names = tuple(race)
  target_ref = row_sets[0][0]
  draft_ref = row_sets[1][0] if len(row_sets) > 1 else None
  first_tile, last_tile = chunk.first, chunk.last  # first / last chunk of the whole vocabulary
  vocab_ids, in_vocab = chunk.vocab_ids, chunk.in_vocab  # the last tile may run past V
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, 1, LANES), 2)

  def load(ref):  # [bb, rows, chunk] float32 scaled logits, -inf outside the vocabulary
    x = ref[:, :, chunk.lanes].astype(jnp.float32)
    if not schedule.greedy:
      x = x / jnp.float32(sampling.temperature)
    return jnp.where(in_vocab, x, _NEG_INF)

  def write(token, p_token, accepted):
    out = jnp.where(lane == 0, token, jnp.where(lane == 1, p_token, accepted))
    out_ref[...] = jnp.where(lane < 3, out, 0)

  # ---- STATS: running argmax (greedy) or max and online sum of exp.
  if schedule.has_stats:
    @pl.when(pass_id == 0)
    def _stats():
      for ref, stats in row_sets:
        @pl.when(first_tile)
        def _init(stats=stats):
          set_column(stats["max"], _NEG_INF)
          if "argmax" in stats:
            set_column(stats["argmax"], 0)
          if schedule.sampled:
            set_column(stats["sum"], 0.0)

        x = load(ref)
        old_max = column(stats["max"])
        tile_max, tile_token = tile_argmax(x, vocab_ids)
        later = replaces(tile_max, old_max)
        new_max = jnp.where(later, tile_max, old_max)
        if "argmax" in stats:
          set_column(stats["argmax"], jnp.where(later, tile_token, column(stats["argmax"])))
        if schedule.sampled:  # online log-sum-exp; the where()s keep -inf prefixes from NaN
          rescale = jnp.where(old_max == new_max, 1.0, jnp.exp(old_max - new_max))
          terms = jnp.where(x == _NEG_INF, 0.0, jnp.exp(x - new_max))
          set_column(stats["sum"], column(stats["sum"]) * rescale
                      + jnp.sum(terms, axis=-1, keepdims=True))
        set_column(stats["max"], new_max)

      if schedule.sampled:
        @pl.when(first_tile)
        def _init_siblings():
          for name in ("rejected", "mass_r", "mass_s"):
            set_column(sibling[name], 0)
          set_column(sibling["accepted"], -1)

  if schedule.greedy:
    @pl.when(last_tile)
    def _greedy_finish():
      y = column(stats_sets[0]["argmax"])
      write(y, y, -1)
    return

  threshold_passes(schedule, row_sets, load, pass_id, first_tile, last_tile, lane)

  def threshold(stats):  # [bb, rows, 1] float32 floor of the final kept set
    if schedule.top_p:
      return sampling_lib.key_to_float(column(stats["base"]))
    if schedule.top_k:
      return sampling_lib.key_to_float(column(stats["top_k_key"]))
    return jnp.full(stats["max"].shape[:2] + (1,), _NEG_INF, jnp.float32)

  def warped(ref, stats):
    x = load(ref)
    return jnp.where(x >= threshold(stats), x, _NEG_INF) if schedule.has_threshold else x

  columns = columns_ref[...]  # [bb, rows, 2]: seed bits, position of the node's successor
  nodes = jax.lax.broadcasted_iota(jnp.int32, (1, columns.shape[1], 1), 1)

  def noise(purpose):
    return tile_steps.noise(columns[:, :, 0:1], columns[:, :, 1:2], nodes, vocab_ids, purpose)

  def race_step(scores, best_key, token_key):
    tile_best, tile_token = tile_argmax(jnp.where(in_vocab, scores, _NEG_INF), vocab_ids)
    old_best = column(race[best_key])
    later = replaces(tile_best, old_best)
    set_column(race[token_key], jnp.where(later, tile_token, column(race[token_key])))
    set_column(race[best_key], jnp.where(later, tile_best, old_best))

  def init_race():
    for name in race_names:
      set_column(race[name], _NEG_INF if name.startswith("best") else 0)

  if not schedule.sampled:  # ---- "match": y_n = argmax(warped p_n + G_n), every node at once.
    @pl.when(pass_id == schedule.race_pass)
    def _match_race():
      pl.when(first_tile)(init_race)
      race_step(warped(target_ref, stats_sets[0]) + noise(trees.PURPOSE_TREE_SAMPLE),
                "best", "token")

      @pl.when(last_tile)
      def _finish():
        y = column(race["token"])
        write(y, y, -1)
    return

  # ---- SUM: the normaliser over the final kept set, with the final max.
  if schedule.has_threshold:
    @pl.when(pass_id == schedule.sum_pass)
    def _sum_pass():
      for ref, stats in row_sets:
        pl.when(first_tile)(lambda stats=stats: set_column(stats["sum"], 0.0))
        weights = jnp.exp(warped(ref, stats) - column(stats["max"]))
        set_column(stats["sum"], column(stats["sum"]) + jnp.sum(weights, -1, keepdims=True))

  def probabilities():  # p_n and q (of n's children) on the tile, [bb, rows, bv] each
    return tuple(jnp.exp(warped(ref, stats) - column(stats["max"])) / column(stats["sum"])
                 for ref, stats in row_sets)

  child_tokens = child_tokens_ref[...]  # [bb, rows, M], -1: no such child
  num_children = child_tokens.shape[-1]

  def current(p, q):  # (r, s) after the ranks rejected so far (later ones: not rejected yet)
    steps = [(column(sibling["rejected"], i) > 0, column(sibling["mass_r"], i),
              column(sibling["mass_s"], i), child_tokens[:, :, i:i + 1])
             for i in range(num_children)]
    return replay(p, q, vocab_ids, steps, schedule.without_replacement, tile_steps)

  # ---- SIBLING j: the ratio test of every node's rank-j child against r_j, s_j.
  @pl.when((pass_id >= schedule.first_sibling) & (pass_id < schedule.race_pass))
  def _sibling_pass():
    j = pass_id - schedule.first_sibling
    child_lane = jax.lax.broadcasted_iota(jnp.int32, (1, 1, num_children), 2) == j
    token = jnp.sum(jnp.where(child_lane, child_tokens, 0), axis=-1, keepdims=True)
    pl.when(first_tile)(lambda: set_column(sibling["sums"], 0.0))
    r, s = current(*probabilities())
    sums = sibling_sums(r, s, vocab_ids == token)
    sibling["sums"][...] += sum(jnp.where(lane == i, part, 0.0) for i, part in enumerate(sums))

    @pl.when(last_tile)
    def _decide():
      r_at, s_at, mass_r, mass_s = (column(sibling["sums"], i) for i in range(4))
      u = jnp.sum(jnp.where(child_lane, uniforms_ref[...], 0.0), axis=-1, keepdims=True)
      searching = (token >= 0) & (column(sibling["accepted"]) < 0)
      accepted = searching & (u * s_at < r_at)  # tree_rule.accepts
      set_column(sibling["accepted"], jnp.where(accepted, j, column(sibling["accepted"])))
      _set_lane(sibling["rejected"], lane, j, (searching & ~accepted).astype(jnp.int32))
      _set_lane(sibling["mass_r"], lane, j, mass_r)
      _set_lane(sibling["mass_s"], lane, j, mass_s)

  # ---- RACE: the residual race over log r (after every rejected rank) and the race over log p.
  @pl.when(pass_id == schedule.race_pass)
  def _residual_race():
    pl.when(first_tile)(init_race)
    p, q = probabilities()
    r, _ = current(p, q)
    g = noise(trees.PURPOSE_TREE_RESIDUAL)
    race_step(log_weights(r) + g, "best", "token")
    race_step(log_weights(p) + g, "best_p", "token_p")

    @pl.when(last_tile)
    def _finish():
      write(column(race["token"]), column(race["token_p"]), column(sibling["accepted"]))
