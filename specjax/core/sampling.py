"""Sampling: settings, warping, random streams and the one threshold search, in pure jnp.

Everything that decides which token comes out lives here or in `specjax.verify.rule` (the verify
rule built on it), so that plain generation, speculative decoding, the Pallas kernels and the
exactness audit all share one definition:

* `Sampling`: temperature, top-k and top-p. `warp_logits` applies them, in that order, identically
  to the target's and the drafter's logits.
* Random numbers are a counter-based hash of `(seed, position, index, purpose)` built from 32-bit
  integer ops, where `seed` is the row's own `uint32` (`row_seeds`: one per request), `position`
  the token's absolute position in its row and `purpose` one of `PURPOSE_*`. There is no batch-slot
  index and no round counter, so a request's tokens depend only on its seed and prompt: the same
  request gives the same tokens in slot 0 of a batch of 1 and in slot 5 of a batch of 8, under any
  mesh. The same numbers can be computed inside a Pallas kernel on TPU, on GPU and in interpret
  mode, so the fused kernels and this reference return identical tokens.
* Categorical sampling is a Gumbel-max race over the vocabulary: `argmax(logits + G_v)`. Each
  vocabulary entry has its own noise, so the race can be run tile by tile without a softmax or a
  sort.
* `specjax.verify.rule.verify_reference`: accept draft `x` with probability `min(1, p(x) / q(x))`;
  at the first rejection sample from `normalize(max(p - q, 0))` (falling back to `p` when the
  residual has no mass); if every draft is accepted sample a bonus token from `p`. Temperature 0 is
  greedy.

Why reusing a position's stream after a rejection is still exact. A speculative round at row
length `L` draws the drafts with the `PURPOSE_DRAFT` noise of positions `L .. L+k-1`, the ratio
tests with the `PURPOSE_ACCEPT` uniforms of the same positions, and the correction (or bonus) with
the `PURPOSE_RESIDUAL` noise of position `L+n`, where `n` is the number of leading acceptances.
Everything the round emits (the `n` accepted drafts and the token at `L+n`), and the decision to
stop at `L+n`, is a function of the noise at positions `<= L+n` only: a draft at position `j`
depends on the draft noise at positions `<= j`, and `n` reads the ratio tests only up to the first
rejection. The next round starts at `L+n+1` and reuses the noise of positions `> L+n`, which the
earlier drafts past the rejection consumed but which never influenced anything emitted. Given
everything emitted so far, those numbers are therefore still independent and uniform (a stopping
time argument: the stop position is decided by the noise before it), so each round sees fresh
randomness exactly as if a new stream had been drawn. No position's residual noise is used twice:
once a token at a position is emitted, no later round samples at that position again.

Thresholds (shared with the kernel): top-k and top-p each keep the tokens whose (temperature-scaled)
logit is `>=` a threshold, so tied tokens are kept or dropped together. Top-k's threshold is the
k-th largest logit. Top-p's is the logit of the token at which the descending cumulative mass of the
top-k survivors first reaches `top_p`, i.e. the largest `t` with `sum_{x_v >= t} exp(x_v - max) >=
top_p * sum_v exp(x_v - max)`; it is searched between the top-k threshold and the max. Neither is
found by sorting: `radix_threshold` searches the 32-bit order-preserving integer image of float32
(`float_to_key`) with `RADIX - 1 = 15` candidates per round, one counting or summing reduction per
round, `RADIX_ROUNDS = 8` rounds. That lands exactly on a logit value, needs no sort (slow on TPU),
and is the same computation the tiled kernels do pass by pass and the vocabulary-sharded rule does
with one collective per round.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

# Purposes: each draws from its own random stream.
PURPOSE_SAMPLE = 1  # plain autoregressive sampling from the target
PURPOSE_DRAFT = 2  # the drafter's proposal
PURPOSE_ACCEPT = 3  # the uniform of the ratio test
PURPOSE_RESIDUAL = 4  # the correction (residual) or bonus token


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How tokens are chosen. `temperature=0` is greedy (top-k / top-p are then irrelevant).

  Attributes:
    temperature: >= 0. Logits are divided by it.
    top_k: keep the `top_k` most likely tokens (ties at the boundary kept); None = all.
    top_p: nucleus sampling, in (0, 1]; None or 1.0 = all.
  """

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    t = self.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
      raise ValueError(f"Sampling.temperature must be a finite number >= 0, got {t!r}")
    object.__setattr__(self, "temperature", float(t))
    if self.top_k is not None:
      if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
        raise ValueError(f"Sampling.top_k must be a positive int or None, got {self.top_k!r}")
    if self.top_p is not None:
      p = self.top_p
      if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
        raise ValueError(f"Sampling.top_p must be in (0, 1] or None, got {p!r}")
      object.__setattr__(self, "top_p", float(p))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


GREEDY = Sampling()


# --------------------------------------------------------------------------------------------
# Counter-based random numbers.
# --------------------------------------------------------------------------------------------

def _rotl(x, r):
  return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def _fmix32(h):
  h = h ^ (h >> jnp.uint32(16))
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> jnp.uint32(13))
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> jnp.uint32(16))


def hash_bits(seed, *counters) -> jax.Array:
  """32 random bits from a seed word and integer counters (MurmurHash3's 32-bit word mixing).

  Pure `uint32` multiply / xor / shift, so the same bits come out of a TPU or GPU kernel, the CPU
  and interpret mode. `seed` is uint32 (an int32 seed is reinterpreted bit for bit, as kernels
  carry it). Arguments broadcast against each other.
  """
  seed = jnp.asarray(seed)
  if seed.dtype == jnp.int32:
    seed = jax.lax.bitcast_convert_type(seed, jnp.uint32)
  h = seed.astype(jnp.uint32)
  for word in counters:
    k = jnp.asarray(word).astype(jnp.uint32) * jnp.uint32(0xCC9E2D51)
    k = _rotl(k, 15) * jnp.uint32(0x1B873593)
    h = h ^ k
    h = _rotl(h, 13) * jnp.uint32(5) + jnp.uint32(0xE6546B64)
  return _fmix32(h ^ jnp.uint32(4 * len(counters)))


def bits_to_uniform(bits: jax.Array) -> jax.Array:
  """Maps 32 random bits to a float32 uniform in the open interval (0, 1): the top 23 bits, plus
  one half, times 2^-23, so the largest value is 1 - 2^-24, which float32 holds exactly. (With 24
  bits, 2^24 - 0.5 rounds to 2^24 in float32 and the uniform reached 1.0: a Gumbel key of +inf,
  and NaN for a token of probability 0, which the race then picked.)"""
  return ((bits >> jnp.uint32(9)).astype(jnp.float32) + 0.5) * jnp.float32(2.0 ** -23)


def uniform(seeds, *counters) -> jax.Array:
  """A float32 uniform in (0, 1) per element; `seeds` (uint32) broadcasts against the counters."""
  return bits_to_uniform(hash_bits(seeds, *counters))


def gumbel(seeds, *counters) -> jax.Array:
  return -jnp.log(-jnp.log(uniform(seeds, *counters)))


def row_seeds(rng: jax.Array, batch: int) -> jax.Array:
  """`[batch]` uint32 per-row stream seeds.

  Args:
    rng: one PRNG key (typed `jax.random.key` or raw `PRNGKey`): row `b` gets the seed of
      `fold_in(rng, b)`; or a `[batch]` array of keys, one per request, so a request's tokens do
      not depend on its batch slot or its neighbours.
    batch: the number of rows.

  Returns:
    `[batch]` uint32.
  """
  keys = rng
  if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
    if keys.dtype != jnp.uint32 or keys.ndim not in (1, 2) or keys.shape[-1] != 2:
      raise ValueError(f"rng must be a PRNG key or a [B] array of keys, got dtype {keys.dtype} "
                       f"shape {tuple(keys.shape)}")
    keys = jax.random.wrap_key_data(keys)
  if keys.ndim == 0:
    single = keys
    keys = jax.vmap(lambda b: jax.random.fold_in(single, b))(jnp.arange(batch, dtype=jnp.uint32))
  elif keys.shape != (batch,):
    raise ValueError(f"a key array must hold one key per row: shape ({batch},), got {keys.shape}")
  return jax.vmap(lambda key: jax.random.bits(key, (), jnp.uint32))(keys)


# --------------------------------------------------------------------------------------------
# Warping.
# --------------------------------------------------------------------------------------------

RADIX_BITS = 4
RADIX = 1 << RADIX_BITS  # candidates per round of a threshold search: RADIX - 1 tested at once
RADIX_ROUNDS = 8  # each round divides the key interval by RADIX: 16 ** 8 = 2 ** 32 keys

_SIGN_MAGNITUDE = 0x7FFFFFFF
_SIGN_BIT = -0x80000000


def float_to_key(x: jax.Array) -> jax.Array:
  """Order-preserving map float32 -> int32: `a < b` iff `key(a) < key(b)` (NaN excluded)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(bits < 0, bits ^ jnp.int32(_SIGN_MAGNITUDE), bits)


def key_to_float(key: jax.Array) -> jax.Array:
  """Inverse of `float_to_key`."""
  bits = jnp.where(key < 0, key ^ jnp.int32(_SIGN_MAGNITUDE), key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


# The radix search keeps `(base, width)` per row: `base` is an int32 key where the predicate holds
# and the answer lies in the keys `base .. base + width - 1`. `width` can exceed 2**31, so it is
# an unsigned quantity carried in an int32 (wrapping adds, logical shifts, comparisons with the
# sign bit flipped): the same elementwise int32 ops lower on TPU, on GPU and in jnp.

def _unsigned_less(a: jax.Array, b: jax.Array) -> jax.Array:
  return (a ^ jnp.int32(_SIGN_BIT)) < (b ^ jnp.int32(_SIGN_BIT))


def _radix_step(width: jax.Array) -> jax.Array:
  return jax.lax.shift_right_logical(width + jnp.int32(RADIX - 1), jnp.int32(RADIX_BITS))


def radix_start(low: jax.Array, top: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(base, width)` of a search over the float32 interval `[low, top]` (`low` must hold)."""
  base = float_to_key(low)
  return base, float_to_key(top) - base + jnp.int32(1)


def radix_candidates(base: jax.Array, width: jax.Array,
                     j: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(thresholds, open)` of candidate `j` (int32 in `1 .. RADIX-1`, broadcast against `base`):
  the key `base + j * ceil(width / RADIX)` as a float32, and whether it lies inside the interval."""
  offsets = _radix_step(width) * j
  return key_to_float(base + offsets), _unsigned_less(offsets, width)


def radix_update(base: jax.Array, width: jax.Array, num_good: jax.Array,
                 num_open: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Narrows `(base, width)` given how many of the `num_open` open candidates hold (the ones
  that hold are a prefix: the predicate only gets false as the threshold grows)."""
  step = _radix_step(width)
  best = step * num_good
  first_bad = jnp.where(num_good < num_open, best + step, width)
  return base + best, first_bad - best


def radix_threshold(low: jax.Array, top: jax.Array, holds_at) -> jax.Array:
  """Largest float32 `t` in `[low, top]` with `holds_at(t)`: the one threshold search.

  The predicate must hold at `low` and only get false as `t` grows. Floats order like their
  `float_to_key` images, so the search runs over int32 keys: each of `RADIX_ROUNDS` rounds tests
  `RADIX - 1` evenly spaced candidates at once (one reduction over the vocabulary per round, in
  the reference, the vocabulary-sharded rule and both kernels) and keeps the sub-interval between
  the last that holds and the first that fails. The result is always one of the tested values.

  Args:
    low: `[...]` float32 where the predicate holds (e.g. `-inf`).
    top: `[...]` float32 upper end (e.g. the max).
    holds_at: maps `[..., RADIX-1]` float32 thresholds to `[..., RADIX-1]` bool.

  Returns:
    `[...]` float32.
  """
  base, width = radix_start(low, top)
  j = jnp.arange(1, RADIX, dtype=jnp.int32)

  def search_round(_, bounds):
    base, width = bounds
    thresholds, open_ = radix_candidates(base[..., None], width[..., None], j)
    good = open_ & holds_at(thresholds)
    count = lambda mask: jnp.sum(mask.astype(jnp.int32), axis=-1)
    return radix_update(base, width, count(good), count(open_))

  base, _ = jax.lax.fori_loop(0, RADIX_ROUNDS, search_round, (base, width))
  return key_to_float(base)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`jax.lax.top_k(x, k)` (values and indices of the `k` largest over the last axis), kept whole.

  Its two outputs pass through an `optimization_barrier`, so that XLA cannot fold a later slice of
  them (`top[:, 0]`, one depth of a `[B, D, V]` result) into the top-k itself: XLA:CPU then sorts
  the whole vocabulary instead of running its top-k kernel. Measured on `[1, 4, 49,152]` float32,
  `k` = 3, the first depth's values kept: 40 ms against 0.34 ms; `[1, 49,152]` with one column of
  each output kept: 15 ms against 0.11 ms (a 2-core AMD EPYC, load average 4). Same values
  (`tests/core/test_top_k.py`, which also reads the compiled program for the sort).

  Not for a program that XLA:CPU partitions (a top-k inside a vocabulary-sharded verify): there
  it aborts on the barrier (a check failure in `hlo_casting_utils`), so
  `specjax.verify.candidates` keeps `jax.lax.top_k`.
  """
  return jax.lax.optimization_barrier(jax.lax.top_k(x, k))


def first_argmax(x: jax.Array) -> jax.Array:
  """`[..., V] -> [...]` int32 index of the first maximum over the last axis: `jnp.argmax`'s
  answer (a NaN counts as the maximum, the first one wins), as a max and a min-reduction, which
  XLA:CPU runs faster than `jnp.argmax`'s paired-value reduction (docs/benchmarks.md,
  "`first_argmax` on XLA:CPU"); every greedy step and verify round pays it."""
  vocab = x.shape[-1]
  best = jnp.max(x, axis=-1, keepdims=True)  # (XLA:CPU's max does not always propagate NaN)
  ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  # One min-reduction: a NaN's key is its id, a maximum's its id + V, anything else 2 V.
  key = jnp.where(jnp.isnan(x), ids, jnp.where(x == best, ids + vocab, 2 * vocab))
  first = jnp.min(key, axis=-1)
  return jnp.where(first >= vocab, first - vocab, first)


class JnpReductions:
  """Reductions over the last (vocabulary) axis with jnp: a whole vocabulary on one device."""

  def max(self, x: jax.Array) -> jax.Array:
    return jnp.max(x, axis=-1)

  def sum(self, x: jax.Array) -> jax.Array:
    return jnp.sum(x, axis=-1)

  def sum_at_least(self, x: jax.Array, weights: jax.Array | None,
                   thresholds: jax.Array) -> jax.Array:
    """`[..., R]`: `sum_v [x_v >= t_j] * w_v` for thresholds `[..., R]` (`weights` None: count)."""
    above = x[..., None, :] >= thresholds[..., None]  # [..., R, V]
    if weights is None:
      return jnp.sum(above.astype(jnp.int32), axis=-1)
    return jnp.sum(jnp.where(above, weights[..., None, :], 0.0), axis=-1)


_LOCAL = JnpReductions()


def top_k_threshold(x: jax.Array, top_k: int, ops=_LOCAL) -> jax.Array:
  """`[...]` the `top_k`-th largest value of `x [..., V]` (by counting, not sorting)."""
  top = ops.max(x)
  return radix_threshold(jnp.full_like(top, -jnp.inf), top,
                         lambda t: ops.sum_at_least(x, None, t) >= top_k)


def top_p_threshold(x: jax.Array, top_p: float, ops=_LOCAL, low=None) -> jax.Array:
  """`[...]` the nucleus threshold of `x [..., V]` (`-inf` = dropped): see the module doc.

  `low`: a value known to hold (the top-k threshold when top-k ran first: the search then runs
  over the top-k survivors' range only); default `-inf`.
  """
  top = ops.max(x)
  weights = jnp.exp(x - top[..., None])  # [..., V]; 0 where x = -inf
  needed = jnp.float32(top_p) * ops.sum(weights)
  low = jnp.full_like(top, -jnp.inf) if low is None else low
  return radix_threshold(low, top,
                         lambda t: ops.sum_at_least(x, weights, t) >= needed[..., None])


def warp_logits(logits: jax.Array, sampling: Sampling, ops=_LOCAL) -> jax.Array:
  """Temperature, then top-k, then top-p (over the top-k survivors). Dropped tokens get `-inf`.

  Args:
    logits: `[..., V]` raw logits (or a vocabulary slice of them, with `ops` reducing across
      the slices).
    sampling: the sampling settings; must not be greedy.
    ops: reductions over the vocabulary axis (`max`, `sum`); default jnp over the whole axis.

  Returns:
    `[..., V]` float32 warped logits; `softmax` of them is the sampling distribution.
  """
  if sampling.greedy:
    raise ValueError("warp_logits is for temperature > 0; greedy decoding uses argmax")
  x = logits.astype(jnp.float32) / jnp.float32(sampling.temperature)
  vocab = getattr(ops, "vocab", None) or x.shape[-1]
  floor = None
  if sampling.top_k is not None and sampling.top_k < vocab:
    floor = top_k_threshold(x, sampling.top_k, ops)
    x = jnp.where(x >= floor[..., None], x, -jnp.inf)
  if sampling.top_p is not None and sampling.top_p < 1.0:
    x = jnp.where(x >= top_p_threshold(x, sampling.top_p, ops, floor)[..., None], x, -jnp.inf)
  return x


def probabilities(logits: jax.Array, sampling: Sampling) -> jax.Array:
  """The sampling distribution `[..., V]` float32 (one-hot at the argmax when greedy)."""
  if sampling.greedy:
    return jax.nn.one_hot(first_argmax(logits), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(warp_logits(logits, sampling), axis=-1)


def token_logprobs(logits: jax.Array, tokens: jax.Array, sampling: Sampling) -> jax.Array:
  """`log_softmax(logits / T)[token]` over the whole vocabulary: `[..., V]`, `[...]` -> `[...]`
  float32, T = 1 when greedy, no top-k / top-p (the form RL losses compare against: the policy's
  tempered log-probability of the token, whatever the truncation it was sampled with)."""
  x = logits.astype(jnp.float32)
  if not sampling.greedy and sampling.temperature != 1.0:
    x = x / jnp.float32(sampling.temperature)
  picked = jnp.take_along_axis(x, jnp.asarray(tokens, jnp.int32)[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(x, axis=-1)


def no_distribution(logits: jax.Array) -> jax.Array:
  """`[..., V] -> [...]` bool: where the logits define no distribution (a NaN, a +inf, or no logit
  above -inf), as broken weights or an overflow leave them. A -inf logit alone (a masked token)
  is a probability of 0 and is fine."""
  return (jnp.any(~(logits < jnp.inf), axis=-1)  # NaN or +inf
          | ~jnp.any(logits > -jnp.inf, axis=-1))


def sample_race(scores: jax.Array, seeds: jax.Array, positions: jax.Array,
                purpose: int) -> jax.Array:
  """Gumbel-max: `argmax_v(scores_v + G(seed, position, v, purpose))`.

  Args:
    scores: `[..., V]` float32 log-weights (unnormalised; `-inf` = excluded).
    seeds: uint32 per-row stream seeds, broadcastable to `scores.shape[:-1]`.
    positions: int32 absolute positions, broadcastable to `scores.shape[:-1]`.
    purpose: one of the `PURPOSE_*` stream ids.

  Returns:
    int32 ids of shape `scores.shape[:-1]`.
  """
  vocab_ids = jnp.arange(scores.shape[-1], dtype=jnp.int32)
  seeds = jnp.asarray(seeds)
  noise = gumbel(seeds[..., None], jnp.asarray(positions)[..., None], vocab_ids, purpose)
  return first_argmax(scores + noise)


def sample_token(logits: jax.Array, sampling: Sampling, seeds: jax.Array, positions: jax.Array,
                 purpose: int = PURPOSE_SAMPLE) -> jax.Array:
  """One token per leading index from raw logits `[..., V]`: argmax if greedy, else a race.

  Args:
    logits: `[..., V]` raw logits.
    sampling: the sampling settings.
    seeds: uint32 per-row seeds (`row_seeds`), broadcastable to `logits.shape[:-1]`.
    positions: int32 absolute position of the sampled token in its row.
    purpose: the stream id (`PURPOSE_*`).
  """
  if sampling.greedy:
    return first_argmax(logits)
  return sample_race(warp_logits(logits, sampling), seeds, positions, purpose)


# --------------------------------------------------------------------------------------------
# The verify rule.
# --------------------------------------------------------------------------------------------

class VerifyResult(NamedTuple):
  """What a verify rule returns (`specjax.verify.rule.verify_rule` and the kernels)."""

  num_accepted: jax.Array  # [B] int32 in [0, k]
  tokens: jax.Array  # [B, k + 1] int32: accepted drafts, then the correction or bonus, then 0


def leading_true(mask: jax.Array) -> jax.Array:
  """Number of leading True entries along the last axis, int32."""
  return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
