"""Sampled decoding with a DFlash drafter reproduces the target's law, and the test can tell.

The harness of tests/exactness/test_exactness.py: a tiny target over an 8-token vocabulary
generates 3 tokens for N = 20,000 copies of one prompt (each row its own random stream, seeded);
the joint distribution of the 3 tokens (512 cells) is compared with the target's exact
distribution, enumerated from its own logits with an independent float64 NumPy implementation of
temperature / top-k / top-p. Pooled chi-square; a correct drafter must pass at ALPHA = 1e-3, at
T = 1 and at T = 0.7 with top-k 5 / top-p 0.9. The DFlash drafter has random weights (its
marginals far from p) and reads the target's layers 0 and 1 (the last: its final normed state).

Three proposal modes: the sampled chain (`x_i ~ q_i`, `q_i` handed to the verify), the argmax
chain (point mass) and DDTree trees (sample-then-match).

Broken twins, which must fail the same test at the same N with p < POWER_ALPHA = 1e-6 (draft
noise that shares the verifier's stream, the bias vLLM's probabilistic DFlash had):

* chain: each draft is drawn from its own `q_i` (by inverse CDF, so its law is exactly `q_i`),
  but with the very uniform the ratio test then uses for that position (`PURPOSE_ACCEPT`);
* DDTree: each node's token is drawn from its depth's marginal with the Gumbel noise of the
  target's own sample at that node (`PURPOSE_TREE_SAMPLE`, same position, same node index), so
  that whether the walk reaches a node and what the target samples there are correlated.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.core.sampling import PURPOSE_ACCEPT, first_argmax, gumbel, uniform, warp_logits
from specjax.drafters import DFlashDrafter
from specjax.drafters.dflash import network as dflash
from specjax.drafters.dflash.checkpoint import target_tables
from specjax.drafters.dflash.tree import DFlashTreeDrafter
from specjax.testing.models import tiny_config
from specjax.trees.structure import PURPOSE_TREE_SAMPLE, Tree
from tests.exactness.test_exactness import (ALPHA, N, NEW, POWER_ALPHA, PROMPT, VOCAB,
                                            chi_square_pvalue, exact_joint)

SETTINGS = {
    "t1": sj.Sampling(temperature=1.0),
    "t0.7_topk5_topp0.9": sj.Sampling(temperature=0.7, top_k=5, top_p=0.9),
}
NUM_DRAFT = 2
DDTREE = sj.TreeSpec(builder="ddtree", depth=2, width=3, num_nodes=6)


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=VOCAB), jax.random.key(10))


def make_drafter(target, mode="sampled", cls=DFlashDrafter):
  config = dflash.DFlashConfig(embed_dim=32, num_layers=1, num_heads=4, num_kv_heads=2,
                               head_dim=8, mlp_dim=64, vocab_size=VOCAB, block_size=4,
                               mask_token_id=VOCAB - 1, target_layer_ids=(0, 1),
                               num_target_layers=2)
  embed, head = target_tables(target)
  # Seed 7: its first marginal overlaps p (sum min(p, q) about 0.8, p(argmax q) about 0.4-0.5)
  # so that every rule is exercised both ways; its later marginals are random.
  return cls(dflash.init_network(config, jax.random.key(7), scale=0.3), embed, head, mode=mode)


def run(target, drafter, sampling, *, tree=None, seed=0):
  tokens = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (N, 1))
  shape = dict(num_draft=NUM_DRAFT) if tree is None else dict(tree=tree)
  out = sj.decode(target, drafter, tokens, jax.random.key(seed), max_new_tokens=NEW,
                  sampling=sampling, **shape)
  assert np.all(np.asarray(out.num_tokens) == NEW)
  return np.asarray(out.tokens), out.stats.summary()


def pvalue(target, drafter, name, **kwargs):
  sampling = SETTINGS[name]
  tokens, summary = run(target, drafter, sampling, **kwargs)
  p = chi_square_pvalue(tokens, exact_joint(target, sampling))
  print(f"{type(drafter).__name__} {name}: p = {p:.3g}, tau {summary['tokens_per_round']:.3f}, "
        f"acceptance {summary['acceptance_rate']:.3f}")
  return p, summary


# ---------------------------------------------------------------------------------------------
# Broken twins (test-only).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AcceptStreamDFlash(DFlashDrafter):
  """Draws `x_i ~ warp(q_i)` by inverse CDF with the ratio test's own uniform of position
  `L + i` (`PURPOSE_ACCEPT`) and hands `q_i` to the verify: right marginal law, shared stream."""

  def draft(self, logits, sampling, seeds, lengths):
    if sampling.greedy:
      return super().draft(logits, sampling, seeds, lengths)
    positions = lengths[:, None] + jnp.arange(logits.shape[1], dtype=jnp.int32)[None]
    u = uniform(seeds[:, None], positions, 0, PURPOSE_ACCEPT)  # [B, k], as the verify draws it
    probs = jax.nn.softmax(warp_logits(logits, sampling), axis=-1)
    below = jnp.cumsum(probs, axis=-1) <= u[..., None]
    tokens = jnp.minimum(jnp.sum(below, axis=-1), logits.shape[-1] - 1).astype(jnp.int32)
    return tokens, logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleStreamDDTree(DFlashTreeDrafter):
  """A DDTree whose node tokens are drawn from their depth's marginal with the Gumbel noise the
  verify uses to sample the target at that very node (`PURPOSE_TREE_SAMPLE`)."""

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, guide=None):
    state, tree = super().propose(state, sequence, lengths, num_draft=num_draft,
                                  sampling=sampling, seeds=seeds, guide=guide)
    if sampling.greedy:
      return state, tree
    marginals = self.marginals(state, sequence, lengths)  # [B, D, V]
    q = jnp.take_along_axis(marginals, (tree.depths - 1)[..., None], axis=1)  # [B, N, V]
    nodes = jnp.arange(1, tree.num_nodes + 1, dtype=jnp.int32)[None, :, None]
    vocab = jnp.arange(q.shape[-1], dtype=jnp.int32)
    noise = gumbel(seeds[:, None, None], (lengths[:, None] + tree.depths)[..., None], nodes, 0,
                   vocab, PURPOSE_TREE_SAMPLE)
    tokens = first_argmax(warp_logits(q, sampling) + noise).astype(jnp.int32)
    return state, Tree(tokens, tree.parents, tree.depths, tree.valid)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleStreamSource(DFlashDrafter):
  """A DFlash drafter whose trees are `SampleStreamDDTree`s."""

  def tree_drafter(self, target, spec):
    return SampleStreamDDTree(self, spec)


def ddtree_twin(target):
  return make_drafter(target, "argmax", SampleStreamSource)


# ---------------------------------------------------------------------------------------------
# Correct modes pass (CI's costly step: the sampled chain at T = 0.7 with top-k / top-p, DDTree at
# T = 1 and the chain twin at T = 1; every other setting and the DDTree twin under `-m slow`).


@pytest.mark.costly
@pytest.mark.parametrize("name", [pytest.param("t1", marks=pytest.mark.slow),
                                  "t0.7_topk5_topp0.9"])
def test_sampled_chain_matches_target_distribution(target, name):
  p, summary = pvalue(target, make_drafter(target, "sampled"), name)
  assert 0.05 < summary["acceptance_rate"] < 0.95  # the ratio test is exercised both ways
  assert p > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_argmax_chain_matches_target_distribution(target, name):
  p, summary = pvalue(target, make_drafter(target, "argmax"), name)
  assert 0.05 < summary["acceptance_rate"] < 0.95
  assert p > ALPHA


@pytest.mark.costly
@pytest.mark.parametrize("name", ["t1", pytest.param("t0.7_topk5_topp0.9",
                                                     marks=pytest.mark.slow)])
def test_ddtree_matches_target_distribution(target, name):
  p, summary = pvalue(target, make_drafter(target, "argmax"), name, tree=DDTREE)
  assert summary["accepted"] > 0.05 * summary["rounds"]
  assert p > ALPHA


# ---------------------------------------------------------------------------------------------
# The broken twins fail the same test at the same N.


@pytest.mark.costly
@pytest.mark.parametrize("name", ["t1", pytest.param("t0.7_topk5_topp0.9",
                                                     marks=pytest.mark.slow)])
def test_chain_draft_sharing_the_accept_stream_is_detected(target, name):
  p, _ = pvalue(target, make_drafter(target, "sampled", AcceptStreamDFlash), name)
  assert p < POWER_ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_ddtree_nodes_sharing_the_target_sample_stream_are_detected(target, name):
  p, _ = pvalue(target, ddtree_twin(target), name, tree=DDTREE)
  assert p < POWER_ALPHA
