"""Measured costs and acceptance profiles: what `specjax.drafters.adaptive.auto_num_draft` and
`specjax.adaptive_drafter` read.

A **cost table** is measured once per backend (`specjax.tuning.calibrate.measure_costs`, or `specjax
calibrate`): the target's forward over blocks of `w = 1 .. W` positions at batch `B` (a chain
verifies `k + 1` positions; a tree of `N` nodes scores `N + 1`), the drafter's cost per draft step,
one step of plain `specjax.generate`, and what a real decode round costs beyond its forward and
draft steps (the rule, the drafter's catch-up on the verified tokens, the loop's bookkeeping). It is
saved as `cost_table_<backend>.json` (with the device kind, the jax version, the batch and the date)
beside a checkpoint.

An **acceptance profile** (`acceptance_profile.json`, measured by `specjax calibrate` on a few
prompts) holds the drafter's per-position acceptance `alpha_j`: the probability that draft `j`
is accepted given that drafts `1 .. j-1` were. A round with `k` drafts then yields
`E[tokens | k] = 1 + sum_{j<=k} prod_{i<=j} alpha_i` tokens on average. For a
`HybridDrafter` it also holds the head's profile alone and its prompt-lookup copies' profile
(`AcceptanceProfile.head`, `.lookup`): the priors of `specjax.adaptive_drafter`, which keeps the
two apart per row.

`choose_num_draft` maximises expected tokens per unit time,
`E[tokens | k] / (verify(k + 1) + k * draft_step + round_overhead)`, over the `k` both files
cover, on the host before anything is compiled (so `k` is static and the loop has no host syncs);
`auto_num_draft(drafter, calibration)` is its front door, whose `AutoChoice` the caller passes to
`decode` as `num_draft=choice.num_draft, verify_widths=choice.widths`. There is no fallback guess:
without both files it raises a ValueError that says how to make them.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib

import jax
import numpy as np

from specjax.core.sampling import Sampling
from specjax.drafters import as_drafter

__all__ = ["AcceptanceProfile", "AdaptivePlan", "AutoChoice", "Calibration", "CostTable",
           "PROFILE_FILE", "adaptive_plan", "adaptive_widths", "auto_num_draft", "choose_num_draft",
           "choose_widths", "cost_table_file", "expected_tokens", "load_calibration",
           "resolve_calibration"]

FORMAT = 1
PROFILE_FILE = "acceptance_profile.json"
WIDTH_SAVING = 0.1  # a smaller verify width is compiled when it is >= 10% cheaper
MAX_AUTO_WIDTHS = 4


def cost_table_file(backend: str | None = None) -> str:
  """`cost_table_<backend>.json` (default: jax's default backend, e.g. cpu, gpu, tpu)."""
  return f"cost_table_{backend or jax.default_backend()}.json"


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write(path: pathlib.Path, data: dict) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(data, indent=1) + "\n")
  return path


def _read(path: pathlib.Path, what: str) -> dict:
  data = json.loads(path.read_text())
  if data.get("format") != FORMAT:
    raise ValueError(f"{path}: {what} of format {data.get('format')!r}, this specjax reads "
                     f"format {FORMAT}: measure it again with `specjax calibrate`")
  return data


@dataclasses.dataclass(frozen=True)
class CostTable:
  """Per-backend costs in milliseconds (see the module docstring).

  Attributes:
    verify_ms: the target's forward over `w` positions, `w = 1 .. W` (`verify_ms[w - 1]`).
    draft_step_ms: the drafter's cost per draft token (slope between two `num_draft`s).
    generate_step_ms: one token of plain `specjax.generate` (slope between two lengths).
    backend, device_kind, jax_version, batch, context, date: where and how it was measured.
    notes: free-form facts (target and drafter kinds, repeats, the round timings).
    round_overhead_ms: what a decode round costs beyond `verify(k + 1) + k * draft_step` (the
      rule, the drafter's catch-up on the verified block, the loop's bookkeeping), measured on
      whole decode rounds; 0 in tables measured before it was.
  """

  verify_ms: tuple[float, ...]
  draft_step_ms: float
  generate_step_ms: float
  backend: str
  device_kind: str
  jax_version: str
  batch: int
  context: int
  date: str
  notes: dict = dataclasses.field(default_factory=dict)
  round_overhead_ms: float = 0.0

  def __post_init__(self):
    values = (*self.verify_ms, self.draft_step_ms, self.generate_step_ms, self.round_overhead_ms)
    if not self.verify_ms or not all(math.isfinite(v) and v >= 0 for v in values):
      raise ValueError(f"a cost table needs finite, non-negative costs, got {values}")
    if not self.generate_step_ms > 0:
      raise ValueError("a cost table needs a positive generate step (every plan is priced in "
                       f"generate steps), got {self.generate_step_ms}")

  @property
  def max_width(self) -> int:
    return len(self.verify_ms)

  def verify_cost(self, width: int) -> float:
    if not 1 <= width <= self.max_width:
      raise ValueError(f"the cost table covers verify widths 1..{self.max_width}, not {width}")
    return self.verify_ms[width - 1]

  def round_cost(self, num_draft: int, width: int | None = None) -> float:
    """A decode round with `num_draft` drafts verified at `width` (default `num_draft + 1`)."""
    width = num_draft + 1 if width is None else width
    return self.verify_cost(width) + num_draft * self.draft_step_ms + self.round_overhead_ms

  def save(self, directory) -> pathlib.Path:
    """Writes `cost_table_<backend>.json` in `directory`; returns its path."""
    data = dict(format=FORMAT, **dataclasses.asdict(self))
    data["verify_ms"] = list(self.verify_ms)
    return _write(pathlib.Path(directory) / cost_table_file(self.backend), data)

  @classmethod
  def load(cls, directory, backend: str | None = None) -> CostTable:
    """Reads `cost_table_<backend>.json` from `directory` (FileNotFoundError if absent)."""
    path = pathlib.Path(directory) / cost_table_file(backend)
    data = _read(path, "cost table")
    data.pop("format")
    data["verify_ms"] = tuple(float(v) for v in data["verify_ms"])
    return cls(**data)


@dataclasses.dataclass(frozen=True)
class AcceptanceProfile:
  """A drafter's per-position acceptance (see the module docstring).

  Attributes:
    alpha: `alpha_j`, j = 1 .. K: P(draft j accepted | drafts before it accepted).
    sampling: the sampling settings it was measured under (as a dict).
    rounds: verify rounds measured; prompts: prompts measured; date.
    head: for a `HybridDrafter`, the head's profile alone (its rounds: decode rounds).
    lookup: for a `HybridDrafter`, its copies' profile (its rounds: the positions of the target's
      text at which lookup found a match; `specjax.tuning.calibrate.measure_acceptance`).
  """

  alpha: tuple[float, ...]
  sampling: dict
  rounds: int
  prompts: int
  date: str
  head: AcceptanceProfile | None = None
  lookup: AcceptanceProfile | None = None

  def __post_init__(self):
    if not self.alpha or not all(0.0 <= a <= 1.0 for a in self.alpha):
      raise ValueError(f"alpha must be probabilities, got {self.alpha}")

  @classmethod
  def from_counts(cls, rounds: int, accepted_per_position, *, sampling: Sampling,
                  prompts: int) -> AcceptanceProfile:
    """`alpha_j = accepted[j] / reached[j]` with `reached[1] = rounds` and
    `reached[j] = accepted[j - 1]` (a draft is tested only if all before it were accepted)."""
    accepted = [int(a) for a in accepted_per_position]
    reached = [int(rounds)] + accepted[:-1]
    alpha = tuple(a / r if r else 0.0 for a, r in zip(accepted, reached))
    return cls(alpha, dataclasses.asdict(sampling), int(rounds), int(prompts), _now())

  def save(self, directory) -> pathlib.Path:
    data = dict(format=FORMAT, **dataclasses.asdict(self))
    for name in ("head", "lookup"):
      if data[name] is None:
        del data[name]
    return _write(pathlib.Path(directory) / PROFILE_FILE, data)

  @classmethod
  def from_dict(cls, data: dict) -> AcceptanceProfile:
    data = dict(data)
    data["alpha"] = tuple(float(a) for a in data["alpha"])
    for name in ("head", "lookup"):
      if data.get(name) is not None:
        data[name] = cls.from_dict(data[name])
    return cls(**data)

  @classmethod
  def load(cls, directory) -> AcceptanceProfile:
    data = _read(pathlib.Path(directory) / PROFILE_FILE, "acceptance profile")
    data.pop("format")
    return cls.from_dict(data)


@dataclasses.dataclass(frozen=True)
class Calibration:
  """A cost table and an acceptance profile: everything `auto_num_draft` and
  `specjax.adaptive_drafter` need."""

  costs: CostTable
  profile: AcceptanceProfile


@dataclasses.dataclass(frozen=True)
class AutoChoice:
  """What `choose_num_draft` (`auto_num_draft`) picked, and why: pass
  `num_draft=choice.num_draft, verify_widths=choice.widths` to `specjax.decode`.

  Attributes:
    num_draft: `k`.
    widths: the compiled verify widths (ending in `k + 1`; `decode`'s `verify_widths`).
    expected_tokens: `E[tokens | k]` per round.
    round_ms: `verify(k + 1) + k * draft_step + round_overhead` from the table.
    speedup: `expected_tokens / round_ms * generate_step_ms`: the predicted speedup over
      `specjax.generate` (below 1: speculation is predicted to be slower than the target
      alone).
    scores: tokens per millisecond for every `k` considered (index `k - 1`).
  """

  num_draft: int
  widths: tuple[int, ...]
  expected_tokens: float
  round_ms: float
  speedup: float
  scores: tuple[float, ...]


def expected_tokens(alpha, num_draft: int) -> float:
  """`1 + sum_{j=1..k} prod_{i<=j} alpha_i`: tokens per round with `k` drafts."""
  total, reach = 1.0, 1.0
  for a in list(alpha)[:num_draft]:
    reach *= a
    total += reach
  return total


def _cheaper_widths(costs: CostTable, num_draft: int, saving: float, lowest: int) -> list[int]:
  """Walking down from `k + 1` to `lowest`: `k + 1`, then every width whose forward is at least
  `saving` cheaper than the last one kept (largest first)."""
  kept = [num_draft + 1]
  for width in range(num_draft, lowest - 1, -1):
    if costs.verify_cost(width) <= (1.0 - saving) * costs.verify_cost(kept[-1]):
      kept.append(width)
  return kept


def _draft_limit(costs: CostTable, profile: AcceptanceProfile, max_draft: int | None,
                 cap: int | None = None) -> int:
  """The largest `k` both the cost table and the profile cover (and `max_draft`, `cap` allow)."""
  limit = min(costs.max_width - 1, len(profile.alpha))
  for bound in (max_draft, cap):
    if bound is not None:
      limit = min(limit, bound)
  if limit < 1:
    raise ValueError(f"the cost table (widths 1..{costs.max_width}) and the profile "
                     f"({len(profile.alpha)} positions) cover no num_draft >= 1")
  return limit


def choose_widths(costs: CostTable, num_draft: int) -> tuple[int, ...]:
  """Verify widths worth compiling for `k` drafts under a confidence stop: walking down from
  `k + 1`, a width is kept when its forward is at least `WIDTH_SAVING` cheaper than the last kept
  one (at most `MAX_AUTO_WIDTHS`)."""
  return tuple(sorted(_cheaper_widths(costs, num_draft, WIDTH_SAVING, 1)[:MAX_AUTO_WIDTHS]))


def choose_num_draft(costs: CostTable, profile: AcceptanceProfile, *,
                     max_draft: int | None = None, confidence_stop: bool = False) -> AutoChoice:
  """The `k` that maximises `E[tokens | k] / CostTable.round_cost(k)`.

  Args:
    costs: the backend's cost table.
    profile: the drafter's acceptance profile.
    max_draft: an upper bound on `k` (e.g. a Medusa drafter's number of heads).
    confidence_stop: the drafter stops rows early, so smaller verify widths are worth compiling
      (`choose_widths`); otherwise the only width is `k + 1`.

  Returns:
    An `AutoChoice`; ties go to the smaller `k`.
  """
  limit = _draft_limit(costs, profile, max_draft)
  scores = []
  for k in range(1, limit + 1):
    scores.append(expected_tokens(profile.alpha, k) / costs.round_cost(k))
  best = int(np.argmax(scores)) + 1  # first maximum: the smaller k on ties
  round_ms = costs.round_cost(best)
  widths = choose_widths(costs, best) if confidence_stop else (best + 1,)
  return AutoChoice(best, widths, expected_tokens(profile.alpha, best), round_ms,
                    scores[best - 1] * costs.generate_step_ms, tuple(scores))


def auto_num_draft(drafter, calibration) -> AutoChoice:
  """The `k` (and verify widths) that `drafter` should draft under a measured calibration.

  `choose_num_draft` for this drafter: its `max_draft` (e.g. a Medusa drafter's heads) bounds `k`,
  and a confidence stop (`confidence=`) makes narrower verify widths worth compiling. Usage:

      choice = specjax.drafters.adaptive.auto_num_draft(drafter, calibration="DIR")
      specjax.decode(target, drafter, ..., num_draft=choice.num_draft,
                     verify_widths=choice.widths)

  Args:
    drafter: the drafter (or draft model) `decode` will run.
    calibration: a directory holding `cost_table_<backend>.json` and `acceptance_profile.json`
      (`specjax calibrate --out DIR`), or a `Calibration`.

  Raises:
    ValueError: no calibration, a missing file, or one that covers no `k >= 1`.
  """
  drafter = as_drafter(drafter)
  measured = resolve_calibration(calibration)
  return choose_num_draft(measured.costs, measured.profile, max_draft=drafter.max_draft,
                          confidence_stop=drafter.confidence is not None)


@dataclasses.dataclass(frozen=True)
class AdaptivePlan:
  """What `specjax.adaptive_drafter` compiles (`adaptive_plan`; see
  `specjax.drafters.adaptive.drafter`).

  Attributes:
    max_draft: `K`, the longest chain a row may draft.
    widths: the compiled verify widths (`adaptive_widths`).
    round_ms: `K + 1` predicted round costs for `k = 0 .. K` drafts: the verify forward at the
      smallest compiled width holding `k + 1` positions, `k` draft steps and the measured
      per-round overhead (`CostTable.round_cost`); a table without a measured overhead counts the
      drafter's catch-up on the verified tokens as one more draft step.
    prior: `K` acceptances a row starts from: the profile's (its head's, for a hybrid), each
      shrunk towards the pooled acceptance by `PRIOR_SHRINK` rounds (deep positions are
      measured on few rounds).
    copy_prior: the same from the profile's `lookup` part, or None.
    plain: no `k >= 1` promises `PLAIN_MARGIN` (1.1) times the tokens per millisecond of
      `generate`'s step, even for a row whose acceptance odds are `headroom_odds` times the
      profile's (a large batch on CPU, where a verify block and the drafter's multi-row steps are
      compute-bound): `decode` then runs `generate`'s loop, with no drafter and no round
      bookkeeping.
  """

  max_draft: int
  widths: tuple[int, ...]
  round_ms: tuple[float, ...]
  prior: tuple[float, ...]
  copy_prior: tuple[float, ...] | None = None
  plain: bool = False


PRIOR_SHRINK = 10.0
HEADROOM_ODDS = 4.0  # K suits a row accepting each draft at 4x the profile's odds
# Drafting must promise this much over `generate`'s step (at the lifted odds) or `decode` runs
# `generate`: a gain of a few percent in the cost model is lost to what it leaves out (rows
# stopping short of their best k, drafts the token stop refuses, timing noise in the table).
PLAIN_MARGIN = 1.1
MAX_ADAPTIVE_DRAFT = 8
ADAPTIVE_SAVING = 0.03  # rows pick their own k, so a width 3% cheaper than the next is worth it
MAX_ADAPTIVE_WIDTHS = 5


def adaptive_widths(costs: CostTable, num_draft: int) -> tuple[int, ...]:
  """Verify widths for per-row adaptive length: always 1 (a plain target step) and `K + 1`; in
  between, walking down from `K + 1`, each width at least `ADAPTIVE_SAVING` cheaper than the last
  kept one (the cheapest-to-reach first), at most `MAX_ADAPTIVE_WIDTHS` in all."""
  kept = _cheaper_widths(costs, num_draft, ADAPTIVE_SAVING, 2)[:MAX_ADAPTIVE_WIDTHS - 1]
  return tuple(sorted({1, *kept}))


def lifted(profile: AcceptanceProfile, odds: float) -> AcceptanceProfile:
  """The profile with every `alpha_j`'s odds multiplied by `odds` (a row that accepts more)."""
  a = np.clip(np.asarray(profile.alpha, np.float64), 0.0, 1.0)
  alpha = a * odds / np.maximum(1.0 - a + a * odds, 1e-12)
  return dataclasses.replace(profile, alpha=tuple(float(x) for x in alpha))


def adaptive_plan(costs: CostTable, profile: AcceptanceProfile, *,
                  max_draft: int | None = None,
                  headroom_odds: float = HEADROOM_ODDS) -> AdaptivePlan:
  """The static part of per-row adaptive length: `K`, the widths, the round costs, the prior.

  `K` is the `k` `choose_num_draft` picks for a row whose acceptance odds are `headroom_odds`
  times the profile's at every position (1.0: the best fixed `k` on average). Rows choose their
  own `k <= K` every round, so `K` must leave room for the rows that accept more than the
  average (code, quoted text); a wider `K` costs compile time and `[B, K]` state, not time per
  round (the verify forward runs at the narrowest compiled width that holds the round's drafts,
  and the target cache is written after the width switch, not copied into it).
  """
  if not headroom_odds >= 1.0:
    raise ValueError(f"headroom_odds must be >= 1, got {headroom_odds}")
  parts = [part for part in (profile.head or profile, profile.lookup) if part is not None]
  limit = min(_draft_limit(costs, part, max_draft, MAX_ADAPTIVE_DRAFT) for part in parts)
  limit = min(limit, max(choose_num_draft(costs, lifted(part, headroom_odds),
                                          max_draft=limit).num_draft for part in parts))
  prior, *copy_prior = [_shrunk_prior(part, limit) for part in parts]
  widths = adaptive_widths(costs, limit)
  round_ms = []
  for k in range(limit + 1):
    width = min(w for w in widths if w >= k + 1)
    catch_up = 0.0 if costs.round_overhead_ms else costs.draft_step_ms
    round_ms.append(costs.round_cost(k, width) + catch_up)
  step_rate = 1.0 / costs.generate_step_ms
  best_rate = max(expected_tokens(lifted(part, headroom_odds).alpha, k) / round_ms[k]
                  for part in parts for k in range(1, limit + 1))
  return AdaptivePlan(limit, widths, tuple(round_ms), prior,
                      copy_prior[0] if copy_prior else None,
                      plain=best_rate < PLAIN_MARGIN * step_rate)


def _shrunk_prior(profile: AcceptanceProfile, limit: int) -> tuple[float, ...]:
  """The profile's first `limit` acceptances, each shrunk towards their pooled value by
  `PRIOR_SHRINK` rounds."""
  alpha = np.asarray(profile.alpha[:limit], np.float64)
  reached = profile.rounds * np.concatenate([[1.0], np.cumprod(alpha)[:-1]])
  pooled = float((alpha * reached).sum() / max(reached.sum(), 1.0))
  prior = (alpha * reached + PRIOR_SHRINK * pooled) / (reached + PRIOR_SHRINK)
  return tuple(float(a) for a in prior)


def load_calibration(directory, backend: str | None = None) -> Calibration:
  """The cost table for `backend` (default: this process's) and the acceptance profile in
  `directory`.

  Raises:
    ValueError: a file is missing (the message names it and the command that measures it).
  """
  directory = pathlib.Path(directory)
  missing = [name for name in (cost_table_file(backend), PROFILE_FILE)
             if not (directory / name).is_file()]
  if missing:
    raise ValueError(f"a calibration needs measured costs: {', '.join(missing)} not found in "
                     f"{directory}; run `specjax calibrate --out {directory}` on this backend "
                     "(or pass an explicit num_draft)")
  return Calibration(CostTable.load(directory, backend), AcceptanceProfile.load(directory))


def resolve_calibration(calibration) -> Calibration:
  """A `Calibration`, or one loaded from a directory; None is a ValueError saying what to do."""
  if isinstance(calibration, Calibration):
    return calibration
  if calibration is None:
    raise ValueError("choosing the draft length needs a calibration: pass calibration=DIR, a "
                     "directory with cost_table_<backend>.json and acceptance_profile.json "
                     "written by `specjax calibrate --out DIR` (there is no unmeasured default)")
  if isinstance(calibration, (str, pathlib.Path)):
    return load_calibration(calibration)
  raise ValueError(f"calibration must be a directory or a "
                   f"specjax.drafters.adaptive.Calibration, got {type(calibration).__name__}")
