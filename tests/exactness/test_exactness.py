"""Sampled speculative decoding reproduces the target's own distribution, and the test can tell.

Tiny models over an 8-token vocabulary generate 3 tokens for N = 20,000 copies of one prompt (each
batch row has its own random stream). The joint distribution of the 3 tokens (512 cells) is
compared with the target's exact distribution, enumerated from its own logits with an independent
float64 NumPy implementation of temperature / top-k / top-p. Cells with expected count < 5 are
pooled; the chi-square test passes at significance 1e-3. Cells the target gives probability 0
(cut by top-k / top-p) must never occur. The same test must reject deliberately broken rules with
p < 1e-6, which shows it has the power to catch them. Everything is seeded.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.testing.rules import rule_warping_only_p, rule_without_residual
from specjax.testing.models import tiny_config
from specjax.models.transformer import forward

from scipy import stats as scipy_stats  # noqa: E402

VOCAB = 8
NEW = 3
N = 20_000
PROMPT = [1, 2, 3, 1, 2, 3, 1]
ALPHA = 1e-3
POWER_ALPHA = 1e-6

SETTINGS = {
    "t1": sj.Sampling(temperature=1.0),
    "t0.7_topk3": sj.Sampling(temperature=0.7, top_k=3),
    "t0.9_topp0.8": sj.Sampling(temperature=0.9, top_p=0.8),
}


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=VOCAB), jax.random.key(10))


@pytest.fixture(scope="module")
def draft():
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=1), jax.random.key(11))


def numpy_distribution(logits: np.ndarray, sampling: sj.Sampling) -> np.ndarray:
  """Temperature, top-k, top-p in float64: the oracle, written without specjax's code."""
  x = logits.astype(np.float64) / sampling.temperature
  keep = np.ones_like(x, bool)
  if sampling.top_k is not None:
    kth = np.sort(x, axis=-1)[..., ::-1][..., sampling.top_k - 1:sampling.top_k]
    keep &= x >= kth
  probs = np.where(keep, np.exp(x - x.max(-1, keepdims=True)), 0.0)
  probs /= probs.sum(-1, keepdims=True)
  if sampling.top_p is not None:
    order = np.sort(probs, axis=-1)[..., ::-1]
    first = np.argmax(np.cumsum(order, axis=-1) >= sampling.top_p - 1e-12, axis=-1)
    threshold = np.take_along_axis(order, first[..., None], axis=-1)
    probs = np.where(probs >= threshold, probs, 0.0)
    probs /= probs.sum(-1, keepdims=True)
  return probs


def exact_joint(target, sampling) -> np.ndarray:
  """P(x1, x2, x3) under the target alone, by enumerating all 8^3 continuations."""
  grid = np.stack(np.meshgrid(*[np.arange(VOCAB)] * NEW, indexing="ij"), -1).reshape(-1, NEW)
  seqs = np.concatenate([np.tile(PROMPT, (len(grid), 1)), grid], axis=1)
  logits = np.asarray(forward(target, jnp.asarray(seqs, jnp.int32),
                              jnp.zeros(len(seqs), jnp.int32)).logits)
  joint = np.ones(len(grid))
  for i in range(NEW):
    probs = numpy_distribution(logits[:, len(PROMPT) - 1 + i], sampling)
    joint *= probs[np.arange(len(grid)), grid[:, i]]
  return joint


def chi_square_pvalue(tokens: np.ndarray, joint: np.ndarray) -> float:
  cells = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
  observed = np.bincount(cells, minlength=VOCAB ** NEW).astype(np.float64)
  expected = joint * len(tokens)
  assert observed[joint == 0].sum() == 0, "emitted a sequence the target cannot produce"
  support = joint > 0
  observed, expected = observed[support], expected[support]
  small = expected < 5
  if small.any():
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
  expected *= observed.sum() / expected.sum()
  return float(scipy_stats.chisquare(observed, expected).pvalue)


def run_decode(target, drafter, sampling, num_draft=2, seed=0, verify_impl="auto"):
  tokens = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (N, 1))
  out = sj.decode(target, drafter, tokens, jax.random.key(seed), max_new_tokens=NEW,
                  num_draft=num_draft, sampling=sampling, verify_impl=verify_impl)
  assert np.all(np.asarray(out.num_tokens) == NEW)
  return np.asarray(out.tokens), out.stats


# Deliberately broken rules (`specjax.testing.rules`): each wraps the real rule so that only the
# named step is wrong. Every goodness-of-fit test below has a power check: the broken rule run
# through the same decode and the same assertion at the same N must give p < 1e-6.
DRAFT_MODEL_BROKEN = {"t1": rule_without_residual, "t0.7_topk3": rule_warping_only_p,
                      "t0.9_topp0.8": rule_without_residual}
NGRAM_BROKEN = rule_without_residual  # a point-mass q: only the residual step can be wrong


@pytest.mark.costly
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_draft_model_decode_matches_target_distribution(target, draft, name):
  sampling = SETTINGS[name]
  tokens, stats = run_decode(target, draft, sampling)
  summary = stats.summary()
  assert 0.05 < summary["acceptance_rate"] < 0.95  # the rule is exercised both ways
  assert chi_square_pvalue(tokens, exact_joint(target, sampling)) > ALPHA


@pytest.mark.costly
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_ngram_decode_matches_target_distribution(target, name):
  sampling = SETTINGS[name]
  tokens, stats = run_decode(target, sj.NGramDrafter(max_ngram=2), sampling, num_draft=3)
  assert stats.summary()["accepted"] > 0
  assert chi_square_pvalue(tokens, exact_joint(target, sampling)) > ALPHA


@pytest.mark.costly
@pytest.mark.parametrize("name", [*(pytest.param(name, marks=pytest.mark.slow)
                                      for name in sorted(SETTINGS) if name != "t1"), "t1"])
def test_draft_model_power(target, draft, name):
  sampling = SETTINGS[name]
  tokens, _ = run_decode(target, draft, sampling, verify_impl=DRAFT_MODEL_BROKEN[name])
  assert chi_square_pvalue(tokens, exact_joint(target, sampling)) < POWER_ALPHA


@pytest.mark.costly
@pytest.mark.parametrize("name", [*(pytest.param(name, marks=pytest.mark.slow)
                                      for name in sorted(SETTINGS) if name != "t1"), "t1"])
def test_ngram_power(target, name):
  sampling = SETTINGS[name]
  tokens, _ = run_decode(target, sj.NGramDrafter(max_ngram=2), sampling, num_draft=3,
                         verify_impl=NGRAM_BROKEN)
  assert chi_square_pvalue(tokens, exact_joint(target, sampling)) < POWER_ALPHA


# The draft model over its KV cache in 8-bit floats (`ModelDrafter(cache_dtype=...)`): another
# q, the same law; its broken twin (the residual skipped) must be rejected at the same N.
@pytest.mark.costly
def test_draft_model_with_an_8bit_cache_matches_target_distribution(target, draft):
  sampling = SETTINGS["t1"]
  drafter = sj.ModelDrafter(draft, cache_dtype="float8_e4m3fn")
  tokens, stats = run_decode(target, drafter, sampling)
  assert 0.05 < stats.summary()["acceptance_rate"] < 0.95
  assert chi_square_pvalue(tokens, exact_joint(target, sampling)) > ALPHA
  broken, _ = run_decode(target, drafter, sampling, verify_impl=rule_without_residual)
  assert chi_square_pvalue(broken, exact_joint(target, sampling)) < POWER_ALPHA


def test_plain_generate_matches_target_distribution(target):
  """The baseline itself: sj.generate samples the same exact distribution."""
  sampling = SETTINGS["t0.7_topk3"]
  tokens = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (N, 1))
  out = sj.generate(target, tokens, jax.random.key(3), max_new_tokens=NEW, sampling=sampling)
  assert chi_square_pvalue(np.asarray(out.tokens), exact_joint(target, sampling)) > ALPHA
