"""DFlash training: the training forward is the decode forward, and the loss can be minimised.

* Consistency: for every anchor `a`, the logits `dflash_loss` trains on equal the logits the
  drafter computes at decode time (`DFlashDrafter.init` on the first `a + 1` tokens, then
  `block_logits`: context entries of positions `< a`, the block `[token_a, MASK ..]`), to float32
  rounding; and the loss is the weighted cross-entropy of those logits, recomputed here in NumPy.
* A few AdamW steps on one fixed batch lower the loss (the gradients reach every weight).

The first runs in CI's costly step, the second under `-m slow`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import specjax as sj
from specjax.drafters import DFlashDrafter
from specjax.drafters.dflash import network as dflash
from specjax.drafters.dflash.checkpoint import target_tables
from specjax.loop.state import target_features
from specjax.testing.models import tiny_config
from specjax.training.dflash import block_weights, dflash_loss, init_from_target

VOCAB, BLOCK, GAMMA = 32, 4, 2.0


def _setup():
  target = sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=3), jax.random.key(0))
  config = dflash.DFlashConfig(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=8, mlp_dim=64, vocab_size=VOCAB, block_size=BLOCK,
                               mask_token_id=VOCAB - 1, target_layer_ids=(0, 2),
                               num_target_layers=3)
  network = init_from_target(config, target, jax.random.key(1))
  network = dflash.DFlashNetwork(jax.tree.map(
      lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape), network.params), config)
  tokens = jax.random.randint(jax.random.key(3), (2, 12), 1, VOCAB - 1).astype(jnp.int32)
  return target, network, tokens


def _batch(target, network, tokens, anchors):
  drafter = DFlashDrafter(network, *target_tables(target))
  out = target(tokens, jnp.zeros((tokens.shape[0],), jnp.int32), None,
               **target_features(drafter))
  features = dflash.gather_features(network.config, out.taps, out.hidden)
  anchors = jnp.asarray(anchors, jnp.int32)
  inside = (np.asarray(anchors)[..., None] + np.arange(1, BLOCK)) < tokens.shape[1]
  weights = jnp.asarray(inside * block_weights(BLOCK, GAMMA), jnp.float32)
  return drafter, {"features": features, "tokens": tokens, "anchors": anchors,
                   "weights": weights}


@pytest.mark.costly
def test_training_logits_are_the_decode_logits():
  target, network, tokens = _setup()
  anchors = [[0, 4, 9, 10], [2, 3, 7, 11]]
  drafter, batch = _batch(target, network, tokens, anchors)
  embed, head = target_tables(target)
  loss, _ = dflash_loss(network.params, network.config, embed, head, batch)
  # The loss recomputed from decode-time logits, in NumPy: one decode-time state per anchor
  # (a row holding the first a + 1 tokens), all in one batch.
  rows = [row for row in range(2) for _ in anchors[row]]
  flat = [a for row in range(2) for a in anchors[row]]
  prefixes = tokens[jnp.asarray(rows)]
  lengths = jnp.asarray(flat, jnp.int32) + 1
  out = target(prefixes, jnp.zeros_like(lengths), None, **target_features(drafter))
  state = drafter.init(prefixes, lengths, prefixes.shape[1] + BLOCK, out)
  logits = np.asarray(drafter.block_logits(state, prefixes, lengths), np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # [R*M, B - 1, V]
  w = np.asarray(batch["weights"]).reshape(len(flat), BLOCK - 1)
  total, weight = 0.0, 0.0
  for i, (row, a) in enumerate(zip(rows, flat)):
    for k in range(1, BLOCK):
      if w[i, k - 1] > 0:
        total -= w[i, k - 1] * logp[i, k - 1, int(tokens[row, a + k])]
        weight += w[i, k - 1]
  np.testing.assert_allclose(float(loss), total / weight, rtol=1e-5)


@pytest.mark.slow
def test_a_few_steps_lower_the_loss():
  target, network, tokens = _setup()
  _, batch = _batch(target, network, tokens, [[1, 3, 5, 7], [0, 2, 6, 8]])
  embed, head = target_tables(target)
  optimizer = optax.adam(3e-3)
  params, state = network.params, optax.adam(3e-3).init(network.params)
  grad = jax.jit(jax.value_and_grad(
      lambda p: dflash_loss(p, network.config, embed, head, batch)[0]))
  first, grads = grad(params)
  assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads))
  for _ in range(30):
    loss, grads = grad(params)
    updates, state = optimizer.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert float(grad(params)[0]) < 0.5 * float(first)
