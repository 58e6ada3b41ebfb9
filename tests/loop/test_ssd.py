"""SSD (`specjax.loop.ssd.decode_ssd`, `specjax.drafters.SSDDrafter`): greedy identity with
`generate` at hit and at miss on ragged batches, on one device and split by role over 2 CPU
devices (the same tokens, one collective in the program), the fan-out, the candidates, Saguaro's
q, and the bad-input errors.

Models: tiny random transformers over V = 64 (`specjax.testing.harness`): the target, and a noisy
copy of it (relative noise 0.07 on every weight) as the draft, which is accepted often and
rejected every few tokens, so outcomes of every length happen and some miss the outcome cache.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import SSDDrafter
from specjax.drafters import ssd as ssd_drafter
from specjax.loop import ssd
from specjax.testing import harness

K = 3
NEW = 20


@pytest.fixture(scope="module")
def models():
  target = harness.harness_target(num_layers=2)
  draft = sj.Model(harness.noisy_copy(target.params, jax.random.key(5), 0.07), target.config)
  return target, draft


@pytest.fixture(scope="module")
def batch():
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, harness.VOCAB, (3, 7)), jnp.int32)
  return tokens, jnp.asarray([7, 3, 5], jnp.int32)  # ragged


def _role_mesh(size: int = 2):
  return jax.make_mesh((size,), ("role",), devices=jax.devices()[:size])


def _generate(target, batch, eos_id=None):
  tokens, lengths = batch
  return sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=NEW,
                     eos_id=eos_id)


def _ssd(target, drafter, batch, **kwargs):
  tokens, lengths = batch
  return ssd.decode_ssd(target, drafter, tokens, jax.random.key(0), lengths=lengths,
                        max_new_tokens=NEW, num_draft=K, **kwargs)


def test_greedy_equals_generate_at_hit_and_at_miss(models, batch):
  target, draft = models
  ref = _generate(target, batch)
  # The draft is the target: every round accepts all K and the bonus is the draft's own argmax,
  # its rank-0 candidate at k = K: every lookup hits, every round after the first emits K + 1.
  out = _ssd(target, SSDDrafter(target, budget=K + 1), batch)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  outcomes, hits = np.asarray(out.ssd.outcomes), np.asarray(out.ssd.hits)
  assert np.array_equal(hits, outcomes) and outcomes[:, K].sum() > 0
  np.testing.assert_array_equal(out.ssd.fallbacks, [1, 1, 1])  # the first round only
  assert out.stats.summary()["tokens_per_round"] > K
  # A noisy draft with the smallest budget: hits and misses both happen, and the tokens are
  # still the target's.
  out = _ssd(target, SSDDrafter(draft, budget=K + 1), batch)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  outcomes, hits = np.asarray(out.ssd.outcomes).sum(), np.asarray(out.ssd.hits).sum()
  assert 0 < hits < outcomes
  assert np.all(np.asarray(out.ssd.fallbacks) > 1)  # misses fell back to a plain target step


def test_greedy_eos_on_ragged_rows(models, batch):
  target, draft = models
  ref = _generate(target, batch)
  eos = int(np.asarray(ref.tokens)[1, 4])  # row 1 stops at its 5th token (others may too)
  ref = _generate(target, batch, eos_id=eos)
  out = _ssd(target, SSDDrafter(draft, budget=6), batch, eos_id=eos)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.num_tokens, ref.num_tokens)
  assert int(out.num_tokens[1]) <= 5


def test_role_split_gives_the_single_device_tokens_with_one_collective(models, batch):
  target, draft = models
  tokens, lengths = batch
  mesh = _role_mesh()
  ref = _generate(target, batch)
  split = _ssd(target, SSDDrafter(draft, budget=K + 1), batch, mesh=mesh)
  np.testing.assert_array_equal(split.tokens, ref.tokens)
  assert 0 < np.asarray(split.ssd.hits).sum() < np.asarray(split.ssd.outcomes).sum()
  # Sampled, with Saguaro sampling: the split's tokens are the one-device tokens, and its
  # compiled program holds one collective (the round's exchange).
  sampling = sj.Sampling(temperature=0.7, top_k=16, top_p=0.9)
  drafter = SSDDrafter(draft, budget=6, saguaro=0.5)
  one = _ssd(target, drafter, batch, sampling=sampling)
  args = (target, drafter, tokens, lengths, jax.random.key(0), jnp.asarray([-1], jnp.int32),
          jnp.int32(NEW))
  static = dict(sampling=sampling, num_draft=K, capacity=32, pad_id=0, variant="exact")
  two = ssd._decode_ssd.lower(*args, mesh=mesh, **static).compile()
  collectives = re.findall(r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute|"
                           r"reduce-scatter)(?:-start)?\(", two.as_text())
  assert collectives == ["all-reduce"], collectives
  two = two(*args)
  np.testing.assert_array_equal(two.tokens[:, :NEW], one.tokens)
  np.testing.assert_array_equal(two.ssd.hits, one.ssd.hits)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mesh="no_role"), "'role' axis"),
    (dict(mesh="role3"), "size 2"),
])
def test_bad_mesh_is_rejected_before_compiling(models, batch, kwargs, message):
  target, draft = models
  mesh = (jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]) if kwargs["mesh"] == "no_role"
          else _role_mesh(3))
  before = ssd.TRACE_COUNTS["decode_ssd"]
  with pytest.raises(ValueError, match=message):
    _ssd(target, SSDDrafter(draft), batch, mesh=mesh)
  assert ssd.TRACE_COUNTS["decode_ssd"] == before


def test_bad_budget_fan_out_and_saguaro_are_rejected(models, batch):
  target, draft = models
  with pytest.raises(ValueError, match="budget must be an int >= num_draft \\+ 1 = 4"):
    _ssd(target, SSDDrafter(draft, budget=K), batch)
  with pytest.raises(ValueError, match="fan_out must hold num_draft \\+ 1 = 4"):
    _ssd(target, SSDDrafter(draft, fan_out=(2, 2, 2)), batch)
  for bad in (-0.1, 1.5, float("nan"), True):
    with pytest.raises(ValueError, match="saguaro .*\\[0, 1\\]"):
      SSDDrafter(draft, saguaro=bad)
  with pytest.raises(ValueError, match="needs a specjax.drafters.SSDDrafter"):
    ssd.decode_ssd(target, draft, batch[0], jax.random.key(0), lengths=batch[1])


def test_geometric_fan_out():
  # K = 3, budget 10, a = 0.81, r = 1: weights 0.81^(k/2) = 1, 0.9, 0.81, 0.729 * 2 = 1.458 (sum
  # 4.168); the 6 spare branches split 1.440, 1.296, 1.166, 2.099 -> floors 1, 1, 1, 2 (5), the
  # largest remainder (0.440, k = 0) takes the sixth: F = 1 + (2, 1, 1, 2).
  assert ssd_drafter.geometric_fan_out(3, 10, acceptance=0.81) == (3, 2, 2, 3)
  assert ssd_drafter.geometric_fan_out(3, 4) == (1, 1, 1, 1)
  fan_out = ssd_drafter.geometric_fan_out(7, 24)
  assert sum(fan_out) == 24 and min(fan_out) >= 1 and list(fan_out[:-1]) == sorted(
      fan_out[:-1], reverse=True)
  ks, ranks = ssd_drafter.fan_out_layout((2, 1, 3))
  np.testing.assert_array_equal(ks, [0, 0, 1, 2, 2, 2])
  np.testing.assert_array_equal(ranks, [0, 1, 0, 0, 1, 2])


def test_candidates_exclude_the_rejected_draft():
  # V = 5, K = 2, fan-out (2, 1, 1). Logits after [last], [last, d1], [last, d1, d2].
  logits = jnp.asarray([[[5., 4., 3., 2., 1.], [1., 2., 3., 4., 5.], [0., 9., 8., 0., 0.]]] * 2)
  drafts = jnp.asarray([[0, 4], [0, 4]], jnp.int32)
  k, t = ssd_drafter.candidates(logits, drafts, jnp.asarray([2, 0], jnp.int32), (2, 1, 1))
  # Row 0 drafted: k = 0 excludes d1 = 0 -> tokens 1, 2; k = 1 excludes d2 = 4 -> 3; k = 2 (the
  # bonus) excludes nothing -> 1.
  np.testing.assert_array_equal(k[0], [0, 0, 1, 2])
  np.testing.assert_array_equal(t[0], [1, 2, 3, 1])
  # Row 1 drafted nothing (after a miss): its whole budget at k = 0, nothing excluded.
  np.testing.assert_array_equal(k[1], [0, 0, 0, 0])
  np.testing.assert_array_equal(t[1], [0, 1, 2, 3])


def test_saguaro_q_scales_the_top_tokens():
  logits = jnp.log(jnp.asarray([0.5, 0.3, 0.2]))
  q = np.exp(ssd_drafter.saguaro_log_q(logits, sj.Sampling(temperature=1.0), 1, 0.5))
  # The top token's 0.5 becomes 0.25; renormalised by 0.75: (1/3, 0.4, 0.2667).
  np.testing.assert_allclose(q, [0.25 / 0.75, 0.3 / 0.75, 0.2 / 0.75], rtol=1e-6)
  q = np.exp(ssd_drafter.saguaro_log_q(logits, sj.Sampling(temperature=1.0), 3, 0.0))
  np.testing.assert_allclose(q, [0.5, 0.3, 0.2], rtol=1e-6)  # no mass left: q itself
  q = np.exp(ssd_drafter.saguaro_log_q(logits, sj.Sampling(temperature=1.0), 2, 0.0))
  np.testing.assert_allclose(q, [0.0, 0.0, 1.0], atol=1e-7)
