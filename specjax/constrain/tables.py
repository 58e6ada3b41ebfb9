"""A token-level automaton as fixed device tables, and the pure-jnp operations on them.

A grammar compiled over a tokenizer (`specjax.constrain.compile`) is a deterministic finite
automaton whose alphabet is the model's token ids. On device it is four arrays, never a dense
`[S, V]` transition matrix (at `V = 151,936` that is 600 KB per state):

* `classes [V]` int32: each token's class. Two tokens share a class when they lead every state
  to the same next state (or are refused by the same states): inside a JSON string every
  ordinary 3-character token behaves alike, so the 151,936 ids of Qwen2.5-Coder's tokenizer fall
  into a few hundred classes for a tool-call schema. Class 0 holds the tokens no state allows
  (special tokens, the model's padding rows).
* `next_state [S, C]` int32: the state class `c` leads state `s` to, or `DEAD` where `s` does not
  allow it. A state's allowed tokens are the tokens whose class leads somewhere
  (`allowed_mask`: one gather of `V` entries from the state's row); a state that allows nothing
  is dead (`is_dead`).
* `accepting [S]` bool: the states where the text so far is a whole match. The stop ids are
  allowed exactly there (and lead back to the same state).
* `initial` int32: the start state.

Why classes and not a bitmask with sorted per-state transition lists (CSR). Measured with
Qwen2.5-Coder's tokenizer on the benchmark's tool schemas (`benchmarks.constrained`): a string
field allows almost every token in each of its states, so a CSR holds about `S x V` entries: a
four-field e-mail schema (1,704 states) had 23.5 million transitions, 293 MiB with its bitmask,
against 427 classes, under 4 MiB here. A step also looks its next state up directly
(`next_state[s, classes[t]]`) instead of searching a row.

`advance(tables, state, token)` returns `DEAD = -1` for a token the state does not allow, and
from `DEAD` (which allows nothing) it stays `DEAD`.

Several automata (one per schema of a ragged batch) stack into one `ConstraintTables` with a
leading schema axis `[G, ...]` (`stack_tables`), padded to the largest `S` and `C`: padding
states allow nothing and padding classes are never used. The operations then take a per-row
`schema` index.

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
           "from_transitions", "is_dead", "mask_logits", "pad_tables", "padded_sizes",
           "stack_tables", "table_bytes", "token_allowed"]

DEAD = -1  # the state after a disallowed token; it allows nothing


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConstraintTables:
  """A token automaton's device tables (see the module doc); `G` = schemas when stacked.

  Attributes:
    classes: `[(G,) V]` int32 each token's class (0: allowed nowhere).
    next_state: `[(G,) S, C]` int32 the state a class leads each state to, `DEAD` where refused.
    accepting: `[(G,) S]` bool states where the text is a whole match (stop ids allowed).
    initial: `[(G,)]` int32 start state.
    vocab_size: static: the model's vocabulary size `V` (masks are `[..., V]`).
  """

  classes: jax.Array
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
  def num_classes(self) -> int:
    return self.next_state.shape[-1]

  @property
  def nbytes(self) -> int:
    """Bytes of device memory the tables take."""
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(self))

  def memory_report(self) -> dict:
    """Bytes per table, and the shapes, as plain Python numbers."""
    fields = ("classes", "next_state", "accepting", "initial")
    report = {name: int(getattr(self, name).nbytes) for name in fields}
    report.update(total=self.nbytes, schemas=self.num_schemas, states=self.num_states,
                  token_classes=self.num_classes, vocab_size=self.vocab_size)
    return report


def from_transitions(source, token, target, accepting, vocab_size: int,
                     initial: int = 0) -> ConstraintTables:
  """Tables (NumPy-backed, unpadded) of the automaton with transitions `source -> target` on
  `token` (three int arrays of one length; states `0 .. len(accepting) - 1`).

  The token classes come from each token's transition set: a 64-bit hash of its
  `(source, target)` pairs groups the tokens, and the result is then checked exactly (every
  transition read back from the class table, and every token's count of transitions equal to
  its class's), so a hash collision raises instead of merging unlike tokens.

  Raises:
    ValueError: a token outside `[0, vocab_size)`, a state out of range, or two transitions
      from one state on one token.
  """
  source = np.asarray(source, np.int64)
  token = np.asarray(token, np.int64)
  target = np.asarray(target, np.int64)
  accepting = np.asarray(accepting, bool)
  states = len(accepting)
  if len(token) and (token.min() < 0 or token.max() >= vocab_size):
    raise ValueError(f"transition tokens must lie in [0, {vocab_size})")
  if len(source) and (min(source.min(), target.min()) < 0
                      or max(source.max(), target.max()) >= states):
    raise ValueError(f"transition states must lie in [0, {states})")
  with np.errstate(over="ignore"):
    # Each (source, target) pair as one 64-bit key through the splitmix64 finalizer: sums of
    # these pseudo-random words identify a token's transition set.
    pair = (source.astype(np.uint64) << np.uint64(32)) | target.astype(np.uint64)
    pair = (pair ^ (pair >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    pair = (pair ^ (pair >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    pair = pair ^ (pair >> np.uint64(31))
    order = np.argsort(token, kind="stable")
    sorted_tokens = token[order]
    starts = np.flatnonzero(np.r_[True, sorted_tokens[1:] != sorted_tokens[:-1]]) if len(
        order) else np.zeros(0, np.int64)
    present = sorted_tokens[starts]
    sums = np.add.reduceat(pair[order], starts) if len(order) else np.zeros(0, np.uint64)
  counts = np.diff(np.append(starts, len(order)))
  _, inverse = np.unique(np.stack([sums, counts.astype(np.uint64)], axis=1), axis=0,
                         return_inverse=True)
  classes = np.zeros(vocab_size, np.int32)
  classes[present] = inverse.reshape(-1) + 1
  num_classes = int(classes.max()) + 1
  next_state = np.full((states, num_classes), DEAD, np.int32)
  next_state[source, classes[token]] = target
  per_class = np.count_nonzero(next_state >= 0, axis=0)
  if (not np.array_equal(next_state[source, classes[token]], target)
      or not np.array_equal(per_class[classes[present]], counts)):
    if len(np.unique(source * vocab_size + token)) != len(token):
      raise ValueError("the automaton is not deterministic: a state has two transitions on one "
                       "token")
    raise RuntimeError("token classes: a 64-bit hash collision merged unlike tokens")
  return ConstraintTables(classes=classes, next_state=next_state, accepting=accepting,
                          initial=np.asarray(initial, np.int32), vocab_size=int(vocab_size))


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


def _rows(tables: ConstraintTables, state, schema):
  """`(rows [..., C], schema or None)`: each state's `next_state` row, all `DEAD` for `DEAD`."""
  tables = as_device(tables)
  schema, state = _schema_and_state(tables, state, schema)
  safe = jnp.clip(state, 0, tables.num_states - 1)
  rows = tables.next_state[safe] if schema is None else tables.next_state[schema, safe]
  return jnp.where((state >= 0)[..., None], rows, jnp.int32(DEAD)), schema


def allowed_mask(tables: ConstraintTables, state, schema=None) -> jax.Array:
  """`[..., V]` bool: the tokens `state` allows (`[...]` int32 states; `schema` `[...]` int32
  when the tables are stacked). `DEAD` allows nothing."""
  rows, schema = _rows(tables, state, schema)
  classes = jnp.asarray(tables.classes)
  if schema is None:
    return rows[..., classes] >= 0
  return jnp.take_along_axis(rows, classes[schema], axis=-1) >= 0


def advance(tables: ConstraintTables, state, token, schema=None) -> jax.Array:
  """The state after `token`: `[...]` int32, `DEAD` where `state` does not allow it (or the token
  is outside the vocabulary), elementwise over the leading axes.

  Args:
    tables: the automaton (stacked or not).
    state: `[...]` int32 states (`DEAD` stays `DEAD`).
    token: `[...]` int32 token ids.
    schema: `[...]` int32 schema index per element, for stacked tables.
  """
  rows, schema = _rows(tables, state, schema)
  token = jnp.asarray(token, jnp.int32)
  inside = (token >= 0) & (token < tables.vocab_size)
  safe = jnp.clip(token, 0, tables.vocab_size - 1)
  classes = jnp.asarray(tables.classes)
  cls = classes[safe] if schema is None else classes[schema, safe]
  nxt = jnp.take_along_axis(rows, cls[..., None], axis=-1)[..., 0]
  return jnp.where(inside, nxt, jnp.int32(DEAD))


def token_allowed(tables: ConstraintTables, state, token, schema=None) -> jax.Array:
  """`[...]` bool: whether `state` allows `token` (one lookup, no `[..., V]` mask)."""
  return advance(tables, state, token, schema) >= 0


def is_dead(tables: ConstraintTables, state, schema=None) -> jax.Array:
  """`[...]` bool: `state` allows no token (`DEAD`, or a state whose row leads nowhere)."""
  rows, _ = _rows(tables, state, schema)
  return ~jnp.any(rows >= 0, axis=-1)


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


def padded_sizes(num_states: int, num_classes: int) -> tuple[int, int]:
  """`(S, C)` that `pad_tables` pads to by default: four sizes per power of two, at least 16
  states and 64 classes, so that most grammars share a compiled program and padding costs at
  most 25% per axis."""
  return _bucket(num_states, 16), _bucket(num_classes, 64)


def table_bytes(num_states: int, num_classes: int, vocab_size: int) -> int:
  """Bytes of unstacked tables of `num_states` states and `num_classes` classes."""
  return num_states * num_classes * 4 + vocab_size * 4 + num_states + 4


def pad_tables(tables: ConstraintTables, num_states: int | None = None,
               num_classes: int | None = None) -> ConstraintTables:
  """The same automaton with more (unreachable, dead) states and unused classes.

  Args:
    tables: unstacked tables.
    num_states: `S` to pad to; None = `padded_sizes`' bucket.
    num_classes: `C` to pad to; None = `padded_sizes`' bucket.

  Returns:
    Tables of the padded shapes (NumPy-backed); walks and masks are unchanged.
  """
  if tables.stacked:
    raise ValueError("pad_tables takes unstacked tables (stack_tables pads stacked ones)")
  states, classes = tables.num_states, tables.num_classes
  default_states, default_classes = padded_sizes(states, classes)
  num_states = default_states if num_states is None else int(num_states)
  num_classes = default_classes if num_classes is None else int(num_classes)
  if num_states < states or num_classes < classes:
    raise ValueError(f"cannot pad tables of {states} states and {classes} classes down to "
                     f"{num_states} and {num_classes}")
  next_state = np.full((num_states, num_classes), DEAD, np.int32)
  next_state[:states, :classes] = np.asarray(tables.next_state)
  accepting = np.zeros(num_states, bool)
  accepting[:states] = np.asarray(tables.accepting)
  return ConstraintTables(classes=np.asarray(tables.classes, np.int32), next_state=next_state,
                          accepting=accepting, initial=np.asarray(tables.initial, np.int32),
                          vocab_size=tables.vocab_size)


def stack_tables(tables) -> ConstraintTables:
  """Stacks unstacked tables (one per schema) along a new leading schema axis.

  Each is padded (`pad_tables`) to the largest `S` and `C` among them; all must share one
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
  classes = max(t.num_classes for t in tables)
  padded = [pad_tables(t, states, classes) for t in tables]
  return jax.tree.map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *padded)
