"""Sampling and the exact speculative verify rule, in pure jnp.

Everything that decides which token comes out lives here, so that plain generation, speculative
decoding, the Pallas kernel's reference and the exactness audit all share one definition:

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
* `verify_reference`: accept draft `x` with probability `min(1, p(x) / q(x))`; at the first
  rejection sample from `normalize(max(p - q, 0))` (falling back to `p` when the residual has no
  mass); if every draft is accepted sample a bonus token from `p`. Temperature 0 is greedy.

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
logit is `>=` a threshold, so tied tokens are kept or dropped together. Top-k's threshold is the k-th
largest logit. Top-p's is the logit of the token at which the descending cumulative mass of the
top-k survivors first reaches `top_p`, i.e. the largest `t` with `sum_{x_v >= t} exp(x_v - max) >=
top_p * sum_v exp(x_v - max)`. Neither is found by sorting: `bisect_threshold` bisects over the
32-bit order-preserving integer image of float32 (`float_to_key`), one counting or summing pass per
step, `BISECT_STEPS` steps. That lands exactly on a logit value, needs no sort (slow on TPU), and is
the same computation the tiled kernel does pass by pass over vocabulary tiles.
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
  """Maps 32 random bits to a float32 uniform in the open interval (0, 1)."""
  return ((bits >> jnp.uint32(8)).astype(jnp.float32) + 0.5) * jnp.float32(2.0 ** -24)


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

BISECT_STEPS = 32  # halvings of an int32 key interval; 32 always reach a single value

_SIGN_MAGNITUDE = 0x7FFFFFFF


def float_to_key(x: jax.Array) -> jax.Array:
  """Order-preserving map float32 -> int32: `a < b` iff `key(a) < key(b)` (NaN excluded)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(bits < 0, bits ^ jnp.int32(_SIGN_MAGNITUDE), bits)


def key_to_float(key: jax.Array) -> jax.Array:
  """Inverse of `float_to_key`."""
  bits = jnp.where(key < 0, key ^ jnp.int32(_SIGN_MAGNITUDE), key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def bisect_midpoint(lo: jax.Array, hi: jax.Array) -> jax.Array:
  """`ceil((lo + hi) / 2)` of int32 keys without overflow."""
  return (lo | hi) - ((lo ^ hi) >> 1)


def bisect_update(lo: jax.Array, hi: jax.Array, mid: jax.Array, holds: jax.Array):
  """One step of "largest key where a decreasing predicate holds": keep `mid` if it holds."""
  return jnp.where(holds, mid, lo), jnp.where(holds, hi, mid - 1)


def bisect_threshold(x: jax.Array, holds_at) -> jax.Array:
  """Largest float `t` with `holds_at(t)`, for a predicate that only gets false as `t` grows.

  The search runs over keys in `[key(-inf), key(max x)]`, so `holds_at(-inf)` must be true.

  Args:
    x: `[..., V]` float32; only its max is used (the upper end of the search).
    holds_at: maps a `[..., 1]` float32 threshold to a `[...]` bool.

  Returns:
    `[..., 1]` float32 threshold, always equal to one of the values tested by `holds_at`.
  """
  hi = float_to_key(jnp.max(x, axis=-1, keepdims=True))
  lo = jnp.full_like(hi, float_to_key(jnp.float32(-jnp.inf)))

  def step(_, bounds):
    lo, hi = bounds
    mid = bisect_midpoint(lo, hi)
    return bisect_update(lo, hi, mid, holds_at(key_to_float(mid))[..., None])

  lo, _ = jax.lax.fori_loop(0, BISECT_STEPS, step, (lo, hi))
  return key_to_float(lo)


def top_k_threshold(x: jax.Array, top_k: int) -> jax.Array:
  """`[..., 1]` the `top_k`-th largest value of `x [..., V]` (by counting, not sorting)."""
  return bisect_threshold(x, lambda t: jnp.sum((x >= t).astype(jnp.int32), axis=-1) >= top_k)


def top_p_threshold(x: jax.Array, top_p: float) -> jax.Array:
  """`[..., 1]` the nucleus threshold of `x [..., V]` (`-inf` = dropped): see the module doc."""
  weights = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))  # [..., V]; 0 where x = -inf
  needed = jnp.float32(top_p) * jnp.sum(weights, axis=-1)
  mass_at = lambda t: jnp.sum(jnp.where(x >= t, weights, 0.0), axis=-1)
  return bisect_threshold(x, lambda t: mass_at(t) >= needed)


def warp_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
  """Temperature, then top-k, then top-p. Dropped tokens get `-inf`.

  Args:
    logits: `[..., V]` raw logits.
    sampling: the sampling settings; must not be greedy.

  Returns:
    `[..., V]` float32 warped logits; `softmax` of them is the sampling distribution.
  """
  if sampling.greedy:
    raise ValueError("warp_logits is for temperature > 0; greedy decoding uses argmax")
  x = logits.astype(jnp.float32) / jnp.float32(sampling.temperature)
  vocab = x.shape[-1]
  if sampling.top_k is not None and sampling.top_k < vocab:
    x = jnp.where(x >= top_k_threshold(x, sampling.top_k), x, -jnp.inf)
  if sampling.top_p is not None and sampling.top_p < 1.0:
    x = jnp.where(x >= top_p_threshold(x, sampling.top_p), x, -jnp.inf)
  return x


def probabilities(logits: jax.Array, sampling: Sampling) -> jax.Array:
  """The sampling distribution `[..., V]` float32 (one-hot at the argmax when greedy)."""
  if sampling.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(warp_logits(logits, sampling), axis=-1)


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
  return jnp.argmax(scores + noise, axis=-1).astype(jnp.int32)


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
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return sample_race(warp_logits(logits, sampling), seeds, positions, purpose)


# --------------------------------------------------------------------------------------------
# The verify rule.
# --------------------------------------------------------------------------------------------

class VerifyResult(NamedTuple):
  num_accepted: jax.Array  # [B] int32 in [0, k]
  tokens: jax.Array  # [B, k + 1] int32: accepted drafts, then the correction or bonus, then 0


def verify_reference(target_logits: jax.Array, draft_logits: jax.Array | None,
                     draft_tokens: jax.Array, *, sampling: Sampling, seeds: jax.Array,
                     positions: jax.Array) -> VerifyResult:
  """The exact speculative accept/reject rule.

  Args:
    target_logits: `[B, k + 1, V]` target logits at the k draft positions and one past them.
    draft_logits: `[B, k, V]` the drafter's raw logits for its proposals, or None when the drafter
      proposes deterministically (a point mass: n-gram lookup, argmax drafts).
    draft_tokens: `[B, k]` int32 proposals.
    sampling: applied identically to both models' logits.
    seeds: `[B]` uint32 per-row stream seeds (`row_seeds`).
    positions: `[B]` int32 absolute sequence position of each row's first draft token.

  Returns:
    `VerifyResult(num_accepted [B], tokens [B, k + 1])`: `tokens[b, :n]` are the accepted drafts,
    `tokens[b, n]` the correction (or the bonus when `n == k`), zeros after.
  """
  b, k = draft_tokens.shape
  vocab = target_logits.shape[-1]
  seeds = jnp.asarray(seeds, jnp.uint32)
  draft_tokens = draft_tokens.astype(jnp.int32)
  index = jnp.arange(k + 1, dtype=jnp.int32)
  token_positions = positions.astype(jnp.int32)[:, None] + index  # [B, k+1]

  if sampling.greedy:
    target_argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    accepted = draft_tokens == target_argmax[:, :k]
    num_accepted = _leading_true(accepted)
    final = jnp.take_along_axis(target_argmax, num_accepted[:, None], axis=1)[:, 0]
  else:
    warped_p = warp_logits(target_logits, sampling)  # [B, k+1, V]
    p = jax.nn.softmax(warped_p, axis=-1)
    p_draft = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]  # [B, k]
    if draft_logits is None:
      q_draft = jnp.ones_like(p_draft)
      q = jax.nn.one_hot(draft_tokens, vocab, dtype=jnp.float32)
    else:
      q = jax.nn.softmax(warp_logits(draft_logits, sampling), axis=-1)  # [B, k, V]
      q_draft = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    u = uniform(seeds[:, None], token_positions[:, :k], 0, PURPOSE_ACCEPT)  # [B, k]
    accepted = u * q_draft < p_draft  # u < p/q without dividing; q = 0 < p always accepts
    num_accepted = _leading_true(accepted)
    # Correction at the first rejection, or bonus from p after k acceptances.
    p_n = jnp.take_along_axis(p, num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q = 0 at the bonus slot
    q_n = jnp.take_along_axis(q_padded, num_accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    has_mass = jnp.sum(residual, axis=-1, keepdims=True) > 0
    weights = jnp.where(has_mass, residual, p_n)
    scores = jnp.where(weights > 0, jnp.log(weights), -jnp.inf)
    final_positions = positions.astype(jnp.int32) + num_accepted
    final = sample_race(scores, seeds, final_positions, PURPOSE_RESIDUAL)

  tokens = jnp.where(index[None, :k] < num_accepted[:, None], draft_tokens, 0)
  tokens = jnp.concatenate([tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
  tokens = jnp.where(index[None] == num_accepted[:, None], final[:, None], tokens)
  return VerifyResult(num_accepted, tokens)


def _leading_true(mask: jax.Array) -> jax.Array:
  """Number of leading True entries along the last axis, int32."""
  return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
