"""The one-round vocabulary-sharded verify (`specjax.verify.candidates`) under top-k sampling and
under top-p alone.

On 8 simulated CPU devices, (1, 8) and (2, 4) meshes (the vocabulary split 8 and 4 ways):

* it returns the single-device reference's tokens token for token, at T = 0.7 with top-k 20 and
  top-p 0.9, at T = 1 with top-k 5, and with top-p alone (0.9 at T = 0.7, 0.8 at T = 1: each
  shard sends its 65 most likely tokens and its slice's normalizer), with a drafter's logits and with a point-mass drafter,
  with per-row draft counts, on a vocabulary that divides the shards (1,000) and one that is
  padded (100: each shard sends its whole slice);
* the candidate branch is the one that ran: the same call with a poisoned fallback (every row's
  count -1) still equals the reference;
* a row whose logits are all equal (every shard holds more tied tokens at the threshold than it
  sends; under top-p alone, a nucleus larger than what a shard sends) takes the fallback (the poisoned one shows), and the real fallback equals the reference;
* the compiled candidate branch holds all-gathers and no all-reduce (the threshold search's
  collectives are gone), and greedy decoding does not use it.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.loop import row_seeds
from jax.sharding import PartitionSpec as P
from specjax.core.sampling import VerifyResult, warp_logits
from specjax.verify import candidates, sharded
from specjax.verify.rule import verify_reference

SHAPES = [(1, 8), (2, 4)]
SETTINGS = [sj.Sampling(temperature=0.7, top_k=20, top_p=0.9),
            sj.Sampling(temperature=1.0, top_k=5)]
NUCLEUS = [sj.Sampling(temperature=0.7, top_p=0.9), sj.Sampling(temperature=1.0, top_p=0.8)]


def _case(vocab, seed=0, batch=8, k=5, with_draft=True):
  rng = np.random.default_rng(seed)
  target = jnp.asarray(rng.normal(size=(batch, k + 1, vocab)) * 3, jnp.float32)
  draft = target[:, :k] + jnp.asarray(rng.normal(size=(batch, k, vocab)) * 0.3, jnp.float32)
  noise = jnp.asarray(rng.gumbel(size=(batch, k, vocab)), jnp.float32)
  tokens = jnp.argmax(warp_logits(draft, SETTINGS[0]) + noise, axis=-1).astype(jnp.int32)
  return dict(target_logits=target, draft_logits=draft if with_draft else None,
              draft_tokens=tokens, seeds=row_seeds(jax.random.key(seed), batch),
              positions=jnp.asarray(rng.integers(0, 50, size=batch), jnp.int32),
              num_drafted=jnp.asarray(rng.integers(0, k + 1, size=batch), jnp.int32))


def _sharded(case, sampling, shape):
  mesh = sj.make_mesh(shape)
  return jax.jit(lambda c: sharded.sharded_verify(**c, sampling=sampling, mesh=mesh))(case)


def _poisoned(monkeypatch):
  """Wrap the fallback so that its counts are all -1: where it runs, it shows."""
  original = sharded._candidate_rule

  def patched(*args, fallback, **kwargs):
    def poisoned(*a, **k):
      result = fallback(*a, **k)
      return VerifyResult(jnp.full_like(result.num_accepted, -1), result.tokens)
    return original(*args, fallback=poisoned, **kwargs)

  monkeypatch.setattr(sharded, "_candidate_rule", patched)


def _sampling_params():
  """Every sampling on the (2, 4) mesh in CI's costly step; on (1, 8), one top-k and one top-p
  setting there and the other two under `-m slow` (CI's time budget)."""
  ids = ["t0.7-topk20-topp0.9", "t1-topk5", "t0.7-topp0.9", "t1-topp0.8"]
  params = []
  for shape in SHAPES:
    for index, (sampling, name) in enumerate(zip(SETTINGS + NUCLEUS, ids)):
      slow = shape == (1, 8) and index in (1, 3)
      params.append(pytest.param(shape, sampling, id=f"{name}-{shape}",
                                 marks=pytest.mark.slow if slow else pytest.mark.costly))
  return params


@pytest.mark.parametrize("shape, sampling", _sampling_params())
@pytest.mark.parametrize("vocab,with_draft", [(1000, True), (1000, False), (100, True)],
                         ids=["v1000", "v1000-point-mass", "v100-padded"])
def test_equals_the_single_device_rule_and_runs_the_candidate_branch(shape, sampling, vocab,
                                                                     with_draft, monkeypatch):
  case = _case(vocab, seed=sum(shape) + vocab, with_draft=with_draft)
  want = verify_reference(**case, sampling=sampling)
  assert candidates.uses_candidates(sampling, vocab)
  _poisoned(monkeypatch)
  got = _sharded(case, sampling, shape)
  np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  if with_draft:  # the case is not degenerate: rows accept different numbers of drafts
    assert len(set(np.asarray(want.num_accepted).tolist())) > 1


@pytest.mark.parametrize("sampling", [SETTINGS[0], NUCLEUS[0]], ids=["topk", "topp"])
def test_ties_at_the_threshold_take_the_fallback(sampling, monkeypatch):
  case = _case(1000, seed=3)
  case["target_logits"] = case["target_logits"].at[0].set(0.0)  # row 0: every token tied
  want = verify_reference(**case, sampling=sampling)
  np.testing.assert_array_equal(_sharded(case, sampling, (1, 8)).tokens, want.tokens)
  _poisoned(monkeypatch)
  assert (np.asarray(_sharded(case, sampling, (1, 8)).num_accepted) == -1).all()


@pytest.mark.parametrize("sampling", [SETTINGS[0], NUCLEUS[0]], ids=["topk", "topp"])
def test_the_candidate_branch_gathers_once_and_reduces_nothing(sampling):
  """Lowered on its own (a fallback without collectives), the candidate branch makes exactly one
  collective, an all-gather of the packed ids, p, q and per-shard (K + 1)-th logits, and no
  all-reduce (the threshold search over the slices had one per radix round). One, not one per
  array: separate independent gathers inside one `shard_map` deadlocked on 8 CPU devices under
  load (tests/parallel/test_mesh.py's stream test aborted in a rendezvous)."""
  case = _case(1000, seed=5)
  mesh = sj.make_mesh((1, 8))

  def local(target, draft, tokens, seeds, positions, counts):
    offset = jax.lax.axis_index("model").astype(jnp.int32) * target.shape[-1]
    def none(*args, **kwargs):
      del args, kwargs
      return VerifyResult(jnp.zeros(tokens.shape[:1], jnp.int32),
                          jnp.zeros((tokens.shape[0], tokens.shape[1] + 1), jnp.int32))

    result = candidates.candidate_verify(
        target, draft, tokens, sampling=sampling, seeds=seeds, positions=positions,
        num_drafted=counts, axes=("model",), vocab=1000, offset=offset, fallback=none)
    return result.num_accepted, result.tokens

  run = jax.shard_map(local, mesh=mesh, in_specs=(P(None, None, "model"),) * 2 + (P(),) * 4,
                      out_specs=(P(), P()), check_vma=False)
  text = jax.jit(run).lower(case["target_logits"], case["draft_logits"], case["draft_tokens"],
                            case["seeds"], case["positions"], case["num_drafted"]).as_text()
  gathers = len(re.findall(r'"stablehlo\.all_gather"', text))
  reduces = len(re.findall(r'"stablehlo\.all_reduce"', text))
  assert gathers == 1 and reduces == 0, (gathers, reduces)


def test_greedy_and_untruncated_sampling_do_not_use_candidates():
  assert not candidates.uses_candidates(sj.Sampling(), 1000)
  assert not candidates.uses_candidates(sj.Sampling(temperature=1.0), 1000)
  assert not candidates.uses_candidates(sj.Sampling(temperature=1.0, top_p=1.0), 1000)
  assert not candidates.uses_candidates(sj.Sampling(temperature=1.0, top_k=999), 1000)
  assert candidates.uses_candidates(sj.Sampling(temperature=1.0, top_k=50), 1000)
  assert candidates.uses_candidates(sj.Sampling(temperature=1.0, top_p=0.9), 1000)
  assert candidates.uses_candidates(sj.Sampling(temperature=1.0, top_k=1000, top_p=0.9), 1000)


def _long_tail_case(seed=11, batch=64, k=2, vocab=16000, head=40):
  """Logits whose nucleus (top-p 0.8 at T = 1) lies in 40 head tokens (about 5 a shard) while a
  tail of 15,960 tokens holds a tenth of the mass; a shard sends at most 5 * 66 of its 2,000."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(batch, 2 * k + 1, vocab)) * 0.1
  for row in logits.reshape(-1, vocab):
    row[rng.choice(vocab, head, replace=False)] = 8.3 + rng.normal(size=head)
  target = jnp.asarray(logits[:, :k + 1], jnp.float32)
  draft = jnp.asarray(logits[:, k + 1:], jnp.float32)
  tokens = jnp.argmax(draft + jnp.asarray(rng.gumbel(size=draft.shape), jnp.float32), axis=-1)
  return dict(target_logits=target, draft_logits=draft, draft_tokens=tokens.astype(jnp.int32),
              seeds=row_seeds(jax.random.key(seed), batch),
              positions=jnp.asarray(rng.integers(0, 50, size=batch), jnp.int32),
              num_drafted=jnp.full((batch,), k, jnp.int32))


def test_top_p_alone_counts_the_mass_no_shard_sends(monkeypatch):
  """The nucleus's needed mass is top-p times the whole vocabulary's (from every slice's
  normalizer), not the candidates': on a long tail the candidate branch (fallback poisoned) still
  equals the reference. (A rule that took the candidates' sum for the whole mass returns other
  tokens here: 5 of the 192 differed when tried; 64 rows, so that the test can see it.)"""
  sampling = sj.Sampling(temperature=1.0, top_p=0.8)
  case = _long_tail_case()
  x = case["target_logits"]
  top = jnp.max(x, axis=-1, keepdims=True)
  kept = np.asarray(jax.lax.top_k(x.reshape(x.shape[:2] + (8, -1)), 66)[0])  # what shards send
  share = jnp.exp(jnp.asarray(kept) - top[..., None]).sum((-1, -2)) / jnp.exp(x - top).sum(-1)
  assert float(share.mean()) < 0.97  # the unsent tail holds several percent of the mass
  nucleus = (np.asarray(warp_logits(x, sampling)) > -np.inf).sum(-1)
  assert 1 < nucleus.min() and nucleus.max() < 40  # inside the head, so inside what is sent
  want = verify_reference(**case, sampling=sampling)
  _poisoned(monkeypatch)
  got = _sharded(case, sampling, (1, 8))
  np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
  np.testing.assert_array_equal(got.tokens, want.tokens)
