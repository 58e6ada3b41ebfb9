"""Compiling a JSON Schema or a regex into `ConstraintTables` over a model's tokenizer.

Why outlines-core. Exact speculative decoding needs the allowed set of every state a drafted
token can lead to, inside one jitted loop, so the automaton must be a fixed table that can live on
device and be walked with array ops. `outlines_core.Index` is exactly that: a deterministic
finite automaton over token ids (the regex's byte DFA lifted to the tokenizer's vocabulary), and
it exports every state's full transition map (`get_transitions`), which this module turns into
the token-class tables (`specjax.constrain.tables`) once, on the host. llguidance and xgrammar are the other well-kept
choices, but both compute masks at run time from a parser (an Earley parser, a pushdown
automaton with a per-state cache) driven token by token from the host: they export no fixed
tables to walk on device, and their grammars (context-free, recursive JSON) have no finite state
set. The price of a finite automaton is the finite language: recursive schemas are unrolled to a
bounded depth (`max_recursion_depth`), and outlines-core ignores some JSON Schema keywords (numeric
`minimum` / `maximum`, `allOf` of unlike types); see docs/constrain.md.

The build, host side, once per (grammar, tokenizer):

1. the schema is checked against its metaschema (`jsonschema`) and turned into a regex
   (`outlines_core.json_schema.build_regex_from_schema`);
2. the tokenizer's tokens are spelt as bytes (`specjax.constrain.vocabulary.token_bytes`) into an
   `outlines_core.Vocabulary` (cached per tokenizer), special tokens and the stop ids left out;
3. `outlines_core.Index(regex, vocabulary)` builds the token automaton;
4. its transitions are trimmed to the states from which an accepting state is still reachable (a
   token that leads nowhere completable is never allowed), renumbered from the initial state 0,
   and the stop ids are allowed exactly in the accepting states (leading back to the same state);
5. the tokens are grouped into classes of like transitions (`tables.from_transitions`);
6. the tables are padded to bucketed shapes (`padded_sizes`: four per power of two) so most
   grammars share a compiled program, checked against the memory budget, and returned as a
   `Constraint`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import warnings
import weakref
from typing import Any

import numpy as np

from specjax.constrain.tables import (ConstraintTables, check_vocab, from_transitions,
                                      pad_tables, padded_sizes, table_bytes)
from specjax.constrain.vocabulary import token_bytes

__all__ = ["DEFAULT_MAX_BYTES", "Constraint", "json_schema", "regex"]

DEFAULT_MAX_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True, eq=False)
class Constraint:
  """A grammar compiled over one tokenizer: what `specjax.generate(..., constraint=)` takes.

  Attributes:
    tables: the unstacked, padded `ConstraintTables` (NumPy-backed; moved to device by the call).
    pattern: the regex the automaton matches (for a JSON schema, the one built from it).
    schema: the JSON schema as a dict, or None for a regex.
    eos_ids: the stop ids, allowed exactly in accepting states.
    num_states: states before padding.
    num_transitions: allowed (state, token) pairs before padding, stop ids included.
    build_seconds: wall time of the build, the outlines-core index included.
    max_bytes: the memory budget it was built under; in a batch of several constraints, its
      tables padded to the batch's common shape (`stack_tables`) must still fit in it.
  """

  tables: ConstraintTables
  pattern: str
  schema: dict | None
  eos_ids: tuple[int, ...]
  num_states: int
  num_transitions: int
  build_seconds: float
  max_bytes: int = DEFAULT_MAX_BYTES

  @property
  def vocab_size(self) -> int:
    return self.tables.vocab_size

  @property
  def nbytes(self) -> int:
    return self.tables.nbytes

  def __repr__(self):
    what = "json_schema" if self.schema is not None else "regex"
    return (f"Constraint({what}, states={self.num_states}, transitions={self.num_transitions}, "
            f"vocab_size={self.vocab_size}, nbytes={self.nbytes})")


def json_schema(schema: dict | str, tokenizer, *, vocab_size: int | None = None,
                eos_ids=None, whitespace_pattern: str | None = None,
                max_recursion_depth: int = 3, max_bytes: int = DEFAULT_MAX_BYTES) -> Constraint:
  """Compiles a JSON Schema into a `Constraint`: output that parses as JSON and validates.

  Args:
    schema: the schema, a dict or a JSON string.
    tokenizer: the model's `specjax.io.Tokenizer`.
    vocab_size: the model's vocabulary size `V` (`model.vocab_size`, which may exceed the
      tokenizer's); None = the tokenizer's.
    eos_ids: the stop ids allowed once the JSON is complete; None = `tokenizer.eos_ids`.
    whitespace_pattern: regex for the whitespace allowed between JSON tokens; None =
      outlines-core's default (at most one space).
    max_recursion_depth: how deep recursive (`$ref`) schemas are unrolled.
    max_bytes: the tables' memory budget.

  Returns:
    A `Constraint`.

  Raises:
    ValueError: a string that is not JSON, an invalid schema or one outlines-core does not
      support, an empty language, a tokenizer larger than `vocab_size`, stop ids outside it, or
      tables over `max_bytes`.
  """
  if isinstance(schema, str):
    try:
      schema = json.loads(schema)
    except json.JSONDecodeError as error:
      raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
  if not isinstance(schema, (dict, bool)):
    raise ValueError(f"a JSON schema is a dict (or its JSON text), got {type(schema).__name__}")
  _check_schema(schema)
  from outlines_core.json_schema import build_regex_from_schema
  try:
    pattern = build_regex_from_schema(json.dumps(schema), whitespace_pattern,
                                      max_recursion_depth)
  except ValueError as error:
    raise ValueError(f"outlines-core cannot compile this JSON schema: {error}") from None
  return _build(pattern, tokenizer, schema=schema, vocab_size=vocab_size, eos_ids=eos_ids,
                max_bytes=max_bytes)


def regex(pattern: str, tokenizer, *, vocab_size: int | None = None, eos_ids=None,
          max_bytes: int = DEFAULT_MAX_BYTES) -> Constraint:
  """Compiles a regular expression (outlines-core's dialect, Rust `regex` syntax) into a
  `Constraint`: the output text, before the stop id, is a full match of `pattern`.

  Args:
    pattern: the regex (matched against the whole output, like `re.fullmatch`).
    tokenizer, vocab_size, eos_ids, max_bytes: as in `json_schema`.

  Returns:
    A `Constraint`.

  Raises:
    ValueError: an invalid regex, an empty language, or the vocabulary problems of
      `json_schema`.
  """
  if not isinstance(pattern, str):
    raise ValueError(f"a regex is a str, got {type(pattern).__name__}")
  return _build(pattern, tokenizer, schema=None, vocab_size=vocab_size, eos_ids=eos_ids,
                max_bytes=max_bytes)


def _check_schema(schema) -> None:
  try:
    import jsonschema
  except ImportError:  # the `grammar` extra brings it; without it outlines-core's checks remain
    return
  try:
    jsonschema.validators.validator_for(schema).check_schema(schema)
  except jsonschema.exceptions.SchemaError as error:
    where = "/".join(str(part) for part in error.path) or "(top level)"
    raise ValueError(f"invalid JSON schema at {where}: {error.message}") from None


def _check_tokenizer(tokenizer, vocab_size, eos_ids) -> tuple[int, tuple[int, ...]]:
  vocab_size = tokenizer.vocab_size if vocab_size is None else int(vocab_size)
  if tokenizer.vocab_size > vocab_size:
    raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary "
                     f"has {vocab_size}: this tokenizer does not belong to this model")
  eos_ids = tuple(tokenizer.eos_ids) if eos_ids is None else tuple(
      int(i) for i in np.atleast_1d(eos_ids))
  if not eos_ids:
    raise ValueError("a constraint needs at least one stop id (eos_ids), to end the output "
                     "where the grammar is complete")
  bad = [i for i in eos_ids if not 0 <= i < vocab_size]
  if bad:
    raise ValueError(f"stop ids {bad} are outside the model's vocabulary (size {vocab_size})")
  return vocab_size, eos_ids


_VOCABULARIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _vocabulary(tokenizer, eos_ids: tuple[int, ...]):
  """outlines-core's `Vocabulary` of the tokenizer's byte spellings, cached per tokenizer."""
  from outlines_core import Vocabulary
  cached = _VOCABULARIES.get(tokenizer, {})
  if eos_ids not in cached:
    by_bytes: dict[bytes, list[int]] = {}
    for index, spelling in enumerate(token_bytes(tokenizer)):
      if spelling is not None and index not in eos_ids:
        by_bytes.setdefault(spelling, []).append(index)
    cached[eos_ids] = Vocabulary(eos_ids[0], by_bytes)
    _VOCABULARIES[tokenizer] = cached
  return cached[eos_ids]


def _index(pattern: str, vocabulary):
  from outlines_core import Index
  try:
    return Index(pattern, vocabulary)
  except ValueError as error:
    message = str(error)
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        re.compile(pattern)
    except re.error as syntax:
      message = f"{message} ({syntax})"
    if "incompatible" in message and "characters: []" in message:
      raise ValueError(f"the regex {pattern!r} is unsatisfiable: no text matches it (empty "
                       f"language; outlines-core: {message})") from None
    if "incompatible" in message:
      raise ValueError(f"the tokenizer cannot spell the constraint {pattern!r}: "
                       f"{message}") from None
    raise ValueError(f"invalid regex {pattern!r}: {message}") from None


def _edges(transitions: dict, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """outlines-core's `{state: {token: next}}` as `(source, token, target)` int64 arrays, the
  stop id's transitions left out."""
  sources, tokens, targets = [], [], []
  for state, row in transitions.items():
    sources.append(np.full(len(row), state, np.int64))
    tokens.append(np.fromiter(row.keys(), np.int64, len(row)))
    targets.append(np.fromiter(row.values(), np.int64, len(row)))
  source, token, target = (np.concatenate(a) if a else np.zeros(0, np.int64)
                           for a in (sources, tokens, targets))
  keep = token != stop
  return source[keep], token[keep], target[keep]


def _trim(source, target, initial: int, finals: set) -> list[int]:
  """The states reachable from `initial` from which a final state is reachable, `initial`
  first, then in breadth-first order; empty when no final state can be reached."""
  width = int(max(source.max(initial=0), target.max(initial=0), initial)) + 1
  pairs = {divmod(int(key), width) for key in np.unique(source * width + target)}
  parents: dict[int, set] = {}
  children: dict[int, set] = {}
  for a, b in pairs:
    parents.setdefault(b, set()).add(a)
    children.setdefault(a, set()).add(b)
  live, frontier = set(finals), list(finals)
  while frontier:
    for parent in parents.get(frontier.pop(), ()):
      if parent not in live:
        live.add(parent)
        frontier.append(parent)
  if initial not in live:
    return []
  order, seen = [initial], {initial}
  for state in order:
    for child in sorted(children.get(state, ())):
      if child in live and child not in seen:
        seen.add(child)
        order.append(child)
  return order


def _build(pattern: str, tokenizer, *, schema, vocab_size, eos_ids, max_bytes) -> Constraint:
  start = time.perf_counter()
  vocab_size, eos_ids = _check_tokenizer(tokenizer, vocab_size, eos_ids)
  index = _index(pattern, _vocabulary(tokenizer, eos_ids))
  finals = set(index.get_final_states())
  source, token, target = _edges(index.get_transitions(), eos_ids[0])
  order = _trim(source, target, index.get_initial_state(), finals)
  what = "JSON schema" if schema is not None else f"regex {pattern!r}"
  if not order:
    raise ValueError(f"the {what} is unsatisfiable over this tokenizer: no text the tokens can "
                     f"spell is a full match (empty language)")
  # Renumber: state `order[i]` becomes `i`; edges into or out of dropped states go.
  known = np.asarray(sorted(order), np.int64)
  number = np.empty(len(known), np.int64)
  number[np.searchsorted(known, order)] = np.arange(len(order))
  renumber = lambda states: np.where(
      np.isin(states, known), number[np.clip(np.searchsorted(known, states), 0,
                                             len(known) - 1)], -1)
  source, target = renumber(source), renumber(target)
  keep = (source >= 0) & (target >= 0)
  source, token, target = source[keep], token[keep], target[keep]
  if not np.any(source == 0):
    raise ValueError(f"the {what} matches only the empty text: the initial state allows no "
                     f"token but the stop ids")
  # The stop ids: allowed in accepting states, leading back to the same state.
  accepting = np.asarray([state in finals for state in order])
  stops = np.asarray(sorted(set(eos_ids)), np.int64)
  final_ids = np.nonzero(accepting)[0]
  source = np.concatenate([source, np.repeat(final_ids, len(stops))])
  token = np.concatenate([token, np.tile(stops, len(final_ids))])
  target = np.concatenate([target, np.repeat(final_ids, len(stops))])
  num_states, num_transitions = len(order), len(token)
  tables = from_transitions(source, token, target, accepting, vocab_size)
  _check_budget(num_states, tables.num_classes, vocab_size, max_bytes, what)
  tables = pad_tables(tables)
  return Constraint(tables=tables, pattern=pattern, schema=schema, eos_ids=eos_ids,
                    num_states=num_states, num_transitions=num_transitions,
                    build_seconds=time.perf_counter() - start, max_bytes=int(max_bytes))


def _check_budget(num_states, num_classes, vocab_size, max_bytes, what) -> None:
  need = table_bytes(*padded_sizes(num_states, num_classes), vocab_size)
  if need > max_bytes:
    raise ValueError(f"the {what}'s tables need {need / 2**20:.1f} MiB ({num_states} states, "
                     f"{num_classes} token classes at V = {vocab_size}), over the budget "
                     f"max_bytes = {max_bytes / 2**20:.1f} MiB; simplify the grammar or raise "
                     f"max_bytes")


def check_constraint(constraint: Any, vocab_size: int) -> None:
  """Raises a ValueError unless `constraint` is a `Constraint` for a vocabulary of `vocab_size`."""
  if not isinstance(constraint, Constraint):
    raise ValueError(f"constraint must be a specjax.Constraint (sj.constrain.json_schema / "
                     f"sj.constrain.regex), got {type(constraint).__name__}")
  check_vocab(constraint.tables, vocab_size)


@dataclasses.dataclass(frozen=True)
class ConstraintInputs:
  """What a decoding call carries for its constraint: `tables` stacked over the distinct
  constraints (`[G, ...]`, jax arrays), `schema` `[B]` int32 each row's index into them, and the
  union of their stop ids."""

  tables: ConstraintTables
  schema: Any
  eos_ids: tuple[int, ...]

  def stop_ids(self, eos_ids) -> tuple[int, ...]:
    """A call's own stop ids (`-1` for none is dropped) joined with the constraints'."""
    return tuple(dict.fromkeys(int(i) for i in (*eos_ids, *self.eos_ids) if i >= 0))


def constraint_inputs(constraint, batch: int, vocab_size: int) -> ConstraintInputs:
  """Checks a call's `constraint=` (one `Constraint`, or a sequence of `batch` of them) against
  the batch and the model's vocabulary, and stacks the distinct ones' tables.

  Raises:
    ValueError: not a `Constraint`, a sequence of the wrong length, tables for another
      vocabulary size, or a constraint whose tables padded to the batch's common shape exceed
      its `max_bytes`.
  """
  import jax.numpy as jnp

  from specjax.constrain.tables import as_device, stack_tables

  rows = [constraint] * batch if isinstance(constraint, Constraint) else constraint
  if isinstance(rows, (str, bytes, dict)) or not hasattr(rows, "__len__"):
    raise ValueError(f"constraint must be a specjax.Constraint or a sequence of them, one per "
                     f"row, got {type(constraint).__name__}")
  rows = list(rows)
  if len(rows) != batch:
    raise ValueError(f"constraint is a sequence of {len(rows)} constraints but the batch has "
                     f"{batch} rows: pass one per row, or one Constraint for all")
  distinct: dict[int, int] = {}
  for row in rows:
    check_constraint(row, vocab_size)
    distinct.setdefault(id(row), len(distinct))
  unique = list({id(row): row for row in rows}.values())
  schema = jnp.asarray([distinct[id(row)] for row in rows], jnp.int32)
  eos_ids = tuple(dict.fromkeys(i for row in unique for i in row.eos_ids))
  stacked = stack_tables([row.tables for row in unique])
  share = stacked.nbytes // len(unique)  # one constraint's tables padded to the common shape
  for row in unique:
    if share > row.max_bytes:
      raise ValueError(f"in this batch of {len(unique)} distinct constraints, each one's tables "
                       f"are padded to {stacked.num_states} states and "
                       f"{stacked.num_classes} token classes ({share / 2**20:.2f} MiB), over "
                       f"the budget of {row!r} (max_bytes = {row.max_bytes / 2**20:.2f} MiB); "
                       f"batch grammars of similar sizes together or raise its max_bytes")
  return ConstraintInputs(as_device(stacked), schema, eos_ids)
