"""Suffix drafting (SuffixDecoding-style): the longest match of a row's suffix, in its own text and
in a shared corpus of earlier outputs, continued by the most frequent next token.

**What is matched.** Each round, row `b` looks for the longest `m <= max_match` such that its last
`m` tokens occurred earlier, (a) in its own prompt + generated text and (b) in a `SuffixCorpus`
(a fixed-capacity token array of earlier outputs the caller passes in). Every occurrence of that
longest context is a candidate continuation (the tokens that followed it). The draft is a greedy
walk by frequency: at each step the next token is the one most candidates still agreeing with the
draft so far continue with, and `p_d` = its share of them (an empirical conditional probability;
a candidate whose text ends there votes for "stop"). The longest context is preferred over a more
frequent shorter one: a longer match pins the situation down (in code and chat, the same 8 tokens
are followed by the same thing far more often than the same 2 are), and its counts still rank its
continuations. This is SuffixDecoding's walk (frequency-scored paths below the matched node) on
the chain protocol.

**How much is drafted.** Row `b` drafts `num_drafted = min(n, limits[b])` tokens, `n` the first
step at which (i) `n >= ceil(spec_factor * m)` (a short match earns a short draft), or (ii) the
product `p_0 ... p_n` falls below `min_prob` (the continuation rarely agrees), or (iii) no
candidate continues. No match at all drafts nothing: the round is a plain target step. The
defaults (`spec_factor` 8, `min_prob` 0) draft as far as the candidates go: specjax verifies a
fixed `k + 1`-token block, so a shorter draft saves no verify work, only accepted tokens (on the
agent prompt set, k = 6, greedy: tau 3.00 against 2.92 with 2 and 0.1; see docs/benchmarks.md).
Lower them where verify cost grows with the draft; in a tree they bound which nodes are kept.
The tokens are copied deterministically, so `Proposal.logits = None` (a point-mass q): the verify
rule stays exact under any sampling settings, and greedy output is token-identical to greedy
decoding.

**The corpus index: a sorted array of left contexts (the suffix array of the reversed text).**
`SuffixCorpus.order [C]` lists the corpus slots sorted by the tokens *before* them, nearest first
(slot `j`'s key is `tokens[j-1], tokens[j-2], ..., tokens[j-depth]`). The row's suffix read
backwards is then one pattern whose prefixes are all the contexts `m = 1, 2, ...`, so their
occurrence ranges are nested: matching walks `m` upward, each level two binary searches on one
token inside the previous range, and the final range `[lo, hi)` both counts the occurrences and
lists their continuation slots (`order[lo:hi]`). Per round and row: `O(max_match log C)` scalar
gathers, depth `O(max_match log C)`, independent of the text. The alternatives: a forward suffix
array needs a separate search per `m` (the suffixes of a suffix are not its prefixes),
`O(max_match^2 log C)`; a suffix automaton or suffix tree has pointer-chasing construction with
data-dependent sizes, awkward under static shapes; a hashed index per context length costs
`O(C max_match)` memory and still needs collision checks. Memory: `tokens` and `order`, `8 C`
bytes. Building the order is prefix doubling (Manber-Myers) on the left contexts:
`ceil(log2 depth)` stable sorts, `O(C log C log depth)`, on device; `append` rebuilds it (appends
happen between `decode` calls, not per round). Up to `num_candidates` occurrences are read per
source (evenly spread over the range, each weighted `count / read`, so frequencies are exact when
`count <= num_candidates`); the walk is `O(num_candidates^2 k)`.

The row's own text changes every round, so it is not indexed: a vectorised scan computes, for
every earlier position, the length of the common left context with the row's end, `O(S max_match)`
per row and round for a buffer of `S` tokens. A match that ends `p` tokens before the row's end
continues with period `p` (an overlapping copy, as prompt lookup does).

**The corpus is a ring buffer.** Sequences are stored back to back, each followed by a separator
(-1, also the value of a never-written slot; contexts and continuations stop at it). `append`
writes at `head` and wraps, overwriting the oldest text; one append larger than the capacity keeps
its last `C` slots. Reads are circular, which is what a ring needs: the newest text ends in a
separator, so nothing runs from the newest into the oldest.

**Threading a corpus through calls.** `SuffixDrafter` is a pytree whose corpus arrays are traced
leaves (`max_match`, ... and the corpus's capacity and depth are static), so `decode` with a new
corpus of the same capacity reuses its compiled program:

    corpus = sj.drafters.SuffixCorpus.from_sequences(earlier_outputs, capacity=100_000)
    for ids, lengths in requests:
      out = sj.decode(target, sj.SuffixDrafter(corpus=corpus), ids, rng, lengths=lengths, ...)
      corpus = corpus.append(out.tokens, out.num_tokens)   # jitted, on device

Trees: `specjax.decode(target, SuffixDrafter(...), ..., tree=TreeSpec("ngram", depth=D,
width=M))` drafts the `M` most frequent distinct continuations merged into a trie
(`specjax.drafters.suffix_tree`) in place of prompt lookup's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import TextOnlyDrafter
from specjax.drafters.proposal import Proposal
from specjax.core.tracing import TRACE_COUNTS
from specjax.core.validation import check_count

__all__ = ["SEPARATOR", "SuffixCorpus", "SuffixDrafter", "corpus_match", "row_match"]

SEPARATOR = -1  # between sequences and in never-written slots; never matched
_STATIC = dict(static=True)


def _is_array(value) -> bool:
  return isinstance(value, (jax.Array, np.ndarray))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SuffixCorpus:
  """A shared corpus of earlier outputs, indexed for suffix matching (see the module docstring).

  Build one with `SuffixCorpus.from_sequences` (or `empty`); `append` adds finished outputs on
  device and returns the new corpus.

  Attributes:
    tokens: `[C]` int32 token ids, `SEPARATOR` after every sequence and in unwritten slots.
    order: `[C]` int32, the slots sorted by their left context (nearest token first), ties by slot.
    head: `[]` int32, the slot the next append writes first.
    size: `[]` int32, slots written so far (at most `C`).
    depth: static; the left-context length `order` is sorted by (a drafter matches at most this).
  """

  tokens: jax.Array  # [C] int32
  order: jax.Array  # [C] int32
  head: jax.Array  # [] int32
  size: jax.Array  # [] int32
  depth: int = dataclasses.field(default=32, metadata=_STATIC)

  def __post_init__(self):
    check_count(self.depth, "SuffixCorpus depth")
    for name in ("tokens", "order"):
      value = getattr(self, name)
      if not _is_array(value):
        continue  # a pytree placeholder (jax rebuilds dataclasses with sentinels)
      if value.ndim != 1 or value.dtype != jnp.int32:
        raise ValueError(f"SuffixCorpus.{name} must be a rank-1 int32 array [capacity], got "
                         f"{value.dtype}{list(value.shape)}")
      if value.shape[0] < 1:
        raise ValueError("SuffixCorpus needs a capacity >= 1, got an empty array")
    if _is_array(self.tokens) and _is_array(self.order) and self.tokens.shape != self.order.shape:
      raise ValueError(f"SuffixCorpus.tokens {list(self.tokens.shape)} and order "
                       f"{list(self.order.shape)} differ in shape")

  @property
  def capacity(self) -> int:
    return self.tokens.shape[0]

  @classmethod
  def empty(cls, capacity: int, depth: int = 32) -> SuffixCorpus:
    """A corpus of `capacity` slots with nothing in it."""
    return cls.from_sequences([], capacity, depth=depth)

  @classmethod
  def from_sequences(cls, sequences: Sequence[Sequence[int]], capacity: int, depth: int = 32
                     ) -> SuffixCorpus:
    """A corpus holding `sequences` (lists or 1-D integer arrays of token ids >= 0) back to back,
    each followed by a separator; if they need more than `capacity` slots, the oldest (first) are
    dropped, as the ring buffer would.

    Raises:
      ValueError: `capacity` or `depth` not an int >= 1, a sequence that is not 1-D integers, or
        a negative token id.
    """
    check_count(capacity, "SuffixCorpus capacity")
    check_count(depth, "SuffixCorpus depth")
    stream = []
    for i, sequence in enumerate(sequences):
      array = np.asarray(sequence)
      if array.size == 0:
        array = array.astype(np.int32).reshape(0)
      if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"SuffixCorpus.from_sequences: sequence {i} must be 1-D integer token "
                         f"ids, got {array.dtype}{list(array.shape)}")
      if array.size and array.min() < 0:
        raise ValueError(f"SuffixCorpus.from_sequences: sequence {i} has a negative token id")
      stream.extend([array.astype(np.int32), np.asarray([SEPARATOR], np.int32)])
    stream = np.concatenate(stream) if stream else np.zeros((0,), np.int32)
    stream = stream[-capacity:]
    tokens = np.full((capacity,), SEPARATOR, np.int32)
    tokens[:len(stream)] = stream
    tokens = jnp.asarray(tokens)
    return cls(tokens, build_order(tokens, depth), jnp.int32(len(stream) % capacity),
               jnp.int32(len(stream)), depth)

  def append(self, tokens: jax.Array, lengths: jax.Array) -> SuffixCorpus:
    """The corpus with row `b`'s first `lengths[b]` tokens of `tokens [B, T]` added (in row order,
    each followed by a separator), overwriting the oldest slots when full; the index is rebuilt.
    Jitted (one trace per shape); callable inside the caller's own `jax.jit`.

    Raises:
      ValueError: `tokens` not a rank-2 integer array or `lengths` not rank-1 of its batch size.
    """
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"SuffixCorpus.append needs tokens [B, T] of integers, got "
                       f"{tokens.dtype}{list(tokens.shape)}")
    if lengths.ndim != 1 or lengths.shape[0] != tokens.shape[0]:
      raise ValueError(f"SuffixCorpus.append needs lengths [{tokens.shape[0]}], got "
                       f"{list(lengths.shape)}")
    return _append(self, tokens, lengths)


@functools.partial(jax.jit, static_argnames=("depth",))
def build_order(tokens: jax.Array, depth: int) -> jax.Array:
  """The slots of the circular text `tokens [C]` sorted by their left context of `depth` tokens
  (nearest first), ties by slot: prefix doubling, `ceil(log2 depth)` stable sorts."""
  capacity = tokens.shape[0]
  slots = jnp.arange(capacity, dtype=jnp.int32)
  rank = jnp.take(tokens, (slots - 1) % capacity) + 1  # the context of length 1; separator = 0
  span = 1
  while span < depth:  # rank: the context of length `span`; pair it with the one `span` back
    earlier = jnp.take(rank, (slots - span) % capacity)
    order = jnp.lexsort((earlier, rank))
    first, second = rank[order], earlier[order]
    new = jnp.concatenate([jnp.zeros((1,), bool),
                           (first[1:] != first[:-1]) | (second[1:] != second[:-1])])
    rank = jnp.zeros_like(rank).at[order].set(jnp.cumsum(new, dtype=jnp.int32))
    span *= 2
  return jnp.argsort(rank, stable=True).astype(jnp.int32)


@jax.jit
def _append(corpus: SuffixCorpus, tokens: jax.Array, lengths: jax.Array) -> SuffixCorpus:
  TRACE_COUNTS["suffix_append"] += 1
  batch, width = tokens.shape
  capacity = corpus.capacity
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, width)
  starts = jnp.cumsum(lengths + 1) - (lengths + 1)  # [B] where each row begins in the stream
  total = jnp.sum(lengths + 1)
  column = jnp.arange(width + 1, dtype=jnp.int32)[None, :]  # [1, T + 1]: T tokens + a separator
  padded = jnp.concatenate([tokens.astype(jnp.int32), jnp.zeros((batch, 1), jnp.int32)], axis=1)
  values = jnp.where(column < lengths[:, None], padded, SEPARATOR)
  offset = starts[:, None] + column  # [B, T + 1] place in the stream
  keep = (column <= lengths[:, None]) & (offset >= total - capacity)  # the last C slots only
  slot = jnp.where(keep, (corpus.head + offset) % capacity, capacity)  # capacity: dropped
  new_tokens = corpus.tokens.at[slot.reshape(-1)].set(values.reshape(-1), mode="drop")
  return SuffixCorpus(new_tokens, build_order(new_tokens, corpus.depth),
                      ((corpus.head + total) % capacity).astype(jnp.int32),
                      jnp.minimum(corpus.size + total, capacity).astype(jnp.int32), corpus.depth)


def corpus_match(corpus: SuffixCorpus, row: jax.Array, length: jax.Array, max_match: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The longest left context of row `[S]`'s end (its first `length` tokens) found in `corpus`.

  Returns:
    `(matched, lo, hi)`: the context length `m <= max_match` (0: none), and the range of `order`
    whose slots follow an occurrence of it (`hi - lo` occurrences; all `C` slots when `m = 0`).
  """
  capacity = corpus.capacity
  steps = max(capacity, 1).bit_length() + 1  # binary-search iterations to empty any range

  def context(position, back):  # the token `back` slots before the slot at `order[position]`
    slot = corpus.order[jnp.minimum(position, capacity - 1)]
    return corpus.tokens[(slot - back) % capacity]

  def bound(lo, hi, back, value, strict):  # first position in [lo, hi) whose token >= (>) value
    def step(_, carry):
      lo, hi = carry
      mid = (lo + hi) // 2
      token = context(mid, back)
      right = (token <= value) if strict else (token < value)
      active = lo < hi
      return jnp.where(active & right, mid + 1, lo), jnp.where(active & ~right, mid, hi)
    return jax.lax.fori_loop(0, steps, step, (lo, hi))[0]

  def level(back, carry):
    matched, lo, hi = carry
    value = row[jnp.maximum(length - back, 0)]
    new_lo = bound(lo, hi, back, value, False)
    new_hi = bound(new_lo, hi, back, value, True)
    hit = (matched == back - 1) & (back <= length) & (new_hi > new_lo)
    return (jnp.where(hit, back, matched), jnp.where(hit, new_lo, lo),
            jnp.where(hit, new_hi, hi))

  start = (jnp.int32(0), jnp.int32(0), jnp.int32(capacity))
  return jax.lax.fori_loop(1, max(max_match, 0) + 1, level, start)


def row_match(row: jax.Array, length: jax.Array, max_match: int) -> jax.Array:
  """`[S]` int32: for each position `j < length` of row `[S]`, how many tokens before `j` equal
  the row's last tokens before `length` (capped at `max_match`); 0 at and past `length`."""
  size = row.shape[0]
  position = jnp.arange(size, dtype=jnp.int32)[None, :]  # [1, S]
  back = jnp.arange(1, max_match + 1, dtype=jnp.int32)[:, None]  # [M, 1]
  here = jnp.take(row, jnp.maximum(position - back, 0))  # [M, S]
  there = jnp.take(row, jnp.maximum(length - back, 0))  # [M, 1]
  same = (here == there) & (position - back >= 0) & (length - back >= 0)
  run = jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=0), axis=0)
  return jnp.where(position[0] < length, run, 0).astype(jnp.int32)


def _spread(count: jax.Array, num: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`num` offsets spread evenly over `[0, count)`, which are real, and each one's weight."""
  read = jnp.minimum(count, num)
  index = jnp.arange(num, dtype=jnp.float32)
  offsets = jnp.floor(index * count.astype(jnp.float32) / jnp.maximum(read, 1)).astype(jnp.int32)
  weight = count.astype(jnp.float32) / jnp.maximum(read, 1).astype(jnp.float32)
  return offsets, jnp.arange(num) < read, jnp.full((num,), weight)


def _walk(tokens: jax.Array, valid: jax.Array, weight: jax.Array
          ) -> tuple[jax.Array, jax.Array]:
  """The greedy most-frequent walk over candidate continuations `tokens [N, k]` (`valid [N, k]`:
  the candidate's text goes on there) of weights `[N]` (0: no candidate): the draft `[k]` and each
  step's share `p_d [k]` of the weight still agreeing with the draft before it, candidates whose
  text ends there included (0 once none continues)."""
  def step(live, column):
    token, ok = column
    ok = ok & (live > 0)
    votes = jnp.where(ok, live, 0.0)
    score = jnp.sum(jnp.where(token[None, :] == token[:, None], votes[None, :], 0.0), axis=1)
    score = jnp.where(ok, score, -1.0)
    best = jnp.argmax(score)  # ties: the earliest candidate (the row's latest match first)
    share = jnp.where(jnp.any(ok), score[best] / jnp.maximum(jnp.sum(live), 1e-30), 0.0)
    live = jnp.where(ok & (token == token[best]), live, 0.0)
    return live, (token[best], share)
  _, (draft, share) = jax.lax.scan(step, weight, (tokens.T, valid.T))
  return draft, share


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SuffixDrafter(TextOnlyDrafter):
  """Suffix drafting over the row's own text and an optional shared `SuffixCorpus` (see the module
  docstring). No weights, a point-mass `q`: exact under sampling.

  Attributes:
    corpus: a `SuffixCorpus` (traced: a new one of the same capacity does not recompile), or None.
    max_match: the longest context matched, in tokens (static; at most `corpus.depth`).
    num_candidates: occurrences read per source (the row's latest ones; the corpus spread evenly).
    spec_factor: a match of `m` tokens drafts at most `ceil(spec_factor * m)` tokens.
    min_prob: drafting stops where the product of the walk's step shares falls below this.
  """

  corpus: SuffixCorpus | None = None
  max_match: int = dataclasses.field(default=32, metadata=_STATIC)
  num_candidates: int = dataclasses.field(default=32, metadata=_STATIC)
  spec_factor: float = dataclasses.field(default=8.0, metadata=_STATIC)
  min_prob: float = dataclasses.field(default=0.0, metadata=_STATIC)
  vocab_size: None = dataclasses.field(default=None, metadata=_STATIC)

  def __post_init__(self):
    check_count(self.max_match, "SuffixDrafter max_match")
    check_count(self.num_candidates, "SuffixDrafter num_candidates")
    if not (isinstance(self.spec_factor, (int, float)) and self.spec_factor > 0):
      raise ValueError(f"SuffixDrafter needs spec_factor > 0, got {self.spec_factor!r}")
    if not (isinstance(self.min_prob, (int, float)) and 0 <= self.min_prob <= 1):
      raise ValueError(f"SuffixDrafter needs 0 <= min_prob <= 1, got {self.min_prob!r}")
    if self.corpus is not None and not isinstance(self.corpus, SuffixCorpus):
      if _is_array(self.corpus) or isinstance(self.corpus, (list, tuple)):
        raise ValueError(f"SuffixDrafter.corpus must be a SuffixCorpus (build one with "
                         f"SuffixCorpus.from_sequences), got {type(self.corpus).__name__}")
    elif self.corpus is not None and self.max_match > self.corpus.depth:
      raise ValueError(f"SuffixDrafter.max_match {self.max_match} exceeds the corpus's depth "
                       f"{self.corpus.depth} (its index sorts that many tokens of context)")

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, limits=None):
    del sampling, seeds
    tokens, drafted = jax.vmap(lambda row, length: self.draft_row(row, length, num_draft))(
        sequence, lengths)
    if limits is not None:
      drafted = jnp.minimum(drafted, limits.astype(jnp.int32))
    return state, Proposal(tokens, None, drafted)


  def draft_row(self, row: jax.Array, length: jax.Array, num_draft: int
                ) -> tuple[jax.Array, jax.Array]:
    """One row `[S]` with `length` valid tokens: `(draft [num_draft] int32, num_drafted)`."""
    matched, tokens, valid, weight = self.candidates(row, length, num_draft)
    draft, share = _walk(tokens, valid, weight)
    steps = jnp.arange(num_draft, dtype=jnp.int32)
    keep = (jnp.cumprod(share) >= self.min_prob) & (share > 0) & (steps < self.limit(matched))
    drafted = jnp.sum(jnp.cumprod(keep.astype(jnp.int32))).astype(jnp.int32)
    last = row[jnp.maximum(length - 1, 0)]
    return jnp.where(steps < drafted, draft, last).astype(jnp.int32), drafted

  def limit(self, matched: jax.Array) -> jax.Array:
    """The most tokens a match of `matched` tokens drafts: `ceil(spec_factor * matched)`."""
    return jnp.ceil(self.spec_factor * matched.astype(jnp.float32)).astype(jnp.int32)

  def candidates(self, row: jax.Array, length: jax.Array, depth: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The continuations of row `[S]`'s longest matched context (its first `length` tokens).

    Returns:
      `(matched, tokens [N, depth], valid [N, depth], weight [N])`: the context length (0: no
      match), up to `num_candidates` continuations from the row (its latest occurrences) then up
      to `num_candidates` from the corpus, where each one's text goes on (prefix-closed), and the
      occurrences each stands for (0: no candidate).
    """
    num = self.num_candidates
    steps = jnp.arange(depth, dtype=jnp.int32)
    run = row_match(row, length, self.max_match)  # [S]
    matched = jnp.max(run)
    if self.corpus is not None:
      corpus_len, lo, hi = corpus_match(self.corpus, row, length, self.max_match)
      matched = jnp.maximum(matched, corpus_len)
    # The row's candidates: its latest positions after a context of the longest length.
    mask = (run >= matched) & (matched > 0)
    row_num = min(num, row.shape[0])
    latest, _ = jax.lax.top_k(jnp.where(mask, jnp.arange(row.shape[0]), -1), row_num)
    row_count = jnp.sum(mask)
    period = jnp.maximum(length - latest, 1)[:, None]
    tokens = jnp.take(row, jnp.maximum(latest, 0)[:, None] + steps[None, :] % period)
    valid = jnp.broadcast_to((latest >= 0)[:, None], tokens.shape)
    row_weight = row_count / jnp.maximum(jnp.minimum(row_count, row_num), 1)
    weight = jnp.where(latest >= 0, row_weight, 0.0).astype(jnp.float32)
    if self.corpus is not None:
      count = jnp.where(corpus_len == matched, hi - lo, 0)
      offsets, real, each = _spread(count, num)
      slots = self.corpus.order[jnp.minimum(lo + offsets, self.corpus.capacity - 1)]
      text = self.corpus.tokens[(slots[:, None] + steps[None, :]) % self.corpus.capacity]
      going = real[:, None] & (jnp.cumprod((text != SEPARATOR).astype(jnp.int32), axis=1) > 0)
      tokens = jnp.concatenate([tokens, text])
      valid = jnp.concatenate([valid, going])
      weight = jnp.concatenate([weight, jnp.where(real, each, 0.0)])
    return matched, tokens.astype(jnp.int32), valid, weight
