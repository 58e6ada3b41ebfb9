"""SSD's loop: speculative speculative decoding (Saguaro) in one `lax.while_loop`.

`specjax.decode` runs it when its drafter is a `specjax.drafters.SSDDrafter` (`prepare_ssd`);
`decode_ssd` is the same call under its earlier name.

Each round has two halves that read the same inputs (the committed sequence and the round's
served drafts) and never each other's outputs:

* the **target half** verifies the served drafts `d [B, K]` against their `q` with the exact rule
  (`specjax.verify.rule`), which gives each row's outcome `(k, t*)`;
* the **draft half** pre-speculates the next round for the likely outcomes
  (`specjax.drafters.ssd.pre_speculate`): branch keys `(k, t*)`, `K` drafts per branch and their
  `q`.

Then one exchange: the outcome cache (the branches) and the outcomes meet, every row appends its
kept tokens, and looks its outcome up by exact key `(row, k, t*)`. A hit serves that branch's
drafts and `q` in the next round; a miss serves none (`num_drafted = 0`): the next round is a
plain target step for that row, while the draft half spends its whole budget on that step's
`k = 0` outcomes. The first round is such a step for every row.

**Placement** (`SSDDrafter.mesh`). On one device the two halves run one after the other (no
overlap, the same tokens). With a mesh holding a `role` axis of size 2, the loop runs inside
`jax.shard_map`: the devices at `role = 0` run the target half and those at `role = 1` the draft
half (`lax.cond` on the role index), at the same time, and the exchange is ONE `psum` over `role`
per round (the outcomes, the branch keys, drafts and `q` packed into one int32 buffer, each side
contributing zeros where the other writes). Both roles then hold the same sequence, so the loop's
bookkeeping runs on both and the output is the single-device output, token for token. Weights and
caches are replicated across the two roles (each only runs its own); tensor parallelism within a
role is not done here.

**Outcome cache in the loop state.** `SSDCarry` holds the served drafts and their `q` (the hit
branch, chosen at the exchange), and the per-`k` hit counters. The branch keys live only from the
exchange to the lookup inside one round: the cache is replaced every round.

**Negative controls.** The jitted program takes a static `variant` (`NEGATIVE_CONTROLS`): broken
twins of the loop that only `specjax.testing.ssd_variants` runs, to prove that the exactness
tests can fail. The public entry points always run "exact".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from specjax.core import validation
from specjax.core.outputs import DecodeOutput
from specjax.core.sampling import GREEDY, Sampling, no_distribution, row_seeds, warp_logits
from specjax.core.sequence import gather_tokens
from specjax.core.tracing import TRACE_COUNTS
from specjax.drafters.ssd import (ROLE_AXIS, SSDDrafter, check_role_mesh, pre_speculate,
                                  saguaro_log_q)
from specjax.loop.arguments import DecodeArguments, check_decode_arguments
from specjax.loop.program import Program
from specjax.loop.round import _advance, _keep, _nonfinite_emitted
from specjax.loop.state import DecodeState, finish, init_state
from specjax.verify.rule import verify_reference

__all__ = ["ROLE_AXIS", "SSDCarry", "SSDOutput", "SSDProgram", "SSDStats", "check_role_mesh",
           "decode_ssd", "prepare_ssd"]

T1 = Sampling(temperature=1.0)  # the rule on logits that are already warped (p) or final (q')

# Broken twins of the loop, run only by `specjax.testing.ssd_variants` (the exactness tests'
# power checks); the public entry points run "exact":
#  "k_only": the cache keyed by k alone (a wrong-prefix branch is served) with the q its drafts
#    were drawn from: still exact (speculative sampling is exact for any proposal used
#    consistently), fewer accepted drafts;
#  "k_only_realised_q": keyed by k alone, the served drafts verified with q re-scored at the
#    realised prefix: not exact;
#  "unscaled_q": Saguaro sampling's drafts verified with the unscaled q: not exact for C < 1;
#  "wrong_branch_q": a hit verified with the q of the next branch slot: not exact.
NEGATIVE_CONTROLS = ("k_only", "k_only_realised_q", "unscaled_q", "wrong_branch_q")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SSDStats:
  """Per row, per outcome length `k = 0 .. K`: `outcomes [B, K + 1]` rounds whose outcome had `k`
  accepted drafts and after which the row went on, `hits [B, K + 1]` of those whose `(k, t*)` was
  in the outcome cache, and `fallbacks [B]` rounds the row ran with no drafts (the first round and
  every round after a miss)."""

  outcomes: jax.Array
  hits: jax.Array
  fallbacks: jax.Array

  def hit_rate(self) -> np.ndarray:
    """`[K + 1]` hits / outcomes per `k` over the batch (NaN where no outcome had that `k`)."""
    outcomes = np.asarray(self.outcomes).sum(0)
    return np.asarray(self.hits).sum(0) / np.where(outcomes > 0, outcomes, np.nan)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SSDCarry:
  """The draft side's cache and the outcome cache's served entry, in the loop state."""

  cache: Any  # the draft model's KVCache (valid before each row's lengths - 1)
  drafts: jax.Array  # [B, K] int32 the drafts this round verifies
  log_q: jax.Array | None  # [B, K, V] float32 log q' they were drawn from (None when greedy)
  num_drafted: jax.Array  # [B] int32: K on a hit, 0 after a miss (a plain target step)
  stats: SSDStats


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SSDOutput(DecodeOutput):
  """`DecodeOutput` (`tokens`, `num_tokens`, `stats`; `logprobs` is None), and `ssd`: the outcome
  cache's `SSDStats`."""

  ssd: SSDStats | None = None


@dataclasses.dataclass(frozen=True)
class SSDProgram(Program):
  """A checked SSD call: `_decode_ssd` and its inputs (`Program`'s fields), run on the
  drafter's mesh (replicated on both roles) or on one device."""

  mesh: jax.sharding.Mesh | None = None

  def _placed(self) -> tuple:
    if self.mesh is None:
      return self.inputs
    # Replicated on both roles (a no-op for what is already placed so).
    return jax.device_put(self.inputs,
                          jax.sharding.NamedSharding(self.mesh, PartitionSpec()))

  def run(self) -> SSDOutput:
    """Runs the loop.

    Returns:
      `SSDOutput(tokens [B, max_new_tokens], num_tokens [B], stats, None, ssd)`.
    """
    out = self.jitted(*self._placed(), jnp.int32(self.max_new_tokens), **self.static)
    return dataclasses.replace(out, tokens=out.tokens[:, :self.max_new_tokens])

  def compile(self) -> jax.stages.Compiled:
    """Lowers and compiles the loop for these arguments, without running it."""
    return self.jitted.lower(*self._placed(), jnp.int32(self.max_new_tokens),
                             **self.static).compile()


def prepare_ssd(target, args: DecodeArguments, *, sampling: Sampling, pad_id: int | None,
                return_logprobs: bool = False) -> SSDProgram:
  """SSD's program for `decode`'s checked arguments (`args.drafter` an `SSDDrafter`).

  Raises:
    ValueError: `return_logprobs` (not collected by SSD's loop).
  """
  if return_logprobs:
    raise ValueError("an SSDDrafter does not return log-probabilities: leave return_logprobs "
                     "out")
  static = dict(sampling=sampling, num_draft=args.num_draft, capacity=args.capacity,
                pad_id=validation.resolve_pad_id(target, pad_id))
  inputs = (target, args.drafter, args.tokens, args.lengths, args.rng, args.eos_ids)
  return SSDProgram(_decode_ssd, inputs, static, args.max_new_tokens, mesh=args.drafter.mesh)


def decode_ssd(target, drafter: SSDDrafter, tokens, rng, *, lengths=None,
               max_new_tokens: int = 64, num_draft: int = 4, sampling: Sampling = GREEDY,
               eos_id: int | tuple[int, ...] | None = None, pad_id: int | None = None,
               mesh=None) -> SSDOutput:
  """`specjax.decode(target, drafter, ...)` with an `SSDDrafter`, under its earlier name.

  Args:
    target, tokens, rng, lengths, max_new_tokens, num_draft, sampling, eos_id, pad_id: as
      `specjax.decode`.
    drafter: a `specjax.drafters.SSDDrafter`.
    mesh: None (the drafter's own `mesh`), or a mesh with a `role` axis of size 2 for the role
      split: the same as `SSDDrafter(..., mesh=mesh)`.

  Returns:
    `SSDOutput(tokens [B, max_new_tokens], num_tokens [B], stats, logprobs=None, ssd)`.

  Raises:
    ValueError: `decode`'s checks, a drafter that is not an `SSDDrafter`, a fan-out budget below
      `K + 1`, a mesh without a `role` axis of size 2, or a `mesh` other than the drafter's own;
      before anything is traced.
  """
  if not isinstance(drafter, SSDDrafter):
    raise ValueError(f"decode_ssd needs a specjax.drafters.SSDDrafter, got "
                     f"{type(drafter).__name__}")
  mesh = check_role_mesh(mesh)
  if mesh is not None and mesh != drafter.mesh:
    if drafter.mesh is not None:
      raise ValueError("decode_ssd's mesh= differs from the SSDDrafter's own mesh: give one")
    drafter = dataclasses.replace(drafter, mesh=mesh)
  args = check_decode_arguments(target, drafter, tokens, rng, lengths=lengths,
                                max_new_tokens=max_new_tokens, num_draft=num_draft,
                                sampling=sampling, eos_id=eos_id, verify_impl="reference")
  return prepare_ssd(target, args, sampling=sampling, pad_id=pad_id).run()


@functools.partial(jax.jit, static_argnames=("sampling", "num_draft", "capacity", "pad_id",
                                             "variant"))
def _decode_ssd(target, drafter, tokens, lengths, rng, eos_ids, max_new_tokens, *, sampling,
                num_draft, capacity, pad_id, variant: str = "exact") -> SSDOutput:
  TRACE_COUNTS["decode_ssd"] += 1
  if variant != "exact" and variant not in NEGATIVE_CONTROLS:
    raise ValueError(f"variant must be 'exact' or one of {NEGATIVE_CONTROLS}, got {variant!r}")
  mesh = drafter.mesh
  seeds = row_seeds(rng, tokens.shape[0])
  run = functools.partial(_loop, sampling=sampling, num_draft=num_draft, capacity=capacity,
                          pad_id=pad_id, variant=variant, split=mesh is not None)
  if mesh is None:
    return run(target, drafter, tokens, lengths, seeds, eos_ids, max_new_tokens)
  replicated = PartitionSpec()
  return jax.shard_map(run, mesh=mesh, in_specs=replicated, out_specs=replicated,
                       axis_names={ROLE_AXIS}, check_vma=False)(
                           target, drafter, tokens, lengths, seeds, eos_ids, max_new_tokens)


def _loop(target, drafter, tokens, lengths, seeds, eos_ids, max_new_tokens, *, sampling,
          num_draft, capacity, pad_id, variant, split):
  state = init_state(target, drafter.drafter, tokens, lengths, max_new_tokens, eos_ids, seeds,
                     num_draft=num_draft, capacity=capacity)
  batch = tokens.shape[0]
  zeros = jnp.zeros((batch, num_draft + 1), jnp.int32)
  log_q = None
  if not sampling.greedy:
    log_q = jnp.zeros((batch, num_draft, target.vocab_size), jnp.float32)
  carry = SSDCarry(cache=state.draft_state, drafts=jnp.zeros((batch, num_draft), jnp.int32),
                   log_q=log_q, num_drafted=jnp.zeros((batch,), jnp.int32),
                   stats=SSDStats(zeros, zeros, jnp.zeros((batch,), jnp.int32)))
  state = dataclasses.replace(state, draft_state=carry)
  body = functools.partial(_round, target, drafter, num_draft=num_draft, sampling=sampling,
                           variant=variant, split=split)
  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  out = finish(state, capacity, pad_id)
  return SSDOutput(out.tokens, out.num_tokens, out.stats, None, state.draft_state.stats)


class _Outcome(NamedTuple):
  """The target half's message: the rule's tokens `[B, K + 1]`, `accepted [B]`, the logits'
  non-finite flags `[B, K + 1]`."""

  tokens: jax.Array
  accepted: jax.Array
  bad: jax.Array


class _Branches(NamedTuple):
  """The draft half's message: keys `(k [B, NB], t [B, NB])`, `drafts [B, NB, K]`, `log_q [B, NB,
  K, V]` (None when greedy)."""

  keys_k: jax.Array
  keys_t: jax.Array
  drafts: jax.Array
  log_q: jax.Array | None


def _target_half(target, state: DecodeState, *, sampling: Sampling):
  """Verifies the served drafts: `(_Outcome, target cache)`."""
  carry = state.draft_state
  lengths = state.lengths
  block = jnp.concatenate([gather_tokens(state.tokens, lengths - 1, 1), carry.drafts], axis=1)
  scored = target(block, lengths - 1, state.target_cache)
  if sampling.greedy:
    result = verify_reference(scored.logits, None, carry.drafts, sampling=GREEDY,
                              seeds=state.seeds, positions=lengths,
                              num_drafted=carry.num_drafted)
  else:
    result = verify_reference(warp_logits(scored.logits, sampling), carry.log_q, carry.drafts,
                              sampling=T1, seeds=state.seeds, positions=lengths,
                              num_drafted=carry.num_drafted)
  outcome = _Outcome(result.tokens.astype(jnp.int32), result.num_accepted.astype(jnp.int32),
                     no_distribution(scored.logits))
  return outcome, scored.cache


def _draft_half(drafter, state: DecodeState, *, num_draft: int, sampling: Sampling, variant: str):
  """Pre-speculates the next round: `(_Branches, draft cache)`."""
  carry = state.draft_state
  cache, keys_k, keys_t, drafts, log_q = pre_speculate(
      drafter, carry.cache, state.tokens, state.lengths, carry.drafts, carry.num_drafted,
      num_draft=num_draft, sampling=sampling, seeds=state.seeds,
      report_unscaled=variant == "unscaled_q")
  return _Branches(keys_k, keys_t, drafts, log_q), cache


def _pack(tree) -> tuple[jax.Array, Any]:
  """Every leaf of `tree` bitcast to int32 and flattened into one `[n]` buffer (adding zeros to
  it is exact for every dtype, unlike float addition of a bitcast integer), and how to unpack."""
  leaves, treedef = jax.tree.flatten(tree)
  specs = [(x.shape, x.dtype) for x in leaves]

  def to_int(x):
    if x.dtype == jnp.bool_:
      return x.astype(jnp.int32)
    if x.dtype == jnp.int32:
      return x
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)

  flat = jnp.concatenate([to_int(x).reshape(-1) for x in leaves])

  def unpack(buffer):
    out, offset = [], 0
    for shape, dtype in specs:
      size = int(np.prod(shape))
      part = buffer[offset:offset + size].reshape(shape)
      offset += size
      if dtype == jnp.bool_:
        part = part != 0
      elif dtype != jnp.int32:
        part = jax.lax.bitcast_convert_type(part, jnp.float32).astype(dtype)
      out.append(part)
    return jax.tree.unflatten(treedef, out)

  return flat, unpack


def _exchange(target, drafter, state: DecodeState, *, num_draft, sampling, variant, split):
  """Both halves and their one exchange: `(_Outcome, _Branches, target cache, draft cache)`."""
  run_target = functools.partial(_target_half, target, sampling=sampling)
  run_draft = functools.partial(_draft_half, drafter, num_draft=num_draft, sampling=sampling,
                                variant=variant)
  if not split:  # one device: one after the other
    outcome, target_cache = run_target(state)
    branches, draft_cache = run_draft(state)
    return outcome, branches, target_cache, draft_cache

  shapes = jax.eval_shape(lambda s: (run_target(s)[0], run_draft(s)[0]), state)
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)

  def as_target(state):
    outcome, cache = run_target(state)
    return (outcome, zeros[1]), cache, state.draft_state.cache

  def as_draft(state):
    branches, cache = run_draft(state)
    return (zeros[0], branches), state.target_cache, cache

  role = jax.lax.axis_index(ROLE_AXIS)
  message, target_cache, draft_cache = jax.lax.cond(role == 0, as_target, as_draft, state)
  flat, unpack = _pack(message)
  outcome, branches = unpack(jax.lax.psum(flat, ROLE_AXIS))  # the round's one collective
  return outcome, branches, target_cache, draft_cache


def _rescore(drafter, cache, state: DecodeState, drafts, *, sampling: Sampling, fan_out):
  """`log q'` `[B, K, V]` of `drafts [B, K]` re-scored by the draft at each row's realised prefix
  (`state` after the round): the "k_only_realised_q" negative control only."""
  lengths = state.lengths
  block = jnp.concatenate([gather_tokens(state.tokens, lengths - 1, 1), drafts[:, :-1]], axis=1)
  logits = drafter.model(block, lengths - 1, cache, write_cache=False).logits
  scale = drafter.saguaro
  return jnp.stack([saguaro_log_q(logits[:, i], sampling, fan_out[i], scale)
                    for i in range(drafts.shape[1])], axis=1)


def _round(target, drafter, state: DecodeState, *, num_draft: int, sampling: Sampling,
           variant: str, split: bool) -> DecodeState:
  """One round: both halves, the exchange, the kept tokens and the lookup."""
  carry = state.draft_state
  outcome, branches, target_cache, draft_cache = _exchange(
      target, drafter, state, num_draft=num_draft, sampling=sampling, variant=variant,
      split=split)
  accepted = outcome.accepted
  count, hit_eos = _keep(outcome.tokens, accepted, state)
  live = ~state.done
  target_cache = target_cache.with_lengths(state.lengths + count - 1)
  calls = jnp.where(live, drafter.forwards_per_round(num_draft), 0)
  state = dataclasses.replace(state, stats=dataclasses.replace(
      state.stats, draft_calls=state.stats.draft_calls + calls))
  state = _advance(state, outcome.tokens, accepted=accepted, count=count, hit_eos=hit_eos,
                   drafted=carry.num_drafted, nonfinite=_nonfinite_emitted(outcome.bad, count),
                   target_cache=target_cache)

  # The lookup: exact key (row, k, t*).
  bonus = jnp.take_along_axis(outcome.tokens, accepted[:, None], axis=1)  # [B, 1] t*
  same_k = branches.keys_k == accepted[:, None]
  match = same_k if variant in ("k_only", "k_only_realised_q") else (
      same_k & (branches.keys_t == bonus))
  hit = jnp.any(match, axis=1)
  slot = jnp.argmax(match, axis=1).astype(jnp.int32)
  pick = lambda x, index: jnp.take_along_axis(
      x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]
  drafts = pick(branches.drafts, slot)
  log_q = None
  if branches.log_q is not None:
    q_slot = (slot + 1) % branches.keys_k.shape[1] if variant == "wrong_branch_q" else slot
    log_q = pick(branches.log_q, q_slot)
    if variant == "k_only_realised_q":
      log_q = _rescore(drafter, draft_cache, state, drafts, sampling=sampling,
                       fan_out=drafter.branches(num_draft))
  went_on = live & ~state.done  # rows that look their outcome up for another round
  num_drafted = jnp.where(hit, num_draft, 0).astype(jnp.int32)
  counts = carry.stats
  at_k = jax.nn.one_hot(accepted, num_draft + 1, dtype=jnp.int32) * went_on[:, None]
  stats = SSDStats(outcomes=counts.outcomes + at_k,
                   hits=counts.hits + at_k * hit[:, None].astype(jnp.int32),
                   fallbacks=counts.fallbacks + (live & (carry.num_drafted == 0)).astype(
                       jnp.int32))
  new_carry = SSDCarry(cache=draft_cache, drafts=drafts, log_q=log_q, num_drafted=num_drafted,
                       stats=stats)
  return dataclasses.replace(state, draft_state=new_carry)
