"""A parallel-drafting EAGLE head (P-EAGLE-style): every draft of a round from one forward.

* Training and inference agree: step `j >= 2` of the training-time unroll (`eagle_unroll`, its
  placeholders) equals the logits of the drafting forward at slot `j - 1`, run with the head's KV
  cache over the true pairs and the first draft (`parallel_inputs` + `head_forward`). The same
  check with the placeholders in the wrong order fails, so the check can fail.
* Greedy decoding with a parallel EAGLE-3 or MTP head on a ragged batch returns exactly
  `sj.generate`'s tokens, at the head's longest round and a shorter one, with two head forwards a
  round; after decoding, its KV cache holds the target's features (the placeholder slots it wrote
  while drafting are overwritten).
* A parallel head trains (`head_run`, `parallel=True`), saves and loads through Orbax with its
  placeholders, and decodes greedily like `generate`.
* Bad input: more drafts than the head has slots, a negative `parallel`, a parallel Medusa or a
  too-short unroll: clear errors.

* Trees (top-`K` per parallel position): in a head tree (EAGLE-2 dynamic, sampled), every node's
  draft logits equal slot `d - 2` of the chain's drafting forward run with the node's depth-1
  ancestor as first draft (the neighbouring slot differs, so the check can fail); greedy tree
  decoding (dynamic, static, sampled) returns `sj.generate`'s tokens on a ragged batch with two
  head forwards a round; a sampled tree at T = 0.7 with top-k / top-p fits the target's
  distribution (the tree harness of tests/drafters/test_tree_heads.py: N = 20,000, alpha 1e-3),
  and the same head's top-m tree verified as if sampled is rejected (p < 1e-6); a tree deeper
  than the head's slots is refused before tracing.
* Adaptive length (`sj.adaptive_drafter`) bounds `K` by the head's slots and keeps greedy output
  `generate`'s; on meshes: `test_parallel_head_on_a_mesh_matches_single_device`
  (tests/parallel/test_mesh.py).

The sampled chain's chi-square (T = 1, T = 0.7 with top-k / top-p) and its broken variant (drafts
sampled, verify given point masses at each slot's argmax) are in
`tests/exactness/test_exactness_harness.py` (`eagle3_parallel`).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.loop import KVCache
from specjax.drafters.eagle import network as eagle
from specjax.drafters.eagle.parallel import parallel_inputs
from specjax.drafters.eagle.drafter import EagleDrafter
from specjax.training import head_run, heads
from specjax.testing.models import tiny_config
from specjax.trees.structure import TreeSpec
from tests.drafters.test_heads import (DRAFT_IDS, VOCAB, assert_greedy_equals_generate,
                                       batch, features_mismatch, target)  # noqa: F401 (fixtures)
from tests.exactness.test_exactness import ALPHA
from tests.exactness.test_exactness_harness import argmax_point_mass, neighbour_q
from tests.training.test_heads_train import VOCAB as TRAIN_VOCAB, _write_chunks
from tests.trees.test_trees import all_paths, check_structure

PARALLEL = 3  # placeholder slots: rounds of up to 5 drafts


def parallel_drafter(model, kind: str, parallel: int = PARALLEL, seed: int = 1):
  config = eagle.head_config_for(model.config, kind=kind, draft_vocab_size=len(DRAFT_IDS),
                                 parallel=parallel)
  head = eagle.init_head(config, model, jax.random.key(seed), DRAFT_IDS)
  return EagleDrafter(head, model.params["embed"])


def scaled(drafter: EagleDrafter, factor: float = 3.0) -> EagleDrafter:
  """The head with its matrices scaled: far from the identity, so a wrong slot shows."""
  head = eagle.EagleHead(jax.tree.map(lambda x: x * factor if x.dtype == jnp.float32
                                      and x.ndim == 2 else x, drafter.head.params),
                         drafter.head.config)
  return EagleDrafter(head, drafter.target_embed)


@pytest.mark.parametrize("swap, reads_first", [(False, True), (True, True), (False, False)])
def test_training_unroll_equals_the_drafting_forward(target, swap, reads_first):
  """Chain t's unroll step j (j >= 1) == slot j - 1 of one drafting forward over the cache of the
  true pairs 0..t, slot 0 fed the head's output at t with token t + 2 (or, in vLLM's P-EAGLE
  layout, a placeholder); with the placeholders swapped in the drafting forward (swap=True) the
  later slots differ."""
  drafter = parallel_drafter(target, "eagle3")
  head = drafter.head
  if not reads_first:
    config = dataclasses.replace(head.config, parallel_reads_first=False)
    head = eagle.EagleHead(head.params, config)
  # Far from the identity, so that a wrong slot, position or placeholder shows.
  head = eagle.EagleHead(jax.tree.map(lambda x: x * 3.0 if x.dtype == jnp.float32 and x.ndim == 2
                                      else x, head.params), head.config)
  tokens = jax.random.randint(jax.random.key(2), (2, 14), 0, VOCAB)
  out = jax.jit(lambda m, t: m(t, jnp.zeros((2,), jnp.int32), taps=head.config.taps))(target,
                                                                                      tokens)
  embed = target.params["embed"]
  num_steps = PARALLEL + (2 if reads_first else 1)
  steps = jax.jit(lambda h, t, s: heads.eagle_unroll(h, embed, t, s, num_steps))(
      head, tokens, out.taps)
  features = eagle.project_features(head, out.taps)
  drafting = head
  if swap:
    drafting = eagle.EagleHead({**head.params,
                                "parallel_embed": head.params["parallel_embed"][::-1],
                                "parallel_feature": head.params["parallel_feature"][::-1]},
                               head.config)
  forward = jax.jit(eagle.head_forward)
  for chain in (0, 5):
    cache = head.init_cache(2, 32)
    logits, hidden, cache = forward(head, embed, tokens[:, 1:chain + 2], features[:, :chain + 1],
                                    jnp.zeros(2, jnp.int32), cache)
    np.testing.assert_allclose(logits[:, -1], steps[0][:, chain], atol=2e-4, rtol=2e-4)
    inputs = parallel_inputs(drafting, embed, tokens[:, chain + 2], hidden[:, -1],
                             num_steps - 1)
    block, _, _ = forward(drafting, None, *inputs, cache.lengths, cache)
    np.testing.assert_allclose(block[:, 0], steps[1][:, chain], atol=2e-4, rtol=2e-4)
    later = np.stack([np.asarray(steps[j][:, chain]) for j in range(2, num_steps)], 1)
    if swap:
      assert float(np.abs(np.asarray(block[:, 1:]) - later).max()) > 1e-2
    else:
      np.testing.assert_allclose(block[:, 1:], later, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("kind, num_draft", [("eagle3", PARALLEL + 2), ("eagle3", 3),
                                             ("mtp", PARALLEL + 2)])
def test_greedy_equals_generate_ragged_batch(target, batch, kind, num_draft):
  drafter = parallel_drafter(target, kind)
  assert drafter.forwards_per_round(num_draft) == 2
  assert_greedy_equals_generate(target, drafter, batch, num_draft)


def test_head_cache_holds_the_targets_features(target, batch):
  tokens, lengths = batch
  drafter = parallel_drafter(target, "eagle3", parallel=1)  # rounds of 3 = test_heads' NUM_DRAFT
  assert features_mismatch(target, drafter, tokens, lengths) < 1e-4


@pytest.mark.costly
def test_a_trained_parallel_head_saves_loads_and_decodes(tmp_path):
  data = tmp_path / "data"
  _write_chunks(data, 3)
  config = heads.HeadTrainConfig(kind="eagle3", steps=4, batch_size=4, seq_len=16, ttt_steps=4,
                                 parallel=True, draft_vocab_size=32, warmup_steps=1,
                                 learning_rate=3e-3)
  model = sj.init_params(tiny_config(vocab_size=TRAIN_VOCAB, num_layers=6, pad_id=0),
                         jax.random.PRNGKey(0))
  trained = head_run.train_head(model, data, tmp_path / "run", config, chunks=[0, 1],
                                eval_chunks=[2], rows_per_chunk=4, log_every=1, eval_every=2,
                                eval_batches=1, checkpoint_every=2, progress=False,
                                log=lambda _: None)
  assert trained.config.parallel == 2
  loaded = eagle.load_head(tmp_path / "run" / "head")
  assert loaded.config == trained.config
  for a, b in zip(jax.tree.leaves(trained.params), jax.tree.leaves(loaded.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  untrained = eagle.init_head(trained.config, model, jax.random.key(1), trained.draft_ids)
  assert not np.array_equal(np.asarray(untrained.params["parallel_embed"]),
                            np.asarray(loaded.params["parallel_embed"]))  # trained, then saved
  tokens = jnp.array([[5, 9, 2, 7, 1, 3], [3, 8, 0, 0, 0, 0]], jnp.int32)
  lengths = jnp.array([6, 2], jnp.int32)
  expected = sj.generate(model, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=16)
  out = sj.decode(model, EagleDrafter(loaded, model.params["embed"]), tokens, jax.random.key(5),
                  lengths=lengths, max_new_tokens=16, num_draft=4)
  np.testing.assert_array_equal(out.tokens, expected.tokens)


def test_bad_input_is_a_clear_error(target, batch):
  tokens, lengths = batch
  drafter = parallel_drafter(target, "eagle3")
  assert drafter.max_draft == PARALLEL + 2
  assert parallel_drafter(target, "eagle3", parallel=0).max_draft is None
  with pytest.raises(ValueError, match="exceeds what this parallel head drafts"):
    sj.decode(target, drafter, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=8,
              num_draft=PARALLEL + 3)
  with pytest.raises(ValueError, match="parallel must be an int >= 0"):
    eagle.head_config_for(target.config, draft_vocab_size=4, parallel=-1)
  for kind, ttt_steps in (("medusa", 4), ("eagle3", 2)):
    with pytest.raises(ValueError, match="a parallel head is an EAGLE-3 or MTP head"):
      heads.HeadTrainConfig(kind=kind, ttt_steps=ttt_steps, parallel=True)
  with pytest.raises(ValueError, match="unrolls at most"):
    heads.eagle_unroll(drafter.head, target.params["embed"], tokens, None, PARALLEL + 3)


@pytest.mark.parametrize("broken, reads_first", [
    (None, True), (neighbour_q, True), (argmax_point_mass, True), (None, False)])
def test_each_slot_draws_from_the_q_it_hands_verify(target, broken, reads_first):
  """At T = 1, N = 6,000 rows of one prompt, one round of 5 drafts each (4 in vLLM's P-EAGLE
  layout; distinct row streams): given the first draft `d_1` (the most frequent value's rows,
  about a third of them), draft `j` of every slot `j >= 2` is an independent draw from the q
  the proposal hands verify for it. Pearson's chi-square per slot (cells of expected count < 5
  pooled; a draw where q is 0 fails outright) at a family-wise 1e-3 (Bonferroni over the slots).
  The broken variants (q of the neighbouring slot; a point mass at the slot's argmax) must be
  rejected at the same level."""
  from scipy import stats as scipy_stats
  from specjax.core.sampling import row_seeds
  from specjax.exactness.stats import _pearson
  n, num_draft = 6000, PARALLEL + (2 if reads_first else 1)
  drafter = scaled(parallel_drafter(target, "eagle3"))
  if not reads_first:
    config = dataclasses.replace(drafter.head.config, parallel_reads_first=False)
    drafter = EagleDrafter(eagle.EagleHead(drafter.head.params, config), drafter.target_embed)
  tokens = jnp.tile(jnp.array([[5, 9, 2, 7, 1, 3]], jnp.int32), (n, 1))
  lengths = jnp.full((n,), 6, jnp.int32)

  @jax.jit
  def one_round(tokens, lengths, seeds):  # arguments, not constants XLA would fold
    prefill = target(tokens, jnp.zeros((n,), jnp.int32), taps=drafter.taps)
    state = drafter.init(tokens, lengths, 16, prefill)
    return drafter.propose(state, tokens, lengths, num_draft=num_draft,
                           sampling=sj.Sampling(temperature=1.0), seeds=seeds)[1]

  proposal = one_round(tokens, lengths, row_seeds(jax.random.key(11), n))
  q_logits = proposal.logits if broken is None else broken(proposal.logits)
  drafts = np.asarray(proposal.tokens)
  first = np.bincount(drafts[:, 0], minlength=VOCAB).argmax()
  rows = np.flatnonzero(drafts[:, 0] == first)
  assert len(rows) >= 1000
  pvalues = []
  for j in range(1, num_draft):
    q = np.asarray(jax.nn.softmax(q_logits[rows, j].astype(jnp.float32), axis=-1), np.float64)
    np.testing.assert_allclose(q, np.broadcast_to(q[0], q.shape), atol=1e-5)  # one q per group
    observed = np.bincount(drafts[rows, j], minlength=VOCAB).astype(np.float64)
    if np.any(observed[q[0] == 0] > 0):
      pvalues.append(0.0)
      continue
    statistic, cells = _pearson(observed, len(rows) * q[0])
    pvalues.append(float(scipy_stats.chi2.sf(statistic, cells - 1)) if cells > 1 else 1.0)
  print(f"broken={getattr(broken, '__name__', None)}: slot p-values {pvalues}")
  level = 1e-3 / len(pvalues)
  if broken is None:
    assert min(pvalues) > level, pvalues
  else:
    assert min(pvalues) <= level, pvalues


# ---------------------------------------------------------------------------------------------
# Trees: top-K per parallel position.

TREE_SPECS = {
    "dynamic": TreeSpec("dynamic", depth=PARALLEL + 2, width=3, num_nodes=12),
    "sampled": TreeSpec("sampled", branching=(3, 2, 1, 1), replacement=False),
    "static": TreeSpec("static", depth=4, width=3),
}


@pytest.mark.parametrize("builder", ["dynamic", "sampled"])
def test_tree_logits_equal_the_chain_forward_of_the_depth_one_ancestor(target, batch, builder):
  from tests.drafters.test_tree_heads import build, head_state
  tokens, lengths = batch
  drafter = scaled(parallel_drafter(target, "eagle3"))
  spec = TREE_SPECS[builder]
  state, _ = head_state(target, drafter, tokens, lengths)
  tree = build(drafter, state, tokens, lengths, spec=spec, sampling=sj.Sampling(temperature=1.0))
  check_structure(tree, deterministic=builder == "dynamic")
  slots = spec.depth - 1
  forward = jax.jit(eagle.head_forward)
  got, node_tokens = np.asarray(tree.logits), np.asarray(tree.tokens)
  checked = wrong_slot = 0
  for b in range(3):
    cache = state.cache
    cache = KVCache(cache.k[:, b:b + 1], cache.v[:, b:b + 1], cache.lengths[b:b + 1])
    stored = np.asarray(drafter.full_logits(state.logits[b]))
    groups = {}
    for path in all_paths(tree, b):
      first = int(node_tokens[b, path[0]])
      if first not in groups:  # the chain's drafting forward with this first draft
        inputs = parallel_inputs(drafter.head, drafter.target_embed, jnp.asarray([first]),
                                 state.hidden[b:b + 1], slots)
        logits, _, _ = forward(drafter.head, None, *inputs, lengths[b:b + 1] - 1, cache)
        groups[first] = np.asarray(drafter.full_logits(logits[0]))  # [S, V]
      for depth, node in enumerate(path, start=1):
        expected = stored if depth == 1 else groups[first][depth - 2]
        np.testing.assert_allclose(got[b, node], expected, atol=2e-4, rtol=2e-4)
        checked += 1
        if depth >= 3:  # the neighbouring slot is a different distribution
          finite = np.isfinite(expected)
          wrong_slot += np.abs(groups[first][depth - 3][finite] - expected[finite]).max() > 1e-2
  assert checked >= 3 * spec.depth and wrong_slot > 0


@pytest.mark.parametrize("kind,builder", [
    ("eagle3", "dynamic"),
    pytest.param("mtp", "static", marks=pytest.mark.costly),
    pytest.param("eagle3", "sampled", marks=pytest.mark.costly)])
def test_greedy_tree_decode_equals_generate(target, batch, kind, builder):
  tokens, lengths = batch
  spec = TREE_SPECS[builder]
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=16)
  eos = int(ref.tokens[0, 5])  # row 0 stops early
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=16,
                    eos_id=eos)
  drafter = parallel_drafter(target, kind)
  out = sj.decode(target, drafter, tokens, jax.random.key(5), lengths=lengths,
                  max_new_tokens=16, eos_id=eos, tree=spec)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.num_tokens, ref.num_tokens)
  assert int(ref.num_tokens[0]) < 16
  stats = out.stats
  np.testing.assert_array_equal(stats.draft_calls, stats.rounds * 2)


def fit_drafter(target):
  """A random parallel head on the harness's 8-token target, perturbed so that q differs from p
  and its drafts are accepted often enough to test the tree (as `make_eagle`)."""
  from tests.exactness.test_heads_exactness import DRAFT_IDS as FIT_IDS, perturbed
  config = eagle.head_config_for(target.config, kind="eagle3", draft_vocab_size=len(FIT_IDS),
                                 parallel=1)
  head = eagle.init_head(config, target, jax.random.key(1), FIT_IDS)
  head = eagle.EagleHead(perturbed(head.params, jax.random.key(101), 0.5), config)
  return EagleDrafter(head, target.params["embed"])


# `slow` for CI's time (90-minute budget on 2 cores; 151 s the pair on a 2-core host): CI checks
# that each slot draws from the q it hands verify (with its broken twin) and the tree's greedy
# identity.
@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True])
def test_parallel_tree_matches_target_distribution(broken):
  """A sampled tree of depth 3 (the placeholder slot in use at depth 3) at T = 0.7 with top-k /
  top-p fits the target's distribution; the same head's top-m (dynamic) tree verified as if its
  children were sampled i.i.d. must not."""
  from tests.drafters.test_tree_heads import IidRuleSpec, fit_pvalue
  from tests.exactness.test_exactness import POWER_ALPHA
  target = sj.init_params(tiny_config(vocab_size=8, num_layers=4), jax.random.key(10))
  drafter = fit_drafter(target)
  if broken:
    p, _ = fit_pvalue(target, drafter, IidRuleSpec("dynamic", depth=3, width=2, num_nodes=6),
                      "t1")
    assert p < POWER_ALPHA
    return
  spec = TreeSpec("sampled", branching=(2, 2, 1), replacement=False)
  p, summary = fit_pvalue(target, drafter, spec, "t0.7_topk5_topp0.9")
  assert summary["accepted"] > 0.05 * summary["rounds"]  # the tree is really used
  assert p > ALPHA


def test_a_tree_deeper_than_the_slots_is_refused(target, batch):
  tokens, lengths = batch
  drafter = parallel_drafter(target, "eagle3", parallel=1)  # rounds of up to 3
  with pytest.raises(ValueError, match="exceeds what this parallel head drafts"):
    sj.decode(target, drafter, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=8,
              tree=TreeSpec("dynamic", depth=4, width=2, num_nodes=6))


def test_adaptive_length_with_a_parallel_head_equals_generate(target, batch):
  """`sj.adaptive_drafter` bounds `K` by the head's slots and trims each row's proposal (its
  token stop and limits, `proposed_count`): greedy output stays `generate`'s."""
  from tests.loop.test_explicit_modes import FLAT
  tokens, lengths = batch
  drafter = sj.adaptive_drafter(parallel_drafter(target, "mtp", parallel=1), calibration=FLAT)
  assert drafter.max_draft == 3  # FLAT alone would allow 4
  expected = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=24)
  out = sj.decode(target, drafter, tokens, jax.random.key(5), lengths=lengths,
                  max_new_tokens=24)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_tokens, expected.num_tokens)
  assert int(np.sum(out.stats.accepted)) > 0


def test_a_parallel_run_starts_from_a_sequential_head(target):
  """`specjax train head --parallel --init-from` a sequential head: its weights are kept and the
  placeholders are the ones a fresh parallel head with the run's seed draws; a saved parallel
  head with another slot count, or a sequential run from a parallel head, is a clear error."""
  from specjax.training.head_run import _initial_network
  sequential = parallel_drafter(target, "eagle3", parallel=0).head
  ids = np.asarray(sequential.draft_ids)
  config = heads.HeadTrainConfig(kind="eagle3", ttt_steps=PARALLEL + 2, parallel=True, seed=3)
  started = _initial_network(sequential, target, ids, config)
  assert started.config.parallel == PARALLEL
  kept = {name: started.params[name] for name in sequential.params}
  jax.tree.map(np.testing.assert_array_equal, kept, sequential.params)
  fresh = heads.init_network(config, target, ids)
  for name in ("parallel_embed", "parallel_feature"):
    np.testing.assert_array_equal(started.params[name], fresh.params[name])
  with pytest.raises(ValueError, match=f"has {PARALLEL} placeholder slots"):
    _initial_network(started, target, ids, heads.HeadTrainConfig(
        kind="eagle3", ttt_steps=PARALLEL + 3, parallel=True))
  with pytest.raises(ValueError, match="a sequential head"):
    _initial_network(started, target, ids, heads.HeadTrainConfig(kind="eagle3", ttt_steps=4))


# ---------------------------------------------------------------------------------------------
# vLLM's P-EAGLE layout: an EAGLE-3 checkpoint with parallel_drafting, ptd_token_id, mask_hidden.

PTD = 39  # the mask token (the import target's last id)


def write_peagle(path, target, *, taps_format: bool = True, embed: bool = False, overrides=None):
  from tests.drafters.test_heads import H, IMPORT_IDS, write_eagle3
  rng = np.random.default_rng(3)
  mask = rng.standard_normal((1, (3 if taps_format else 1) * H)).astype(np.float32)
  config = {"parallel_drafting": True, "ptd_token_id": PTD, **(overrides or {})}
  return write_eagle3(path, target, draft_ids=IMPORT_IDS, taps=(3, 1, 4), embed=embed,
                      overrides=config, extra={"mask_hidden": mask})


@pytest.mark.parametrize("taps_format, embed", [(True, False), (False, True)])
def test_peagle_import_drafts_like_the_numpy_layout(taps_format, embed, tmp_path):
  """Every slot after the last verified pair reads (embedding of ptd_token_id, mask_hidden through
  fc when in the taps' format): the drafting forward's logits equal the public EAGLE-3 layer in
  float64 NumPy over the verified pairs followed by such mask slots, at increasing positions."""
  from tests.drafters.test_heads import H, numpy_eagle3
  from specjax.drafters.eagle.eagle3 import load_eagle3
  target = sj.init_params(tiny_config(vocab_size=40, num_layers=5, embed_dim=H),
                          jax.random.key(4))
  w = write_peagle(tmp_path / "head", target, taps_format=taps_format, embed=embed)
  drafter = load_eagle3(tmp_path / "head", target, max_draft=5)
  head = drafter.head
  assert (head.config.parallel, head.config.parallel_reads_first) == (4, False)
  assert drafter.max_draft == 5 and drafter.forwards_per_round(5) == 2

  sequence = np.array([3, 17, 5, 29, 8, 8, 31, 2, 11], np.int32)
  t = len(sequence) - 1  # verified pairs (feature_j, token_{j+1}) for j < t
  out = target(jnp.asarray(sequence)[None], jnp.zeros((1,), jnp.int32), taps=head.config.taps)
  taps = np.asarray(out.taps, np.float64)[:, 0]
  fused = np.concatenate(list(taps), -1) @ w["fc.weight"].T  # [T + 1, H]
  table = w["embed_tokens.weight"] if embed else np.asarray(target.params["embed"], np.float64)
  mask = w["mask_hidden"].reshape(-1)
  mask = mask @ w["fc.weight"].T if taps_format else mask
  slots = 4
  tokens = np.concatenate([sequence[1:], np.full(slots, PTD)])
  features = np.concatenate([fused[:t], np.tile(mask, (slots, 1))])
  want, _ = numpy_eagle3(w, table, tokens, features, np.arange(t + slots))

  cache = head.init_cache(1, 32)
  logits, hidden, cache = eagle.head_forward(head, drafter.target_embed,
                                             jnp.asarray(sequence[1:])[None],
                                             drafter.features(out)[:, :t],
                                             jnp.zeros((1,), jnp.int32), cache)
  np.testing.assert_allclose(logits[0, -1], want[t - 1], rtol=1e-4, atol=1e-4)  # d_1's logits
  inputs = parallel_inputs(head, drafter.target_embed, jnp.array([21]), hidden[:, -1], slots)
  block, _, _ = eagle.head_forward(head, None, *inputs, cache.lengths, cache)
  np.testing.assert_allclose(block[0], want[t:], rtol=1e-4, atol=1e-4)  # d_2 .. d_5


def test_peagle_import_decodes_greedy_like_generate_chain_and_tree(tmp_path):
  from tests.drafters.test_heads import H
  from specjax.drafters.eagle.eagle3 import load_eagle3
  target = sj.init_params(tiny_config(vocab_size=40, num_layers=5, embed_dim=H),
                          jax.random.key(4))
  write_peagle(tmp_path / "head", target)
  drafter = load_eagle3(tmp_path / "head", target, max_draft=4)
  tokens = jnp.array([[5, 9, 2, 7, 1, 3], [3, 0, 0, 0, 0, 0], [11, 4, 6, 4, 0, 0]], jnp.int32)
  lengths = jnp.array([6, 1, 4], jnp.int32)
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=16)
  for kwargs in (dict(num_draft=4), dict(tree=TreeSpec("dynamic", depth=4, width=2,
                                                       num_nodes=6))):
    out = sj.decode(target, drafter, tokens, jax.random.key(5), lengths=lengths,
                    max_new_tokens=16, **kwargs)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.stats.draft_calls, out.stats.rounds * 2)


@pytest.mark.parametrize("overrides, width, message", [
    ({"ptd_token_id": None}, 3, "ptd_token_id None is not a token id"),
    ({"ptd_token_id": 40}, 3, "ptd_token_id 40 is not a token id below 40"),
    ({}, None, "has no mask_hidden tensor"),
    ({}, 2, "mask_hidden has 64 values, expected 96"),
])
def test_peagle_import_rejects_malformed_checkpoints(overrides, width, message, tmp_path):
  from tests.drafters.test_heads import H, IMPORT_IDS, write_eagle3
  from specjax.drafters.eagle.eagle3 import load_eagle3
  target = sj.init_params(tiny_config(vocab_size=40, num_layers=5, embed_dim=H),
                          jax.random.key(4))
  config = {"parallel_drafting": True, "ptd_token_id": PTD, **overrides}
  write_eagle3(tmp_path / "head", target, draft_ids=IMPORT_IDS, taps=(3, 1, 4), overrides=config,
               extra=None if width is None else {"mask_hidden": np.ones((1, width * H),
                                                                         np.float32)})
  with pytest.raises(ValueError, match=message):
    load_eagle3(tmp_path / "head", target)
  write_peagle(tmp_path / "ok", target)
  with pytest.raises(ValueError, match="max_draft must be an int >= 2"):
    load_eagle3(tmp_path / "ok", target, max_draft=1)
