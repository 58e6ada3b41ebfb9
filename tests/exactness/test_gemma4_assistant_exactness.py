"""Sampled decoding with a Gemma 4 assistant reproduces the target's law, and the test can tell.

The harness of tests/exactness/test_exactness.py: a tiny Gemma 4 target over an 8-token
vocabulary (window and global layers of different head widths, two KV-shared layers, per-layer
embeddings, layer scalars) generates 3 tokens for N = 20,000 copies of one prompt (each row its
own seeded random stream); the joint law of the 3 tokens (512 cells) is compared with the
target's exact law, enumerated from its own logits in float64 (pooled chi-square, pass at
ALPHA = 1e-3), at T = 1 and at T = 0.7 with top-k 5 / top-p 0.9. The assistant has random
weights and ordered embeddings (4 centroids of 2 tokens, the top 2 kept): each draft step's q is
0 on half the vocabulary, which only the residual can emit.

Broken twin, which must fail at p < POWER_ALPHA = 1e-6: drafts drawn from the masked law, but
the verify handed the assistant's unmasked law of the same steps (the q of another distribution
than the one the draft came from).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import Gemma4AssistantDrafter
from specjax.drafters.gemma4_assistant import network as assistant
from specjax.models.config import ModelConfig, RopeScaling
from tests.exactness.test_exactness import (ALPHA, N, NEW, POWER_ALPHA, PROMPT, VOCAB,
                                            chi_square_pvalue, exact_joint)

SETTINGS = {
    "t1": sj.Sampling(temperature=1.0),
    "t0.7_topk5_topp0.9": sj.Sampling(temperature=0.7, top_k=5, top_p=0.9),
}
NUM_DRAFT = 2
ROPE = RopeScaling(kind="proportional", factor=1.0, partial_rotary_factor=0.5)


@pytest.fixture(scope="module")
def target():
  config = ModelConfig(
      vocab_size=VOCAB, embed_dim=16, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
      mlp_dim=32, max_len=64, rope_theta=10_000.0, rope_scaling=ROPE, rope_local_theta=100.0,
      activation="gelu_tanh", tie_embeddings=True, scale_embeddings=True, qk_norm=True,
      post_norms=True, query_pre_attn_scalar=1.0, sliding_window=3, sliding_window_pattern=2,
      global_head_dim=16, global_kv_heads=1, v_norm=True, kv_shared_layers=2,
      per_layer_input_dim=4, per_layer_vocab_size=VOCAB, layer_scalar=True,
      final_logit_softcap=30.0, family="gemma4_text")
  return sj.init_params(config, jax.random.key(10))


def make_drafter(target, cls=Gemma4AssistantDrafter):
  tc = target.config
  config = assistant.AssistantConfig(
      vocab_size=VOCAB, embed_dim=16, backbone_dim=tc.embed_dim, num_heads=4,
      layer_global=(False, True), head_dim=8, global_head_dim=16, mlp_dim=32, num_kv_heads=2,
      global_kv_heads=1, sliding_window=3, rope_local_theta=100.0, rope_theta=10_000.0,
      rope_scaling=ROPE, ordered_embeddings=True, num_centroids=4, centroid_top_k=2)
  network = assistant.init_network(config, jax.random.key(7))
  sources = (tc.kv_store_layer(True), tc.kv_store_layer(False))
  return cls(network, target.params["embed"], sources)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnmaskedQ(Gemma4AssistantDrafter):
  """Drafts from the masked (ordered-embedding) law, hands the verify the unmasked law of the
  same steps (teacher-forced on the drawn drafts)."""

  def chain(self, state, sequence, lengths, num_draft, sampling, seeds):
    tokens, masked = super().chain(state, sequence, lengths, num_draft, sampling, seeds)
    if sampling.greedy:
      return tokens, masked
    config = dataclasses.replace(self.network.config, ordered_embeddings=False)
    full = dataclasses.replace(self.network, config=config)
    kv, visible = self.step_inputs(state)
    token = jnp.take_along_axis(sequence, (lengths - 1)[:, None], axis=1)[:, 0]
    hidden, logits = state.hidden, []
    for j in range(num_draft):
      step, hidden, _ = assistant.assistant_step(full, self.embed(token), hidden, lengths - 1,
                                                 kv, visible)
      logits.append(step)
      token = tokens[:, j]
    return tokens, jnp.stack(logits, axis=1)


def pvalue(target, drafter, name):
  sampling = SETTINGS[name]
  tokens = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (N, 1))
  out = sj.decode(target, drafter, tokens, jax.random.key(0), max_new_tokens=NEW,
                  num_draft=NUM_DRAFT, sampling=sampling)
  assert np.all(np.asarray(out.num_tokens) == NEW)
  summary = out.stats.summary()
  p = chi_square_pvalue(np.asarray(out.tokens), exact_joint(target, sampling))
  print(f"{type(drafter).__name__} {name}: p = {p:.3g} (N = {N}), tau "
        f"{summary['tokens_per_round']:.3f}, acceptance {summary['acceptance_rate']:.3f}")
  return p, summary


@pytest.mark.costly
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_assistant_matches_target_distribution(target, name):
  p, summary = pvalue(target, make_drafter(target), name)
  # The ratio test is exercised both ways (the random assistant is far from the target: about 2%
  # of its drafts are accepted at T = 1).
  assert 0.01 < summary["acceptance_rate"] < 0.95
  assert p > ALPHA


@pytest.mark.costly
def test_unmasked_q_twin_is_rejected(target):
  p, _ = pvalue(target, make_drafter(target, UnmaskedQ), "t1")
  assert p < POWER_ALPHA
