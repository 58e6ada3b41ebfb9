"""`sj.decode(..., constraint=)` with SmolLM2's real tokenizer and tool-call schemas: greedy tokens
equal to `sj.generate(..., constraint=)`'s on a ragged batch of different grammars, for the draft
model, the int8 self-draft, prompt lookup and the suffix drafter; the outputs parse and validate;
tokens the grammar forces are drafted for free."""

import jax
import numpy as np
import pytest

import specjax as sj
from specjax.drafters.suffix import SuffixCorpus, SuffixDrafter
from specjax.testing.models import tiny_config
from tests.constrain.test_generate import (  # noqa: F401  (biased, constraints: fixtures)
    NEW, Biased, _check_rows, _prompts, biased, constraints)

SCHEMAS = ("get_weather", "permissions", "set_thermostat", "create_event")


def json_target(biased, vocab_size):
  """A random model as wide as the int8 self-draft's groups need (32), with the closing bias."""
  config = tiny_config(vocab_size=vocab_size, num_layers=2, embed_dim=32, mlp_dim=64)
  return Biased(sj.init_params(config, jax.random.key(4)), biased.bias)


def json_draft(biased, vocab_size):
  """Another random model of the same vocabulary with the same closing bias: drafts that are
  sometimes right, sometimes not."""
  config = tiny_config(vocab_size=vocab_size, num_layers=1, embed_dim=16, mlp_dim=32)
  return Biased(sj.init_params(config, jax.random.key(5)), biased.bias)


target = pytest.fixture(json_target, scope="module", name="target")
draft_model = pytest.fixture(json_draft, scope="module", name="draft_model")


def _drafters(target, draft_model, tokenizer):
  corpus = SuffixCorpus.from_sequences(
      [tokenizer.encode('{"city": "Paris", "unit": "celsius"}'),
       tokenizer.encode('["read", "write"]')], capacity=256)
  return {"draft model": draft_model, "self int8": sj.self_drafter(target.model, bits=8),
          "n-gram": sj.NGramDrafter(max_ngram=2), "suffix": SuffixDrafter(corpus=corpus)}


def test_greedy_decode_equals_constrained_generate(target, draft_model, tokenizer, constraints):
  rows = [constraints[name] for name in SCHEMAS]
  tokens, lengths = _prompts(tokenizer, len(rows))
  want = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=NEW,
                     eos_id=tokenizer.eos_ids, constraint=rows)
  _check_rows(want, rows, tokenizer)
  for name, drafter in _drafters(target, draft_model, tokenizer).items():
    got = sj.decode(target, drafter, tokens, jax.random.key(0), lengths=lengths,
                    max_new_tokens=NEW, num_draft=4, eos_id=tokenizer.eos_ids, constraint=rows)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens), err_msg=name)
    np.testing.assert_array_equal(np.asarray(got.num_tokens), np.asarray(want.num_tokens))
    summary = got.stats.summary()
    assert summary["forced"] > 0, name  # keys, quotes and braces come free
    assert summary["rounds"] < int(np.sum(want.num_tokens)), name


# `slow` for CI's time (90-minute budget on 2 cores; 194 s on a 2-core host): CI runs the greedy
# constrained decodes here.
@pytest.mark.slow
def test_sampled_decode_validates(biased, draft_model, tokenizer, constraints):
  rows = [constraints[name] for name in ("search", "send_email", "update_user", "place_order",
                                         "add_note")]
  tokens, lengths = _prompts(tokenizer, len(rows))
  out = sj.decode(biased, draft_model, tokens, jax.random.key(7), lengths=lengths,
                  max_new_tokens=NEW, num_draft=4, sampling=sj.Sampling(0.7, top_k=50, top_p=0.9),
                  eos_id=tokenizer.eos_ids, constraint=rows)
  _check_rows(out, rows, tokenizer)


def test_a_drafter_of_another_vocabulary_is_refused(biased, tokenizer, constraints):
  other = sj.init_params(tiny_config(vocab_size=tokenizer.vocab_size, num_layers=1),
                         jax.random.key(1))
  tokens, lengths = _prompts(tokenizer, 1)
  with pytest.raises(ValueError, match="vocabulary"):
    sj.decode(biased, other, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=8,
              constraint=constraints["permissions"])
