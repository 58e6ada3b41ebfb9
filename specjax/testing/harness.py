"""The exactness harness: does a sampled decoding path emit the target's own distribution?

`run_path` decodes `num_samples` rows of each of several prompts with one `specjax.decode` call
(every row its own random stream), then `goodness_of_fit` runs the audit's statistic
(`specjax.exactness.stats.position_tests`) on the new tokens: at every (prompt, position) the rows
are grouped by their sampled prefix; within a group every row's next token is an independent draw
from the target's warped distribution given that prefix (exactness says so, whatever the drafter,
the tree, the number of rounds or where a round started), which is computed from the target's own
logits (`specjax.core.sampling.probabilities`, the definition `specjax.generate` samples from).
Pearson chi-square per group with cells of expected count < 5 pooled; groups are independent given
their prefixes, so their statistics and degrees of freedom add. A token of probability 0 is an
outright failure. One p-value per (prompt, position) that has a group of >= 10 rows; the path passes
when every p-value exceeds the Bonferroni level `alpha / number_of_tests`.

The models (`harness_target`, `noisy_copy`) are tiny random transformers over a 64-token
vocabulary whose output head is scaled up, so that the target's next-token entropy is about one
nat at temperature 1 (half a nat at 0.7 with top-k 16 / top-p 0.9): prefixes then stay shared by
enough rows for the grouped test to reach several rounds deep, and the draft's q (a noisy copy of
the target) is close enough to p that long chains are accepted and far enough that rejections
and residuals happen in every round.

Nothing in the library imports this module (it is test-only, like `specjax.testing.rules`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.exactness.audit import _last_logits, _memoized
from specjax.exactness.stats import position_tests
from specjax.loop.decode import decode
from specjax.loop.generate import generate
from specjax.models import Model, init_params
from specjax.testing.models import tiny_config

__all__ = ["DRAFT_NOISE", "Fit", "LOGIT_SCALE", "PathRun", "Scorer", "VOCAB", "goodness_of_fit",
           "harness_prompts", "harness_target", "harness_world", "noisy_copy", "run_path"]

VOCAB = 64
LOGIT_SCALE = 5.0  # the target's output head times this: about 1 nat of entropy at T = 1
DRAFT_NOISE = 0.07  # the harness's draft model: the target plus this much relative noise


def harness_target(seed: int = 0, *, num_layers: int = 4, logit_scale: float = LOGIT_SCALE):
  """A tiny random target over `VOCAB` tokens (4 layers, so EAGLE-3 taps (2, 2, 1) exist) whose
  output head is scaled by `logit_scale` (peaked next-token distributions)."""
  model = init_params(tiny_config(vocab_size=VOCAB, num_layers=num_layers), jax.random.key(seed))
  return Model(dict(model.params, lm_head=model.params["lm_head"] * logit_scale), model.config)


def noisy_copy(params, rng: jax.Array, scale: float):
  """Every float leaf of `params` (a pytree, or a `specjax.Model`'s params) plus Gaussian noise of
  `scale` times the leaf's own standard deviation: a drafter whose q is near p but not p."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(rng, len(leaves))
  noisy = []
  for x, key in zip(leaves, keys):
    if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 1 and x.size > 1:
      spread = jnp.std(x)
      spread = jnp.where(spread > 0, spread, 1.0)
      x = x + scale * spread * jax.random.normal(key, x.shape, x.dtype)
    noisy.append(x)
  return jax.tree.unflatten(tree, noisy)


def harness_prompts(target, *, seed: int = 1, seed_lengths: Sequence[int] = (2, 3, 4),
                    continuation: int = 4) -> list[list[int]]:
  """Ragged prompts that repeat themselves, so prompt lookup finds matches: per seed length `s`,
  `s` random tokens, the target's greedy continuation of them (`continuation` tokens), the same
  `s` tokens again (lengths `2 s + continuation`)."""
  rng = np.random.default_rng(seed)
  prompts = []
  for length in seed_lengths:
    start = rng.integers(0, target.vocab_size, size=length).tolist()
    out = generate(target, jnp.asarray([start], jnp.int32), jax.random.key(0),
                      max_new_tokens=continuation)
    prompts.append(start + np.asarray(out.tokens)[0].tolist() + start)
  return prompts


class Scorer:
  """The target's float32 logits after each prefix, each distinct prefix scored once (shared by
  every path and setting of one target: logits do not depend on the sampling settings)."""

  def __init__(self, target):
    self.target = target
    self.scores = _memoized(lambda prefixes: _last_logits(target, prefixes))

  def __call__(self, prefixes):
    return self.scores(prefixes)


@dataclasses.dataclass(frozen=True)
class PathRun:
  """One sampled run: `tokens [P, N, new]` and the decode's batch totals (`DecodeStats.summary`)."""

  tokens: np.ndarray
  summary: dict


def harness_world() -> dict:
  """The harness's setting as its tests use it: `target` (`harness_target()`), `draft` (its
  `noisy_copy` at `DRAFT_NOISE`, key 5), `prompts` (`harness_prompts(target)`) and `scorer`."""
  target = harness_target()
  draft = Model(noisy_copy(target.params, jax.random.key(5), DRAFT_NOISE), target.config)
  return dict(target=target, draft=draft, prompts=harness_prompts(target),
              scorer=Scorer(target))


def run_path(target, draft, prompts: list[list[int]], *, num_samples: int, max_new_tokens: int,
             sampling, seed: int = 0, num_draft: int | None = None, verify_impl: Any = "auto",
             tree=None, verify_widths=None) -> PathRun:
  """Decodes `num_samples` rows of every prompt in ONE `specjax.decode` call (one compiled
  program
  per path and setting), row `b` seeded by `fold_in(key(seed), b)`.

  Returns:
    `PathRun(tokens [len(prompts), num_samples, max_new_tokens], summary)`; every row must emit
    `max_new_tokens` tokens (no EOS).
  """
  lengths = np.repeat([len(p) for p in prompts], num_samples).astype(np.int32)
  tokens = np.zeros((len(lengths), max(len(p) for p in prompts)), np.int32)
  for i, prompt in enumerate(prompts):
    tokens[i * num_samples:(i + 1) * num_samples, :len(prompt)] = prompt
  kwargs = {} if tree is None else dict(tree=tree)
  if tree is None:
    kwargs.update(num_draft=num_draft, verify_widths=verify_widths)
  out = decode(target, draft, jnp.asarray(tokens), jax.random.key(seed),
               lengths=jnp.asarray(lengths), max_new_tokens=max_new_tokens, sampling=sampling,
               verify_impl=verify_impl, **kwargs)
  num_tokens = np.asarray(out.num_tokens)
  if not np.all(num_tokens == max_new_tokens):
    raise AssertionError(f"rows ended early: {np.unique(num_tokens)}")
  new = np.asarray(out.tokens).reshape(len(prompts), num_samples, max_new_tokens)
  return PathRun(new, out.stats.summary())


@dataclasses.dataclass(frozen=True)
class Fit:
  """The grouped chi-square of one run (see the module docstring).

  Attributes:
    tests: one `specjax.exactness.stats.PositionTest` per (prompt, position).
    alpha: the family-wise level.
  """

  tests: tuple
  alpha: float

  @property
  def tested(self) -> list:
    """The tests with degrees of freedom (or an impossible token)."""
    return [t for t in self.tests if t.dof > 0 or t.impossible]

  @property
  def num_tests(self) -> int:
    return len(self.tested)

  @property
  def corrected_alpha(self) -> float:
    """The Bonferroni level, `alpha / num_tests`."""
    return self.alpha / max(self.num_tests, 1)

  @property
  def min_pvalue(self) -> float:
    return min((t.pvalue for t in self.tested), default=1.0)

  @property
  def worst(self):
    return min(self.tested, key=lambda t: t.pvalue, default=None)

  @property
  def passed(self) -> bool:
    return self.num_tests > 0 and self.min_pvalue > self.corrected_alpha

  @property
  def deepest_position(self) -> int:
    """The last position any prompt could test."""
    return max((t.position for t in self.tested), default=0)

  @property
  def rows_tested(self) -> int:
    return sum(t.rows_tested for t in self.tests)

  def describe(self) -> str:
    worst = self.worst
    where = "" if worst is None else f" at prompt {worst.prompt}, position {worst.position}"
    return (f"min p = {self.min_pvalue:.3g}{where}; {self.num_tests} tests, Bonferroni level "
            f"{self.corrected_alpha:.3g}; positions tested up to {self.deepest_position}; "
            f"{self.rows_tested} row-positions in tested groups")


def goodness_of_fit(prompts: list[list[int]], tokens: np.ndarray, sampling, scorer: Scorer, *,
                    alpha: float) -> Fit:
  """The audit's prefix-grouped chi-square (`specjax.exactness.stats.position_tests`) of `tokens
  [P, N, positions]` against `scorer.target` under `sampling`, Bonferroni over its tests."""
  from scipy import stats as scipy_stats  # lazily, as the audit does
  return Fit(tuple(position_tests(prompts, tokens, sampling, scipy_stats, scorer)), alpha)
