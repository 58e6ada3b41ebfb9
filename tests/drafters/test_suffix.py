"""The suffix drafter (`specjax.SuffixDrafter`, `specjax.drafters.SuffixCorpus`).

* The matcher against a plain-Python reference written here (brute force over the row's text and
  the corpus's sequences, the ring buffer modelled as "the last C slots of the stream"): the
  longest matched context, the corpus's occurrence count and next tokens, every position's
  match length in the row, and the drafted tokens, counts and length of the most-frequent walk;
  on hand-made cases (periodic and overlapping text, a corpus hit, an empty corpus, a full corpus
  that wrapped) with the answers worked by hand, and on 150 random cases over a 3-token vocabulary
  (many repeats, so long matches, ties and sequence ends happen).
* Greedy identity: `sj.decode` with the suffix drafter at temperature 0 equals `sj.generate` on a
  ragged batch (8, 10 and 12 prompt tokens), with and without a corpus, k = 2 and 5; with a corpus
  holding the target's own greedy continuations the drafts are accepted far more often.
* Exactness under sampling: the exactness harness (`specjax.testing.harness`: the audit's
  prefix-grouped chi-square per position, Bonferroni over the positions) at T = 1 and at T = 0.7
  with top-k 16 / top-p 0.9, with a corpus; ALPHA = 1e-3 family-wise; N = 300 rows per prompt in
  the default selection, N = 2,000 in the `slow` ones; seeded. A broken variant (the same drafts,
  but the proposal claims a q with its mass on another token: every draft is then accepted) is
  rejected by the same statistic at the same N and level.
* One compiled program: the decode's jaxpr has no callbacks and one top-level while loop; a new
  corpus of the same capacity (appended under `jax.jit`) does not retrace `decode`, and `append`
  traces once per shape.
* Bad arguments raise a ValueError at construction.
* The tree form (`decode(..., draft=SuffixDrafter(...), tree=TreeSpec("ngram", ...))`): on 80
  random cases its trie holds only prefixes of candidates whose share is >= min_prob within the
  match's limit, and its leaves are the `width` best-scored distinct paths of the reference
  (compared as sorted score lists, so ties need no tie-break); greedy identity on the ragged batch
  with and without a corpus, with and without verify widths; the exactness harness at T = 0.7
  top-k/top-p (N = 300), and at both settings with N = 2,000 in the slow selection (whose T = 0.7
  run found one impossible token, from a uniform of exactly 1.0 in the Gumbel race:
  `specjax.core.sampling.bits_to_uniform` now stays inside (0, 1)).

Smallest p-values at this commit (Bonferroni levels 1.4e-5 to 4.8e-5): chain, N = 300: 4.0e-4 (T =
1), 5.0e-3 (T = 0.7); N = 2,000: 4.4e-3 (T = 1), 1.1e-3 (T = 0.7); tree, N = 300: 1.5e-2 (T = 0.7);
N = 2,000: 5.7e-2 (T = 1), 0 (T = 0.7, before the uniform's fix). The broken variant: 1.6e-195 (T =
0.7, N = 300) and 1.3e-277 (T = 1, N = 300, slow).
Cost (2-core shared CPU, one worker): the default selection about 1.5 minutes, the slow one about
2 minutes.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import SuffixCorpus
from specjax.drafters import suffix, suffix_tree
from specjax.testing import harness
from specjax.core.tracing import TRACE_COUNTS

SEP = -1
ALPHA = 1e-3  # family-wise level of one exactness run (Bonferroni over its position tests)
N_DEFAULT = 300  # rows per prompt in the default selection
N_SLOW = 2000  # rows per prompt in the slow runs
NEW = 24  # new tokens per row
K = 7  # drafts per round in the exactness runs
SETTINGS = {
    "t1": sj.Sampling(temperature=1.0),
    "t0.7_topk16_topp0.9": sj.Sampling(temperature=0.7, top_k=16, top_p=0.9),
}


# ---------------------------------------------------------------------------------------------
# The plain-Python reference.


def ring_text(sequences, capacity):
  """What a ring buffer of `capacity` slots holds after storing `sequences` in order: the last
  `capacity` items of the stream `s_1 SEP s_2 SEP ...`, oldest first."""
  stream = [t for s in sequences for t in list(s) + [SEP]]
  return stream[-capacity:]


def corpus_occurrences(text, pattern):
  """Positions `i` of `text` right after an occurrence of `pattern` (a list of token ids)."""
  m = len(pattern)
  return [i for i in range(m, len(text) + 1) if text[i - m:i] == pattern]


def row_occurrences(row, pattern):
  """Positions `j < len(row)` of the row right after an earlier occurrence of `pattern`."""
  m = len(pattern)
  return [j for j in range(m, len(row)) if row[j - m:j] == pattern]


def longest(row, text, max_match):
  """`(m_row, m_corpus)`: the longest suffix of `row` (at most `max_match`) found in each."""
  m_row = m_corpus = 0
  for m in range(1, min(max_match, len(row)) + 1):
    pattern = row[len(row) - m:]
    if row_occurrences(row, pattern):
      m_row = m
    if text is not None and corpus_occurrences(text, pattern):
      m_corpus = m
  return m_row, m_corpus


def candidates(row, text, max_match, k):
  """The longest match `m` and every candidate continuation (a list of up to `k` tokens; a
  corpus one stops at its sequence's end)."""
  m_row, m_corpus = longest(row, text, max_match)
  m = max(m_row, m_corpus)
  found = []
  if m == 0:
    return 0, found, 0, 0
  pattern = row[len(row) - m:]
  in_row = row_occurrences(row, pattern) if m_row == m else []
  for j in in_row:
    found.append([row[j + d % (len(row) - j)] for d in range(k)])
  in_corpus = corpus_occurrences(text, pattern) if text is not None and m_corpus == m else []
  for i in in_corpus:
    cont = []
    for t in text[i:i + k]:
      if t == SEP:
        break
      cont.append(t)
    found.append(cont)
  return m, found, len(in_row), len(in_corpus)


def check_walk(found, m, drafted_tokens, drafted, *, k, spec_factor, min_prob):
  """Walks the most-frequent path over `found` as the drafter should, taking the drafter's token
  among tied ones, and checks its draft and length. Returns the reference length."""
  live, cumulative, expected = list(found), 1.0, 0
  limit = math.ceil(spec_factor * m)
  for d in range(k):
    going = [c for c in live if len(c) > d]
    if not going or d >= limit:
      break
    counts = collections.Counter(c[d] for c in going)
    best = max(counts.values())
    cumulative *= best / len(live)
    if cumulative < min_prob:
      break
    token = int(drafted_tokens[d])
    assert counts.get(token, 0) == best, (d, token, counts)
    expected += 1
    live = [c for c in going if c[d] == token]
  assert drafted == expected, (drafted, expected, found)
  return expected


# ---------------------------------------------------------------------------------------------
# The matcher against the reference.

S = 48  # the token buffer of a row in the unit tests
MAX_MATCH = 6
KD = 5  # drafts asked for in the unit tests


def _buffer(row):
  buffer = np.zeros((S,), np.int32)
  buffer[:len(row)] = row
  return jnp.asarray(buffer), jnp.int32(len(row))


@jax.jit
def _draft(drafter, buffer, length):
  return drafter.draft_row(buffer, length, KD)


@jax.jit
def _corpus_match(corpus, buffer, length):
  return suffix.corpus_match(corpus, buffer, length, MAX_MATCH)


@jax.jit
def _row_match(buffer, length):
  return suffix.row_match(buffer, length, MAX_MATCH)


def _drafter(corpus, **kwargs):
  kwargs = dict(dict(max_match=MAX_MATCH, num_candidates=64, spec_factor=2.0, min_prob=0.13),
                **kwargs)
  return sj.SuffixDrafter(corpus=corpus, **kwargs)


def check_against_reference(row, sequences, capacity, *, corpus=None, **kwargs):
  """All the matcher's outputs for `row` against the reference; `corpus` defaults to
  `from_sequences(sequences, capacity)`. Returns `(m, drafted)`."""
  text = None if sequences is None else ring_text(sequences, capacity)
  if corpus is None and sequences is not None:
    corpus = SuffixCorpus.from_sequences(sequences, capacity, depth=MAX_MATCH)
  buffer, length = _buffer(row)
  # Every position's match length in the row.
  run = np.asarray(_row_match(buffer, length))
  for j in range(S):
    want = 0
    while (j < len(row) and want < min(MAX_MATCH, j, len(row))
           and row[j - want - 1] == row[len(row) - want - 1]):
      want += 1
    assert run[j] == want, (j, run[j], want)
  m_row, m_corpus = longest(row, text, MAX_MATCH)
  assert run.max() == m_row
  if corpus is not None:
    matched, lo, hi = map(int, _corpus_match(corpus, buffer, length))
    assert matched == m_corpus, (matched, m_corpus)
    if m_corpus > 0:
      pattern = row[len(row) - m_corpus:]
      occurrences = corpus_occurrences(text, pattern)
      assert hi - lo == len(occurrences)
      tokens, order = np.asarray(corpus.tokens), np.asarray(corpus.order)
      got = sorted(int(tokens[order[x]]) for x in range(lo, hi))
      want = sorted(text[i] if i < len(text) else SEP for i in occurrences)
      assert got == want
  drafter = _drafter(corpus, **kwargs)
  m, found, _, _ = candidates(row, text, MAX_MATCH, KD)
  draft, drafted = _draft(drafter, buffer, length)
  check_walk(found, m, np.asarray(draft), int(drafted), k=KD, spec_factor=drafter.spec_factor,
             min_prob=drafter.min_prob)
  return m, int(drafted), np.asarray(draft)


def test_periodic_row_continues_with_its_period():
  # 1 2 3 1 2 3 1 2: the longest earlier context is "1 2 3 1 2" (5 tokens, ending at position
  # 5); it continues 3 1 2 and then, 3 tokens before the end, repeats with period 3.
  m, drafted, draft = check_against_reference([1, 2, 3, 1, 2, 3, 1, 2], None, 0)
  assert m == 5 and drafted == 5
  np.testing.assert_array_equal(draft, [3, 1, 2, 3, 1])


def test_overlapping_run_and_short_match_limits_the_draft():
  # 7 7 7 7: "7 7 7" occurs ending at position 3 (overlapping the suffix): period 1, all 7s.
  m, drafted, draft = check_against_reference([7, 7, 7, 7], None, 0)
  assert m == 3 and drafted == 5
  np.testing.assert_array_equal(draft, [7] * 5)
  # 4 9 4: one token of context ("4", ending at 1) earns ceil(2.0 * 1) = 2 drafts: 9 4.
  m, drafted, draft = check_against_reference([4, 9, 4], None, 0)
  assert m == 1 and drafted == 2
  np.testing.assert_array_equal(draft[:2], [9, 4])


def test_corpus_hit_picks_the_most_frequent_continuation():
  # "2 3 4" is followed by 5, 7, 5 in the corpus: 5 (2 of 3); after "2 3 4 5" both sequences end,
  # so nothing continues and one token is drafted.
  sequences = [[1, 2, 3, 4, 5], [9, 2, 3, 4, 7], [2, 3, 4, 5]]
  m, drafted, draft = check_against_reference([8, 8, 2, 3, 4], sequences, 32)
  assert m == 3 and drafted == 1 and draft[0] == 5
  # A longer context narrows it: "9 2 3 4" occurs once, followed by 7.
  m, drafted, draft = check_against_reference([9, 2, 3, 4], sequences, 32)
  assert m == 4 and drafted == 1 and draft[0] == 7
  # The row's own text and the corpus tie at "3 4": 6 (row) once, 5 twice, 7 once -> 5 at 2/4.
  m, drafted, draft = check_against_reference([3, 4, 6, 0, 3, 4], sequences, 32)
  assert m == 2 and draft[0] == 5
  # min_prob above 2/4 stops it before the first token.
  m, drafted, _ = check_against_reference([3, 4, 6, 0, 3, 4], sequences, 32, min_prob=0.6)
  assert drafted == 0
  # A sequence that ends votes for stopping: after "2 3 4", 5 (3 of 3), then 1 for 2 of the 3
  # (one sequence ended): 1 * 2/3 falls below 0.7 (one draft) but not below 0.6 (two drafts,
  # then every sequence has ended).
  sequences = [[2, 3, 4, 5], [2, 3, 4, 5, 1], [2, 3, 4, 5, 1]]
  for min_prob, want in ((0.7, 1), (0.6, 2)):
    m, drafted, draft = check_against_reference([0, 2, 3, 4], sequences, 32, min_prob=min_prob)
    assert (m, drafted) == (3, want)
    np.testing.assert_array_equal(draft[:want], [5, 1][:want])


def test_empty_corpus_and_no_match_draft_nothing():
  for corpus in (SuffixCorpus.empty(16, depth=MAX_MATCH), None):
    drafter = _drafter(corpus)
    draft, drafted = _draft(drafter, *_buffer([1, 2, 3]))
    assert int(drafted) == 0
  m, drafted, _ = check_against_reference([1, 2, 3], [], 16)
  assert m == 0 and drafted == 0


def test_full_corpus_drops_the_oldest():
  # Capacity 8: "1 2 3 | 4 5 6 | 7 8 9 |" is 12 slots; the last 8 are "4 5 6 | 7 8 9 |".
  sequences = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
  corpus = SuffixCorpus.from_sequences(sequences, 8, depth=MAX_MATCH)
  np.testing.assert_array_equal(corpus.tokens, [4, 5, 6, SEP, 7, 8, 9, SEP])
  assert check_against_reference([0, 2], sequences, 8)[0] == 0  # "2" was dropped
  assert check_against_reference([0, 5], sequences, 8)[2][0] == 6
  # Appending wraps: "7 8 9 |" fills slots 4-7 of a corpus holding "4 5 6 |", "1 2 |" slots 0-2.
  corpus = SuffixCorpus.from_sequences([[4, 5, 6]], 8, depth=MAX_MATCH)
  corpus = jax.jit(lambda c, t, n: c.append(t, n))(
      corpus, jnp.asarray([[7, 8, 9], [1, 2, 0]]), jnp.asarray([3, 2]))
  np.testing.assert_array_equal(corpus.tokens, [1, 2, SEP, SEP, 7, 8, 9, SEP])
  assert int(corpus.head) == 3 and int(corpus.size) == 8
  sequences = [[4, 5, 6], [7, 8, 9], [1, 2]]
  assert check_against_reference([0, 5], sequences, 8, corpus=corpus)[0] == 0  # overwritten
  assert check_against_reference([0, 8], sequences, 8, corpus=corpus)[2][0] == 9
  assert check_against_reference([6, 1], sequences, 8, corpus=corpus)[2][0] == 2


@pytest.mark.costly
@pytest.mark.parametrize("seed", range(3))
def test_random_rows_and_corpora_match_the_reference(seed):
  rng = np.random.default_rng(seed)
  for case in range(50):
    vocab = 3
    sequences = [rng.integers(0, vocab, rng.integers(0, 12)).tolist()
                 for _ in range(rng.integers(0, 8))]
    capacity = int(rng.choice([16, 64]))
    row = rng.integers(0, vocab, rng.integers(1, 30)).tolist()
    if case % 2:  # half the corpora grown by a jitted append (the ring wraps in some)
      split = len(sequences) // 2
      corpus = SuffixCorpus.from_sequences(sequences[:split], capacity, depth=MAX_MATCH)
      rest = sequences[split:] or [[]]
      width = max(1, max(len(s) for s in rest))
      padded = np.zeros((len(rest), width), np.int32)
      for i, s in enumerate(rest):
        padded[i, :len(s)] = s
      corpus = corpus.append(jnp.asarray(padded), jnp.asarray([len(s) for s in rest]))
      sequences = sequences[:split] + rest
    else:
      corpus = None
    text = ring_text(sequences, capacity)
    m, found, in_row, in_corpus = candidates(row, text, MAX_MATCH, KD)
    if max(in_row, in_corpus) > 64:
      continue  # the drafter reads at most 64 occurrences per source: counts then are estimates
    check_against_reference(row, sequences, capacity, corpus=corpus)


def test_limits_cap_the_draft():
  drafter = _drafter(None)
  buffer, length = _buffer([1, 2, 3, 1, 2, 3, 1, 2])
  _, proposal = drafter.propose((), buffer[None], length[None], num_draft=KD, sampling=None,
                                seeds=None, limits=jnp.asarray([2]))
  assert proposal.logits is None
  np.testing.assert_array_equal(proposal.num_drafted, [2])


# ---------------------------------------------------------------------------------------------
# Decoding with the suffix drafter: greedy identity, exactness, one compiled program.


@pytest.fixture(scope="module")
def world():
  target = harness.harness_target()
  prompts = harness.harness_prompts(target)  # 8, 10 and 12 tokens, each repeating its start
  tokens = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
  for i, prompt in enumerate(prompts):
    tokens[i, :len(prompt)] = prompt
  tokens, lengths = jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)
  greedy = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=NEW)
  # A corpus of earlier outputs: each prompt with its greedy continuation, and unrelated text.
  rng = np.random.default_rng(7)
  earlier = [p + np.asarray(greedy.tokens[i]).tolist() for i, p in enumerate(prompts)]
  earlier += [rng.integers(0, harness.VOCAB, 40).tolist() for _ in range(4)]
  corpus = SuffixCorpus.from_sequences(earlier, capacity=1024)
  return dict(target=target, prompts=prompts, tokens=tokens, lengths=lengths, greedy=greedy,
              corpus=corpus, scorer=harness.Scorer(target))


@pytest.mark.parametrize("num_draft", [2, 5])
def test_greedy_equals_generate_on_a_ragged_batch(world, num_draft):
  accepted = {}
  for name, corpus in (("none", None), ("corpus", world["corpus"])):
    out = sj.decode(world["target"], sj.SuffixDrafter(corpus=corpus), world["tokens"],
                    jax.random.key(3), lengths=world["lengths"], max_new_tokens=NEW,
                    num_draft=num_draft)
    np.testing.assert_array_equal(out.tokens, world["greedy"].tokens)
    np.testing.assert_array_equal(out.num_tokens, world["greedy"].num_tokens)
    summary = out.stats.summary()
    assert 0 < summary["drafted"] <= num_draft * summary["rounds"]
    accepted[name] = summary["accepted"]
  # The corpus holds these prompts' greedy continuations: it predicts nearly every token (a round
  # emits at most k accepted drafts and a target token).
  most = NEW * num_draft / (num_draft + 1) * len(world["prompts"])
  assert accepted["corpus"] >= 0.8 * most
  assert accepted["corpus"] > 2 * accepted["none"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ClaimsAnotherQ(sj.SuffixDrafter):
  """Broken: proposes the same tokens deterministically, but tells verify its q put its mass on
  the next token id (so q(draft) ~ 0 and every draft is accepted)."""

  def propose(self, state, sequence, lengths, **kwargs):
    state, proposal = super().propose(state, sequence, lengths, **kwargs)
    logits = 12.0 * jax.nn.one_hot((proposal.tokens + 1) % harness.VOCAB, harness.VOCAB)
    return state, dataclasses.replace(proposal, logits=logits)


def _fit(world, drafter, setting, num_samples):
  sampling = SETTINGS[setting]
  run = harness.run_path(world["target"], drafter, world["prompts"], num_samples=num_samples,
                         max_new_tokens=NEW, sampling=sampling, num_draft=K, seed=11)
  fit = harness.goodness_of_fit(world["prompts"], run.tokens, sampling, world["scorer"],
                                alpha=ALPHA)
  print(f"\nsuffix {type(drafter).__name__} [{setting}] N = {num_samples}: {fit.describe()}; "
        f"tokens per round {run.summary['tokens_per_round']:.2f}")
  return run, fit


def _exact(world, setting, num_samples):
  run, fit = _fit(world, sj.SuffixDrafter(corpus=world["corpus"]), setting, num_samples)
  assert run.summary["accepted"] > 0  # drafts are accepted: the rule is exercised
  assert fit.num_tests >= 3
  assert fit.passed, fit.describe()


def _broken(world, setting, num_samples):
  _, fit = _fit(world, ClaimsAnotherQ(corpus=world["corpus"]), setting, num_samples)
  assert fit.min_pvalue <= ALPHA / max(fit.num_tests, 1), fit.describe()


@pytest.mark.costly
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_sampling_is_exact(world, setting):
  _exact(world, setting, N_DEFAULT)


@pytest.mark.costly
def test_claiming_another_q_is_detected(world):
  _broken(world, "t0.7_topk16_topp0.9", N_DEFAULT)


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_sampling_is_exact_at_large_n(world, setting):
  _exact(world, setting, N_SLOW)


@pytest.mark.slow
def test_claiming_another_q_is_detected_at_t1(world):
  _broken(world, "t1", N_DEFAULT)


def test_one_while_loop_no_callbacks(world):
  drafter = sj.SuffixDrafter(corpus=world["corpus"])
  jaxpr = jax.make_jaxpr(lambda t, n: sj.decode(world["target"], drafter, t, jax.random.key(0),
                                                lengths=n, max_new_tokens=8, num_draft=4))(
      world["tokens"], world["lengths"])
  assert "callback" not in str(jaxpr)
  calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("pjit", "jit")]
  assert len(calls) == 1
  body = calls[0].params["jaxpr"].jaxpr.eqns
  assert len([e for e in body if e.primitive.name == "while"]) == 1  # the round loop


def test_new_corpus_does_not_retrace(world):
  tokens, lengths = world["tokens"], world["lengths"]
  corpus = SuffixCorpus.from_sequences(world["prompts"], capacity=777)
  decode = lambda c: sj.decode(world["target"], sj.SuffixDrafter(corpus=c), tokens,
                               jax.random.key(1), lengths=lengths, max_new_tokens=NEW,
                               num_draft=3)
  append = jax.jit(lambda c, t, n: c.append(t, n))
  out = decode(corpus)
  traced = TRACE_COUNTS["decode"]
  appends = TRACE_COUNTS["suffix_append"]
  summaries = []
  for _ in range(2):
    corpus = append(corpus, out.tokens, out.num_tokens)  # on device, the same capacity
    assert corpus.capacity == 777
    out = decode(corpus)
    np.testing.assert_array_equal(out.tokens, world["greedy"].tokens)
    summaries.append(out.stats.summary()["accepted"])
  assert TRACE_COUNTS["decode"] == traced
  assert TRACE_COUNTS["suffix_append"] - appends <= 1  # once for this shape at most
  assert summaries[0] > 0


@pytest.mark.parametrize("build, message", [
    (lambda: sj.SuffixDrafter(max_match=0), "SuffixDrafter max_match must be >= 1"),
    (lambda: sj.SuffixDrafter(num_candidates=0), "SuffixDrafter num_candidates must be >= 1"),
    (lambda: sj.SuffixDrafter(spec_factor=0.0), "spec_factor > 0"),
    (lambda: sj.SuffixDrafter(min_prob=1.5), "min_prob"),
    (lambda: sj.SuffixDrafter(corpus=jnp.zeros((8,), jnp.int32)), "must be a SuffixCorpus"),
    (lambda: sj.SuffixDrafter(corpus=SuffixCorpus.empty(8, depth=4), max_match=8), "depth"),
    (lambda: SuffixCorpus.from_sequences([[1, 2]], capacity=0),
     "SuffixCorpus capacity must be >= 1"),
    (lambda: SuffixCorpus.from_sequences([[1, 2]], capacity=2.5),
     "SuffixCorpus capacity must be an int"),
    (lambda: SuffixCorpus.from_sequences([[1.0, 2.0]], capacity=8), "integer token ids"),
    (lambda: SuffixCorpus.from_sequences([[[1, 2]]], capacity=8), "1-D integer"),
    (lambda: SuffixCorpus.from_sequences([[1, -2]], capacity=8), "negative token id"),
    (lambda: SuffixCorpus(jnp.zeros((8,), jnp.float32), jnp.zeros((8,), jnp.int32),
                             jnp.int32(0), jnp.int32(0)), "rank-1 int32"),
    (lambda: SuffixCorpus(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4), jnp.int32),
                             jnp.int32(0), jnp.int32(0)), "rank-1 int32"),
    (lambda: SuffixCorpus.empty(8).append(jnp.zeros((4,), jnp.int32), jnp.zeros((1,))),
     "tokens \\[B, T\\]"),
])
def test_bad_arguments_raise_before_compiling(build, message):
  before = dict(TRACE_COUNTS)
  with pytest.raises(ValueError, match=message):
    build()
  assert dict(TRACE_COUNTS) == before


# ---------------------------------------------------------------------------------------------
# The tree form (`SuffixTreeDrafter`, through `decode(..., tree=TreeSpec("ngram", ...))`).


def tree_paths(tree, b=0):
  """The maximal root-to-leaf token paths of row `b`'s valid nodes."""
  tokens, parents = np.asarray(tree.tokens[b]), np.asarray(tree.parents[b])
  valid = np.asarray(tree.valid[b])
  paths = {}
  for i in np.argsort(np.asarray(tree.depths[b]), kind="stable"):
    if valid[i]:
      assert parents[i] == -1 or valid[parents[i]], "a valid node below an invalid one"
      paths[i] = (paths[parents[i]] if parents[i] >= 0 else ()) + (int(tokens[i]),)
  has_child = {parents[i] for i in paths if parents[i] >= 0}
  return sorted(paths[i] for i in paths if i not in has_child), sorted(paths.values())


def reference_tree(found, m, *, width, depth, spec_factor, min_prob):
  """The reference's paths: every candidate cut where its prefix's share of the candidates falls
  below `min_prob` or at the match's limit; prefixes of another path dropped; scored by the sum of
  their prefixes' shares. Returns `{path: score}` and the share of every prefix."""
  total = len(found)
  share = lambda prefix: sum(c[:len(prefix)] == list(prefix) for c in found) / total
  limit = min(depth, math.ceil(spec_factor * m))
  kept = set()
  for c in found:
    path = ()
    for d in range(min(limit, len(c))):
      if share(path + (c[d],)) < min_prob:
        break
      path += (c[d],)
    if path:
      kept.add(path)
  maximal = {p for p in kept if not any(q != p and q[:len(p)] == p for q in kept)}
  return {p: sum(share(p[:d + 1]) for d in range(len(p))) for p in maximal}, share


@pytest.mark.parametrize("seed", range(2))
def test_tree_keeps_the_most_frequent_paths(seed):
  rng = np.random.default_rng(100 + seed)
  spec = sj.TreeSpec("ngram", depth=4, width=3)
  propose = jax.jit(lambda d, s, n: d.propose((), s, n, num_draft=spec.depth, sampling=None,
                                              seeds=None)[1])
  checked = 0
  for case in range(40):
    sequences = [rng.integers(0, 3, rng.integers(0, 12)).tolist() for _ in range(6)]
    row = rng.integers(0, 3, rng.integers(1, 30)).tolist()
    corpus = SuffixCorpus.from_sequences(sequences, 64, depth=MAX_MATCH)
    drafter = suffix_tree.SuffixTreeDrafter(_drafter(corpus, min_prob=0.13), spec)
    m, found, in_row, in_corpus = candidates(row, ring_text(sequences, 64), MAX_MATCH,
                                             spec.depth)
    if max(in_row, in_corpus) > 64:
      continue
    buffer, length = _buffer(row)
    leaves, nodes = tree_paths(propose(drafter, buffer[None], length[None]))
    want, share = reference_tree(found, m, width=spec.width, depth=spec.depth, spec_factor=2.0,
                                 min_prob=0.13)
    for node in nodes:  # every node is a kept prefix of a candidate
      assert share(node) >= 0.13 and len(node) <= math.ceil(2.0 * m), (node, found)
    assert set(leaves) <= set(want), (leaves, want)
    best = sorted(want.values(), reverse=True)[:spec.width]
    np.testing.assert_allclose(sorted((want[p] for p in leaves), reverse=True), best, rtol=1e-5)
    checked += bool(leaves)
  assert checked >= 10


@pytest.mark.parametrize("spec", [sj.TreeSpec("ngram", depth=4, width=3),
                                  sj.TreeSpec("ngram", depth=3, width=2, widths=(2, 6))],
                         ids=["d4w3", "d3w2_widths"])
def test_tree_greedy_equals_generate_on_a_ragged_batch(world, spec):
  for corpus in (None, world["corpus"]):
    out = sj.decode(world["target"], sj.SuffixDrafter(corpus=corpus), world["tokens"],
                    jax.random.key(3), lengths=world["lengths"], max_new_tokens=NEW, tree=spec)
    np.testing.assert_array_equal(out.tokens, world["greedy"].tokens)
    np.testing.assert_array_equal(out.num_tokens, world["greedy"].num_tokens)
    assert out.stats.summary()["accepted"] > 0


def _tree_exact(world, setting, num_samples):
  sampling = SETTINGS[setting]
  run = harness.run_path(world["target"], sj.SuffixDrafter(corpus=world["corpus"]),
                         world["prompts"], num_samples=num_samples, max_new_tokens=NEW,
                         sampling=sampling, seed=12, tree=sj.TreeSpec("ngram", depth=4, width=3))
  fit = harness.goodness_of_fit(world["prompts"], run.tokens, sampling, world["scorer"],
                                alpha=ALPHA)
  print(f"\nsuffix tree [{setting}] N = {num_samples}: {fit.describe()}; tokens per round "
        f"{run.summary['tokens_per_round']:.2f}")
  assert run.summary["accepted"] > 0
  assert fit.num_tests >= 3
  assert fit.passed, fit.describe()


@pytest.mark.costly
def test_tree_sampling_is_exact(world):
  _tree_exact(world, "t0.7_topk16_topp0.9", N_DEFAULT)


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["t1", "t0.7_topk16_topp0.9"])
def test_tree_sampling_is_exact_at_large_n(world, setting):
  _tree_exact(world, setting, N_SLOW)
