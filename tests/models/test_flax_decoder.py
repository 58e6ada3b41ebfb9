"""`specjax.decode` inside a user's jitted Flax eval step (NNX and Linen, via the adapter).

`examples/flax_train_eval.py` trains a Flax target and draft with optax for 40 steps on a toy
language and evaluates every 20 steps with a jitted eval step that builds specjax models from the
current params and calls `sj.decode`. Checked: the eval step is traced once across the three
evaluations (params change, shapes do not); the acceptance rate it logs rises with training
(the draft learns what the target learns); greedy speculative tokens from inside the eval step
equal `sj.generate` on the same params outside it; and the adapters follow the model protocol
(prefill + step equals one block forward; their pytree leaves are exactly the user's params).
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax as sj
from specjax.loop import KVCache
from specjax.models.adapter import CacheSpec, LinenModel, NNXModel, from_linen, from_nnx
from specjax.models.flax_decoder import DecoderConfig, LinenDecoder, NNXDecoder

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "flax_train_eval.py"


@pytest.fixture(scope="module")
def example():
  spec = importlib.util.spec_from_file_location("flax_train_eval", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("kind", ["nnx", pytest.param("linen", marks=pytest.mark.slow)])
def test_decode_in_a_jitted_eval_step_of_a_flax_training_loop(example, kind):
  logs = []
  record = example.run(kind, steps=40, eval_every=20, log=logs.append)
  assert record["traces"] == 1  # three evaluations with changing params, one trace
  acceptance = record["acceptance"]
  assert len(acceptance) == 3 and all(0.0 <= a <= 1.0 for a in acceptance)
  assert acceptance[-1] > acceptance[0] + 0.3, acceptance  # training shows in the logged rate
  assert any("acceptance rate" in line for line in logs)
  # Greedy speculative decoding inside the jitted step == plain generation outside it.
  target = record["as_target"](record["target_params"])
  reference = sj.generate(target, record["prompts"], jax.random.key(0), max_new_tokens=12)
  np.testing.assert_array_equal(record["eval_tokens"][-1], np.asarray(reference.tokens))


def _models():
  config = DecoderConfig(vocab_size=24, embed_dim=16, num_layers=2, num_heads=2, mlp_dim=32,
                         max_len=32)
  spec = CacheSpec.from_config(config)
  nnx_model = from_nnx(NNXDecoder(config, rngs=nnx.Rngs(0)), spec)
  module = LinenDecoder(config)
  cache = KVCache.create(config.num_layers, 1, 4, config.num_heads, config.head_dim)
  params = module.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1,), jnp.int32),
                       cache)
  return {"nnx": (nnx_model, nnx.split(NNXDecoder(config, rngs=nnx.Rngs(0)))[1]),
          "linen": (from_linen(module, params, spec), params)}


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_adapter_follows_the_model_protocol(kind):
  model, params = _models()[kind]
  assert isinstance(model, (NNXModel, LinenModel))
  assert model.vocab_size == 24 and model.max_len == 32
  # Leaves are the user's params, nothing else.
  leaves = jax.tree.leaves(model)
  assert len(leaves) == len(jax.tree.leaves(params))
  for a, b in zip(leaves, jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  # Prefill 5 tokens then feed 3 more at per-row offsets == one forward over all 8.
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 24, jnp.int32)
  full = model(tokens, jnp.zeros((2,), jnp.int32), model.init_cache(2, 16))
  part = model(tokens[:, :5], jnp.zeros((2,), jnp.int32), model.init_cache(2, 16))
  rest = model(tokens[:, 5:], jnp.full((2,), 5, jnp.int32), part.cache)
  np.testing.assert_allclose(rest.logits, full.logits[:, 5:], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(rest.cache.lengths, [8, 8])
  # New weight values are new leaves of the same structure: a jitted function traces once.
  traces = []

  @jax.jit
  def logits(model, tokens):
    traces.append(1)
    return model(tokens, jnp.zeros((2,), jnp.int32)).logits

  logits(model, tokens)
  changed = logits(jax.tree.map(lambda x: x * 1.5, model), tokens)
  assert len(traces) == 1 and not np.allclose(changed, full.logits)


@pytest.mark.parametrize("kind,same,num_draft",
                         [("nnx", True, 6), ("nnx", False, 2), ("nnx", False, 4),
                          ("linen", True, 6)],
                         ids=["nnx-draft=target-k6", "nnx-other-k2", "nnx-other-k4",
                              "linen-draft=target-k6"])
def test_decode_to_the_full_learned_position_table_equals_generate(kind, same, num_draft):
  """Prompt + new tokens = max_len: the last rounds feed drafts at positions past the position
  table; they are never emitted, and the tokens that are equal `generate`'s."""
  config = DecoderConfig(vocab_size=24, embed_dim=16, num_layers=2, num_heads=2, mlp_dim=32,
                         max_len=32)
  spec = CacheSpec.from_config(config)

  def build(seed):
    if kind == "nnx":
      return from_nnx(NNXDecoder(config, rngs=nnx.Rngs(seed)), spec)
    module = LinenDecoder(config)
    cache = KVCache.create(config.num_layers, 1, 4, config.num_heads, config.head_dim)
    params = module.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32),
                         jnp.zeros((1,), jnp.int32), cache)
    return from_linen(module, params, spec)

  target = build(0)
  draft = target if same else build(7)
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 24, jnp.int32)
  max_new = config.max_len - tokens.shape[1]
  expected = sj.generate(target, tokens, jax.random.key(0), max_new_tokens=max_new)
  out = sj.decode(target, draft, tokens, jax.random.key(0), max_new_tokens=max_new,
                  num_draft=num_draft)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  assert not np.any(out.stats.nonfinite)
  if same:  # every draft accepted: the last round's drafts lay past the table
    assert int(np.max(out.stats.rounds)) * (num_draft + 1) > max_new
