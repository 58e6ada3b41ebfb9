"""SSD (`specjax.decode` with a `specjax.drafters.SSDDrafter`, `specjax.loop.ssd`): greedy
identity with `generate` at hit and at miss on ragged batches, on one device and split by role over
2 CPU devices (the same tokens, one collective in the program), `decode_ssd` (the earlier entry
point) equal to the routed call, the fan-out, the candidates, Saguaro's q, and the bad-input
errors before anything is traced.

Models: tiny random transformers over V = 64 (`specjax.testing.harness`): the target, and a noisy
copy of it (relative noise 0.07 on every weight) as the draft, which is accepted often and
rejected every few tokens, so outcomes of every length happen and some miss the outcome cache.
"""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import SSDDrafter
from specjax.drafters import ssd as ssd_drafter
from specjax.loop import ssd
from specjax.testing import harness, ssd_variants

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
  return sj.decode(target, drafter, tokens, jax.random.key(0), lengths=lengths,
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


def test_decode_routes_ssd_and_decode_ssd_is_the_same_call(models, batch):
  target, draft = models
  tokens, lengths = batch
  ref = _generate(target, batch)
  drafter = SSDDrafter(draft, budget=6)
  routed = _ssd(target, drafter, batch)
  assert isinstance(routed, sj.DecodeOutput) and isinstance(routed, ssd.SSDOutput)
  np.testing.assert_array_equal(routed.tokens, ref.tokens)
  np.testing.assert_array_equal(routed.num_tokens, ref.num_tokens)
  assert routed.logprobs is None
  earlier = ssd.decode_ssd(target, drafter, tokens, jax.random.key(0), lengths=lengths,
                           max_new_tokens=NEW, num_draft=K)
  np.testing.assert_array_equal(earlier.tokens, routed.tokens)
  np.testing.assert_array_equal(earlier.ssd.hits, routed.ssd.hits)
  np.testing.assert_array_equal(earlier.ssd.outcomes, routed.ssd.outcomes)
  np.testing.assert_array_equal(earlier.stats.rounds, routed.stats.rounds)
  assert 0 < np.asarray(routed.ssd.hits).sum() < np.asarray(routed.ssd.outcomes).sum()


def test_role_split_gives_the_single_device_tokens_with_one_collective(models, batch):
  target, draft = models
  tokens, lengths = batch
  mesh = _role_mesh()
  ref = _generate(target, batch)
  # Greedy, through decode_ssd's mesh= (the earlier spelling of SSDDrafter(mesh=)).
  split = ssd.decode_ssd(target, SSDDrafter(draft, budget=K + 1), tokens, jax.random.key(0),
                         lengths=lengths, max_new_tokens=NEW, num_draft=K, mesh=mesh)
  np.testing.assert_array_equal(split.tokens, ref.tokens)
  assert 0 < np.asarray(split.ssd.hits).sum() < np.asarray(split.ssd.outcomes).sum()
  # Sampled, with Saguaro sampling, through specjax.decode with the drafter's mesh: the split's
  # tokens are the one-device tokens, and its compiled program (specjax.precompile: the program
  # the call runs) holds one collective (the round's exchange).
  sampling = sj.Sampling(temperature=0.7, top_k=16, top_p=0.9)
  drafter = SSDDrafter(draft, budget=6, saguaro=0.5)
  one = _ssd(target, drafter, batch, sampling=sampling)
  on_roles = SSDDrafter(draft, budget=6, saguaro=0.5, mesh=mesh)
  compiled = sj.precompile(sj.decode, target, on_roles, tokens, jax.random.key(0),
                           lengths=lengths, max_new_tokens=NEW, num_draft=K, sampling=sampling)
  collectives = re.findall(r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute|"
                           r"reduce-scatter)(?:-start)?\(", compiled.as_text())
  assert collectives == ["all-reduce"], collectives
  traces = ssd.TRACE_COUNTS["decode_ssd"]
  two = _ssd(target, on_roles, batch, sampling=sampling)
  assert ssd.TRACE_COUNTS["decode_ssd"] == traces  # the precompiled program
  np.testing.assert_array_equal(two.tokens, one.tokens)
  np.testing.assert_array_equal(two.ssd.hits, one.ssd.hits)


@pytest.mark.parametrize("make_mesh, message", [
    (lambda: jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]), "'role' axis"),
    (lambda: _role_mesh(3), "size 2"),
    (lambda: "role", "must be a jax.sharding.Mesh"),
])
def test_bad_mesh_is_rejected_when_the_drafter_is_built(models, batch, make_mesh, message):
  target, draft = models
  tokens, lengths = batch
  with pytest.raises(ValueError, match=message):
    SSDDrafter(draft, mesh=make_mesh())
  before = ssd.TRACE_COUNTS["decode_ssd"]
  with pytest.raises(ValueError, match=message):  # decode_ssd's mesh= checks the same
    ssd.decode_ssd(target, SSDDrafter(draft), tokens, jax.random.key(0), lengths=lengths,
                   max_new_tokens=NEW, num_draft=K, mesh=make_mesh())
  assert ssd.TRACE_COUNTS["decode_ssd"] == before


@pytest.mark.parametrize("kwargs, message", [
    (dict(tree=sj.TreeSpec("static", depth=3, width=2)), "does not support tree="),
    (dict(constraint="[0-9]+"), "does not support constraint="),
    (dict(verify_widths=(2,)), "does not support verify_widths="),
    (dict(verify_impl="kernel"), "verify_impl must be 'auto' or 'reference'"),
    (dict(return_logprobs=True), "does not return log-probabilities"),
    (dict(num_draft=7), "budget must be an int >= num_draft \\+ 1 = 8"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_unsupported_decode_options_are_rejected_before_tracing(models, batch, kwargs, message):
  target, draft = models
  tokens, lengths = batch
  call = dict(lengths=lengths, max_new_tokens=NEW, num_draft=K) | kwargs
  before = dict(ssd.TRACE_COUNTS)
  with pytest.raises(ValueError, match=message):
    sj.decode(target, SSDDrafter(draft, budget=6), tokens, jax.random.key(0), **call)
  with pytest.raises(ValueError, match=message):
    sj.precompile(sj.decode, target, SSDDrafter(draft, budget=6), tokens, jax.random.key(0),
                  **call)
  assert dict(ssd.TRACE_COUNTS) == before


def test_other_entry_points_and_mixed_meshes_are_rejected(models, batch):
  target, draft = models
  tokens, lengths = batch
  with pytest.raises(ValueError, match="decode_stream does not run an SSDDrafter"):
    next(sj.decode_stream(target, SSDDrafter(draft), tokens, jax.random.key(0), lengths=lengths))
  on_roles = SSDDrafter(draft, mesh=_role_mesh())
  other = jax.make_mesh((2,), ("role",), devices=jax.devices()[2:4])
  with pytest.raises(ValueError, match="differs from the SSDDrafter's own mesh"):
    ssd.decode_ssd(target, on_roles, tokens, jax.random.key(0), lengths=lengths, mesh=other)


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


def test_the_broken_twins_live_behind_specjax_testing(models, batch):
  assert "variant" not in inspect.signature(sj.decode).parameters
  assert "variant" not in inspect.signature(ssd.decode_ssd).parameters
  target, draft = models
  tokens, lengths = batch
  call = dict(lengths=lengths, max_new_tokens=NEW, num_draft=K)
  drafter = SSDDrafter(draft, budget=K + 1)
  with pytest.raises(ValueError, match="variant must be one of"):
    ssd_variants.decode_ssd_variant(target, drafter, tokens, jax.random.key(0), variant="exact",
                                    **call)
  # The twin runs: keyed by k alone, every lookup finds a branch (more hits than the exact key's,
  # which misses with this draft), and greedy it still emits the target's tokens.
  exact = _ssd(target, drafter, batch)
  k_only = ssd_variants.decode_ssd_variant(target, drafter, tokens, jax.random.key(0),
                                           variant="k_only", **call)
  np.testing.assert_array_equal(k_only.tokens, _generate(target, batch).tokens)
  np.testing.assert_array_equal(k_only.ssd.hits, k_only.ssd.outcomes)
  assert np.asarray(exact.ssd.hits).sum() < np.asarray(exact.ssd.outcomes).sum()


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
