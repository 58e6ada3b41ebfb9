"""Draft trees from feature heads (EAGLE-3, MTP, Medusa) inside the tree decode loop.

* Tree attention of the head: for every root-to-leaf path of a head-built tree (EAGLE-2 dynamic,
  sampled), the draft logits each node was chosen from equal the head's plain chain forward
  along that path (one-token steps, each fed the previous step's output feature), float32.
* The target's tree forward returns the head's features: along every root-to-leaf path, the taps
  and the final hidden state equal a plain causal forward over the prompt and the path.
* Greedy tree decoding with an EAGLE-3 / MTP head (dynamic and static trees) and Medusa heads
  (static) returns `sj.generate`'s tokens on a ragged batch (one row a single-token prompt) with
  EOS; stats count the head's forwards as the chain does.
* Features flow: after decoding, the head's cache and carried output equal a fresh head forward
  over the *target's* features of the final sequences; a drafter that feeds its own features
  (the entries it drafted) fails the same check.
* Goodness of fit: sampled and dynamic head trees at temperature 1.0 and 0.7 with top-k/top-p
  reproduce the target's distribution: the harness of tests/exactness/test_exactness.py (N = 20,000 rows,
  3 tokens, 8-token vocabulary, pooled chi-square, ALPHA = 1e-3, random heads with a 6-id draft
  vocabulary). Power: the same dynamic tree verified as if its top-m children were sampled (the
  i.i.d. rule) fails the same test at the same N with p < POWER_ALPHA = 1e-6.
* One top-level while loop, no callbacks, one trace per bucket; bad combinations raise
  ValueError before tracing.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.loop import KVCache
from specjax.drafters.eagle import network as eagle
from specjax.drafters import tree_heads
from specjax.drafters.eagle.drafter import EagleDrafter
from specjax.models.transformer import forward
from specjax.core.sampling import row_seeds
from specjax.testing.models import tiny_config
from specjax.core.tracing import TRACE_COUNTS
from specjax.drafters.tree import tree_drafter
from specjax.loop.round import path_output, round_step, score_tree
from specjax.loop.state import init_state
from specjax.core.validation import pytree_classes
from specjax.trees.structure import TreeSpec
from tests.exactness.test_exactness import ALPHA, N, NEW, POWER_ALPHA, PROMPT, VOCAB, chi_square_pvalue, exact_joint
from tests.drafters.test_heads import DRAFT_IDS, make_drafter
from tests.exactness.test_heads_exactness import SETTINGS, make_eagle
from tests.trees.test_trees import all_paths, check_structure

ATOL = 2e-5
MAX_NEW = 16


@pytest.fixture(scope="module")
def target():
  # 4 layers so that the EAGLE-3 taps (2, L//2, L-3) = (2, 2, 1) exist; vocabulary 12.
  return sj.init_params(tiny_config(vocab_size=12, num_layers=4), jax.random.key(0))


@pytest.fixture(scope="module")
def batch():
  tokens = jnp.array([[5, 9, 2, 7, 1, 3], [3, 0, 0, 0, 0, 0], [11, 4, 6, 4, 0, 0]], jnp.int32)
  return tokens, jnp.array([6, 1, 4], jnp.int32)


def head_state(target, drafter, tokens, lengths):
  """The head's state after the prompt, and the target's prefill output."""
  out = forward(target, tokens, jnp.zeros(tokens.shape[0], jnp.int32), taps=drafter.taps,
                return_hidden=drafter.needs_hidden)
  return drafter.init(tokens, lengths, tokens.shape[1] + 16, out), out


SPECS = {  # widths of 3 (a quarter of the vocabulary) so that random heads get drafts accepted
    "dynamic": TreeSpec("dynamic", depth=3, width=3, num_nodes=9),
    "sampled": TreeSpec("sampled", branching=(3, 2, 1), replacement=False),
    "static": TreeSpec("static", depth=3, width=3),
}


# 8 of the dynamic pool's 2 + 4 + 4 candidates: some depth-3 node is always kept.
PATH_SPEC = TreeSpec("dynamic", depth=3, width=2, num_nodes=8)

# Verify widths chosen on device (`lax.switch`): the target's features are padded like its logits.
WIDTHS_SPEC = TreeSpec("dynamic", depth=3, width=3, num_nodes=9, widths=(3, 6))


@functools.partial(jax.jit, static_argnames=("spec", "sampling"))
def build(drafter, state, tokens, lengths, *, spec, sampling):
  """One round's head tree below each row's last prompt token."""
  root = tokens[jnp.arange(tokens.shape[0]), lengths - 1]
  return tree_heads.draft_tree(drafter, state, spec=spec, root=root, sequence=tokens,
                               lengths=lengths, sampling=sampling,
                               seeds=jnp.arange(tokens.shape[0], dtype=jnp.uint32))


chain_step = jax.jit(eagle.head_forward)


# ---------------------------------------------------------------------------------------------
# Tree attention of the head, and the target's features over a tree.


@pytest.mark.parametrize("kind,builder", [
    ("eagle3", "dynamic"),
    pytest.param("mtp", "sampled", marks=pytest.mark.slow),
    pytest.param("eagle3", "sampled", marks=pytest.mark.slow),
    pytest.param("mtp", "dynamic", marks=pytest.mark.slow)])
def test_head_tree_logits_equal_chain_forward_on_every_path(target, batch, kind, builder):
  tokens, lengths = batch
  drafter = make_drafter(target, kind)
  state, _ = head_state(target, drafter, tokens, lengths)
  spec = PATH_SPEC if builder == "dynamic" else SPECS[builder]
  tree = build(drafter, state, tokens, lengths, spec=spec, sampling=sj.Sampling(temperature=1.0))
  check_structure(tree, deterministic=True)
  # Every (row, path) case runs the chain as `EagleDrafter.propose` does: one pair per step,
  # (previous output feature, token) at slot L - 2 + depth, over the committed cache.
  cases = [(b, path) for b in range(3) for path in all_paths(tree, b)]
  rows = np.asarray([b for b, _ in cases])
  path_tokens = np.zeros((len(cases), spec.depth), np.int32)
  for i, (b, path) in enumerate(cases):
    path_tokens[i, :len(path)] = np.asarray(tree.tokens[b])[path]
  cache = state.cache
  cache = KVCache(cache.k[:, rows], cache.v[:, rows], cache.lengths[rows])
  hidden, logits = state.hidden[rows], state.logits[rows]
  chain = [logits]  # chain[j]: the draft logits of the depth-(j + 1) node
  for j in range(1, spec.depth):
    step_logits, out, cache = chain_step(
        drafter.head, drafter.target_embed, jnp.asarray(path_tokens[:, j - 1:j]),
        hidden[:, None], lengths[rows] - 2 + j, cache)
    hidden = out[:, 0]
    chain.append(step_logits[:, 0])
  chain = np.asarray(drafter.full_logits(jnp.stack(chain, axis=1)))  # [cases, D, V]
  got = np.asarray(tree.logits)
  checked = 0
  for i, (b, path) in enumerate(cases):
    for j, node in enumerate(path):
      np.testing.assert_allclose(got[b, node], chain[i, j], atol=ATOL, rtol=0)
      checked += 1
  assert checked >= 3 * spec.depth and max(len(p) for _, p in cases) == spec.depth


def test_target_tree_features_equal_causal_forward_on_every_path(target, batch):
  tokens, lengths = batch
  drafter = make_drafter(target, "eagle3")
  state, _ = head_state(target, drafter, tokens, lengths)
  spec = PATH_SPEC
  tree = build(drafter, state, tokens, lengths, spec=spec, sampling=sj.Sampling(temperature=1.0))
  root = tokens[jnp.arange(3), lengths - 1]

  @jax.jit
  def score(target, tree):
    cache = target(tokens, jnp.zeros((3,), jnp.int32), target.init_cache(3, 24)).cache
    starts = lengths - 1
    return score_tree(target, tree, root, starts, cache.with_lengths(starts),
                      jnp.zeros((3,), bool), spec, taps=drafter.taps, return_hidden=True)

  scored = score(target, tree)
  cases = [(b, path) for b in range(3) for path in all_paths(tree, b)]
  index = np.zeros((len(cases), 4), np.int32)  # [root, path nodes] as extended indices
  sequences = np.zeros((len(cases), tokens.shape[1] + 3), np.int32)
  for i, (b, path) in enumerate(cases):
    index[i, 1:1 + len(path)] = np.asarray(path) + 1
    length = int(lengths[b])
    sequences[i, :length + len(path)] = np.concatenate(
        [np.asarray(tokens[b, :length]), np.asarray(tree.tokens[b])[path]])
  rows = np.asarray([b for b, _ in cases])
  scored_rows = scored._replace(hidden=scored.hidden[rows], taps=scored.taps[:, rows])
  along = path_output(scored_rows, jnp.asarray(index))
  plain = jax.jit(functools.partial(forward, taps=drafter.taps, return_hidden=True))(
      target, jnp.asarray(sequences), jnp.zeros(len(cases), jnp.int32))
  for i, (b, path) in enumerate(cases):
    span = slice(int(lengths[b]) - 1, int(lengths[b]) + len(path))  # the root, then the path
    width = len(path) + 1
    np.testing.assert_allclose(along.taps[:, i, :width], plain.taps[:, i, span], atol=ATOL,
                               rtol=0)
    np.testing.assert_allclose(along.hidden[i, :width], plain.hidden[i, span], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# Greedy identity, stats.


@pytest.mark.parametrize("kind,spec", [
    ("eagle3", SPECS["dynamic"]),
    ("medusa", SPECS["static"]),
    pytest.param("mtp", WIDTHS_SPEC, marks=pytest.mark.slow),
    pytest.param("eagle3", SPECS["static"], marks=pytest.mark.slow),
    pytest.param("mtp", SPECS["static"], marks=pytest.mark.slow),
    pytest.param("eagle3", SPECS["sampled"], marks=pytest.mark.slow),
    pytest.param("medusa", SPECS["sampled"], marks=pytest.mark.slow),
], ids=lambda x: x if isinstance(x, str) else x.builder + ("_widths" if x.widths else ""))
def test_greedy_head_tree_decode_equals_generate(target, batch, kind, spec):
  tokens, lengths = batch
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=MAX_NEW)
  eos = int(ref.tokens[0, 5])  # row 0 stops early; the others may or may not meet it
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=MAX_NEW,
                    eos_id=eos)
  drafter = make_drafter(target, kind)
  out = sj.decode(target, drafter, tokens, jax.random.key(5), lengths=lengths,
                  max_new_tokens=MAX_NEW, eos_id=eos, tree=spec)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.num_tokens, ref.num_tokens)
  assert int(ref.num_tokens[0]) < MAX_NEW
  stats = out.stats
  print(kind, spec.builder, stats.summary())
  assert int(np.sum(stats.accepted)) > 0
  per_depth = np.asarray(stats.accepted_per_position)
  assert per_depth.shape == (3, spec.depth)
  np.testing.assert_array_equal(per_depth.sum(axis=1), stats.accepted)
  assert np.all(np.diff(per_depth, axis=1) <= 0)  # depth d + 1 is accepted only after depth d
  np.testing.assert_array_equal(stats.draft_calls,
                                stats.rounds * drafter.forwards_per_round(spec.depth))
  np.testing.assert_array_equal(stats.target_calls, stats.rounds + 1)


# ---------------------------------------------------------------------------------------------
# Features flow: the head's cache holds the target's features, never its own.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OwnFeaturesEagle(EagleDrafter):
  """The bug the features-flow test must catch: the accepted tokens keep the entries the head
  drafted them with, each paired with the head's own output feature of the token before."""

  def observe(self, state, scored, block, emitted, count, lengths):
    del scored, block
    cache, hidden = state.cache, state.hidden
    outputs, all_logits = [], []
    for j in range(emitted.shape[1]):
      logits, out, cache = self._run(emitted[:, j:j + 1], hidden[:, None], lengths - 1 + j,
                                     cache)
      hidden = out[:, 0]
      outputs.append(hidden)
      all_logits.append(logits[:, 0])
    last = jnp.maximum(count - 1, 0)[:, None, None]
    pick = lambda x: jnp.take_along_axis(jnp.stack(x, axis=1), last, axis=1)[:, 0]
    kept = count > 0
    return type(state)(
        cache.with_lengths(jnp.where(kept, lengths - 1 + count, state.cache.lengths)),
        jnp.where(kept[:, None], pick(outputs), state.hidden),
        jnp.where(kept[:, None], pick(all_logits), state.logits))


@functools.partial(jax.jit, static_argnames=("spec", "classes"))
def _final_tree_state(target, drafter, tokens, lengths, *, spec, classes):
  del classes  # a cache key only: OwnFeaturesEagle's treedef equals EagleDrafter's in jax 0.10
  drafter = tree_drafter(target, drafter, spec)
  state = init_state(target, drafter, tokens, lengths, jnp.int32(MAX_NEW), jnp.array([-1]),
                     row_seeds(jax.random.key(3), tokens.shape[0]), num_draft=spec.depth,
                     capacity=64)
  step = functools.partial(round_step, target, drafter, num_draft=spec.depth,
                           sampling=sj.Sampling())
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)


def final_tree_state(target, drafter, tokens, lengths, *, spec):
  """`decode(..., tree=)`'s loop, returning the whole state (the head's included). Keyed, like
  `decode`, on the drafter's classes (`pytree_classes`), so a subclass never runs its parent's
  program."""
  return _final_tree_state(target, drafter, tokens, lengths, spec=spec,
                           classes=pytree_classes(target, drafter))


def features_mismatch(target, drafter, tokens, lengths, spec) -> float:
  """Max |difference| between the head's cache/output after tree decoding and a fresh head
  forward over the target's features of each final sequence."""
  state = final_tree_state(target, drafter, tokens, lengths, spec=spec)
  final_lengths = np.asarray(state.lengths)
  assert np.all(final_lengths == np.asarray(lengths) + MAX_NEW)
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=MAX_NEW)
  for b, length in enumerate(np.asarray(lengths)):  # greedy identity holds for any head
    np.testing.assert_array_equal(state.tokens[b, length:length + MAX_NEW], ref.tokens[b])
  assert len(set(np.asarray(state.stats.accepted).tolist())) > 1  # ragged acceptance
  sequence = state.tokens[:, :int(final_lengths.max())]
  out = forward(target, sequence, jnp.zeros(3, jnp.int32), taps=drafter.taps,
                return_hidden=drafter.needs_hidden)
  shifted = jnp.concatenate([sequence[:, 1:], jnp.zeros_like(sequence[:, :1])], axis=1)
  head_cache = state.draft_state.cache
  _, hidden, expected = eagle.head_forward(
      drafter.head, drafter.target_embed, shifted, drafter.features(out), jnp.zeros(3, jnp.int32),
      drafter.head.init_cache(3, head_cache.max_len))
  np.testing.assert_array_equal(head_cache.lengths, final_lengths - 1)
  worst = 0.0
  for b, length in enumerate(final_lengths):
    for got, want in ((head_cache.k, expected.k), (head_cache.v, expected.v)):
      diff = np.abs(np.asarray(got[0, b, :, :length - 1]) - np.asarray(want[0, b, :, :length - 1]))
      worst = max(worst, float(diff.max()))
    worst = max(worst, float(np.abs(np.asarray(state.draft_state.hidden[b])
                                    - np.asarray(hidden[b, length - 2])).max()))
  return worst


@pytest.mark.parametrize("kind", ["mtp", pytest.param("eagle3", marks=pytest.mark.slow)])
def test_head_cache_holds_the_targets_features(target, batch, kind):
  tokens, lengths = batch
  mismatch = features_mismatch(target, make_drafter(target, kind), tokens, lengths,
                               WIDTHS_SPEC)
  assert mismatch < 1e-4


@pytest.mark.slow
def test_own_features_are_detected(target, batch):
  tokens, lengths = batch
  drafter = make_drafter(target, "mtp", OwnFeaturesEagle)
  assert features_mismatch(target, drafter, tokens, lengths, WIDTHS_SPEC) > 1e-2


# ---------------------------------------------------------------------------------------------
# The compiled program and bad input.


def test_one_while_loop_no_callbacks_no_recompilation(target, batch):
  tokens, lengths = batch
  drafter = make_drafter(target, "eagle3")
  spec = SPECS["dynamic"]
  sampling = sj.Sampling()  # the greedy test's program (sampled programs: the fit tests below)
  jaxpr = jax.make_jaxpr(lambda t, l: sj.decode(
      target, drafter, t, jax.random.key(0), lengths=l, max_new_tokens=8, tree=spec,
      sampling=sampling))(tokens, lengths)
  assert "callback" not in str(jaxpr)
  calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("pjit", "jit")]
  assert len(calls) == 1
  top = [e for e in calls[0].params["jaxpr"].jaxpr.eqns if e.primitive.name == "while"]
  assert len(top) == 1
  before = TRACE_COUNTS["decode"]
  for max_new, seed in ((10, 1), (30, 2), (64, 3)):  # one bucket of max_new_tokens
    sj.decode(target, drafter, tokens, jax.random.key(seed), lengths=lengths,
                max_new_tokens=max_new, tree=spec, sampling=sampling, eos_id=seed)
  assert TRACE_COUNTS["decode"] - before <= 1


def test_bad_combinations_raise_before_tracing(target, batch):
  tokens, lengths = batch
  run = lambda drafter, spec: sj.decode(target, drafter, tokens, jax.random.key(0),
                                        lengths=lengths, max_new_tokens=4, tree=spec)
  medusa_drafter = make_drafter(target, "medusa")  # 3 heads
  before = TRACE_COUNTS["decode"]
  with pytest.raises(ValueError, match="Medusa heads predict every depth"):
    run(medusa_drafter, SPECS["dynamic"])
  with pytest.raises(ValueError, match="needs 4 Medusa heads"):
    run(medusa_drafter, TreeSpec("static", depth=4, width=2))
  eagle3 = make_drafter(target, "eagle3")
  with pytest.raises(ValueError, match="min_prob"):
    run(dataclasses.replace(eagle3, confidence=0.5), SPECS["dynamic"])
  with pytest.raises(ValueError, match="width .* exceeds"):
    run(eagle3, TreeSpec("dynamic", depth=2, width=len(DRAFT_IDS) + 1))
  with pytest.raises(ValueError, match="candidates per depth"):
    run(eagle3, TreeSpec("static", choices=((0,), (len(DRAFT_IDS),))))
  shallow = sj.init_params(tiny_config(vocab_size=12, num_layers=1), jax.random.key(0))
  with pytest.raises(ValueError, match="taps"):  # taps (2, 2, 1) of a 4-layer target
    sj.decode(shallow, eagle3, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=4,
              tree=SPECS["dynamic"])
  wider = sj.init_params(tiny_config(vocab_size=16, num_layers=4), jax.random.key(0))
  with pytest.raises(ValueError, match="draft vocabulary"):
    sj.decode(wider, eagle3, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=4,
              tree=SPECS["dynamic"])
  assert TRACE_COUNTS["decode"] == before


# ---------------------------------------------------------------------------------------------
# Goodness of fit (the harness of tests/exactness/test_exactness.py: N, NEW, ALPHA, POWER_ALPHA there).

FIT_SPECS = {
    "sampled": TreeSpec("sampled", branching=(2, 2), replacement=False),
    "sampled_iid": TreeSpec("sampled", branching=(2, 2), replacement=True),
    "dynamic": TreeSpec("dynamic", depth=2, width=2, num_nodes=4),
}


@dataclasses.dataclass(frozen=True)
class IidRuleSpec(TreeSpec):
  """A broken spec: top-m children verified as if they were sampled i.i.d. from q."""

  @property
  def rule(self) -> str:
    return "iid"


@pytest.fixture(scope="module")
def fit_target():
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=4), jax.random.key(10))


def fit_pvalue(target, drafter, spec, setting):
  sampling = SETTINGS[setting]
  tokens = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (N, 1))
  out = sj.decode(target, drafter, tokens, jax.random.key(0), max_new_tokens=NEW,
                  sampling=sampling, tree=spec)
  assert np.all(np.asarray(out.num_tokens) == NEW)
  summary = out.stats.summary()
  p = chi_square_pvalue(np.asarray(out.tokens), exact_joint(target, sampling))
  print(f"{type(drafter).__name__} {spec.builder} {setting}: p = {p:.3g}, "
        f"{summary['tokens_per_round']:.3f} tokens per round")
  return p, summary


@pytest.mark.costly
@pytest.mark.parametrize("kind,builder,setting", [
    ("eagle3", "sampled", "t0.7_topk5_topp0.9"),
    pytest.param("eagle3", "sampled", "t1", marks=pytest.mark.slow),
    pytest.param("eagle3", "dynamic", "t1", marks=pytest.mark.slow),
    pytest.param("eagle3", "dynamic", "t0.7_topk5_topp0.9", marks=pytest.mark.slow),
    pytest.param("eagle3", "sampled_iid", "t1", marks=pytest.mark.slow),
    pytest.param("mtp", "sampled", "t1", marks=pytest.mark.slow),
    pytest.param("mtp", "dynamic", "t0.7_topk5_topp0.9", marks=pytest.mark.slow),
])
def test_head_tree_matches_target_distribution(fit_target, kind, builder, setting):
  p, summary = fit_pvalue(fit_target, make_eagle(fit_target, kind), FIT_SPECS[builder], setting)
  assert summary["accepted"] > 0.05 * summary["rounds"]  # the tree is really used
  assert p > ALPHA


@pytest.mark.slow
def test_top_m_children_verified_as_sampled_is_detected(fit_target):
  spec = IidRuleSpec("dynamic", depth=2, width=2, num_nodes=4)
  p, _ = fit_pvalue(fit_target, make_eagle(fit_target, "eagle3"), spec, "t1")
  assert p < POWER_ALPHA
