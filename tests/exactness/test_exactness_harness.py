"""Every sampled decoding path emits the target's own distribution, and each one's broken variant
is caught by the same test.

**Setup.** A tiny random 4-layer target over V = 64 tokens with its output head scaled so that its
next-token entropy is about 1 nat at T = 1 (`specjax.testing.harness`); three ragged prompts (8, 10
and 12 tokens, each repeating its start so prompt lookup finds matches); N rows per prompt in ONE
`specjax.decode` call per path and setting (every row its own random stream): N = 2,000 for the
chain, the static and i.i.d. trees, EAGLE-3 and MTP, N = 1,000 for the other paths (each broken
variant uses its path's N). 24 new tokens per row, k = 7 for chains (trees of depth 4 and 5), so a
row runs about ten rounds and the tested positions span several of them. Settings: T = 1, and T =
0.7 with top-k 16 and top-p 0.9. Drafters: a noisy copy of the target (first-draft acceptance about
0.6), prompt lookup, static / dynamic / sampled (i.i.d. and without replacement) / n-gram trees,
EAGLE-3, MTP and Medusa heads and a parallel EAGLE-3 head (all K drafts from one forward) with
random weights (exactness does not depend on their quality; they are rarely accepted), the hybrid
(lookup in front of an EAGLE-3 head), the confidence stop with verify widths, the per-row adaptive
drafter, and the int4 self-drafter (`specjax.self_drafter(bits=4)`). Everything is seeded.

**Statistic** (`specjax.exactness.stats.position_tests`, the audit's own): at every (prompt,
  position)
rows are grouped by their sampled prefix; within a group every row's next token is, under
exactness, an independent draw from the target's warped distribution given that prefix, whatever
the drafter drew or where the round began. So Pearson's chi-square per group (cells of expected
count < 5 pooled; groups of >= 10 rows) against that distribution, computed from the target's own
logits, is valid, and groups, being independent given their prefixes, add statistics and degrees
of freedom. It is a conditional test: it needs no enumeration of the joint (64^24 cells) and stays
valid at every depth; it tests a position as long as some prefix is shared by >= 10 rows (up to
about position 14 at T = 1 and 24 at T = 0.7 here). A token of probability 0 fails outright.

**Levels.** A correct path passes when every one of its p-values exceeds ALPHA / m (ALPHA = 1e-3
family-wise per run, Bonferroni over its m tests, m about 30-37 at T = 1 and 52-62 at T = 0.7). A
broken variant must be rejected by the same statistic at the same N: some p-value <=
POWER_ALPHA / m with POWER_ALPHA = ALPHA (the same level, so "passes" and "fails" mean the same
test). Each run's p-values are printed (`pytest -s`); the smallest, at this commit: correct paths
>= 1.1e-3 (self_int4 at T = 1), broken variants <= 8.2e-8 (the chain's residual drawn with the
draft's stream; every other one <= 1.3e-18).

**Broken variants** (test-only: `specjax.testing.rules` and the subclasses here), all at T = 0.7
with top-k / top-p: on the chain, the correction drawn with the draft's random stream, and the
ratio tests / correction keyed by the slot within the round (every round reuses the previous
round's streams); prompt lookup: the correction sampled from p, not the residual; static tree: the
target's samples keyed by the depth within the round (every round reuses them); n-gram tree:
matching by the target's argmax at T > 0; dynamic tree: top-m children verified as if sampled
from q; i.i.d. sampled tree: an acceptance threshold of 0.8; without replacement: q not
renormalised after a rejected sibling; EAGLE-3: q before the temperature; MTP: drafts outside the
draft vocabulary where q says 0; Medusa: each draft verified with the neighbouring head's q;
parallel EAGLE-3: drafts sampled, but verify given point masses at each slot's argmax; hybrid:
copied drafts verified with the head's q; confidence stop and adaptive: the stop slot's
token drawn from a residual; int4 self-drafter: verify told the float model's q.

Cost (2-core CPU host shared with other work, one worker): the 43 `slow` cases 19.5 minutes
(4.6 to 98 s each; the sampled trees are the slowest), and the parallel head's three added since
40-100 s each; the two small-N checks (`costly`: CI's second step) 18-30 s each.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import specjax as sj
from specjax.verify import tree_rule
from specjax.trees import structure as trees
from specjax.drafters.adaptive.drafter import AdaptiveDrafter
from specjax.drafters.eagle import network as eagle
from specjax.drafters.medusa import network as medusa
from specjax.drafters.eagle.drafter import EagleDrafter
from specjax.drafters.medusa.drafter import MedusaDrafter
from specjax.drafters.hybrid import HybridDrafter
from specjax.kernels.tree_common import NodeResults
from specjax.core.sampling import first_argmax, warp_logits
from specjax.testing import harness, rules

N = 2000  # rows per prompt, for the paths whose broken variants are subtle
N_SMALL = 1000  # rows per prompt elsewhere: every broken variant there is rejected at p < 1e-40
FULL_N_PATHS = ("chain", "tree_static", "tree_iid", "eagle3", "mtp")
NEW = 24  # new tokens per row
K = 7  # chain drafts per round
ALPHA = 1e-3  # family-wise level of one run (Bonferroni over its position tests)
POWER_ALPHA = ALPHA  # a broken variant must be rejected at the same corrected level
HEAD_NOISE = 0.3
DRAFT_IDS = tuple(range(0, harness.VOCAB, 4)) + tuple(range(1, harness.VOCAB, 4)) + tuple(
    range(2, harness.VOCAB, 4))  # 48 of the 64 ids: the heads' reduced draft vocabulary

SETTINGS = {
    "t1": sj.Sampling(temperature=1.0),
    "t0.7_topk16_topp0.9": sj.Sampling(temperature=0.7, top_k=16, top_p=0.9),
}
MUTANT_SETTING = "t0.7_topk16_topp0.9"


# ---------------------------------------------------------------------------------------------
# Shared models (module scope: built once).


@pytest.fixture(scope="module")
def world():
  return harness.harness_world()


def _eagle(target, kind: str, cls=EagleDrafter, seed: int = 1, parallel: int = 0):
  config = eagle.head_config_for(target.config, kind=kind, draft_vocab_size=len(DRAFT_IDS),
                                 parallel=parallel)
  head = eagle.init_head(config, target, jax.random.key(seed), sorted(DRAFT_IDS))
  head = eagle.EagleHead(harness.noisy_copy(head.params, jax.random.key(seed + 100), HEAD_NOISE),
                         config)
  return cls(head, target.params["embed"])


def _medusa(target, cls=MedusaDrafter, seed: int = 2):
  config = medusa.MedusaConfig(embed_dim=target.config.embed_dim, num_heads=K,
                               draft_vocab_size=len(DRAFT_IDS), vocab_size=harness.VOCAB)
  heads = medusa.init_medusa(config, target, sorted(DRAFT_IDS))
  return cls(medusa.MedusaHeads(harness.noisy_copy(heads.params, jax.random.key(seed),
                                                   HEAD_NOISE), config))


# ---------------------------------------------------------------------------------------------
# Broken drafters and tree rules (test-only).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnwarpedQEagle(EagleDrafter):
  """Samples from its warped q but hands verify the logits before the temperature."""

  def propose(self, state, sequence, lengths, *, sampling, **kwargs):
    state, proposal = super().propose(state, sequence, lengths, sampling=sampling, **kwargs)
    return state, dataclasses.replace(proposal, logits=proposal.logits * sampling.temperature)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LeakyVocabEagle(EagleDrafter):
  """Samples over the whole vocabulary (ids outside the draft vocabulary get the head's largest
  logit, so they are drawn often) but hands verify q with -inf outside the draft vocabulary."""

  def full_logits(self, logits):
    inside = super().full_logits(logits)
    return jnp.where(jnp.isfinite(inside), inside, jnp.max(logits, axis=-1, keepdims=True))

  def propose(self, state, sequence, lengths, **kwargs):
    state, proposal = super().propose(state, sequence, lengths, **kwargs)
    in_vocab = jnp.zeros((harness.VOCAB,), bool).at[jnp.asarray(DRAFT_IDS)].set(True)
    return state, dataclasses.replace(
        proposal, logits=jnp.where(in_vocab, proposal.logits, -jnp.inf))


def argmax_point_mass(logits):
  """`[B, k, V]` q logits -> a point mass at each position's argmax (the greedy peers' q)."""
  top = jnp.argmax(logits, axis=-1)[..., None]
  return jnp.where(jnp.arange(logits.shape[-1]) == top, 0.0, -jnp.inf)


def neighbour_q(logits):
  """`[B, k, V]` q logits -> position j gets position j + 1's (the last keeps its own)."""
  return jnp.concatenate([logits[:, 1:], logits[:, -1:]], axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ArgmaxQParallelEagle(EagleDrafter):
  """A parallel head that samples each draft from its slot's q but hands verify a point mass at
  that slot's argmax in its place."""

  def propose(self, state, sequence, lengths, **kwargs):
    state, proposal = super().propose(state, sequence, lengths, **kwargs)
    return state, dataclasses.replace(proposal, logits=argmax_point_mass(proposal.logits))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NeighbourQMedusa(MedusaDrafter):
  """Draft j is drawn from head j, but verify gets head j + 1's q (the last keeps its own)."""

  def propose(self, state, sequence, lengths, **kwargs):
    state, proposal = super().propose(state, sequence, lengths, **kwargs)
    return state, dataclasses.replace(proposal, logits=neighbour_q(proposal.logits))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadQHybrid(HybridDrafter):
  """Copies in lookup rows, but verify gets the head's q there instead of the point mass."""

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, limits=None,
              stop=None, copy=None):
    state, proposal = self.drafter.propose(state, sequence, lengths, num_draft=num_draft,
                                           sampling=sampling, seeds=seeds, limits=limits,
                                           stop=stop)
    copied, found = self.lookup(sequence, lengths, num_draft)
    tokens = jnp.where(found[:, None], copied, proposal.tokens)
    return state, dataclasses.replace(proposal, tokens=tokens)


def tree_sample_round_local(target_logits, tree, *, seeds, positions, rule, sampling,
                            max_children):
  """Sample-then-match with every node's target sample keyed by its depth within the round
  instead of its absolute position: each round reuses the previous round's samples node for node
  (the root's sample is drawn with the same noise in every round). (Keying them one position back
  instead would be no bug: a constant shift relabels the streams and reuses none.)"""
  del rule, max_children
  ext = jnp.broadcast_to(jnp.arange(target_logits.shape[1], dtype=jnp.int32),
                         target_logits.shape[:2])
  y = tree_rule._race(warp_logits(target_logits, sampling), seeds[:, None],
                      jnp.zeros_like(positions)[:, None] + tree.ext_depths(), ext,
                      trees.PURPOSE_TREE_SAMPLE)
  return NodeResults(y, y, jnp.full_like(y, -1))


def tree_match_by_argmax(target_logits, tree, *, seeds, positions, rule, sampling, max_children):
  """Matching by the target's argmax at T > 0: at a node whose argmax is one of its children the
  walk descends to it; elsewhere it emits the node's sample."""
  del rule, max_children
  ext = jnp.broadcast_to(jnp.arange(target_logits.shape[1], dtype=jnp.int32),
                         target_logits.shape[:2])
  y = tree_rule._race(warp_logits(target_logits, sampling), seeds[:, None],
                      positions[:, None] + tree.ext_depths(), ext, trees.PURPOSE_TREE_SAMPLE)
  best = first_argmax(target_logits)  # [B, N + 1]
  is_child = jnp.any((tree.parents[:, None, :] + 1 == ext[:, :, None]) & tree.valid[:, None, :]
                     & (tree.tokens[:, None, :] == best[:, :, None]), axis=2)
  token = jnp.where(is_child, best, y)
  return NodeResults(token, token, jnp.full_like(token, -1))


class _IidRuleSpec(trees.TreeSpec):
  """A deterministic (top-m) tree verified with the i.i.d. sampled rule and the draft's q."""

  @property
  def rule(self) -> str:
    return "iid"


# Subclasses that only make a fresh compiled program for a monkeypatched module (the jit cache
# keys on the spec; a patched global is read at trace time).
class _ThresholdSpec(trees.TreeSpec):
  pass


class _NoRenormalisationSpec(trees.TreeSpec):
  pass


def _spec(cls, spec):
  return cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(trees.TreeSpec)})


# ---------------------------------------------------------------------------------------------
# The paths: name -> world -> run_path keyword arguments.

TREES = {
    "tree_static": trees.TreeSpec("static", depth=5, width=2),
    "tree_dynamic": trees.TreeSpec("dynamic", depth=4, width=2, num_nodes=8),
    "tree_iid": trees.TreeSpec("sampled", branching=(2, 2, 1, 1), replacement=True),
    "tree_without_replacement": trees.TreeSpec("sampled", branching=(3, 2, 1, 1),
                                               replacement=False),
    "tree_ngram": trees.TreeSpec("ngram", depth=5, width=3, max_ngram=2),
}


def _adaptive(draft):
  return AdaptiveDrafter(sj.ModelDrafter(draft), max_draft=K,
                         round_ms=tuple(1.0 + 0.15 * k for k in range(K + 1)),
                         prior=(0.6,) * K, widths=(1, 2, 4))  # decode compiles them (and K + 1)


PATHS = {
    "chain": lambda w: dict(draft=w["draft"]),
    "ngram": lambda w: dict(draft=sj.NGramDrafter(max_ngram=3)),
    **{name: (lambda spec: lambda w: dict(
        draft=None if spec.builder == "ngram" else w["draft"], tree=spec))(spec)
       for name, spec in TREES.items()},
    "eagle3": lambda w: dict(draft=_eagle(w["target"], "eagle3")),
    "mtp": lambda w: dict(draft=_eagle(w["target"], "mtp")),
    "medusa": lambda w: dict(draft=_medusa(w["target"])),
    "eagle3_parallel": lambda w: dict(draft=_eagle(w["target"], "eagle3", parallel=K - 2)),
    "hybrid": lambda w: dict(draft=HybridDrafter(_eagle(w["target"], "eagle3"), ngram=2)),
    "confidence_stop": lambda w: dict(draft=sj.ModelDrafter(w["draft"], confidence=0.5),
                                      verify_widths=(1, 2, 4)),
    "adaptive": lambda w: dict(draft=_adaptive(w["draft"])),
    "self_int4": lambda w: dict(draft=sj.self_drafter(w["target"], bits=4, group=32)),
}

MUTANTS = {
    "chain_residual_with_draft_stream": lambda w: dict(
        draft=w["draft"], verify_impl=rules.rule_residual_with_draft_stream),
    "chain_round_local_stream": lambda w: dict(
        draft=w["draft"], verify_impl=rules.rule_round_local_stream),
    "ngram_without_residual": lambda w: dict(
        draft=sj.NGramDrafter(max_ngram=3), verify_impl=rules.rule_without_residual),
    "tree_static_round_local_stream": lambda w: dict(
        draft=w["draft"], tree=TREES["tree_static"], verify_impl=tree_sample_round_local),
    "tree_ngram_match_by_argmax": lambda w: dict(
        draft=None, tree=TREES["tree_ngram"], verify_impl=tree_match_by_argmax),
    "tree_dynamic_top_m_as_sampled": lambda w: dict(
        draft=w["draft"], tree=_spec(_IidRuleSpec, TREES["tree_dynamic"])),
    "tree_iid_acceptance_threshold_0.8": lambda w: dict(
        draft=w["draft"], tree=_spec(_ThresholdSpec, TREES["tree_iid"]),
        patch=(tree_rule, "accepts", lambda u, r_c, s_c: u * 0.8 * s_c < r_c)),
    "tree_without_replacement_no_renormalisation": lambda w: dict(
        draft=w["draft"], tree=_spec(_NoRenormalisationSpec, TREES["tree_without_replacement"]),
        patch=(tree_rule, "remove_rejected", lambda s, token: s)),
    "eagle3_q_before_temperature": lambda w: dict(draft=_eagle(w["target"], "eagle3",
                                                               UnwarpedQEagle)),
    "mtp_drafts_outside_draft_vocab": lambda w: dict(draft=_eagle(w["target"], "mtp",
                                                                  LeakyVocabEagle)),
    "medusa_neighbour_head_q": lambda w: dict(draft=_medusa(w["target"], NeighbourQMedusa)),
    "eagle3_parallel_argmax_q": lambda w: dict(draft=_eagle(w["target"], "eagle3",
                                                            ArgmaxQParallelEagle, parallel=K - 2)),
    "hybrid_copies_with_head_q": lambda w: dict(draft=HeadQHybrid(_eagle(w["target"], "eagle3"),
                                                                  ngram=2)),
    "confidence_stop_from_residual": lambda w: dict(
        draft=sj.ModelDrafter(w["draft"], confidence=0.5), verify_widths=(1, 2, 4),
        verify_impl=rules.rule_stop_from_residual),
    "adaptive_stop_from_residual": lambda w: dict(
        draft=_adaptive(w["draft"]), verify_impl=rules.rule_stop_from_residual),
    "self_int4_q_from_float_model": lambda w: dict(
        draft=sj.self_drafter(w["target"], bits=4, group=32),
        verify_impl=rules.rule_q_from_float_model),
}


def samples(path: str) -> int:
  """Rows per prompt of `path` (and of its broken variants: the same N)."""
  return N if path in FULL_N_PATHS else N_SMALL


def path_of(mutant: str) -> str:
  """The path a broken variant breaks: the longest path name its name starts with."""
  return max((p for p in PATHS if mutant.startswith(p + "_")), key=len)


def _fit(world, setting: str, monkeypatch, num_samples: int, *, patch=None, **kwargs):
  if patch is not None:
    monkeypatch.setattr(*patch)
  sampling = SETTINGS[setting]
  if "tree" not in kwargs:
    kwargs.setdefault("num_draft", K)
  run = harness.run_path(world["target"], kwargs.pop("draft"), world["prompts"],
                         num_samples=num_samples, max_new_tokens=NEW, sampling=sampling, **kwargs)
  fit = harness.goodness_of_fit(world["prompts"], run.tokens, sampling, world["scorer"],
                                alpha=ALPHA)
  return run, fit


def _report(name, setting, run, fit):
  s = run.summary
  print(f"\n{name} [{setting}]: {fit.describe()}; tokens per round "
        f"{s['tokens_per_round']:.2f}, accepted per draft position {s['accepted_per_position']}")


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("path", list(PATHS))
def test_path_matches_target_distribution(world, path, setting, monkeypatch):
  run, fit = _fit(world, setting, monkeypatch, samples(path), **PATHS[path](world))
  _report(path, setting, run, fit)
  assert run.summary["accepted"] > 0  # drafts are accepted: the rule is exercised
  assert fit.num_tests >= 15
  assert fit.passed, f"{path} [{setting}] is not exact: {fit.describe()}"


@pytest.mark.slow
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_broken_variant_is_detected(world, mutant, monkeypatch):
  run, fit = _fit(world, MUTANT_SETTING, monkeypatch, samples(path_of(mutant)),
                  **MUTANTS[mutant](world))
  _report(mutant, MUTANT_SETTING, run, fit)
  assert fit.min_pvalue <= POWER_ALPHA / max(fit.num_tests, 1), (
      f"the broken variant {mutant} passes: {fit.describe()}")


# ---------------------------------------------------------------------------------------------
# A cheaper guard (`costly`, run by CI's second step): the harness itself, at a small N on the
# chain at T = 1.

SMALL_N = 300


@pytest.mark.costly
@pytest.mark.parametrize("rule, exact", [("auto", True), (rules.rule_without_residual, False)])
def test_harness_small_n_sees_the_classic_bug(world, rule, exact):
  """At N = 300 rows per prompt the same statistic passes the chain and rejects the correction
  sampled from p instead of the residual (the audit's negative control)."""
  sampling = SETTINGS["t1"]
  run = harness.run_path(world["target"], world["draft"], world["prompts"], num_samples=SMALL_N,
                         max_new_tokens=NEW, sampling=sampling, num_draft=K, verify_impl=rule)
  fit = harness.goodness_of_fit(world["prompts"], run.tokens, sampling, world["scorer"],
                                alpha=ALPHA)
  _report(f"small-N chain, {'exact' if exact else 'without residual'}", "t1", run, fit)
  assert fit.num_tests >= 3
  assert fit.passed == exact, fit.describe()
