"""The random streams' uniforms stay inside (0, 1) at the extreme bit patterns, so a Gumbel race
never gives a token of probability 0 a finite (let alone infinite) key."""

import jax.numpy as jnp
import numpy as np

from specjax.core import sampling


def test_uniforms_are_strictly_inside_the_unit_interval_at_the_extreme_bits():
  bits = jnp.asarray([0, 1, 2**8, 2**9 - 1, 2**31, 2**32 - 2**9, 2**32 - 1], jnp.uint32)
  u = np.asarray(sampling.bits_to_uniform(bits))
  assert u.dtype == np.float32
  assert np.all(u > 0) and np.all(u < 1), u
  assert u[-1] == np.float32(1 - 2**-24) and u[0] == np.float32(2**-24)


def test_a_gumbel_race_never_picks_an_excluded_token_at_the_largest_uniform():
  """All-ones bits (the largest uniform) on every token: the excluded token's key stays -inf."""
  logits = jnp.asarray([[0.0, -jnp.inf, 1.0]], jnp.float32)
  u = sampling.bits_to_uniform(jnp.full((1, 3), 2**32 - 1, jnp.uint32))
  keys = logits - jnp.log(-jnp.log(u))
  assert bool(jnp.isfinite(keys[0, 0])) and bool(jnp.isfinite(keys[0, 2]))
  assert keys[0, 1] == -jnp.inf and int(sampling.first_argmax(keys)[0]) == 2
