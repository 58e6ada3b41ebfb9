"""Per-row adaptive draft length: `specjax.decode(target, adaptive_drafter(drafter, DIR),
...)`.

`specjax.drafters.adaptive.auto_num_draft` picks one `k` for every prompt before compiling, from
an acceptance profile averaged over many prompts. But acceptance differs by an order of magnitude
between prompts (a head that writes code well may rarely guess a translation), so the `k` that is
best on average is too long for some rows and too short for others. `AdaptiveDrafter` wraps a
drafter (`adaptive_drafter` builds one from a calibration) and, at the start of every round, gives
each row its own limit `k_b` in `0 .. K`: the one that maximises expected tokens per millisecond,

    E[tokens | k] / round_ms[k],   E[tokens | k] = 1 + sum_{j <= k} prod_{i <= j} alpha_{b,i},

where `round_ms[k]` comes from the backend's cost table (the verify forward at the compiled width
that holds `k + 1` positions, plus the drafter's steps) and `alpha_{b,j}` is the row's own running
acceptance at draft position `j`: decayed counts of the rounds in which draft `j` was reached and
accepted, shrunk (`prior_weight` pseudo-rounds) towards the calibration profile shifted by the
row's pooled odds ratio (a row accepted more often than the profile expects at the positions it
tested is expected to do better at deeper positions too; `AdaptiveDrafter.alpha`). `k_b = 0` runs a
plain target step (verify width 1) when drafting does not pay for that row; the row still learns
whether its first draft would have matched (the drafter makes it anyway), so it starts drafting
again when it would pay.

**Rounds without the drafter.** Around a drafter that can catch up on tokens it did not see
(`catches_up`: a draft model), a round in which every row's history says `k = 0` skips the
drafter entirely (`lax.cond`): a plain target step at verify width 1, where running the drafter
only to learn from its unproposed first draft would cost a draft step per round (on a GPU, where
a small model's forward is launch-bound, that halved the throughput). So does a round in which
every row has, for `stop_rounds` rounds in a row, run the drafter and proposed nothing: its
history says draft, but the token stop below refused every first draft (a drafter whose
confidences are far below its acceptance). When the drafter runs again it first feeds the tokens
it missed, `k + 1` per forward, so its drafts read the whole context. Every `probe_every` skipped
rounds one round runs it again (the wait doubles after each probe that finds every row still at
0, up to `probe_max`), so rows can start drafting when the text turns predictable. The skip
reads only what earlier rounds left (the rows' counts and stops), so it keeps the output law.
When the calibration says no `k >= 1` can beat a plain step even for rows far above the profile
(`specjax.drafters.adaptive.costs.AdaptivePlan.plain`), the drafter is never run.

**Token-level stop** (`AdaptiveDrafter.token_stop`, on by default for drafters whose `propose`
takes `stop=`: every built-in head and draft model). The history says how a row has done, the
drafter's own confidence says how sure it is of the draft in hand. So instead of fixing `k_b`
before the round, the row decides draft by draft (`CostAwareStop`): before proposing draft `j` it
estimates that draft's acceptance from the drafter's top probability `c_j` (known before the draft
is drawn; calibrated per row: its log-odds shifted by how much more often the row's tested drafts
were accepted than their confidences said, `AdaptiveDrafter.confidence_shift`, because a head's
top probability is not the chance that the target agrees: under greedy verification it
understates it), the drafts after it by the row's running `alpha_{b, j+1..K}`, and proposes it only
when some `k >= j` then promises more tokens per millisecond than stopping at `j - 1`. The
estimate of draft `j` itself is a mixture: `w_b * (confidence estimate) + (1 - w_b) * alpha_{b,j}`,
where `w_b` is the posterior of the confidence model after both have predicted the row's tested
slots (`AdaptiveDrafter.confidence_weight`). A trained head's confidence separates its accepted
drafts from its rejected ones and keeps `w_b` near 1; a quantized copy of the target is accepted
about as often when unsure as when sure (its q is close to p whatever its top probability), so
there `alpha` wins and an unsure draft no longer cuts a round that would have been accepted:

    max_{k >= j} (E_{j-1} + r_{j-1} c_j S_{j,k}) / round_ms[k]  >  E_{j-1} / round_ms[j-1],

with `E_{j-1}`, `r_{j-1}` the expected tokens and the chance of reaching slot `j` from the
confidences of the drafts already proposed, and `S_{j,k} = 1 + sum_{j<m<=k} prod_{j<i<=m}
alpha_{b,i}`. Where a wider round costs little (a CPU verify of 5 tokens costs about what one
of 2 does), the threshold falls far below a fixed confidence stop's at deep slots; where the
first draft costs a whole forward more, the row drafts nothing unless the head is sure enough.

**Around a `HybridDrafter`** (prompt lookup in rows whose recent text occurred before, a head
elsewhere) a row keeps two sets of counts: the head's, from the rounds the head drafted, and the
copy's. The copy's are observed every round the row has a match, whether or not its copy was
proposed: copy `j` counts as reached when copies `1 .. j-1` equal the row's emitted tokens and the
target emitted a token at slot `j`, and as accepted when it equals that token (under greedy this
is exactly whether it would have been accepted; at temperature > 0 the chance that a sample from
`p` equals the copy is `p(copy)`, the chance a point-mass draft is accepted). Each round a row
with a match drafts its copy when the copy's best tokens per millisecond (its own `k`, from the
copy's counts) is at least the head's, and then proposes `k` copied tokens; otherwise the head
drafts as above. So rows copy long where copies have held and not at all where they have not
(sampled prose), and the head's estimates are not lifted by the copy's rounds.

Exactness: `k_b` is a function of tokens emitted in earlier rounds only, never of this round's
target logits or random numbers (and the token-level stop at slot `j` depends on the drafts
before `j` and the drafter's distribution at `j`, never on the draft drawn there), so it is
independent of the verify's randomness at every slot of
this round; given everything before slot `j`, the verify emits there a ratio-test outcome for a
draft from `q_j` or a direct sample from `p_j`, both distributed as `p_j` (the same argument as
the confidence stop in `specjax.drafters.model`). Whether a row copies is, likewise, a function
of its emitted text and earlier rounds only. Greedy stays token-identical to `generate`.
Everything runs on device inside the decode loop: no host sync, fixed shapes, the verify width
picked by `lax.switch` among the compiled widths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from specjax.drafters.adaptive import costs
from specjax.drafters.adaptive.stop import (CostAwareStop, confidence_estimate, log_odds,
                                          scored_evidence, shrunk_alpha, takes_stop)
from specjax.drafters import as_drafter
from specjax.drafters.base import DrafterWrapper
from specjax.drafters.hybrid import HybridDrafter
from specjax.drafters.proposal import Proposal
from specjax.core.validation import check_count

__all__ = ["AdaptiveDrafter", "AdaptiveState", "CostAwareStop", "adaptive_drafter"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveState:
  """An `AdaptiveDrafter`'s state.

  Attributes:
    inner: the wrapped drafter's state.
    accepted: `[B, K]` float32 decayed count of rounds in which draft `j` was accepted.
    reached: `[B, K]` float32 decayed count of rounds in which draft `j` was tested (proposed,
      and every draft before it accepted).
    planned: `[B]` int32 drafts the row proposed this round.
    first: `[B]` int32 the row's first draft this round (made even when not proposed).
    confidence: `[B, K]` float32 the drafter's top probability at each slot this round (0 where
      the drafter reports none).
    believed: `[B, K]` float32 decayed sum of those confidences' log-odds over the tested slots
      (beside `accepted`: how often the row's drafts were accepted vs how sure the drafter
      was). Log-odds, not probabilities: a drafter whose confidences are tiny yet whose drafts
      match (a quantized copy of the target where it is unsure, under greedy verification)
      gets a shift as large as that gap, where a mean probability near 0 would cap it.
    evidence: `[B]` float32 decayed log-likelihood ratio, over the tested slots, of the
      confidence estimate (`CostAwareStop`'s confidence-based acceptance) against the row's
      running acceptance `alpha` alone: how far this row's confidences have told accepted drafts
      from rejected ones (`AdaptiveDrafter.confidence_weight`).
    copy_accepted, copy_reached: `[B, K]` float32 the same counts as `accepted`, `reached` for
      the prompt-lookup copy of a `HybridDrafter` (zero for any other drafter).
    copy_tokens: `[B, K]` int32 the row's copy this round; found: `[B]` bool it had one;
      copied: `[B]` bool it proposed it (the head's counts are not updated then).
    skipped: `[B]` bool the drafter was not run this round (every row's choice was 0 and it was
      not a probe round); nothing is learned from such a round.
    stopped: `[B]` int32 consecutive rounds in which the drafter ran and the row proposed
      nothing (its history said draft, its confidences stopped it).
    idle: `[B]` int32 (equal across rows) rounds skipped since the drafter last ran.
    wait: `[B]` int32 (equal across rows) skipped rounds before the next probe.
  """

  inner: Any
  accepted: jax.Array
  reached: jax.Array
  planned: jax.Array
  first: jax.Array
  confidence: jax.Array
  believed: jax.Array
  evidence: jax.Array
  copy_accepted: jax.Array
  copy_reached: jax.Array
  copy_tokens: jax.Array
  found: jax.Array
  copied: jax.Array
  skipped: jax.Array
  stopped: jax.Array
  idle: jax.Array
  wait: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveDrafter(DrafterWrapper):
  """A drafter whose rows each draft their own number of tokens per round (module docstring).

  `adaptive_drafter` builds one from a calibration. It brings its own `K` and verify widths:
  `specjax.decode` takes them from it (leave `num_draft` and `verify_widths` out).

  Attributes:
    drafter: the wrapped `Drafter`; its `propose` takes `limits=` (every built-in one does).
    max_draft: `K`, the longest chain a row may draft (the loop's static `num_draft`).
    round_ms: `K + 1` costs in milliseconds of a round in which a row drafts `k = 0 .. K`.
    prior: `K` acceptance probabilities `alpha_j` (the calibration profile) a row starts from.
    prior_weight: pseudo-rounds of the prior in each position's estimate.
    decay: each observation of a position multiplies its earlier counts by this (recent rounds
      weigh more: a row's acceptance changes as its text moves between, e.g., prose and code).
    token_stop: decide draft by draft from the drafter's confidence (`CostAwareStop`) where the
      drafter supports it; False: each row's `k` is fixed at the start of the round (`limits`).
    copy_prior: `K` acceptances of a `HybridDrafter`'s prompt-lookup copies a row starts from
      (None: `prior`); read only around a `HybridDrafter`.
    probe_every: with a drafter that catches up on rounds it missed (`catches_up`: a draft
      model), a round in which every row would draft 0 does not run the drafter at all (a plain
      target step), and so does a round in which every row either would draft 0 or has
      proposed nothing in each of its last `stop_rounds` rounds (its confidences stopped every
      draft: running the drafter only to propose nothing costs a draft step per round); after
      `probe_every` such rounds one round runs it again (its first draft,
      unproposed, tells each row whether drafting would pay again), and each probe that finds
      every row still at 0 doubles the wait, up to `probe_max`. A round in which a row drafts
      resets it.
    plain: never run a drafter that catches up (the calibration says no `k >= 1` can beat a
      plain target step, even for rows accepting far more than the profile): every round is a
      target step.
    confidence_prior: the log-odds a row starts with for the confidence estimate against its
      `alpha` in the token stop (`AdaptiveState.evidence` at the first round): 0 starts them
      even; a large value trusts the drafter's confidence alone until the row's own rounds say
      otherwise.
    widths: the verify widths `decode` compiles (sorted; `K + 1` is always added; the plan's
      `specjax.drafters.adaptive.costs.AdaptivePlan.widths` from `adaptive_drafter`); None: `K + 1`
      only.
  """

  drafter: Any
  max_draft: int = dataclasses.field(metadata=dict(static=True))
  round_ms: tuple[float, ...] = dataclasses.field(metadata=dict(static=True))
  prior: tuple[float, ...] = dataclasses.field(metadata=dict(static=True))
  prior_weight: float = dataclasses.field(default=2.0, metadata=dict(static=True))
  decay: float = dataclasses.field(default=0.9, metadata=dict(static=True))
  token_stop: bool = dataclasses.field(default=True, metadata=dict(static=True))
  copy_prior: tuple[float, ...] | None = dataclasses.field(default=None,
                                                           metadata=dict(static=True))
  probe_every: int = dataclasses.field(default=8, metadata=dict(static=True))
  probe_max: int = dataclasses.field(default=128, metadata=dict(static=True))
  plain: bool = dataclasses.field(default=False, metadata=dict(static=True))
  stop_rounds: int = dataclasses.field(default=4, metadata=dict(static=True))
  confidence_prior: float = dataclasses.field(default=0.0, metadata=dict(static=True))
  widths: tuple[int, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))

  def __post_init__(self):
    k = self.max_draft
    if hasattr(self.widths, "__iter__") and not isinstance(self.widths, str):
      object.__setattr__(self, "widths", tuple(self.widths))  # static: must hash; decode checks
    if isinstance(self.drafter, AdaptiveDrafter):
      raise ValueError("the drafter is already adaptive")
    if len(self.round_ms) != k + 1 or len(self.prior) != k:
      raise ValueError(f"need {k + 1} round costs and {k} prior acceptances for max_draft={k}, "
                       f"got {len(self.round_ms)} and {len(self.prior)}")
    if not all(c > 0 for c in self.round_ms) or not all(0 <= a <= 1 for a in self.prior):
      raise ValueError(f"round costs must be positive and acceptances in [0, 1], got "
                       f"{self.round_ms} and {self.prior}")
    if self.copy_prior is not None and (len(self.copy_prior) != k
                                        or not all(0 <= a <= 1 for a in self.copy_prior)):
      raise ValueError(f"copy_prior must be {k} acceptances in [0, 1], got {self.copy_prior}")
    if not (isinstance(self.probe_every, int) and isinstance(self.probe_max, int)
            and 1 <= self.probe_every <= self.probe_max and isinstance(self.stop_rounds, int)
            and self.stop_rounds >= 1):
      raise ValueError(f"need ints 1 <= probe_every <= probe_max and stop_rounds >= 1, got "
                       f"{self.probe_every}, {self.probe_max} and {self.stop_rounds}")
    if not math.isfinite(self.confidence_prior):
      raise ValueError(f"confidence_prior must be a finite log-odds, got {self.confidence_prior}")
    if not (self.prior_weight > 0 and 0 < self.decay <= 1):
      raise ValueError(f"prior_weight must be > 0 and decay in (0, 1], got {self.prior_weight} "
                       f"and {self.decay}")

  def init(self, tokens, lengths, buffer_len, prefill):
    batch = tokens.shape[0]
    zeros = jnp.zeros((batch, self.max_draft), jnp.float32)
    ints = jnp.zeros((batch,), jnp.int32)
    no = jnp.zeros((batch,), jnp.bool_)
    return AdaptiveState(self.drafter.init(tokens, lengths, buffer_len, prefill), zeros, zeros,
                         ints, ints, zeros, zeros,
                         jnp.full((batch,), self.confidence_prior, jnp.float32), zeros,
                         zeros, jnp.zeros((batch, self.max_draft), jnp.int32), no, no, no, ints,
                         ints, ints + self.probe_every)

  @property
  def skips(self) -> bool:
    """Whether rounds in which no row drafts skip the drafter (it catches up later)."""
    return bool(self.drafter.catches_up) and not self.copies

  @property
  def copies(self) -> bool:
    """Whether the wrapped drafter copies where the text repeats (a `HybridDrafter`)."""
    return isinstance(self.drafter, HybridDrafter)

  def forwards_in_round(self, state: AdaptiveState, num_draft: int) -> jax.Array:
    """`[B]`: the wrapped drafter's forwards, none in a round that skipped it."""
    return jnp.where(state.skipped, 0, self.drafter.forwards_per_round(num_draft))

  def confidence_shift(self, state: AdaptiveState) -> jax.Array:
    """`[B]` the log-odds of the row's acceptance rate over its tested slots minus the mean
    log-odds of their confidences, each shrunk towards 1/2 (log-odds 0) by `prior_weight`
    pseudo-slots (0 with no history: the confidence is taken at its word)."""
    weight = self.prior_weight
    tested = jnp.sum(state.reached, axis=1) + weight
    rate = jnp.clip((jnp.sum(state.accepted, axis=1) + 0.5 * weight) / tested, 0.01, 0.99)
    return log_odds(rate) - jnp.sum(state.believed, axis=1) / tested

  def confidence_weight(self, state: AdaptiveState) -> jax.Array:
    """`[B]` the weight `CostAwareStop` gives the confidence estimate of a draft's acceptance
    against the row's running `alpha` alone: the posterior of the confidence model when the two
    start even and have since scored the row's tested slots (`AdaptiveState.evidence`). Where
    the drafter's top probability tells accepted drafts from rejected ones (a trained head) it
    wins; where acceptance does not follow it (a quantized copy of the target, accepted about as
    often when unsure as when sure) `alpha` does, and unsure drafts no longer stop the row."""
    return jax.nn.sigmoid(state.evidence)

  def _evidence(self, state: AdaptiveState, tested: jax.Array, hit: jax.Array) -> jax.Array:
    """`state.evidence` after scoring this round's tested slots (`[B, K]`): `scored_evidence`."""
    by_confidence = confidence_estimate(state.confidence, self.confidence_shift(state)[:, None])
    return scored_evidence(state.evidence, by_confidence, self.alpha(state), tested, hit,
                           self.decay)

  def alpha(self, state: AdaptiveState) -> jax.Array:
    """`[B, K]` each row's acceptance estimate per position (of the head's drafts, around a
    `HybridDrafter`; `copy_alpha` for its copies): its counts shrunk towards `prior` at two levels
    (`stop.shrunk_alpha`): a row accepted at position 1 is expected to do better at positions it
    has not yet reached, too."""
    return shrunk_alpha(state.accepted, state.reached, self.prior, self.prior_weight)

  def copy_alpha(self, state: AdaptiveState) -> jax.Array:
    """`[B, K]` each row's acceptance estimate per position of its prompt-lookup copies (the same
    shrinkage as `alpha`, towards `copy_prior`)."""
    prior = self.prior if self.copy_prior is None else self.copy_prior
    return shrunk_alpha(state.copy_accepted, state.copy_reached, prior, self.prior_weight)

  def _best(self, alpha: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(k [B] int32, tokens per millisecond [B])`: the first `k` maximising the rate."""
    expected = 1.0 + jnp.concatenate(
        [jnp.zeros_like(alpha[:, :1]), jnp.cumsum(jnp.cumprod(alpha, axis=1), axis=1)], axis=1)
    rate = expected / jnp.asarray(self.round_ms, jnp.float32)  # [B, K + 1]
    return jnp.argmax(rate, axis=1).astype(jnp.int32), jnp.max(rate, axis=1)

  def limits(self, state: AdaptiveState) -> jax.Array:
    """`[B]` int32: each row's `k` for this round (first maximum of tokens per millisecond)."""
    return self._best(self.alpha(state))[0]

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds):
    if num_draft != self.max_draft:
      raise ValueError(f"an AdaptiveDrafter drafts up to max_draft={self.max_draft}, "
                       f"not num_draft={num_draft}")
    draft = lambda state: self._draft(state, sequence, lengths, num_draft=num_draft,
                                      sampling=sampling, seeds=seeds)
    if not self.skips:
      return draft(state)
    shapes = jax.eval_shape(draft, state)

    def skip(state):
      # A plain target step: no drafts (num_drafted 0, verify width 1), the drafter untouched.
      zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
      kept = ("inner", "accepted", "reached", "believed", "evidence", "copy_accepted",
              "copy_reached", "stopped", "wait")
      state = dataclasses.replace(zeros[0], **{name: getattr(state, name) for name in kept},
                                  idle=state.idle + 1, skipped=jnp.ones_like(state.skipped))
      return state, zeros[1]

    if self.plain:
      return skip(state)
    # Every row's history says: draft nothing, or its confidences have stopped its every draft
    # for `stop_rounds` rounds (until then such a row runs the drafter and learns from its
    # unproposed first draft how far to trust them, `confidence_shift`; probes go on teaching it).
    idle = jnp.all((self.limits(state) == 0) | (state.stopped >= self.stop_rounds))
    probe = state.idle[0] >= state.wait[0]

    def run(state):
      state, proposal = draft(state)
      wait = jnp.where(idle, jnp.minimum(2 * state.wait, self.probe_max), self.probe_every)
      stopped = jnp.where(state.planned == 0, state.stopped + 1, 0)
      return dataclasses.replace(state, idle=jnp.zeros_like(state.idle), wait=wait,
                                 skipped=jnp.zeros_like(state.skipped),
                                 stopped=stopped), proposal

    # The decision reads only earlier rounds' outcomes (exactness: module docstring). The
    # drafter's state passes through the conditional; a draft model's cache is only read in the
    # skipping branch.
    return jax.lax.cond(idle & ~probe, skip, run, state)

  def _draft(self, state, sequence, lengths, *, num_draft, sampling, seeds):
    common = dict(num_draft=num_draft, sampling=sampling, seeds=seeds)
    batch = lengths.shape[0]
    copy_tokens = jnp.zeros((batch, num_draft), jnp.int32)
    found = copied = jnp.zeros((batch,), jnp.bool_)
    alpha = self.alpha(state)
    if self.copies:
      copy_tokens, found = self.drafter.lookup(sequence, lengths, num_draft)
      copy_k, copy_rate = self._best(self.copy_alpha(state))
      head_rate = self._best(alpha)[1]
      copied = found & (copy_k > 0) & (copy_rate >= head_rate)
      common["copy"] = (copy_tokens, copied)
    if self.token_stop and takes_stop(self.drafter):
      limits = jnp.full(lengths.shape, num_draft, jnp.int32)
      stop = CostAwareStop(alpha, self.confidence_shift(state), self.round_ms,
                           self.confidence_weight(state))
      inner, proposal = self.drafter.propose(state.inner, sequence, lengths, stop=stop, **common)
    else:
      limits = self._best(alpha)[0]
      inner, proposal = self.drafter.propose(state.inner, sequence, lengths, limits=limits,
                                             **common)
    planned = limits if proposal.num_drafted is None else proposal.num_drafted
    planned = jnp.minimum(planned.astype(jnp.int32), limits)
    if self.copies:
      planned = jnp.where(copied, copy_k, planned)
    confidence = (jnp.zeros(state.believed.shape, jnp.float32) if proposal.confidence is None
                  else proposal.confidence.astype(jnp.float32))
    state = dataclasses.replace(state, inner=inner, planned=planned, confidence=confidence,
                                first=proposal.tokens[:, 0].astype(jnp.int32),
                                copy_tokens=copy_tokens, found=found, copied=copied)
    return state, Proposal(proposal.tokens, proposal.logits, planned, proposal.confidence)

  def observe(self, state, scored, block, emitted, count, lengths):
    inner = self.drafter.observe(state.inner, scored, block, emitted, count, lengths)
    live = count > 0
    accepted = (count - 1)[:, None]  # drafts kept (fewer where EOS or the length limit cut)
    j = jnp.arange(self.max_draft, dtype=jnp.int32)[None]  # draft j + 1
    tested = (j < state.planned[:, None]) & (j <= accepted)
    hit = tested & (j < accepted)
    # A row that proposed nothing still made its first draft: did the target's token match it?
    unproposed = (state.planned == 0)[:, None] & (j == 0)
    tested = ((tested | unproposed) & live[:, None] & ~state.copied[:, None]
              & ~state.skipped[:, None])
    hit = (hit | (unproposed & (emitted[:, :1] == state.first[:, None]))) & tested
    decay = jnp.where(tested, self.decay, 1.0)
    state = dataclasses.replace(
        state, inner=inner, evidence=self._evidence(state, tested, hit),
        accepted=state.accepted * decay + hit.astype(jnp.float32),
        reached=state.reached * decay + tested.astype(jnp.float32),
        believed=state.believed * decay + jnp.where(tested, log_odds(jnp.clip(
            state.confidence, 1e-6, 1.0 - 1e-6)), 0.0))
    if not self.copies:
      return state
    # The copy's counts, from the emitted tokens (module docstring): copy j is reached when the
    # copies before it equal the emitted tokens and the row emitted a token at slot j.
    num = self.max_draft
    emitted = jnp.pad(emitted, ((0, 0), (0, max(num - emitted.shape[1], 0))),
                      constant_values=-1)[:, :num]
    known = (j < count[:, None]) & state.found[:, None]
    match = (state.copy_tokens == emitted) & known
    before = jnp.cumprod(jnp.pad(match, ((0, 0), (1, 0)), constant_values=True)[:, :num],
                         axis=1).astype(jnp.bool_)
    tested = known & before
    decay = jnp.where(tested, self.decay, 1.0)
    return dataclasses.replace(
        state, copy_accepted=state.copy_accepted * decay + (tested & match).astype(jnp.float32),
        copy_reached=state.copy_reached * decay + tested.astype(jnp.float32))


def adaptive_drafter(drafter, calibration, *, max_draft: int | None = None,
                     **options) -> AdaptiveDrafter:
  """`drafter` wrapped so that each row drafts its own `k` every round, planned from measurements.

      drafter = specjax.adaptive_drafter(drafter, calibration="DIR")
      specjax.decode(target, drafter, tokens, rng, ...)  # K and the widths come with it

  Args:
    drafter: a `Drafter` (its `propose` takes `limits=`: every built-in one) or a draft model.
    calibration: a directory holding `cost_table_<backend>.json` and `acceptance_profile.json`
      (`specjax calibrate --out DIR`), or a `specjax.drafters.adaptive.costs.Calibration`.
    max_draft: an upper bound on `K` (the drafter's own `max_draft`, e.g. Medusa's heads, too).
    **options: further `AdaptiveDrafter` fields (`token_stop`, `prior_weight`, `decay`, ...).

  Returns:
    An `AdaptiveDrafter` with `specjax.drafters.adaptive.costs.adaptive_plan`'s `K`, round costs,
    priors, verify widths and `plain` flag (set: `decode` runs `specjax.generate`, drafting
    cannot pay).
  """
  drafter = as_drafter(drafter)
  measured = costs.resolve_calibration(calibration)
  bounds = [check_count(b, "max_draft") for b in (max_draft, drafter.max_draft) if b is not None]
  plan = costs.adaptive_plan(measured.costs, measured.profile,
                             max_draft=min(bounds) if bounds else None)
  return AdaptiveDrafter(drafter, plan.max_draft, plan.round_ms, plan.prior,
                         copy_prior=plan.copy_prior, plain=plan.plain, widths=plan.widths,
                         **options)
