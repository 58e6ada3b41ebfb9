"""SSD (speculative speculative decoding, Saguaro): the draft pre-speculates every likely outcome.

While the target verifies round `T`'s drafts `d_1 .. d_K`, the draft prepares round `T + 1`'s
drafts for the verification outcomes it expects. An outcome is `v = (k, t*)`: `k` accepted drafts
and the token the verify emits after them (the correction at a rejection, or the bonus when all
`K` were accepted). The draft side, per row (`pre_speculate`):

1. feeds `[last, d_1 .. d_K]` (one forward, written to its cache), which gives its logits at every
   prefix length `k = 0 .. K`;
2. for each `k`, takes its top-`F_k` candidates for `t*` there, excluding its own `d_{k+1}` (a
   rejection's residual `max(p - q, 0)` has no mass on the rejected draft when `q` is the draft's
   distribution: `p(d) > q(d)` would have accepted it);
3. drafts `K` tokens after each of the `sum_k F_k` branches `prefix + d_1 .. d_k + t*`, all branches
   of all rows in one batched forward per depth (a tree mask over the block);
4. returns each branch's key `(k, t*)`, its drafts and the full distribution `q` they were drawn
   from.

The loop (`specjax.loop.ssd`) looks the realised outcome up by its exact key `(row, k, t*)`. A hit
serves the branch's drafts and their `q` to the next verify; a miss falls back to a plain target
step for that row (no drafts), after which the draft side puts its whole budget on the `k = 0`
outcomes (`fan_out_layout`).

**Exactness.** A served branch's drafts are a sample from the draft's `q` conditioned on exactly the
realised prefix (the key matched it), with the draft's own random stream (`PURPOSE_DRAFT`, keyed by
position like every drafter's), independent of the verifier's. The ordinary rule with that `q` is
then exact, whatever `q` is. Whether a row hits is a function of what was emitted before and of the
rejected draft `d_{k+1}` (whose noise is at position `L + k`), never of the served drafts' noise
(positions `> L + k`): the stopping-time argument of `specjax.core.sampling`.

**Saguaro sampling** (`SSDDrafter.saguaro`, `C` in `[0, 1]`): at draft slot `i` the draft samples
from `q'`, its warped distribution with the top-`F_i` tokens' probabilities multiplied by `C` and
renormalised. A rejection's residual `max(p - q', 0)` then puts more mass on those tokens, which
are exactly the cached candidates for `t*`: more hits. It stays exact because the verify is handed
`q'`, the distribution the drafts were really drawn from (`C = 1` is the plain draft).

**Fan-out** (`geometric_fan_out`): Saguaro's geometric allocation, `F_k` proportional to
`a^(k / (1 + r))` with an extra factor for `k = K` (the bonus: all `K` accepted), rounded to
integers that sum to the budget with every `F_k >= 1`.

**Cost.** Step 3 re-feeds the chain and the branches drafted so far at every depth (the decoder's
forward sees the cache as one prefix per row, so a branch cannot read another branch's cache
slots): `K` forwards of `K + 1 + j * NB` tokens, `j = 1 .. K`, about `NB * K^2 / 2` token-forwards
where a per-query cache mask would need `NB * K`. On TPU the forward is weight-bound and this is
cheap; on a CPU it is not (docs/ssd.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.sampling import PURPOSE_DRAFT, Sampling, first_argmax, sample_race, warp_logits
from specjax.drafters.base import OwnModelDrafter
from specjax.drafters.model import ModelDrafter

__all__ = ["ROLE_AXIS", "SSDDrafter", "branch_drafts", "candidates", "check_role_mesh",
           "fan_out_layout", "geometric_fan_out", "pre_speculate", "saguaro_log_q"]

_STATIC = dict(static=True)
ROLE_AXIS = "role"


def check_role_mesh(mesh) -> jax.sharding.Mesh | None:
  """None (one device), or `mesh` if it has a `role` axis of size 2. Other axes (a v5e 2x2 slice
  as `(role, model) = (2, 2)`) are left to XLA's partitioner inside each role: with the
  replicated inputs SSD's loop passes, each role's devices compute the same thing (tensor
  parallelism within a role is not done).

  Raises:
    ValueError: something that is not a mesh, a mesh without a `role` axis, or with one of
      another size.
  """
  if mesh is None:
    return None
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh with a '{ROLE_AXIS}' axis of size 2 "
                     f"(jax.make_mesh((2,), ('{ROLE_AXIS}',))), or None, got "
                     f"{type(mesh).__name__}")
  names = tuple(mesh.axis_names)
  if ROLE_AXIS not in names:
    raise ValueError(f"mesh needs a '{ROLE_AXIS}' axis of size 2 (target devices, draft "
                     f"devices) for the role split, got axes {names}")
  size = dict(zip(names, mesh.axis_sizes))[ROLE_AXIS]
  if size != 2:
    raise ValueError(f"the mesh's '{ROLE_AXIS}' axis must have size 2 (target, draft), got {size}")
  return mesh


def geometric_fan_out(num_draft: int, budget: int, *, acceptance: float = 0.8,
                      exponent: float = 1.0, bonus_factor: float = 2.0) -> tuple[int, ...]:
  """Saguaro's geometric fan-out: `(F_0, .., F_K)` with `F_k` proportional to
  `acceptance^(k / (1 + exponent))`, `F_K` times `bonus_factor`, every `F_k >= 1`, summing to
  `budget` (largest remainders).

  Raises:
    ValueError: `budget < num_draft + 1` (every outcome length needs a branch), or a bad weight.
  """
  if isinstance(budget, bool) or not isinstance(budget, int) or budget < num_draft + 1:
    raise ValueError(f"the fan-out budget must be an int >= num_draft + 1 = {num_draft + 1} (one "
                     f"branch per accepted length k = 0 .. K at least), got {budget!r}")
  if not 0.0 < acceptance <= 1.0 or exponent < 0 or bonus_factor <= 0:
    raise ValueError(f"fan-out weights need acceptance in (0, 1], exponent >= 0, bonus_factor > 0,"
                     f" got {acceptance}, {exponent}, {bonus_factor}")
  weights = np.array([acceptance ** (k / (1.0 + exponent)) for k in range(num_draft + 1)])
  weights[-1] *= bonus_factor
  spare = budget - (num_draft + 1)  # beyond the one branch each k gets
  share = weights / weights.sum() * spare
  extra = np.floor(share).astype(int)
  order = np.argsort(-(share - extra), kind="stable")
  extra[order[:spare - extra.sum()]] += 1
  return tuple(int(1 + e) for e in extra)


def check_fan_out(fan_out, num_draft: int) -> tuple[int, ...]:
  """`fan_out` as a tuple of `num_draft + 1` positive ints; else a ValueError naming it."""
  fan_out = tuple(fan_out)
  if len(fan_out) != num_draft + 1 or any(
      isinstance(f, bool) or not isinstance(f, int) or f < 1 for f in fan_out):
    raise ValueError(f"fan_out must hold num_draft + 1 = {num_draft + 1} positive ints (F_0 .. "
                     f"F_K), got {fan_out!r}")
  return fan_out


def fan_out_layout(fan_out: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
  """The branch slots of a row that drafted `K`: `(k [NB], rank [NB])` int32, slot `b` holding the
  `rank[b]`-th candidate for `t*` after `k[b]` accepted drafts. A row that drafted nothing (after
  a miss) uses `(0, b)` for every slot instead: its only outcome is `k = 0`."""
  ks = np.concatenate([np.full(f, k) for k, f in enumerate(fan_out)]).astype(np.int32)
  ranks = np.concatenate([np.arange(f) for f in fan_out]).astype(np.int32)
  return ks, ranks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SSDDrafter(OwnModelDrafter):
  """A draft model that pre-speculates the next round for the likely outcomes of this one.

  Hand it to `specjax.decode` as the drafter: the call then runs SSD's loop (`specjax.loop.ssd`)
  on one device, or, with `mesh`, split by role (the target verifies on one half of the mesh
  while the draft pre-speculates on the other).

  Attributes:
    drafter: the draft, a `specjax.drafters.ModelDrafter` (a `specjax.Model` is wrapped; a
      self-drafter, `specjax.self_drafter(target, bits=8)`, keeps its prompt sharing). A restricted
      draft vocabulary is not supported.
    budget: branches per row and round (`NB`; at least `K + 1`), split by `geometric_fan_out`
      unless `fan_out` is given. Static.
    fan_out: None, or `(F_0, .., F_K)` explicitly (their sum is the budget). Static.
    saguaro: `C` in `[0, 1]`, Saguaro sampling's scale on the top-`F_i` probabilities at draft slot
      `i` (1 = plain sampling). Ignored when greedy. Static.
    acceptance, exponent, bonus_factor: the geometric fan-out's `a`, `r` and `k = K` factor.
    mesh: where the loop runs. None: on one device (the two halves one after the other). A
      `jax.sharding.Mesh` with a `role` axis of size 2 (`jax.make_mesh((2,), ("role",))`, or
      `(role, model)` for several devices per role): the devices at `role = 0` run the target
      half, those at `role = 1` the draft half, at the same time, with one exchange per round;
      the call replicates the target and the draft on both roles. Static.
  """

  drafter: Any
  budget: int = dataclasses.field(default=8, metadata=_STATIC)
  fan_out: tuple[int, ...] | None = dataclasses.field(default=None, metadata=_STATIC)
  saguaro: float = dataclasses.field(default=1.0, metadata=_STATIC)
  acceptance: float = dataclasses.field(default=0.8, metadata=_STATIC)
  exponent: float = dataclasses.field(default=1.0, metadata=_STATIC)
  bonus_factor: float = dataclasses.field(default=2.0, metadata=_STATIC)
  mesh: jax.sharding.Mesh | None = dataclasses.field(default=None, metadata=_STATIC)

  def __post_init__(self):
    drafter = self.drafter
    if not isinstance(drafter, ModelDrafter):
      if not (hasattr(drafter, "init_cache") and hasattr(drafter, "vocab_size")):
        raise ValueError(f"SSDDrafter needs a draft model or a ModelDrafter, got "
                         f"{type(drafter).__name__}")
      drafter = ModelDrafter(drafter)
    if drafter.draft_ids is not None:
      raise ValueError("SSDDrafter does not support a restricted draft vocabulary (draft_ids)")
    object.__setattr__(self, "drafter", drafter)
    c = self.saguaro
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c <= 1.0:
      raise ValueError(f"saguaro (Saguaro sampling's C) must be a number in [0, 1], got {c!r}")
    object.__setattr__(self, "saguaro", float(c))
    check_role_mesh(self.mesh)
    if self.fan_out is not None:
      object.__setattr__(self, "fan_out", tuple(self.fan_out))
      object.__setattr__(self, "budget", int(sum(self.fan_out)))

  @property
  def model(self):
    return self.drafter.model

  def branches(self, num_draft: int) -> tuple[int, ...]:
    """`(F_0, .., F_K)` for `K = num_draft`.

    Raises:
      ValueError: a budget below `K + 1`, or a `fan_out` of the wrong length.
    """
    if self.fan_out is not None:
      return check_fan_out(self.fan_out, num_draft)
    return geometric_fan_out(num_draft, self.budget, acceptance=self.acceptance,
                             exponent=self.exponent, bonus_factor=self.bonus_factor)

  def forwards_per_round(self, num_draft: int) -> int:
    return num_draft + 1  # the chain, then one forward per depth

  def init(self, tokens, lengths, buffer_len, prefill=None):
    """The draft's cache over the prompt (all but the last token), as `ModelDrafter.init`."""
    return self.drafter.init(tokens, lengths, buffer_len, prefill)

  def propose(self, *args, **kwargs):
    raise ValueError("an SSDDrafter runs in SSD's own loop (specjax.decode routes it there), not "
                     "in ordinary rounds")

  def observe(self, state, scored, block, emitted, count, lengths):
    del scored, block, emitted, count, lengths
    return state


def saguaro_log_q(logits: jax.Array, sampling: Sampling, top_f: int, scale: float) -> jax.Array:
  """`log q'` `[..., V]` float32 from raw draft logits: the warped distribution with its top-`top_f`
  tokens (by raw logit) scaled by `scale` and renormalised (`-inf` where `q' = 0`); where that
  leaves no mass (every token of the support scaled by 0), `q` itself."""
  log_q = jax.nn.log_softmax(warp_logits(logits, sampling), axis=-1)
  if scale == 1.0 or top_f == 0:
    return log_q
  top = jax.lax.top_k(logits.astype(jnp.float32), top_f)[1]  # [..., F]
  in_top = jnp.any(jnp.arange(logits.shape[-1], dtype=jnp.int32) == top[..., None], axis=-2)
  q = jnp.exp(log_q)
  scaled = jnp.where(in_top, q * jnp.float32(scale), q)
  total = jnp.sum(scaled, axis=-1, keepdims=True)
  scaled = jnp.where(total > 0, scaled / jnp.where(total > 0, total, 1.0), q)
  return jnp.where(scaled > 0, jnp.log(jnp.where(scaled > 0, scaled, 1.0)), -jnp.inf)


def candidates(chain_logits: jax.Array, drafts: jax.Array, num_drafted: jax.Array,
               fan_out: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """Each row's branch keys `(k [B, NB], t [B, NB])` int32.

  Args:
    chain_logits: `[B, K + 1, V]` the draft's raw logits after `[last, d_1 .. d_k]`, `k = 0 .. K`.
    drafts: `[B, K]` this round's drafts.
    num_drafted: `[B]` drafts each row proposes this round (`K`, or 0 after a miss).
    fan_out: `(F_0, .., F_K)`.

  A row slot `b` of `fan_out_layout` takes the `rank`-th largest logit at `k` with the row's own
  `d_{k+1}` excluded (for `k < num_drafted`); a row with no drafts takes its top `NB` at `k = 0`.
  """
  batch, width, vocab = chain_logits.shape
  k_num = width - 1
  ks, ranks = fan_out_layout(fan_out)
  budget = ks.shape[0]
  ids = jnp.arange(vocab, dtype=jnp.int32)
  next_draft = jnp.pad(drafts.astype(jnp.int32), ((0, 0), (0, 1)), constant_values=-1)
  excluded = (ids == next_draft[..., None]) & (
      jnp.arange(width, dtype=jnp.int32)[None, :, None] < num_drafted[:, None, None])
  scores = jnp.where(excluded, -jnp.inf, chain_logits.astype(jnp.float32))
  top = jax.lax.top_k(scores, min(budget, vocab - 1))[1]  # [B, K + 1, NB]
  drafted = (num_drafted > 0)[:, None]
  k = jnp.where(drafted, jnp.asarray(ks)[None], 0)
  rank = jnp.where(drafted, jnp.asarray(ranks)[None], jnp.arange(budget, dtype=jnp.int32)[None])
  rank = jnp.minimum(rank, top.shape[-1] - 1)
  t = top[jnp.arange(batch)[:, None], jnp.minimum(k, k_num), rank]
  return k.astype(jnp.int32), t.astype(jnp.int32)


def branch_drafts(model, cache, chain: jax.Array, starts: jax.Array, keys_k: jax.Array,
                  keys_t: jax.Array, *, num_draft: int, sampling: Sampling, seeds: jax.Array,
                  fan_out: tuple[int, ...], scale: float, report_unscaled: bool = False
                  ) -> tuple[jax.Array, jax.Array | None]:
  """`K` drafts after every branch: `(drafts [B, NB, K] int32, log_q [B, NB, K, V] or None)`.

  Branch `b` of a row is `prefix + chain[1 .. k_b] + t_b` (`chain [B, K + 1]` is `[last, d_1 ..
  d_K]` at positions `starts .. starts + K`, the cache holding the prefix before `starts`). Depth
  `j` feeds the chain and every branch's nodes `0 .. j` in one forward (tree mask: node `(b, i)`
  sees chain entries `0 .. k_b` and its own branch's nodes `<= i`; position `starts + 1 + k_b + i`)
  and draws draft `j + 1` of every branch at position `starts + 2 + k_b + j` from `q'` with
  `F_j` (`saguaro_log_q`). `log_q` (None when greedy) is what the drafts were drawn from, or with
  `report_unscaled` the unscaled `q` (a negative control of the tests only).
  """
  batch, width = chain.shape
  budget = keys_k.shape[1]
  chain_pos = starts[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
  nodes = keys_t[:, :, None]  # [B, NB, depth so far]
  all_logq = []
  for depth in range(num_draft):
    d = depth + 1  # node depths fed: 0 .. depth
    node_tokens = nodes.transpose(0, 2, 1).reshape(batch, d * budget)  # depth-major
    node_k = jnp.tile(keys_k, (1, d))  # [B, d * NB]
    node_depth = jnp.repeat(jnp.arange(d, dtype=jnp.int32), budget)[None]
    node_branch = jnp.tile(jnp.arange(budget, dtype=jnp.int32), d)[None]
    node_pos = starts[:, None] + 1 + node_k + node_depth
    tokens = jnp.concatenate([chain, node_tokens], axis=1)
    positions = jnp.concatenate([chain_pos, node_pos], axis=1)
    size = width + d * budget
    chain_index = jnp.arange(width, dtype=jnp.int32)
    mask = jnp.zeros((batch, size, size), bool)
    mask = mask.at[:, :width, :width].set(chain_index[:, None] >= chain_index[None])
    sees_chain = chain_index[None, None] <= node_k[:, :, None]  # [B, dNB, K + 1]
    mask = mask.at[:, width:, :width].set(sees_chain)
    own = ((node_branch[:, :, None] == node_branch[:, None, :])
           & (node_depth[:, None, :] <= node_depth[:, :, None]))  # [1, dNB, dNB]
    mask = mask.at[:, width:, width:].set(jnp.broadcast_to(own, (batch, d * budget, d * budget)))
    last = width + depth * budget + jnp.arange(budget, dtype=jnp.int32)
    out = model(tokens, starts, cache, positions=positions, block_mask=mask, write_cache=False,
                logits_at=jnp.broadcast_to(last, (batch, budget)))
    logits = out.logits  # [B, NB, V]
    draft_pos = starts[:, None] + 2 + keys_k + depth
    if sampling.greedy:
      token = first_argmax(logits)
    else:
      log_q = saguaro_log_q(logits, sampling, fan_out[depth], scale)
      token = sample_race(log_q, seeds[:, None], draft_pos, PURPOSE_DRAFT)
      all_logq.append(saguaro_log_q(logits, sampling, 0, 1.0) if report_unscaled else log_q)
    nodes = jnp.concatenate([nodes, token[:, :, None].astype(jnp.int32)], axis=2)
  drafts = nodes[:, :, 1:]
  return drafts, (None if sampling.greedy else jnp.stack(all_logq, axis=2))


def pre_speculate(drafter: SSDDrafter, cache, sequence: jax.Array, lengths: jax.Array,
                  drafts: jax.Array, num_drafted: jax.Array, *, num_draft: int,
                  sampling: Sampling, seeds: jax.Array, report_unscaled: bool = False):
  """The draft side of a round: `(cache, keys_k [B, NB], keys_t [B, NB], drafts [B, NB, K],
  log_q [B, NB, K, V] or None)` for this round's drafts `drafts [B, K]` after each row's
  `sequence[:lengths]` (see the module docstring). The cache must hold the prefix before
  `lengths - 1`; it comes back holding `[last, d_1 .. d_K]` at `lengths - 1 ..` too, so after an
  outcome with `k` accepted drafts it holds the next round's prefix before `lengths + k`."""
  fan_out = drafter.branches(num_draft)
  model = drafter.model
  starts = lengths - 1
  last = jnp.take_along_axis(sequence, starts[:, None], axis=1)
  chain = jnp.concatenate([last, drafts.astype(jnp.int32)], axis=1)  # [B, K + 1]
  out = model(chain, starts, cache)
  keys_k, keys_t = candidates(out.logits, drafts, num_drafted, fan_out)
  branch, log_q = branch_drafts(model, cache, chain, starts, keys_k, keys_t, num_draft=num_draft,
                                sampling=sampling, seeds=seeds, fan_out=fan_out,
                                scale=drafter.saguaro, report_unscaled=report_unscaled)
  return out.cache, keys_k, keys_t, branch, log_q

