"""The device tables against outlines-core's own `Index` and against `re.fullmatch`: walks with
the real SmolLM2 tokens, the bitmask against the CSR rows, stop ids, padding ids, the dead
sentinel, stacking, jit/vmap, and one compiled program for grammars of the same table shapes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax.constrain as C
from specjax.constrain.compile import _vocabulary
from tests.constrain.reference import completable

PATTERNS = (r"[0-9]{1,3}(\.[0-9]+)?", r"(yes|no|maybe)", r"café [a-zé]{1,6}!",
            r"\{\"k\": \"[a-z]{1,4}\"\}", r"(ab|cd)e?")


def _index(constraint, tokenizer):
  import outlines_core
  return outlines_core.Index(constraint.pattern, _vocabulary(tokenizer, constraint.eos_ids))


_ADVANCE = jax.jit(C.advance)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_walks_agree_with_outlines_index_and_fullmatch(pattern, tokenizer, vocab_size):
  constraint = C.regex(pattern, tokenizer, vocab_size=vocab_size)
  tables = constraint.tables
  index = _index(constraint, tokenizer)
  stop = constraint.eos_ids[0]
  live = completable(index, stop)
  spelled = C.token_bytes(tokenizer)
  accepting = np.asarray(tables.accepting)
  masks = np.asarray(C.allowed_mask(tables, jnp.arange(tables.num_states)))
  rng = np.random.default_rng(0)
  for _ in range(20):
    ours, theirs, text = int(tables.initial), index.get_initial_state(), b""
    pairing = {}
    for _ in range(40):
      assert pairing.setdefault(ours, theirs) == theirs  # one Index state per table state
      mask = masks[ours]
      allowed = set(np.nonzero(mask)[0].tolist())
      expected = {t for t in index.get_allowed_tokens(theirs)
                  if t != stop and index.get_next_state(theirs, t) in live}
      assert accepting[ours] == index.is_final_state(theirs)
      if accepting[ours]:
        expected |= set(constraint.eos_ids)
        assert re.fullmatch(pattern, text.decode("utf-8")), text
      assert allowed == expected
      assert not np.any(mask[tokenizer.vocab_size:])  # padding ids are never allowed
      choices = sorted(allowed - set(constraint.eos_ids))
      if not choices or (accepting[ours] and rng.random() < 0.3):
        break
      token = int(rng.choice(choices))
      ours, theirs = int(_ADVANCE(tables, ours, token)), index.get_next_state(theirs, token)
      text += spelled[token]


def test_class_rows_are_the_index_rows_and_stops_only_where_accepting(tokenizer, vocab_size):
  """Every state's allowed tokens and next states, read through the token classes, equal the
  outlines-core Index's completable transitions (numbered as the walk numbers them)."""
  constraint = C.json_schema({"type": "object", "properties": {"a": {"enum": ["x", "y"]},
                                                                "b": {"type": "integer"}}},
                             tokenizer, vocab_size=vocab_size)
  tables = constraint.tables
  index = _index(constraint, tokenizer)
  masks = np.asarray(C.allowed_mask(tables, jnp.arange(tables.num_states)))
  accepting = np.asarray(tables.accepting)
  assert accepting.any() and not accepting.all()
  assert tables.num_classes < 1000 < vocab_size  # the classes are what keeps the tables small
  stops = set(constraint.eos_ids)
  live = completable(index, min(stops))
  ours_of = {index.get_initial_state(): int(tables.initial)}
  frontier = [index.get_initial_state()]
  while frontier:  # breadth over the Index's completable states, mapped to ours by `advance`
    theirs = frontier.pop()
    ours = ours_of[theirs]
    row = {t: n for t, n in index.get_transitions()[theirs].items()
           if t not in stops and n in live}
    np.testing.assert_array_equal(np.nonzero(masks[ours])[0],
                                  sorted(set(row) | (stops if accepting[ours] else set())))
    nexts = np.asarray(C.advance(tables, jnp.full(len(row), ours), jnp.asarray(list(row))))
    for their_next, our_next in zip(row.values(), nexts.tolist()):
      if their_next not in ours_of:
        ours_of[their_next] = our_next
        frontier.append(their_next)
      assert ours_of[their_next] == our_next
  assert len(set(ours_of.values())) == len(ours_of) == constraint.num_states
  assert not masks[:, tokenizer.vocab_size:].any()
  # Padding states (past num_states) allow nothing: the dead rows.
  assert tables.num_states > constraint.num_states
  assert np.asarray(C.is_dead(tables, jnp.arange(tables.num_states))).tolist() == (
      [False] * constraint.num_states + [True] * (tables.num_states - constraint.num_states))


def test_advance_every_transition_and_the_dead_sentinel(tokenizer, vocab_size):
  constraint = C.regex(r"[0-9]{2}(px|em)", tokenizer, vocab_size=vocab_size)
  tables = constraint.tables
  # Every allowed (state, token) pair, from the mask, against the class table read in NumPy.
  masks = np.asarray(C.allowed_mask(tables, jnp.arange(constraint.num_states)))
  states, tokens = np.nonzero(masks)
  targets = np.asarray(tables.next_state)[states, np.asarray(tables.classes)[tokens]]
  assert np.all(targets >= 0)
  got = jax.jit(C.advance)(tables, jnp.asarray(states), jnp.asarray(tokens))
  np.testing.assert_array_equal(got, targets)
  # Disallowed tokens, ids past the vocabulary and DEAD itself all lead to DEAD.
  letter = tokenizer.encode("a")[0]
  assert int(C.advance(tables, tables.initial, letter)) == C.DEAD
  assert int(C.advance(tables, C.DEAD, tokenizer.encode("1")[0])) == C.DEAD
  assert int(C.advance(tables, tables.initial, vocab_size - 1)) == C.DEAD
  assert not np.asarray(C.allowed_mask(tables, C.DEAD)).any()
  assert bool(C.is_dead(tables, C.DEAD))
  assert not bool(C.token_allowed(tables, tables.initial, letter))
  assert bool(C.token_allowed(tables, tables.initial, tokenizer.encode("1")[0]))


def test_vmap_and_jit_match_the_elementwise_ops(tokenizer, vocab_size):
  tables = C.regex(r"(yes|no|maybe)", tokenizer, vocab_size=vocab_size).tables
  states = jnp.asarray([0, 1, 2, C.DEAD], jnp.int32)
  tokens = jnp.asarray(tokenizer.encode("yes")[:1] * 4, jnp.int32)
  step = jax.jit(jax.vmap(lambda s, t: (C.allowed_mask(tables, s), C.advance(tables, s, t))))
  masks, nexts = step(states, tokens)
  for i in range(4):
    np.testing.assert_array_equal(masks[i], C.allowed_mask(tables, states[i]))
    assert int(nexts[i]) == int(C.advance(tables, states[i], tokens[i]))


def test_another_grammar_of_the_same_shapes_does_not_recompile(tokenizer, vocab_size):
  first = C.regex(r"[0-9]{2}", tokenizer, vocab_size=vocab_size).tables
  second = C.regex(r"(red|green|blue)", tokenizer, vocab_size=vocab_size).tables
  assert jax.tree.map(np.shape, first) == jax.tree.map(np.shape, second)
  traces = []

  @jax.jit
  def walk(tables, tokens):
    traces.append(1)
    def body(state, token):
      return C.advance(tables, state, token), C.allowed_mask(tables, state).sum()
    return jax.lax.scan(body, tables.initial, tokens)

  state, _ = walk(first, jnp.asarray(tokenizer.encode("42")))  # two digit tokens
  assert bool(np.asarray(first.accepting)[int(state)])
  blue = tokenizer.encode("blue")
  state, _ = walk(second, jnp.asarray((blue + blue)[:2]))
  assert len(traces) == 1 and walk._cache_size() == 1
  # Not vacuous: a table of other shapes is a second program.
  walk(C.pad_tables(first, 2 * first.num_states), jnp.asarray([0, 0]))
  assert len(traces) == 2


def test_stacked_tables_equal_each_table(tokenizer, vocab_size):
  a = C.regex(r"[0-9]{1,3}", tokenizer, vocab_size=vocab_size).tables
  b = C.json_schema({"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, tokenizer,
                    vocab_size=vocab_size).tables
  stacked = C.stack_tables([a, b])
  assert stacked.stacked and stacked.num_schemas == 2
  assert stacked.num_states == max(a.num_states, b.num_states)
  rng = np.random.default_rng(1)
  for schema, tables in enumerate((a, b)):
    states = jnp.arange(stacked.num_states)
    masks = C.allowed_mask(stacked, states, jnp.full_like(states, schema))
    own = C.allowed_mask(tables, jnp.clip(states, 0, tables.num_states - 1))
    own = jnp.where((states < tables.num_states)[:, None], own, False)
    np.testing.assert_array_equal(masks, own)
    tokens = jnp.asarray(rng.integers(0, 200, stacked.num_states))
    inside = states < tables.num_states
    np.testing.assert_array_equal(
        C.advance(stacked, states, tokens, jnp.full_like(states, schema))[inside],
        C.advance(tables, states[inside], tokens[inside]))
  with pytest.raises(ValueError, match="schema"):
    C.allowed_mask(stacked, jnp.zeros(2, jnp.int32))


def test_memory_report(tokenizer, vocab_size):
  constraint = C.regex(r"(yes|no)", tokenizer, vocab_size=vocab_size)
  report = constraint.tables.memory_report()
  states, classes = constraint.tables.num_states, constraint.tables.num_classes
  assert report["next_state"] == states * classes * 4
  assert report["classes"] == vocab_size * 4
  assert report["total"] == constraint.nbytes == states * classes * 4 + vocab_size * 4 + states + 4


def test_from_transitions_groups_alike_tokens_only():
  """Tokens with the same transitions share a class, tokens with any difference do not, and an
  automaton that is not deterministic is refused."""
  # 3 states over 8 tokens: 1 and 2 behave alike, 3 differs from them in state 1 only.
  edges = [(0, 1, 1), (0, 2, 1), (0, 3, 1), (1, 1, 2), (1, 2, 2), (1, 3, 0), (2, 5, 2)]
  source, token, target = (np.asarray(x) for x in zip(*edges))
  tables = C.from_transitions(source, token, target, [False, False, True], 8)
  classes = np.asarray(tables.classes)
  assert classes[1] == classes[2] != classes[3]
  assert len({classes[0], classes[4], classes[6], classes[7]}) == 1 and classes[0] == 0
  for s, t, n in edges:
    assert int(C.advance(tables, s, t)) == n
  assert int(C.advance(tables, 2, 1)) == C.DEAD
  with pytest.raises(ValueError, match="not deterministic"):
    C.from_transitions([0, 0], [1, 1], [1, 2], [False, True, True], 8)
