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


FULL = DecoderConfig(vocab_size=24, embed_dim=16, num_layers=2, num_heads=2, mlp_dim=32,
                     max_len=32)


class UnclippedNNXDecoder(NNXDecoder):
  """The NNX template indexing its position table at `starts + t` unclipped, as a user's module
  might: past the table `nnx.Embed` returns NaN."""

  def __call__(self, tokens, starts, cache):
    positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    x = self.embed(tokens) + self.position(positions)
    for layer, block in enumerate(self.blocks):
      x, cache = block(x, starts, cache, layer)
    logits = self.head(self.final_norm(x)).astype(jnp.float32)
    return logits, cache.with_lengths(starts + tokens.shape[1])


def _template(kind, seed, *, finite_past_max_len=True):
  spec = CacheSpec.from_config(FULL, finite_past_max_len=finite_past_max_len)
  if kind == "nnx":
    return from_nnx(NNXDecoder(FULL, rngs=nnx.Rngs(seed)), spec)
  if kind == "unclipped":
    return from_nnx(UnclippedNNXDecoder(FULL, rngs=nnx.Rngs(seed)), spec)
  module = LinenDecoder(FULL)
  cache = KVCache.create(FULL.num_layers, 1, 4, FULL.num_heads, FULL.head_dim)
  params = module.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32),
                       jnp.zeros((1,), jnp.int32), cache)
  return from_linen(module, params, spec)


def _decode_matches_generate(target, draft, num_draft, max_new, prompt=8):
  """Greedy `decode` of two `prompt`-token prompts, `max_new` new tokens: whether its tokens equal
  `generate`'s and no row was flagged non-finite; and the highest position it fed the target."""
  tokens = jax.random.randint(jax.random.key(2), (2, prompt), 0, FULL.vocab_size, jnp.int32)
  expected = sj.generate(target, tokens, jax.random.key(0), max_new_tokens=max_new)
  out = sj.decode(target, draft, tokens, jax.random.key(0), max_new_tokens=max_new,
                  num_draft=num_draft)
  same = (np.array_equal(out.tokens, expected.tokens)
          and not np.any(np.asarray(out.stats.nonfinite)))
  return same, out.stats


def _full_context_prompt(num_draft):
  """A prompt length whose full-context decode ends with one token to go when every draft is
  accepted: new tokens = 1 + a multiple of k + 1, so the last round scores positions up to
  `max_len + k - 2`, past the table."""
  return FULL.max_len - (1 + (num_draft + 1) * (20 // (num_draft + 1)))


def _case(kind, same, k):
  marks = () if (kind, same, k) in FULL_DEFAULT else (pytest.mark.costly,)
  return pytest.param(kind, same, k, marks=marks,
                      id=f"{kind}-{'draft=target' if same else 'other'}-k{k}")


FULL_DEFAULT = {("nnx", True, 6), ("nnx", False, 3), ("linen", True, 4)}
FULL_CASES = ([_case("nnx", same, k) for same in (True, False) for k in range(2, 9)]
              + [_case("linen", True, 4), _case("linen", False, 7)])


@pytest.mark.parametrize("kind,same,num_draft", FULL_CASES)
def test_decode_to_the_full_learned_position_table_equals_generate(kind, same, num_draft):
  """Prompt + new tokens = max_len 32, k = 2..8, the draft the target or an unrelated model: the
  last rounds score drafts at positions past the position table, which the templates clip
  (`finite_past_max_len`); the tokens equal `generate`'s."""
  target = _template(kind, 0)
  draft = target if same else _template(kind, 7)
  prompt = _full_context_prompt(num_draft)
  equal, stats = _decode_matches_generate(target, draft, num_draft, FULL.max_len - prompt,
                                          prompt)
  assert equal
  if same:  # every draft accepted, the last round (1 token to go) scored k positions past it
    assert int(np.min(stats.emitted)) == FULL.max_len - prompt
    assert int(np.max(stats.rounds)) == 1 + (FULL.max_len - prompt - 1) // (num_draft + 1)


BROKEN_CASES = [(True, 6), (False, 3)]


@pytest.mark.parametrize("same,num_draft", BROKEN_CASES,
                         ids=[f"{'draft=target' if same else 'other'}-k{k}"
                              for same, k in BROKEN_CASES])
def test_an_unclipped_table_needs_the_reservation(same, num_draft):
  """A module that indexes its table unclipped: declared `finite_past_max_len` (no reservation),
  the full-context decode is wrong (the broken variant the test above would reject); undeclared,
  `decode` refuses the full context before compiling and, with the last round's `k` positions
  left free, equals `generate`."""
  prompt = _full_context_prompt(num_draft)
  liar = _template("unclipped", 0)
  draft = liar if same else _template("unclipped", 7)
  equal, _ = _decode_matches_generate(liar, draft, num_draft, FULL.max_len - prompt, prompt)
  assert not equal
  honest = _template("unclipped", 0, finite_past_max_len=False)
  draft = honest if same else _template("unclipped", 7, finite_past_max_len=False)
  with pytest.raises(ValueError, match=rf"\+ {num_draft} positions the last round scores past"):
    _decode_matches_generate(honest, draft, num_draft, FULL.max_len - prompt, prompt)
  equal, _ = _decode_matches_generate(honest, draft, num_draft, FULL.max_len - prompt - num_draft,
                                      prompt)
  assert equal
