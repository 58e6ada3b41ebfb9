"""Bad input raises a ValueError that names the problem, before anything compiles."""

import jax
import jax.numpy as jnp
import pytest

import specjax as sj
import specjax.constrain as C
from specjax.core.tracing import TRACE_COUNTS


@pytest.mark.parametrize("schema, match", [
    ('{"type": "object", ', "not valid JSON"),
    ({"type": "objekt"}, "invalid JSON schema.*objekt"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": -1}}},
     "invalid JSON schema at properties/a/maxLength"),
    ({"not": {"type": "string"}}, "outlines-core cannot compile.*Unsupported"),
    ({"type": "string", "minLength": 3, "maxLength": 1}, "maxLength must be greater"),
    ({"enum": []}, "matches only the empty text"),
    (["a list"], "a JSON schema is a dict"),
])
def test_bad_schemas(schema, match, tokenizer):
  with pytest.raises(ValueError, match=match):
    C.json_schema(schema, tokenizer)


@pytest.mark.parametrize("pattern, match", [
    ("(ab", r"invalid regex '\(ab'.*missing \)"),
    ("[z-a]", "invalid regex"),
    ("[a&&b]", "unsatisfiable.*empty language"),
    ("", "matches only the empty text"),
])
def test_bad_regexes(pattern, match, tokenizer):
  with pytest.raises(ValueError, match=match):
    C.regex(pattern, tokenizer)


def test_a_tokenizer_that_does_not_fit_the_model(tokenizer):
  with pytest.raises(ValueError, match="tokenizer has 49152 ids but the model's vocabulary has "
                                       "32000"):
    C.regex("[0-9]+", tokenizer, vocab_size=32000)
  with pytest.raises(ValueError, match=r"stop ids \[49300\] are outside"):
    C.regex("[0-9]+", tokenizer, vocab_size=49216, eos_ids=[2, 49300])
  with pytest.raises(ValueError, match="at least one stop id"):
    C.regex("[0-9]+", tokenizer, eos_ids=[])


def test_tables_over_the_budget(tokenizer):
  with pytest.raises(ValueError, match=r"tables need .* MiB .* over the budget max_bytes"):
    C.json_schema({"type": "object", "properties": {"a": {"type": "string"}}}, tokenizer,
                  max_bytes=100_000)


def test_stacked_tables_over_the_budget(model, tokenizer, vocab_size):
  """Stacking pads a small grammar's tables to the largest one's shape: that must still fit the
  small one's budget."""
  free = C.json_schema({"type": "object", "properties": {"a": {"type": "string"}}}, tokenizer,
                       vocab_size=vocab_size)
  own = C.regex("[0-9]{3}", tokenizer, vocab_size=vocab_size).nbytes
  digits = C.regex("[0-9]{3}", tokenizer, vocab_size=vocab_size, max_bytes=own)
  assert digits.nbytes <= own < free.nbytes
  tokens = jnp.asarray([[1, 2, 3]] * 2)
  sj.generate(model, tokens, jax.random.key(0), max_new_tokens=1, constraint=[digits] * 2)
  with pytest.raises(ValueError, match=r"padded to \d+ states and \d+ token classes .* over "
                                       r"the budget of Constraint\(regex.*max_bytes = "):
    sj.generate(model, tokens, jax.random.key(0), max_new_tokens=1, constraint=[free, digits])


def test_stack_tables_needs_one_vocabulary(tokenizer, vocab_size):
  with pytest.raises(ValueError, match="share one vocabulary size"):
    C.stack_tables([C.regex("[0-9]", tokenizer).tables,
                    C.regex("[0-9]", tokenizer, vocab_size=vocab_size).tables])


def test_check_vocab(tokenizer, vocab_size):
  tables = C.regex("[0-9]+", tokenizer, vocab_size=vocab_size).tables
  C.check_vocab(tables, vocab_size)
  with pytest.raises(ValueError, match="drafter has 49152"):
    C.check_vocab(tables, 49152, "drafter")


def test_generate_rejects_bad_constraints_before_tracing(model, tokenizer, vocab_size):
  tokens = jnp.asarray([[1, 2, 3], [4, 5, 6]])
  before = TRACE_COUNTS["generate"]
  other_vocab = C.regex("[0-9]+", tokenizer)  # built for the tokenizer's 49152 ids
  right = C.regex("[0-9]+", tokenizer, vocab_size=vocab_size)
  cases = [(other_vocab, "vocabulary of 49152 ids but the model has 49216"),
           ([right], "sequence of 1 constraints but the batch has 2"),
           ("[0-9]+", "must be a specjax.Constraint"),
           ([right, "[0-9]+"], "must be a specjax.Constraint")]
  for constraint, match in cases:
    with pytest.raises(ValueError, match=match):
      sj.generate(model, tokens, jax.random.key(0), max_new_tokens=4, constraint=constraint)
  assert TRACE_COUNTS["generate"] == before
