"""Constrained speculative decoding samples the constrained law of `generate(..., constraint=)`.

Tiny models over an 8-token vocabulary and a hand-written 5-state automaton (two of its states
force their one token; no stop id, so every row emits 3 tokens) generate 3 tokens for N = 20,000
copies of one prompt, each row with its own random stream. The joint of the 3 tokens is compared
with the constrained law enumerated from the target's own logits by an independent float64 NumPy
oracle: temperature / top-k / top-p, then the automaton's allowed set (walked here from the
automaton's dict, not from specjax's tables), renormalized, with the law's fallback (the allowed
set warped alone) where the warp leaves no allowed token. Cells with expected count < 5 are
pooled; a chi-square passes at significance 1e-3. A cell the law gives 0 (outside the grammar)
must never occur. The three broken variants of `specjax.testing.grammar` must be rejected at
p < 1e-6 by the same test at the same N. Seeded throughout.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.constrain.compile import Constraint, constraint_inputs
from specjax.drafters.grammar import GrammarDrafter
from specjax.drafters.model import ModelDrafter
from specjax.constrain.tables import from_transitions, pad_tables
from specjax.models.transformer import forward
from specjax.testing import grammar as broken
from specjax.testing.models import tiny_config
from tests.constrain import reference
from tests.exactness.test_exactness import numpy_distribution

VOCAB = 8
NEW = 3
N = 20_000
PROMPT = [1, 2, 3, 1, 2, 3, 1]
ALPHA = 1e-3
POWER_ALPHA = 1e-6
# state -> {token: next state}. States 1 and 4 allow one token (forced); none is a dead end.
AUTOMATON = {0: {1: 1, 2: 2, 3: 2, 5: 0}, 1: {4: 3}, 2: {0: 2, 5: 3, 6: 1},
             3: {0: 2, 2: 3, 4: 4, 7: 0}, 4: {5: 3}}

SETTINGS = {
    "t1": sj.Sampling(temperature=1.0),
    "t0.7_topk3_topp0.9": sj.Sampling(temperature=0.7, top_k=3, top_p=0.9),
}

def automaton_constraint(automaton=AUTOMATON, vocab=VOCAB) -> Constraint:
  """The hand-written automaton as a `Constraint` (state 0 initial, every state accepting)."""
  edges = [(s, t, n) for s, row in sorted(automaton.items()) for t, n in sorted(row.items())]
  source, token, target = (np.asarray(x) for x in zip(*edges))
  tables = from_transitions(source, token, target, np.ones(len(automaton), bool), vocab)
  return Constraint(tables=pad_tables(tables), pattern="<test automaton>", schema=None,
                    eos_ids=(), num_states=len(automaton), num_transitions=len(edges),
                    build_seconds=0.0)

@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=VOCAB), jax.random.key(10))

@pytest.fixture(scope="module")
def draft():
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=1), jax.random.key(11))

@pytest.fixture(scope="module")
def constraint():
  return automaton_constraint()

def numpy_law(logits: np.ndarray, allowed: set, sampling: sj.Sampling) -> np.ndarray:
  """The constrained law at one position: warp, restrict, renormalize; if nothing allowed
  survives the warp, the allowed tokens' logits warped alone."""
  mask = np.isin(np.arange(VOCAB), sorted(allowed))
  probs = numpy_distribution(logits, sampling) * mask
  if probs.sum() > 0:
    return probs / probs.sum()
  return numpy_distribution(np.where(mask, logits, -np.inf), sampling)

def exact_joint(target, sampling) -> np.ndarray:
  """P(x1, x2, x3) under the constrained law, enumerating all 8^3 continuations."""
  grid = np.stack(np.meshgrid(*[np.arange(VOCAB)] * NEW, indexing="ij"), -1).reshape(-1, NEW)
  seqs = np.concatenate([np.tile(PROMPT, (len(grid), 1)), grid], axis=1)
  logits = np.asarray(forward(target, jnp.asarray(seqs, jnp.int32),
                              jnp.zeros(len(seqs), jnp.int32)).logits)
  joint = np.zeros(len(grid))
  for n, row in enumerate(grid):
    state, p = 0, 1.0
    for i, token in enumerate(row):
      allowed = AUTOMATON[state]
      if token not in allowed:
        p = 0.0
        break
      p *= numpy_law(logits[n, len(PROMPT) - 1 + i], set(allowed), sampling)[token]
      state = allowed[token]
    joint[n] = p
  return joint

def chi_square_pvalue(tokens: np.ndarray, joint: np.ndarray, num_tokens: np.ndarray) -> float:
  if np.any(num_tokens != NEW):
    return 0.0  # the law never ends a row early here: no stop id, no state without a token
  cells = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
  if np.any(joint[cells] == 0):
    return 0.0  # a sequence the constrained law cannot produce
  return reference.chi_square_pvalue(cells, joint)

def grammar_drafter(drafter, constraint, batch):
  grammar = constraint_inputs(constraint, batch, VOCAB)
  return GrammarDrafter(sj.drafters.as_drafter(drafter), grammar.tables, grammar.schema)

def run_decode(target, drafter, constraint, sampling, *, kind=None, num_draft=2, seed=0):
  tokens = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (N, 1))
  if kind is None:
    out = sj.decode(target, drafter, tokens, jax.random.key(seed), max_new_tokens=NEW,
                    num_draft=num_draft, sampling=sampling, constraint=constraint)
  else:
    wrapped = broken.wrap(kind, grammar_drafter(drafter, constraint, N))
    out = sj.decode(target, wrapped, tokens, jax.random.key(seed), max_new_tokens=NEW,
                    num_draft=num_draft, sampling=sampling)
  return np.asarray(out.tokens), np.asarray(out.num_tokens), out.stats.summary()

def test_greedy_decode_is_constrained_generate(target, draft, constraint):
  """Every drafter kind, a ragged batch: the tokens of masked greedy generation."""
  prompts = jnp.asarray([PROMPT, PROMPT[:5] + [0, 0], [3, 3, 1, 0, 0, 0, 0], PROMPT[::-1]],
                        jnp.int32)
  lengths = jnp.asarray([7, 5, 3, 7], jnp.int32)
  want = sj.generate(target, prompts, jax.random.key(0), lengths=lengths, max_new_tokens=12,
                     constraint=constraint)
  for drafter in (draft, target, sj.NGramDrafter(max_ngram=2), sj.self_drafter(target, bits=8)):
    got = sj.decode(target, drafter, prompts, jax.random.key(0), lengths=lengths,
                    max_new_tokens=12, num_draft=3, constraint=constraint)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  # The automaton's walk holds for every row (checked on the automaton's dict).
  for row in np.asarray(want.tokens):
    state = 0
    for token in row:
      assert int(token) in AUTOMATON[state]
      state = AUTOMATON[state][int(token)]

def test_forced_tokens_are_free(target, draft, constraint):
  """The n-gram drafter rarely matches here; the forced states still draft, and every forced
  draft is accepted."""
  prompts = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (16, 1))
  out = sj.decode(target, sj.NGramDrafter(max_ngram=2), prompts, jax.random.key(1),
                  max_new_tokens=24, num_draft=3, sampling=SETTINGS["t1"], constraint=constraint)
  summary = out.stats.summary()
  assert summary["forced"] > 0
  assert summary["forced"] <= summary["accepted"]

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnguidedModelDrafter(ModelDrafter):
  """A draft model whose raw chain the grammar walk redraws (as an n-gram's or a head's is)."""

  guided = False


def test_a_draft_model_drafts_inside_the_grammar(target, draft, constraint):
  """Guided: every draft of the draft model's chain is allowed where it stands, so the walk
  keeps all `k` of every row and redraws none; the same model unguided has drafts redrawn."""
  batch, k = 64, 4
  tokens = jnp.tile(jnp.asarray(PROMPT + [0] * 8, jnp.int32), (batch, 1))
  lengths = jnp.full((batch,), len(PROMPT), jnp.int32)
  seeds = jnp.arange(batch, dtype=jnp.uint32)
  redraws = {}
  for guided, inner in ((True, ModelDrafter(draft)), (False, UnguidedModelDrafter(draft))):
    drafter = grammar_drafter(inner, constraint, batch)
    state = drafter.init(tokens, lengths, tokens.shape[1], None)
    for name, sampling in (("greedy", sj.Sampling()), ("t1", SETTINGS["t1"])):
      after, proposal = drafter.propose(state, tokens, lengths, num_draft=k, sampling=sampling,
                                        seeds=seeds)
      redraws[guided, name] = int(jnp.sum(after.redrawn < k))
      if guided:
        np.testing.assert_array_equal(np.asarray(proposal.num_drafted), k)
        for row in np.asarray(proposal.tokens):
          state_id = 0
          for token in row:
            assert int(token) in AUTOMATON[state_id]
            state_id = AUTOMATON[state_id][int(token)]
  assert redraws[True, "greedy"] == redraws[True, "t1"] == 0
  assert redraws[False, "greedy"] + redraws[False, "t1"] > 0, redraws


@pytest.mark.costly
@pytest.mark.parametrize("guided", [True, False], ids=["guided", "walked"])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_draft_model_matches_the_constrained_law(target, draft, constraint, name, guided):
  """Guided (the draft model draws from `q'` in its own loop) and walked (its raw draws kept
  where allowed, the rest redrawn from `q'`)."""
  drafter = ModelDrafter(draft) if guided else UnguidedModelDrafter(draft)
  tokens, num_tokens, summary = run_decode(target, drafter, constraint, SETTINGS[name])
  assert 0.05 < summary["acceptance_rate"] < 0.98  # the rule is exercised both ways
  assert summary["forced"] > 0
  assert chi_square_pvalue(tokens, exact_joint(target, SETTINGS[name]), num_tokens) > ALPHA

@pytest.mark.costly
def test_ngram_matches_the_constrained_law(target, constraint):
  sampling = SETTINGS["t0.7_topk3_topp0.9"]
  tokens, num_tokens, summary = run_decode(target, sj.NGramDrafter(max_ngram=2), constraint,
                                           sampling, num_draft=3)
  assert summary["accepted"] > 0
  assert chi_square_pvalue(tokens, exact_joint(target, sampling), num_tokens) > ALPHA

@pytest.mark.costly
@pytest.mark.parametrize("kind", [broken.MasksPOnly, broken.MasksQOnly, broken.RoundStartMask],
                         ids=lambda kind: kind.__name__)
@pytest.mark.parametrize("guided", [True, False], ids=["guided", "walked"])
def test_broken_variants_are_rejected(target, draft, constraint, kind, guided):
  sampling = SETTINGS["t1"]
  drafter = ModelDrafter(draft) if guided else UnguidedModelDrafter(draft)
  tokens, num_tokens, _ = run_decode(target, drafter, constraint, sampling, kind=kind)
  assert chi_square_pvalue(tokens, exact_joint(target, sampling), num_tokens) < POWER_ALPHA

@pytest.mark.costly
def test_stream_yields_the_constrained_decode(target, draft, constraint):
  prompts = jnp.asarray([PROMPT, PROMPT[:4] + [0, 0, 0]], jnp.int32)
  lengths = jnp.asarray([7, 4], jnp.int32)
  sampling = SETTINGS["t0.7_topk3_topp0.9"]
  want = sj.decode(target, draft, prompts, jax.random.key(3), lengths=lengths, max_new_tokens=10,
                   num_draft=2, sampling=sampling, constraint=constraint)
  rows = [[], []]
  for new, _ in sj.decode_stream(target, draft, prompts, jax.random.key(3), lengths=lengths,
                                 max_new_tokens=10, num_draft=2, sampling=sampling,
                                 constraint=constraint):
    for b, tokens in enumerate(new):
      rows[b].extend(tokens.tolist())
  for b in range(2):
    assert rows[b] == np.asarray(want.tokens)[b, :int(want.num_tokens[b])].tolist()

def test_bad_combinations_are_refused_before_tracing(target, draft, constraint):
  prompts = jnp.asarray([PROMPT], jnp.int32)
  wrapped = grammar_drafter(draft, constraint, 1)
  with pytest.raises(ValueError, match="already a GrammarDrafter"):
    sj.decode(target, wrapped, prompts, jax.random.key(0), constraint=constraint)
  other = sj.init_params(tiny_config(vocab_size=VOCAB + 8, num_layers=1), jax.random.key(2))
  with pytest.raises(ValueError, match="vocabulary"):
    sj.decode(target, other, prompts, jax.random.key(0), constraint=constraint)
