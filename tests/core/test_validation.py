"""Bad input raises a ValueError that names the problem, before anything is compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.core.tracing import TRACE_COUNTS
from specjax.testing.models import tiny_config


@pytest.fixture(scope="module")
def model():
  return sj.init_params(tiny_config(vocab_size=50, max_len=32), jax.random.key(0))


GOOD = jnp.ones((2, 4), jnp.int32)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokens=GOOD.astype(jnp.float32)), "integer"),
    (dict(tokens=jnp.ones((4,), jnp.int32)), r"\[batch, length\]"),
    (dict(tokens=jnp.ones((2, 0), jnp.int32)), "empty"),
    (dict(lengths=jnp.array([4, 0])), "empty prompt"),
    (dict(lengths=jnp.array([4, 5])), "exceed"),
    (dict(lengths=jnp.array([4, 2, 1])), "one per row"),
    (dict(lengths=jnp.array([4.0, 2.0])), "lengths must be an integer"),
    (dict(tokens=GOOD.at[0, 0].set(50)), "outside"),
    (dict(tokens=GOOD.at[0, 0].set(-1)), "outside"),
    (dict(max_new_tokens=29), "exceeds the model's context of 32"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an int"),
    (dict(rng=0), "PRNG key"),
    (dict(rng=jnp.zeros(3, jnp.uint32)), "PRNG key"),
    (dict(rng=jax.random.split(jax.random.key(0), 3)), "array of 2 keys"),  # batch is 2
    (dict(rng=jnp.zeros((3, 2), jnp.uint32)), "array of 2 keys"),
    (dict(eos_id=99), "eos_id"),
    (dict(sampling="greedy"), "specjax.Sampling"),
    (dict(pad_id=1.5), "pad_id must be an int"),
    (dict(pad_id=True), "pad_id must be an int"),
    (dict(pad_id=jnp.int32(0)), "pad_id must be an int"),
    (dict(pad_id=2**31), "int32"),
    # -1 inside a prompt (before its length) is still an error; past it, see below.
    (dict(tokens=GOOD.at[1, 3].set(-1), lengths=jnp.array([4, 4])), "within the prompts"),
])
def test_generate_rejects_bad_input_before_compiling(model, kwargs, message):
  args = dict(tokens=GOOD, rng=jax.random.key(0), max_new_tokens=4)
  args.update(kwargs)
  before = TRACE_COUNTS["generate"]
  with pytest.raises(ValueError, match=message):
    sj.generate(model, args.pop("tokens"), args.pop("rng"), **args)
  assert TRACE_COUNTS["generate"] == before


def test_context_check_uses_real_prompt_lengths(model):
  # Width 30 but the rows are only 3 long: 3 + 20 fits in 32.
  tokens = jnp.ones((2, 30), jnp.int32)
  out = sj.generate(model, tokens, jax.random.key(0), lengths=jnp.array([3, 2]),
                    max_new_tokens=20)
  assert out.tokens.shape == (2, 20)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, top_k=0), "top_k"),
    (dict(temperature=1.0, top_k=2.5), "top_k"),
])
def test_sampling_rejects_bad_settings(kwargs, message):
  with pytest.raises(ValueError, match=message):
    sj.Sampling(**kwargs)


def test_model_config_rejects_bad_shapes():
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    tiny_config(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match="head_dim must be even"):
    tiny_config(head_dim=7)


def test_padding_past_the_lengths_is_never_read(model):
  """Rows padded with -1 (or any id outside the vocabulary) past their length give the same
  tokens as rows padded with 0, for generate and decode; pad_id -1 marks the output's ends."""
  lengths = jnp.array([4, 2, 3], jnp.int32)
  zeros = jnp.array([[5, 6, 7, 8], [9, 3, 0, 0], [4, 4, 2, 0]], jnp.int32)
  odd = jnp.where(jnp.arange(4)[None] < lengths[:, None], zeros,
                  jnp.array([[-1, -1, -1, -1], [-1, -7, -1, 999], [0, 0, 0, 50]]))
  common = dict(lengths=lengths, max_new_tokens=6)
  ref = sj.generate(model, zeros, jax.random.key(0), **common)
  np.testing.assert_array_equal(sj.generate(model, odd, jax.random.key(0), **common).tokens,
                                ref.tokens)
  draft = sj.init_params(tiny_config(vocab_size=50, max_len=32, num_layers=1), jax.random.key(1))
  np.testing.assert_array_equal(
      sj.decode(model, draft, odd, jax.random.key(0), num_draft=2, **common).tokens,
      sj.decode(model, draft, zeros, jax.random.key(0), num_draft=2, **common).tokens)
  # Row 0 stops at its first token (made its EOS here): the rest of its output is pad_id -1.
  stop = int(ref.tokens[0, 0])
  out = sj.decode(model, draft, odd, jax.random.key(0), num_draft=2, eos_id=stop, pad_id=-1,
                  **common)
  assert int(out.num_tokens[0]) == 1 and np.all(np.asarray(out.tokens)[0, 1:] == -1)


def test_numpy_inputs_are_accepted(model):
  out = sj.generate(model, np.ones((1, 3), np.int64), jax.random.PRNGKey(0), max_new_tokens=2)
  assert out.tokens.dtype == jnp.int32


def test_a_subclass_with_its_parents_fields_gets_its_own_compiled_decode():
  """jax 0.10's PyTreeDef equality ignores the class of a dataclass node (a subclass that keeps
  its parent's fields compares equal while hashing differently), so jit caches could hand one
  drafter class the other's program; `decode` keys its cache on the classes. The two drafters
  below share fields and weights and differ only in `propose`; each must run its own code."""
  import dataclasses

  from specjax.drafters.ngram import NGramDrafter
  from specjax.core.validation import pytree_classes

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class NoDrafts(NGramDrafter):
    def propose(self, state, sequence, lengths, *, num_draft, **kwargs):
      state, proposal = super().propose(state, sequence, lengths, num_draft=num_draft, **kwargs)
      return state, dataclasses.replace(proposal, num_drafted=jnp.zeros_like(lengths))

  plain, broken = NGramDrafter(), NoDrafts()
  assert jax.tree.structure(plain) == jax.tree.structure(broken)  # the jax behaviour guarded
  assert pytree_classes(plain) != pytree_classes(broken)
  target = sj.init_params(tiny_config(vocab_size=12), jax.random.key(0))
  tokens = jnp.asarray([[1, 2, 3, 1, 2, 3, 1, 2]], jnp.int32)
  results = [sj.decode(target, d, tokens, jax.random.key(1), max_new_tokens=8, num_draft=3)
             for d in (plain, broken, plain, broken)]
  drafted = [int(np.asarray(r.stats.drafted).sum()) for r in results]
  assert drafted[1] == drafted[3] == 0 and drafted[0] == drafted[2] > 0
