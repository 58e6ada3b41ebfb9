"""A token-level automaton as fixed device tables, and the pure-jnp operations on them.

A grammar compiled over a tokenizer (`specjax.constrain.compile`) is a deterministic finite
automaton whose alphabet is the model's token ids. On device it is four arrays, never a dense
`[S, V]` transition matrix (at `V = 151,936` that is 600 KB per state):

* `allowed [S, ceil(V / 32)]` uint32: bit `t % 32` of word `t // 32` is set when token `t` is
  allowed in state `s`. Ids past the tokenizer's vocabulary (the model's padding rows) are never
  set. A state whose row is all zero allows nothing: a dead state (`is_dead`).
* transitions in CSR form: state `s`'s allowed tokens are `tokens[offsets[s] : offsets[s + 1]]`,
  sorted ascending, and `next_state` holds the state each one leads to. The token sets of
  `allowed` and of the CSR rows are the same.
* `accepting [S]` bool: the states where the text so far is a whole match. The stop ids are
  allowed exactly there (and lead back to the same state).
* `initial` int32: the start state.

`advance(tables, state, token)` returns `DEAD = -1` for a token the state does not allow, and
from `DEAD` (which allows nothing) it stays `DEAD`.

Several automata (one per schema of a ragged batch) stack into one `ConstraintTables` with a
leading schema axis `[G, ...]` (`stack_tables`), every field padded to the largest: padding
states allow nothing and have empty CSR rows. The operations then take a per-row `schema` index.

Every operation is elementwise over leading axes and jit / vmap friendly; the tables are traced
arguments, so another grammar with tables of the same shapes runs the same compiled program
(`pad_tables` rounds shapes up to buckets so that most grammars share one).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DEAD", "ConstraintTables", "advance", "allowed_mask", "as_device", "check_vocab",
           "is_dead", "mask_logits", "pad_tables", "padded_sizes", "stack_tables", "table_bytes",
           "token_allowed"]

DEAD = -1  # the state after a disallowed token; it allows nothing

WORD_BITS = 32


def words_for(vocab_size: int) -> int:
  """uint32 words per bitmask row: `ceil(vocab_size / 32)`."""
  return -(-vocab_size // WORD_BITS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConstraintTables:
  """A token automaton's device tables (see the module doc); `G` = schemas when stacked.

  Attributes:
    allowed: `[(G,) S, ceil(V / 32)]` uint32 bitmask of each state's allowed tokens.
    offsets: `[(G,) S + 1]` int32 CSR row starts into `tokens` / `next_state`.
    tokens: `[(G,) N]` int32 allowed tokens, ascending within each state's row.
    next_state: `[(G,) N]` int32 the state each of them leads to.
    accepting: `[(G,) S]` bool states where the text is a whole match (stop ids allowed).
    initial: `[(G,)]` int32 start state.
    vocab_size: static: the model's vocabulary size `V` (masks are `[..., V]`).
  """

  allowed: jax.Array
  offsets: jax.Array
  tokens: jax.Array
  next_state: jax.Array
  accepting: jax.Array
  initial: jax.Array
  vocab_size: int = dataclasses.field(metadata=dict(static=True))

  @property
  def stacked(self) -> bool:
    """Whether the tables carry a leading schema axis."""
    return self.accepting.ndim == 2

  @property
  def num_schemas(self) -> int:
    return self.accepting.shape[0] if self.stacked else 1

  @property
  def num_states(self) -> int:
    return self.accepting.shape[-1]

  @property
  def num_transitions(self) -> int:
    return self.tokens.shape[-1]

  @property
  def nbytes(self) -> int:
    """Bytes of device memory the tables take."""
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(self))

  def memory_report(self) -> dict:
    """Bytes per table, and the shapes, as plain Python numbers."""
    fields = ("allowed", "offsets", "tokens", "next_state", "accepting", "initial")
    report = {name: int(getattr(self, name).nbytes) for name in fields}
    report.update(total=self.nbytes, schemas=self.num_schemas, states=self.num_states,
                  transitions=self.num_transitions, vocab_size=self.vocab_size)
    return report


def search_steps(tables: ConstraintTables) -> int:
  """Binary-search steps that cover any CSR row: `bit_length` of the widest row possible with
  these shapes (a row holds at most `min(N, V)` tokens). Shapes only, so no grammar recompiles."""
  return max(1, min(tables.num_transitions, tables.vocab_size).bit_length())


def as_device(tables: ConstraintTables) -> ConstraintTables:
  """The tables as jax arrays (a no-op for jax arrays and tracers)."""
  return jax.tree.map(jnp.asarray, tables)


def _schema_and_state(tables: ConstraintTables, state, schema):
  state = jnp.asarray(state, jnp.int32)
  if tables.stacked:
    if schema is None:
      raise ValueError("stacked ConstraintTables need a per-row `schema` index")
    return jnp.broadcast_to(jnp.asarray(schema, jnp.int32), state.shape), state
  return None, state


def _take(table: jax.Array, schema, index) -> jax.Array:
  """`table[schema, index]` (stacked) or `table[index]`, with `index` clipped into range."""
  index = jnp.clip(index, 0, table.shape[-1] - 1)
  return table[index] if schema is None else table[schema, index]


def allowed_words(tables: ConstraintTables, state, schema=None) -> jax.Array:
  """`[..., ceil(V / 32)]` uint32 bitmask rows of `state` (`[...]` int32); `DEAD` gives zeros."""
  tables = as_device(tables)
  schema, state = _schema_and_state(tables, state, schema)
  safe = jnp.clip(state, 0, tables.num_states - 1)
  rows = tables.allowed[safe] if schema is None else tables.allowed[schema, safe]
  return jnp.where((state >= 0)[..., None], rows, jnp.uint32(0))


def allowed_mask(tables: ConstraintTables, state, schema=None) -> jax.Array:
  """`[..., V]` bool: the tokens `state` allows (`[...]` int32 states; `schema` `[...]` int32
  when the tables are stacked). `DEAD` allows nothing."""
  words = allowed_words(tables, state, schema)
  bits = jnp.arange(WORD_BITS, dtype=jnp.uint32)
  mask = ((words[..., :, None] >> bits) & jnp.uint32(1)).astype(bool)
  return mask.reshape(*mask.shape[:-2], -1)[..., :tables.vocab_size]


def token_allowed(tables: ConstraintTables, state, token, schema=None) -> jax.Array:
  """`[...]` bool: whether `state` allows `token` (one bit read, no unpacked mask)."""
  token = jnp.asarray(token, jnp.int32)
  words = allowed_words(tables, state, schema)
  word = jnp.take_along_axis(words, jnp.clip(token // WORD_BITS, 0, words.shape[-1] - 1)[..., None],
                             axis=-1)[..., 0]
  bit = (word >> (token % WORD_BITS).astype(jnp.uint32)) & jnp.uint32(1)
  return (bit == 1) & (token >= 0) & (token < tables.vocab_size)


def is_dead(tables: ConstraintTables, state, schema=None) -> jax.Array:
  """`[...]` bool: `state` allows no token (`DEAD`, or a state whose bitmask row is all zero)."""
  return ~jnp.any(allowed_words(tables, state, schema) != 0, axis=-1)


def advance(tables: ConstraintTables, state, token, schema=None) -> jax.Array:
  """The state after `token`: `[...]` int32, `DEAD` where `state` does not allow it.

  A lower-bound binary search of `token` in the state's sorted CSR row, a fixed number of
  `lax.fori_loop` steps (`search_steps`), elementwise over the leading axes.

  Args:
    tables: the automaton (stacked or not).
    state: `[...]` int32 states (`DEAD` stays `DEAD`).
    token: `[...]` int32 token ids.
    schema: `[...]` int32 schema index per element, for stacked tables.
  """
  tables = as_device(tables)
  schema, state = _schema_and_state(tables, state, schema)
  token = jnp.asarray(token, jnp.int32)
  live = state >= 0
  low = jnp.where(live, _take(tables.offsets, schema, state), 0)
  end = jnp.where(live, _take(tables.offsets, schema, state + 1), 0)

  def step(_, bounds):
    low, high = bounds
    mid = (low + high) // 2
    searching = low < high
    right = searching & (_take(tables.tokens, schema, mid) < token)
    return jnp.where(right, mid + 1, low), jnp.where(searching & ~right, mid, high)

  low, _ = jax.lax.fori_loop(0, search_steps(tables), step, (low, end))
  found = live & (low < end) & (_take(tables.tokens, schema, low) == token)
  return jnp.where(found, _take(tables.next_state, schema, low), jnp.int32(DEAD))


def mask_logits(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """`logits` with every token outside `mask` (`[..., V]` bool) set to `-inf`."""
  return jnp.where(mask, logits, jnp.asarray(-jnp.inf, logits.dtype))


def check_vocab(tables: ConstraintTables, vocab_size: int, what: str = "model") -> None:
  """Raises a ValueError unless the tables were built for a vocabulary of `vocab_size` ids (a
  drafter or model with another vocabulary cannot share them)."""
  if int(vocab_size) != tables.vocab_size:
    raise ValueError(f"the constraint's tables are for a vocabulary of {tables.vocab_size} ids "
                     f"but the {what} has {int(vocab_size)}; build the constraint with "
                     f"vocab_size={int(vocab_size)}")


def _bucket(n: int, minimum: int) -> int:
  """`n` rounded up to `m * 2 ** e` with `m` in {4, 5, 6, 7} (at most 25% more; four buckets
  per octave), at least `minimum`."""
  n = int(n)
  if n <= minimum:
    return minimum
  quantum = 1 << max(0, (n - 1).bit_length() - 3)
  return -(-n // quantum) * quantum


def padded_sizes(num_states: int, num_transitions: int) -> tuple[int, int]:
  """`(S, N)` that `pad_tables` pads to by default: four sizes per power of two, at least 16
  and 1024, so that most grammars share a compiled program and padding costs at most 25%."""
  return _bucket(num_states, 16), _bucket(num_transitions, 1024)


def table_bytes(num_states: int, num_transitions: int, vocab_size: int) -> int:
  """Bytes of unstacked tables of `num_states` and `num_transitions` (exact sizes)."""
  return (num_states * words_for(vocab_size) * 4 + (num_states + 1) * 4 + num_transitions * 8
          + num_states + 4)


def pad_tables(tables: ConstraintTables, num_states: int | None = None,
               num_transitions: int | None = None) -> ConstraintTables:
  """The same automaton with more (unreachable, dead) states and unused transition slots.

  Args:
    tables: unstacked tables.
    num_states: `S` to pad to; None = `padded_sizes`' bucket.
    num_transitions: `N` to pad to; None = `padded_sizes`' bucket.

  Returns:
    Tables of the padded shapes (NumPy-backed); walks and masks are unchanged.
  """
  if tables.stacked:
    raise ValueError("pad_tables takes unstacked tables (stack_tables pads stacked ones)")
  states, count = tables.num_states, tables.num_transitions
  default_states, default_transitions = padded_sizes(states, count)
  num_states = default_states if num_states is None else int(num_states)
  num_transitions = default_transitions if num_transitions is None else int(num_transitions)
  if num_states < states or num_transitions < count:
    raise ValueError(f"cannot pad tables of {states} states and {count} transitions down to "
                     f"{num_states} and {num_transitions}")
  grow = lambda array, size, value: np.concatenate(
      [np.asarray(array), np.full((size - array.shape[0], *array.shape[1:]), value,
                                  np.asarray(array).dtype)])
  offsets = np.asarray(tables.offsets)
  return ConstraintTables(
      allowed=grow(tables.allowed, num_states, 0),
      offsets=grow(offsets, num_states + 1, offsets[-1]),
      tokens=grow(tables.tokens, num_transitions, np.iinfo(np.int32).max),
      next_state=grow(tables.next_state, num_transitions, DEAD),
      accepting=grow(tables.accepting, num_states, False),
      initial=np.asarray(tables.initial, np.int32), vocab_size=tables.vocab_size)


def stack_tables(tables) -> ConstraintTables:
  """Stacks unstacked tables (one per schema) along a new leading schema axis.

  Each is padded (`pad_tables`) to the largest `S` and `N` among them; all must share one
  vocabulary size. Rows then pick their schema with a `[B]` int32 index into the stack.

  Args:
    tables: a sequence of unstacked `ConstraintTables`.

  Returns:
    Stacked `ConstraintTables` (`[G, ...]` fields, `initial [G]`).
  """
  tables = list(tables)
  if not tables:
    raise ValueError("stack_tables needs at least one ConstraintTables")
  if any(t.stacked for t in tables):
    raise ValueError("stack_tables takes unstacked tables")
  sizes = {t.vocab_size for t in tables}
  if len(sizes) > 1:
    raise ValueError(f"stacked tables must share one vocabulary size, got {sorted(sizes)}")
  states = max(t.num_states for t in tables)
  count = max(t.num_transitions for t in tables)
  padded = [pad_tables(t, states, count) for t in tables]
  return jax.tree.map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *padded)
