"""The constrained law (`specjax.constrain.law`) against the NumPy reference of the contract:
warp (temperature, top-k, top-p) on the unconstrained logits, restrict to the allowed tokens,
renormalize; the masked logits warped where that restriction is empty; greedy = allowed argmax."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.constrain import constrained_probs, stuck
from specjax.core.sampling import Sampling
from tests.constrain.reference import masked_law

V = 300
SETTINGS = [Sampling(0.0), Sampling(1.0), Sampling(0.7, top_k=40), Sampling(1.3, top_p=0.8),
            Sampling(0.9, top_k=60, top_p=0.9), Sampling(1.0, top_k=1)]


def _case(seed):
  rng = np.random.default_rng(seed)
  logits = (rng.standard_normal((24, V)) * 2.5).astype(np.float32)
  masks = rng.random((24, V)) < rng.choice([0.01, 0.05, 0.3, 0.9], (24, 1))
  masks[0] = False
  masks[0, 7] = True  # one allowed token
  masks[1] = False
  masks[1, np.argsort(logits[1])[:5]] = True  # only the least likely tokens: top-k drops them all
  masks[:, 0] |= ~masks.any(axis=1)
  return logits, masks


@pytest.mark.parametrize("sampling", SETTINGS, ids=str)
def test_constrained_probs_equal_the_reference(sampling):
  logits, masks = _case(0)
  got = np.asarray(constrained_probs(jnp.asarray(logits), jnp.asarray(masks), sampling))
  for row in range(len(logits)):
    want = masked_law(logits[row], masks[row], sampling.temperature, sampling.top_k,
                      sampling.top_p)
    np.testing.assert_allclose(got[row], want, atol=2e-6, err_msg=f"row {row}")
    assert np.all(got[row][~masks[row]] == 0)


def test_the_order_matters():
  """Not vacuous: restricting before warping (the other convention) gives another law on these
  cases, so the reference above does distinguish the two."""
  logits, masks = _case(0)
  sampling = Sampling(0.9, top_k=60, top_p=0.9)
  got = np.asarray(constrained_probs(jnp.asarray(logits), jnp.asarray(masks), sampling))
  other = np.stack([masked_law(np.where(m, l, -np.inf), m, 0.9, 60, 0.9)
                    for l, m in zip(logits, masks)])
  assert np.max(np.abs(got - other)) > 0.05


def test_stuck_rows():
  logits = jnp.asarray([[0.0, -jnp.inf, 1.0], [-jnp.inf, -jnp.inf, 2.0], [jnp.nan, 0.0, 0.0]])
  masks = jnp.asarray([[True, True, False], [True, True, False], [True, False, False]])
  np.testing.assert_array_equal(stuck(logits, masks), [False, True, False])
  np.testing.assert_array_equal(stuck(logits, jnp.zeros_like(masks)), [True, True, True])
