"""`sj.generate(..., constraint=)` with SmolLM2's real tokenizer and a random-weight model of its
vocabulary (plus 64 padding ids): outputs that parse and validate against ten tool-call schemas,
greedy and sampled; every greedy step equal to the allowed argmax of the model's own full
forward; sampled first and second steps fitting the NumPy law; ragged batches of grammars; dead
rows; and one compiled program for grammars of the same table shapes."""

import dataclasses
import json
import re
import time

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import specjax as sj
import specjax.constrain as C
from specjax.core.tracing import TRACE_COUNTS
from tests.constrain.reference import IndexWalk, chi_square_pvalue, masked_law

_STR = lambda n: {"type": "string", "maxLength": n}

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "city": _STR(12), "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False},
    "search": {"type": "object", "properties": {"query": _STR(16), "limit": {"type": "integer"}},
               "required": ["query", "limit"]},
    "send_email": {"type": "object", "properties": {
        "to": {"type": "string", "pattern": "[a-z]{1,8}@[a-z]{1,8}\\.com"},
        "subject": _STR(10), "urgent": {"type": "boolean"}}, "required": ["to", "urgent"]},
    "create_event": {"type": "object", "properties": {
        "title": _STR(10), "date": {"type": "string", "pattern": "2026-[01][0-9]-[0-3][0-9]"},
        "attendees": {"type": "array", "items": _STR(6), "maxItems": 3}},
        "required": ["title", "date", "attendees"]},
    "update_user": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "name": _STR(8)},
                 "required": ["id", "name"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "set_thermostat": {"type": "object", "properties": {
        "temperature": {"type": "number"}, "mode": {"enum": ["heat", "cool", "auto"]}},
        "required": ["temperature", "mode"]},
    "place_order": {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "[A-Z]{3}[0-9]{2}"},
            "qty": {"type": "integer"}}, "required": ["sku", "qty"]}},
        "express": {"type": "boolean"}}, "required": ["items", "express"]},
    "translate": {"type": "object", "properties": {
        "text": _STR(20), "target": {"enum": ["fr", "de", "es"]}}, "required": ["text", "target"]},
    "add_note": {"type": "object", "properties": {
        "note": {"anyOf": [_STR(8), {"type": "null"}]}, "count": {"type": "integer"}},
        "required": ["note", "count"]},
    "permissions": {"type": "array", "items": {"enum": ["read", "write", "exec"]},
                    "minItems": 1, "maxItems": 3},
}

NEW = 96


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Biased:
  """The random-weight model plus a fixed bias on its logits. A random model's argmax loops
  (`7878787...` in a number), so its greedy JSON never ends; a bias of +3 on the tokens that hold
  a quote, a comma or a closing bracket makes it close strings, numbers and containers soon."""

  model: object
  bias: jax.Array  # [V] float32

  vocab_size = property(lambda self: self.model.vocab_size)
  max_len = property(lambda self: self.model.max_len)
  config = property(lambda self: self.model.config)

  def init_cache(self, *args, **kwargs):
    return self.model.init_cache(*args, **kwargs)

  def __call__(self, tokens, starts, cache=None, **kwargs):
    out = self.model(tokens, starts, cache, **kwargs)
    return out._replace(logits=out.logits + self.bias)


@pytest.fixture(scope="module")
def biased(model, tokenizer, vocab_size):
  spelled = C.token_bytes(tokenizer) + [None] * (vocab_size - tokenizer.vocab_size)
  closing = [piece is not None and any(c in piece for c in b'",}]') for piece in spelled]
  return Biased(model, jnp.where(jnp.asarray(closing), 3.0, 0.0).astype(jnp.float32))


@pytest.fixture(scope="module")
def constraints(tokenizer, vocab_size):
  built, seconds = {}, {}
  for name, schema in SCHEMAS.items():
    start = time.perf_counter()
    built[name] = C.json_schema(schema, tokenizer, vocab_size=vocab_size)
    seconds[name] = time.perf_counter() - start
  print("build seconds:", {k: round(v, 3) for k, v in seconds.items()})
  print("nbytes:", {k: c.nbytes for k, c in built.items()})
  assert max(seconds.values()) < 5.0
  return built


def _prompts(tokenizer, rows):
  texts = [f"Call the tool number {i} with arguments:" for i in range(rows)]
  ids, lengths = tokenizer.encode_batch(texts)
  return jnp.asarray(ids), jnp.asarray(lengths)


def _check_rows(out, constraints_per_row, tokenizer):
  """Every row ended with a stop id, emitted no stop id before it, and its text is a full match
  of the pattern that parses as JSON and validates against the schema."""
  tokens, counts = np.asarray(out.tokens), np.asarray(out.num_tokens)
  assert not np.any(out.stats.constraint_dead)
  for row, constraint in enumerate(constraints_per_row):
    ids = tokens[row, :counts[row]].tolist()
    assert counts[row] < NEW and ids[-1] in constraint.eos_ids, (row, tokenizer.decode(ids))
    assert not set(ids[:-1]) & set(constraint.eos_ids)
    text = tokenizer.decode(ids[:-1], skip_special_tokens=False)
    assert re.fullmatch(constraint.pattern, text), text
    jsonschema.validate(json.loads(text), constraint.schema)


@pytest.mark.parametrize("sampling", [
    sj.Sampling(), sj.Sampling(1.0),
    pytest.param(sj.Sampling(1.0, top_k=200, top_p=0.95), marks=pytest.mark.costly)],
    ids=["greedy", "sampled", "top-k-top-p"])
def test_outputs_validate_on_tool_schemas(sampling, biased, tokenizer, constraints):
  rows = list(constraints.values())
  tokens, lengths = _prompts(tokenizer, len(rows))
  out = sj.generate(biased, tokens, jax.random.key(7), lengths=lengths, max_new_tokens=NEW,
                    sampling=sampling, eos_id=tokenizer.eos_ids, constraint=rows)
  _check_rows(out, rows, tokenizer)
  print([tokenizer.decode(np.asarray(out.tokens[r, :out.num_tokens[r] - 1]))
         for r in range(len(rows))])


def _full_forward_logits(model, prompt, emitted):
  sequence = jnp.asarray([list(prompt) + list(emitted)], jnp.int32)
  return np.asarray(model(sequence, jnp.zeros((1,), jnp.int32)).logits[0])


def test_every_greedy_step_is_the_allowed_argmax(biased, tokenizer, vocab_size, constraints):
  """Recomputed outside `generate`: the model's full forward over prompt + emitted tokens, masked
  with the allowed set read off outlines-core's Index along the same tokens."""
  model = biased
  constraint = constraints["create_event"]
  tokens, lengths = _prompts(tokenizer, 1)
  out = sj.generate(model, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=NEW,
                    eos_id=tokenizer.eos_ids, constraint=constraint)
  emitted = np.asarray(out.tokens[0, :out.num_tokens[0]]).tolist()
  prompt = np.asarray(tokens[0, :lengths[0]]).tolist()
  logits = _full_forward_logits(model, prompt, emitted[:-1])[len(prompt) - 1:]
  walk = IndexWalk(constraint, tokenizer, vocab_size)
  state = walk.initial()
  for step, token in enumerate(emitted):
    mask = walk.mask(state)
    assert token == int(np.argmax(np.where(mask, logits[step], -np.inf))), step
    state = walk.advance(state, token)
  assert emitted[-1] in constraint.eos_ids


def test_sampled_steps_follow_the_masked_warped_law(model, tokenizer, vocab_size):
  """Chi-square of the first token (256 rows, each its own key) against the NumPy law built from
  the model's full-forward logits and outlines-core's allowed set, and of the second token given
  the most frequent first one. Top-k cuts about half of the allowed first tokens: an
  implementation that restricted before warping would sample tokens this law gives probability
  0 (checked to carry enough mass), which `chi_square_pvalue` fails outright."""
  constraint = C.regex(r"[0-9][a-f][0-9]", tokenizer, vocab_size=vocab_size)
  prompt = tokenizer.encode("The code is")
  walk = IndexWalk(constraint, tokenizer, vocab_size)
  mask = walk.mask(walk.initial())
  logits = _full_forward_logits(model, prompt, [])[-1]
  # Top-k that keeps about half of the allowed first tokens: one past the median rank.
  rank = np.argsort(np.argsort(-logits))
  top_k = int(np.median(rank[mask])) + 1
  sampling = sj.Sampling(0.8, top_k=top_k)
  tokens = jnp.tile(jnp.asarray([prompt], jnp.int32), (128, 1))
  first, second = [], []
  for call in range(2):
    keys = jax.random.split(jax.random.key(call), 128)
    out = sj.generate(model, tokens, keys, max_new_tokens=2, sampling=sampling,
                      eos_id=tokenizer.eos_ids, constraint=constraint)
    first += np.asarray(out.tokens[:, 0]).tolist()
    second += np.asarray(out.tokens[:, 1]).tolist()
  first, second = np.asarray(first), np.asarray(second)
  law = masked_law(logits, mask, 0.8, top_k)
  other = masked_law(np.where(mask, logits, -np.inf), mask, 0.8, top_k)
  # The other order puts mass where this law has none: run with it, 256 draws would all miss
  # those tokens with probability below 1e-6.
  assert (1.0 - other[law == 0].sum()) ** len(first) < 1e-6
  assert chi_square_pvalue(first, law) > 1e-3
  common = np.bincount(first).argmax()
  given = second[first == common]
  state = walk.advance(walk.initial(), int(common))
  law2 = masked_law(_full_forward_logits(model, prompt, [int(common)])[-1], walk.mask(state),
                    0.8, top_k)
  assert len(given) >= 40 and chi_square_pvalue(given, law2) > 1e-3


def test_a_ragged_batch_equals_each_grammar_alone(biased, tokenizer, constraints):
  model = biased
  a, b = constraints["translate"], constraints["permissions"]
  tokens, lengths = _prompts(tokenizer, 3)
  keys = jax.random.split(jax.random.key(3), 3)
  sampling = sj.Sampling(1.0)
  mixed = sj.generate(model, tokens, keys, lengths=lengths, max_new_tokens=NEW,
                      sampling=sampling, eos_id=tokenizer.eos_ids, constraint=[a, b, a])
  _check_rows(mixed, [a, b, a], tokenizer)
  for row, constraint in enumerate([a, b, a]):
    alone = sj.generate(model, tokens[row:row + 1], keys[row:row + 1],
                        lengths=lengths[row:row + 1], max_new_tokens=NEW, sampling=sampling,
                        eos_id=tokenizer.eos_ids, constraint=constraint)
    n = int(alone.num_tokens[0])
    assert int(mixed.num_tokens[row]) == n
    np.testing.assert_array_equal(mixed.tokens[row, :n], alone.tokens[0, :n])


def test_another_grammar_of_the_same_shapes_runs_the_same_program(model, tokenizer,
                                                                  vocab_size):
  first = C.regex(r"[0-9]{2}", tokenizer, vocab_size=vocab_size)
  second = C.regex(r"(red|green|blue)", tokenizer, vocab_size=vocab_size)
  assert jax.tree.map(np.shape, first.tables) == jax.tree.map(np.shape, second.tables)
  tokens, lengths = _prompts(tokenizer, 2)
  # No eos_id: the constraint's stop ids (the tokenizer's) end the rows.
  args = (model, tokens, jax.random.key(0))
  kwargs = dict(lengths=lengths, max_new_tokens=8)
  sj.precompile(sj.generate, *args, **kwargs, constraint=first)
  before = TRACE_COUNTS["generate"]
  out = sj.generate(*args, **kwargs, constraint=first)
  again = sj.generate(*args, **kwargs, constraint=second)
  assert TRACE_COUNTS["generate"] == before
  for r in range(2):
    assert re.fullmatch(r"[0-9]{2}", tokenizer.decode(out.tokens[r, :out.num_tokens[r] - 1]))
    assert tokenizer.decode(again.tokens[r, :again.num_tokens[r] - 1]) in ("red", "green", "blue")


def test_a_dead_state_stops_the_row_without_a_token(model, tokenizer, vocab_size):
  """Tables edited so that the state after the first token allows nothing (row 0) and the
  initial state allows nothing (row 1): no token is emitted from a dead state."""
  constraint = C.regex(r"x[0-9]{3}", tokenizer, vocab_size=vocab_size)
  tables = constraint.tables
  after_x = int(C.advance(tables, tables.initial, tokenizer.token_to_id("x")))
  def dead_at(state):
    next_state = np.asarray(tables.next_state).copy()
    next_state[state] = C.DEAD
    return dataclasses.replace(constraint,
                               tables=dataclasses.replace(tables, next_state=next_state))
  first_dead, start_dead = dead_at(after_x), dead_at(int(tables.initial))
  tokens, lengths = _prompts(tokenizer, 3)
  out = sj.generate(model, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=8,
                    eos_id=tokenizer.eos_ids, pad_id=0,
                    constraint=[first_dead, start_dead, constraint])
  np.testing.assert_array_equal(out.stats.constraint_dead, [True, True, False])
  np.testing.assert_array_equal(out.num_tokens[:2], [1, 0])
  assert int(out.tokens[0, 0]) == tokenizer.token_to_id("x")
  assert not np.any(np.asarray(out.tokens[0, 1:])) and not np.any(np.asarray(out.tokens[1]))
  assert re.fullmatch(r"x[0-9]{3}", tokenizer.decode(out.tokens[2, :out.num_tokens[2] - 1]))
  assert out.stats.summary()["constraint_dead"] == 2


def test_sharded_generate_equals_one_device(biased, tokenizer, constraints):
  """On a (data 2, model 4) mesh of the 8 simulated CPU devices (the vocabulary split over
  `model`), the constrained greedy tokens are the single-device ones."""
  from specjax import parallel as sh
  rows = [constraints["get_weather"], constraints["permissions"]] * 2
  tokens, lengths = _prompts(tokenizer, 4)
  kwargs = dict(lengths=lengths, max_new_tokens=NEW, eos_id=tokenizer.eos_ids, constraint=rows)
  single = sj.generate(biased, tokens, jax.random.key(0), **kwargs)
  mesh = sj.make_mesh((2, 4))
  sharded_model = Biased(sj.shard(biased.model, mesh), biased.bias)
  with sh.use_mesh(mesh):
    out = sj.generate(sharded_model, tokens, jax.random.key(0), **kwargs)
  assert out.tokens.sharding.spec[0] == "data"  # rows stayed data parallel
  np.testing.assert_array_equal(out.tokens, single.tokens)
  _check_rows(out, rows, tokenizer)


# SmolLM2-135M (60 s in CI's costly step): `slow` for CI's time; CI runs constrained decodes with
# SmolLM2's real tokenizer and tool-call schemas in tests/constrain/test_speculative_real.py.
@pytest.mark.slow
def test_the_real_model_writes_a_valid_tool_call(tokenizer):
  """SmolLM2-135M-Instruct itself, asked for a weather tool call in its chat template: greedy and
  sampled outputs under the schema parse and validate, and end with its stop id."""
  from specjax.io.gguf import find_packaged_gguf
  target = sj.from_gguf(find_packaged_gguf("smollm2"), platform="cpu")
  schema = SCHEMAS["get_weather"]
  constraint = C.json_schema(schema, tokenizer, vocab_size=target.vocab_size)
  ids = tokenizer.apply_chat_template(
      [{"role": "user", "content": "Call get_weather for Paris in celsius. Answer with the "
                                   "JSON arguments only."}], add_generation_prompt=True)
  tokens = jnp.asarray([ids, ids])
  keys = jax.random.split(jax.random.key(0), 2)
  for sampling in (sj.Sampling(), sj.Sampling(0.7, top_p=0.9)):
    out = sj.generate(target, tokens, keys, max_new_tokens=NEW, sampling=sampling,
                      eos_id=tokenizer.eos_ids, constraint=constraint)
    _check_rows(out, [constraint] * 2, tokenizer)
    print(sampling, [tokenizer.decode(np.asarray(out.tokens[r, :out.num_tokens[r] - 1]))
                     for r in range(2)])
