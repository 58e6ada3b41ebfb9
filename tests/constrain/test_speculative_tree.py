"""Draft trees under a grammar constraint: `decode(..., tree=, constraint=)` samples the constrained
law of `generate(..., constraint=)`.

The 8-token vocabulary, the hand-written automaton, the tiny models and the float64 NumPy oracle
are tests/constrain/test_speculative_law.py's (imported, not copied).

* Greedy identity on a ragged batch whose rows follow two grammars: the automaton, and a variant
  whose state 5 allows nothing, where rows stop without a token (`stats.constraint_dead`) as in
  `generate`. Every builder with the draft model (static, sampled with and without replacement,
  dynamic, dynamic with verify widths), the n-gram trie, a `SuffixDrafter`'s trie, and the head
  tree drafters: EAGLE-3 (dynamic, sampled, static), a parallel EAGLE-3 head (static, dynamic)
  and Medusa heads (static, sampled). Their draft vocabulary leaves out 3 and 6, which the
  automaton allows: the restricted `q` falls back to uniform over the allowed tokens there.
* The trees themselves: every valid node's token is allowed by its parent's state and
  `grammar_states` is the automaton's walk; sampled children come from the restricted `q` the
  tree records.
* SmolLM2's real tokenizer with JSON schemas (tests/constrain/test_speculative_real.py's models):
  greedy sampled and dynamic trees return `generate`'s tokens, and the outputs validate.
* Goodness of fit: N = 20,000 rows of 3 tokens, pooled chi-square against the oracle,
  ALPHA = 1e-3: the sampled tree (3, 2, 1) i.i.d. at T = 1 and at T = 0.7 with top-k 3 and top-p
  0.9 (costly), without replacement at T = 0.7 / top-k / top-p, and the dynamic tree at T = 0.7
  / top-k / top-p (slow). Power (costly): `specjax.testing.grammar`'s tree variants (children
  drawn from the unrestricted `q`; `p` unrestricted; `p` restricted with the root's state) fail
  the same test at the same N with p < POWER_ALPHA = 1e-6.
* `decode_stream` with a tree and a constraint yields `decode`'s tokens; the fused tree kernel
  (interpreted) and a (2, 4) mesh that splits the vocabulary give the reference's tokens; bad
  combinations raise a ValueError before tracing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.constrain.compile import constraint_inputs
from specjax.core.sampling import row_seeds
from specjax.core.tracing import TRACE_COUNTS
from specjax.drafters.eagle import network as eagle
from specjax.drafters.eagle.drafter import EagleDrafter
from specjax.drafters.grammar import GrammarDrafter
from specjax.drafters.grammar_tree import GrammarTreeDrafter, GrammarTreeState
from specjax.drafters.suffix import SuffixCorpus, SuffixDrafter
from specjax.drafters.tree import tree_drafter
from specjax.testing import grammar as broken
from specjax.testing.models import tiny_config
from specjax.trees.structure import TreeSpec
from tests.constrain.test_generate import (  # noqa: F401  (fixtures)
    NEW as JSON_NEW, Biased, _check_rows, _prompts, biased, constraints)
from tests.constrain import test_speculative_real as real
from tests.constrain.test_speculative_law import (  # noqa: F401  (constraint, draft, target)
    ALPHA, AUTOMATON, N, NEW, POWER_ALPHA, PROMPT, SETTINGS, VOCAB, automaton_constraint,
    chi_square_pvalue, constraint, draft, exact_joint, target)
from tests.exactness.test_heads_exactness import DRAFT_IDS, make_eagle, make_medusa

# AUTOMATON with state 2's token 0 leading to state 5, which allows nothing: a row there is stuck.
DEAD_END = {**AUTOMATON, 2: {0: 5, 5: 3, 6: 1}, 5: {}}
MAX_NEW = 12

SPECS = {
    "static": TreeSpec("static", depth=3, width=2),
    "sampled": TreeSpec("sampled", branching=(3, 2, 1)),
    "sampled_without_replacement": TreeSpec("sampled", branching=(3, 2, 1), replacement=False),
    "dynamic": TreeSpec("dynamic", depth=3, width=3, num_nodes=8),
    "dynamic_widths": TreeSpec("dynamic", depth=3, width=3, num_nodes=8, widths=(2, 5)),
    "ngram": TreeSpec("ngram", depth=3, width=3, max_ngram=2),
}


@pytest.fixture(scope="module")
def grammars(constraint):
  """One grammar per row of `ragged`: the automaton and its dead-end variant, alternating."""
  return [constraint, automaton_constraint(DEAD_END)] * 2


@pytest.fixture(scope="module")
def ragged():
  tokens = jnp.asarray([PROMPT, PROMPT[:5] + [0, 0], [3, 3, 1, 0, 0, 0, 0], PROMPT[::-1]],
                       jnp.int32)
  return tokens, jnp.asarray([7, 5, 3, 7], jnp.int32)


@pytest.fixture(scope="module")
def head_target():
  """A target deep enough for EAGLE-3's taps (4 layers) over the same 8 tokens, whose greedy
  rows of the dead-end grammar reach its dead end."""
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=4), jax.random.key(18))


def _walk(automaton, row):
  """`(allowed tokens, stuck)` of `row` under `automaton` (a dict), from state 0."""
  state = 0
  for token in row:
    if int(token) not in automaton[state]:
      return False, False
    state = automaton[state][int(token)]
  return True, not automaton[state]


def assert_greedy_equals_generate(target, drafter, spec, ragged, grammars):
  tokens, lengths = ragged
  want = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=MAX_NEW,
                     constraint=grammars)
  got = sj.decode(target, drafter, tokens, jax.random.key(0), lengths=lengths,
                  max_new_tokens=MAX_NEW, tree=spec, constraint=grammars)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.num_tokens), np.asarray(want.num_tokens))
  np.testing.assert_array_equal(np.asarray(got.stats.constraint_dead),
                                np.asarray(want.stats.constraint_dead))
  dead = np.asarray(want.stats.constraint_dead)
  assert dead[1] and dead[3] and not dead[0]  # the dead-end grammar's rows stop there
  for row, count, automaton in zip(np.asarray(want.tokens), np.asarray(want.num_tokens),
                                   (AUTOMATON, DEAD_END) * 2):
    allowed, stuck = _walk(automaton, row[:count])
    assert allowed and (stuck or count == MAX_NEW)
  summary = got.stats.summary()
  assert 0 <= summary["forced"] <= summary["accepted"]
  return summary


@pytest.mark.parametrize("name", [
    "sampled", "dynamic", "ngram",
    pytest.param("static", marks=pytest.mark.costly),
    pytest.param("sampled_without_replacement", marks=pytest.mark.costly),
    pytest.param("dynamic_widths", marks=pytest.mark.costly)])
def test_greedy_tree_decode_is_constrained_generate(target, draft, ragged, grammars, name):
  summary = assert_greedy_equals_generate(target, draft, SPECS[name], ragged, grammars)
  assert summary["accepted"] > 0


@pytest.mark.parametrize("kind", ["draft", "ngram", "self_int8"])
def test_greedy_chain_with_dead_ends_is_constrained_generate(target, draft, ragged, grammars,
                                                             kind):
  """The chain's counterpart (`tree=None`) on the same dead-end grammars: a row whose drafts walk
  into the state that allows nothing stops there without a token, as `generate`'s does, even
  where a draft past it matches the verify's greedy argmax over nothing."""
  drafter = {"draft": draft, "ngram": sj.NGramDrafter(max_ngram=2),
             "self_int8": sj.self_drafter(target, bits=8)}[kind]
  assert_greedy_equals_generate(target, drafter, None, ragged, grammars)


@pytest.mark.costly
def test_greedy_suffix_trie_is_constrained_generate(target, ragged, grammars):
  corpus = SuffixCorpus.from_sequences([[5, 1, 4, 0, 5, 3, 2, 7, 1, 4], [5, 3, 0, 6, 4, 5]],
                                       capacity=64)
  summary = assert_greedy_equals_generate(target, SuffixDrafter(corpus=corpus), SPECS["ngram"],
                                          ragged, grammars)
  assert summary["accepted"] > 0


def _parallel_eagle(head_target):
  config = eagle.head_config_for(head_target.config, kind="eagle3",
                                 draft_vocab_size=len(DRAFT_IDS), parallel=1)
  head = eagle.init_head(config, head_target, jax.random.key(3), DRAFT_IDS)
  return EagleDrafter(head, head_target.params["embed"])


HEADS = {
    "eagle3": lambda target: make_eagle(target, "eagle3"),
    "eagle3_parallel": _parallel_eagle,
    "medusa": make_medusa,
}


@pytest.mark.costly
@pytest.mark.parametrize("kind, spec", [
    ("eagle3", SPECS["dynamic"]), ("eagle3", SPECS["sampled_without_replacement"]),
    ("eagle3", SPECS["static"]), ("eagle3_parallel", SPECS["static"]),
    ("eagle3_parallel", SPECS["dynamic"]), ("medusa", TreeSpec("static", depth=2, width=3)),
    ("medusa", TreeSpec("sampled", branching=(3, 2)))],
    ids=lambda x: x if isinstance(x, str) else x.builder)
def test_greedy_head_trees_are_constrained_generate(head_target, ragged, grammars, kind, spec):
  assert_greedy_equals_generate(head_target, HEADS[kind](head_target), spec, ragged, grammars)


def propose_once(target, draft, spec, sampling, batch=64):
  """One round's constrained tree after PROMPT, from a fresh draft state, and the wrapper."""
  tokens = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (batch, 1))
  lengths = jnp.full((batch,), len(PROMPT), jnp.int32)
  grammar = constraint_inputs(automaton_constraint(DEAD_END), batch, VOCAB)
  drafter = GrammarTreeDrafter(tree_drafter(target, draft, spec), grammar.tables, grammar.schema)
  buffer = jnp.pad(tokens, ((0, 0), (0, 32)))
  state = drafter.init(buffer, lengths, buffer.shape[1], None)
  # A row in state 2 (after "5 3"): its children's states, and 0's dead end below, differ.
  state = GrammarTreeState(state.inner, jnp.where(jnp.arange(batch) % 2 == 1, 2, state.state))
  seeds = row_seeds(jax.random.key(4), batch)
  _, tree = jax.jit(lambda s: drafter.propose(s, buffer, lengths, num_draft=spec.depth,
                                              sampling=sampling, seeds=seeds))(state)
  return tree, np.asarray(state.state)


@pytest.mark.parametrize("name", ["sampled", "ngram"])
def test_tree_nodes_follow_the_grammar(target, draft, name):
  """Every valid node's token is allowed by its parent's state, `grammar_states` is the
  automaton's walk, and (sampled, T = 0.7 / top-k / top-p) no drawn child was dropped and the
  recorded `q` is `-inf` outside the parent's allowed set."""
  spec = SPECS[name]
  tree, roots = propose_once(target, draft, spec, SETTINGS["t0.7_topk3_topp0.9"])
  tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
  valid, states = np.asarray(tree.valid), np.asarray(tree.grammar_states)
  logits = np.asarray(tree.logits) if tree.logits is not None else None
  for b in range(tokens.shape[0]):
    assert states[b, 0] == roots[b]
    for i in range(tokens.shape[1]):
      parent_state = states[b, parents[b, i] + 1]
      allowed = parent_state >= 0 and int(tokens[b, i]) in DEAD_END[parent_state]
      if valid[b, i]:
        assert allowed
        assert states[b, i + 1] == DEAD_END[parent_state][int(tokens[b, i])]
      if name == "sampled":
        q = logits[b, i]
        assert valid[b, i] == (bool(DEAD_END[parent_state]) if parent_state >= 0 else False)
        outside = [t for t in range(VOCAB) if t not in DEAD_END.get(parent_state, {})]
        if DEAD_END.get(parent_state):
          assert np.all(q[outside] == -np.inf)
  assert valid.sum() > 0 and (name == "sampled" or not valid.all())


# tests/constrain/test_speculative_real.py's target and draft model, under names of their own here
json_target = pytest.fixture(real.json_target, scope="module", name="json_target")
json_draft = pytest.fixture(real.json_draft, scope="module", name="json_draft")


@pytest.mark.parametrize("name", ["dynamic", pytest.param("sampled", marks=pytest.mark.costly)])
def test_greedy_json_trees_equal_constrained_generate(json_target, json_draft, tokenizer,
                                                      constraints, name):
  rows = [constraints[schema] for schema in ("get_weather", "permissions", "set_thermostat")]
  tokens, lengths = _prompts(tokenizer, len(rows))
  want = sj.generate(json_target, tokens, jax.random.key(0), lengths=lengths,
                     max_new_tokens=JSON_NEW, eos_id=tokenizer.eos_ids, constraint=rows)
  got = sj.decode(json_target, json_draft, tokens, jax.random.key(0), lengths=lengths,
                  max_new_tokens=JSON_NEW, eos_id=tokenizer.eos_ids, tree=SPECS[name],
                  constraint=rows)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.num_tokens), np.asarray(want.num_tokens))
  _check_rows(got, rows, tokenizer)
  summary = got.stats.summary()
  assert summary["forced"] > 0  # keys, quotes and braces
  assert summary["rounds"] < int(np.sum(want.num_tokens))


def run_tree_decode(target, draft, constraint, sampling, spec, *, kind=None, seed=0):
  """N copies of PROMPT, 3 new tokens each: `(tokens, num_tokens, summary)`."""
  tokens = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (N, 1))
  if kind is None:
    out = sj.decode(target, draft, tokens, jax.random.key(seed), max_new_tokens=NEW,
                    sampling=sampling, tree=spec, constraint=constraint)
  else:
    grammar = constraint_inputs(constraint, N, VOCAB)
    wrapped = kind(tree_drafter(target, draft, spec), grammar.tables, grammar.schema)
    out = sj.decode(target, wrapped, tokens, jax.random.key(seed), max_new_tokens=NEW,
                    sampling=sampling, tree=spec)
  return np.asarray(out.tokens), np.asarray(out.num_tokens), out.stats.summary()


# Every constrained tree law (91 to 152 s each) and its broken variants below are `slow`, for CI's
# time budget: the grammar's masks enter every builder through the same wrapped drafter, CI checks
# the constrained chain's law and its broken variants (tests/constrain/test_speculative_law.py),
# the unconstrained builders' laws (tests/exactness/test_tree_exactness.py) and the constrained
# trees' greedy identity.
@pytest.mark.parametrize("name, setting", [
    pytest.param("sampled", "t1", marks=pytest.mark.slow),
    pytest.param("sampled", "t0.7_topk3_topp0.9", marks=pytest.mark.slow),
    pytest.param("sampled_without_replacement", "t0.7_topk3_topp0.9", marks=pytest.mark.slow),
    pytest.param("dynamic", "t0.7_topk3_topp0.9", marks=pytest.mark.slow)])
def test_tree_matches_the_constrained_law(target, draft, constraint, name, setting):
  sampling = SETTINGS[setting]
  tokens, num_tokens, summary = run_tree_decode(target, draft, constraint, sampling, SPECS[name])
  p = chi_square_pvalue(tokens, exact_joint(target, sampling), num_tokens)
  print(f"{name} {setting}: p = {p:.3g}, {summary}")
  assert summary["acceptance_rate"] < 0.98  # the rule rejects too
  assert summary["accepted"] > 0.5 * summary["rounds"]  # the tree is really used
  assert summary["accepted_per_position"][1] > 0  # paths deeper than one node are accepted
  assert summary["forced"] > 0
  assert p > ALPHA


# `slow` with the laws above (102 to 126 s each).
@pytest.mark.slow
@pytest.mark.parametrize("kind", [broken.TreeMasksPOnly, broken.TreeMasksQOnly,
                                  broken.TreeRootMask], ids=lambda kind: kind.__name__)
def test_broken_tree_variants_are_rejected(target, draft, constraint, kind):
  sampling = SETTINGS["t1"]
  tokens, num_tokens, _ = run_tree_decode(target, draft, constraint, sampling, SPECS["sampled"],
                                          kind=kind)
  p = chi_square_pvalue(tokens, exact_joint(target, sampling), num_tokens)
  print(f"{kind.__name__}: p = {p:.3g}")
  assert p < POWER_ALPHA


@pytest.mark.costly
def test_stream_yields_the_constrained_tree_decode(target, draft, ragged, grammars):
  tokens, lengths = ragged
  common = dict(lengths=lengths, max_new_tokens=10, sampling=SETTINGS["t0.7_topk3_topp0.9"],
                tree=SPECS["sampled"], constraint=grammars)
  want = sj.decode(target, draft, tokens, jax.random.key(3), **common)
  rows = [[] for _ in range(tokens.shape[0])]
  for new, _ in sj.decode_stream(target, draft, tokens, jax.random.key(3), **common):
    for b, emitted in enumerate(new):
      rows[b].extend(emitted.tolist())
  for b in range(tokens.shape[0]):
    assert rows[b] == np.asarray(want.tokens)[b, :int(want.num_tokens[b])].tolist()


def test_bad_combinations_are_refused_before_tracing(target, draft, constraint):
  prompts = jnp.asarray([PROMPT], jnp.int32)
  spec = SPECS["sampled"]
  grammar = constraint_inputs(constraint, 1, VOCAB)
  chain = GrammarDrafter(sj.drafters.as_drafter(draft), grammar.tables, grammar.schema)
  wrapped = GrammarTreeDrafter(tree_drafter(target, draft, spec), grammar.tables, grammar.schema)
  other = sj.init_params(tiny_config(vocab_size=VOCAB + 8, num_layers=1), jax.random.key(2))
  before = TRACE_COUNTS["decode"]
  cases = [
      (dict(draft=chain, tree=spec), "already a GrammarDrafter"),
      (dict(draft=chain, tree=SPECS["ngram"]), "already a GrammarDrafter"),
      (dict(draft=wrapped, tree=spec, constraint=constraint), "already a GrammarTreeDrafter"),
      (dict(draft=wrapped), "drafts the trees of its own TreeSpec"),
      (dict(draft=wrapped, tree=SPECS["dynamic"]), "drafts the trees of its own TreeSpec"),
      (dict(draft=other, tree=spec, constraint=constraint), "vocabulary"),
      (dict(draft=draft, tree=spec, constraint=[constraint] * 2), "sequence of 2 constraints"),
  ]
  for kwargs, match in cases:
    kwargs = dict(dict(draft=None, tree=None, constraint=None), **kwargs)
    with pytest.raises(ValueError, match=match):
      sj.decode(target, kwargs.pop("draft"), prompts, jax.random.key(0), **kwargs)
  assert TRACE_COUNTS["decode"] == before


@pytest.mark.costly
@pytest.mark.parametrize("name, setting", [("sampled", "t0.7_topk3_topp0.9"),
                                           ("sampled_without_replacement", "t1")])
def test_tree_kernel_on_constrained_logits(target, draft, ragged, grammars, name, setting):
  """The fused tree kernel (`verify_impl="pallas"`, interpreted on CPU; what "auto" runs on TPU
  and GPU) on the constrained logits, `-inf` outside each node's allowed set: the reference
  rule's tokens, dead rows included."""
  tokens, lengths = ragged
  common = dict(lengths=lengths, max_new_tokens=10, sampling=SETTINGS[setting],
                tree=SPECS[name], constraint=grammars)
  want, got = (sj.decode(target, draft, tokens, jax.random.key(1), verify_impl=impl, **common)
               for impl in ("reference", "pallas"))
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.num_tokens), np.asarray(want.num_tokens))
  assert np.any(np.asarray(want.stats.constraint_dead))


@pytest.mark.costly
def test_sharded_tree_decode_equals_one_device(target, draft, ragged, grammars):
  """On a (data 2, model 4) mesh of the 8 simulated CPU devices (the vocabulary split over
  `model`: the tree rule runs on vocabulary slices), the constrained sampled tree's tokens are
  the single-device ones."""
  from specjax import parallel as sh
  tokens, lengths = ragged
  common = dict(lengths=lengths, max_new_tokens=10, sampling=SETTINGS["t0.7_topk3_topp0.9"],
                tree=SPECS["sampled"], constraint=grammars)
  single = sj.decode(target, draft, tokens, jax.random.key(1), **common)
  mesh = sj.make_mesh((2, 4))
  with sh.use_mesh(mesh):
    out = sj.decode(sj.shard(target, mesh), sj.shard(draft, mesh), tokens, jax.random.key(1),
                    **common)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(single.tokens))
  np.testing.assert_array_equal(np.asarray(out.num_tokens), np.asarray(single.num_tokens))
