"""The two-round vocabulary-sharded verify (`specjax.verify.two_rounds`) and the one-gather argmax.

On 8 simulated CPU devices, (1, 8) and (2, 4) meshes (the vocabulary split 8 and 4 ways):

* sampling without top-k or top-p returns the single-device reference's tokens token for token,
  at T = 0.7 and T = 1 (and with a top-k as large as the vocabulary, which keeps every token), with a drafter's logits and with a point-mass drafter, with per-row draft
  counts, on a vocabulary that divides the shards (1,000) and one that is padded (100), in cases
  where rows accept different numbers of drafts (so rejections, residual races and bonus tokens
  all occur);
* greedy decoding (its argmax now one all-gather of each shard's maximum and id) does too;
* what ran is the two-round verify: the lowered program holds exactly two all-gathers and no
  all-reduce (the reduction rule makes one all-reduce per statistic); greedy exactly one gather;
* `combine_argmax` over shards equals `first_argmax` over the whole vocabulary, ties and NaNs
  included.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.core.sampling import first_argmax
from specjax.verify import sharded, two_rounds
from specjax.verify.rule import verify_reference
from tests.verify.test_candidates import _case

SHAPES = [(1, 8), (2, 4)]
SETTINGS = [sj.Sampling(temperature=0.7), sj.Sampling(temperature=1.0)]


def _verify(sampling, shape):
  mesh = sj.make_mesh(shape)
  return jax.jit(lambda c: sharded.sharded_verify(**c, sampling=sampling, mesh=mesh))


def _collectives(sampling, shape, case):
  text = _verify(sampling, shape).lower(case).as_text()
  return (len(re.findall(r'"stablehlo\.all_gather"', text)),
          len(re.findall(r'"stablehlo\.all_reduce"', text)))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("sampling", SETTINGS + [sj.Sampling(temperature=1.0, top_k=1000)],
                         ids=["t0.7", "t1", "t1-topk-the-vocabulary"])
@pytest.mark.parametrize("vocab,with_draft", [(1000, True), (1000, False), (100, True)],
                         ids=["v1000", "v1000-point-mass", "v100-padded"])
def test_equals_the_single_device_rule_in_two_gathers(shape, sampling, vocab, with_draft):
  case = _case(vocab, seed=sum(shape) + vocab, with_draft=with_draft)
  assert two_rounds.uses_two_rounds(sampling, vocab)
  want = verify_reference(**case, sampling=sampling)
  got = _verify(sampling, shape)(case)
  np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  accepted = np.asarray(want.num_accepted)
  assert len(set(accepted.tolist())) > 1  # not degenerate
  assert _collectives(sampling, shape, case) == (2, 0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_greedy_equals_the_single_device_rule_in_one_gather(shape):
  sampling = sj.Sampling()
  for seed, vocab in ((0, 1000), (1, 100)):
    case = _case(vocab, seed=seed)
    # Ties across shards: row 0's first position has its maximum at two ids in different slices.
    case["target_logits"] = case["target_logits"].at[0, 0, [vocab - 1, 3]].set(50.0)
    want = verify_reference(**case, sampling=sampling)
    got = _verify(sampling, shape)(case)
    np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
    np.testing.assert_array_equal(got.tokens, want.tokens)
  assert _collectives(sampling, shape, case) == (1, 0)


def test_truncated_sampling_does_not_use_two_rounds():
  assert not two_rounds.uses_two_rounds(sj.Sampling(), 1000)
  assert not two_rounds.uses_two_rounds(sj.Sampling(temperature=1.0, top_k=50), 1000)
  assert not two_rounds.uses_two_rounds(sj.Sampling(temperature=1.0, top_p=0.9), 1000)
  assert two_rounds.uses_two_rounds(sj.Sampling(temperature=1.0, top_k=1000), 1000)
  assert two_rounds.uses_two_rounds(sj.Sampling(temperature=1.0, top_p=1.0), 1000)
  with pytest.raises(ValueError, match="without top-k"):
    two_rounds.two_round_verify(None, None, jnp.zeros((1, 2), jnp.int32),
                                sampling=sj.Sampling(temperature=1.0, top_k=5), seeds=None,
                                positions=None, axes=("model",), vocab=1000, offset=0,
                                local=None)


@pytest.mark.parametrize("shards", [1, 4, 10])
def test_combine_argmax_equals_first_argmax(shards):
  rng = np.random.default_rng(shards)
  x = rng.integers(0, 4, size=(64, 40)).astype(np.float32)  # many ties
  x[3, [5, 33]] = np.nan
  x[7, :] = -np.inf
  x[9, 20] = np.nan
  per = x.reshape(64, shards, 40 // shards)
  local = np.asarray(first_argmax(jnp.asarray(per)))  # [64, S] first id inside each slice
  values = np.take_along_axis(per, local[..., None], axis=-1)[..., 0]
  ids = local + np.arange(shards) * (40 // shards)
  got = two_rounds.combine_argmax(jnp.asarray(values), jnp.asarray(ids, jnp.int32))
  np.testing.assert_array_equal(got, first_argmax(jnp.asarray(x)))
