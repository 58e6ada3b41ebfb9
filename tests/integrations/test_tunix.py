"""`specjax.integrations.tunix.SpecjaxRollout`: a tunix rollout engine, on tunix's own models.

Skipped, through `pytest.importorskip`, where tunix (the `specjax[tunix]` extra, not in `test`)
is not installed. The policies are tunix's nnx modules (`tunix.models.qwen2` / `qwen3` / `llama3`)
at tiny sizes with random weights, and a word-level tokenizer over their 64 ids.

* The converted policy's logits equal tunix's forward (float32 rounding).
* Greedy rollouts are token-identical to tunix's `VanillaRollout` on the same weights (ragged
  prompts, an EOS that cuts rows, every drafter), and so are the texts and left-padded prompts.
* `return_logprobs` equals tunix's `compute_per_token_logps` on the same tokens, to float32
  rounding (T = 0.7 with top-p, and greedy).
* `update_params` under tunix's transfer guard, then a rollout from the new weights: one compiled
  program for every update, the drafter rebuilt inside it (its acceptance stays a copy's, where a
  stale drafter's falls), greedy tokens equal to `VanillaRollout` on the new weights.
* tunix's `RLCluster` + `GRPOLearner` train two steps with `rollout_engine=SpecjaxRollout`: the
  weights sync into the engine (`RLCluster.sync_weights` keeps the transfer guard on).
* Bad settings: a clear ValueError naming the field.
* (`costly`) Exactness, seeded: N = 2,000 rollouts of each of 3 prompts, 10 new tokens, through the
  engine, at T = 1 and at T = 0.7 with top-p 0.9: the audit's prefix-grouped chi-square per
  position (`specjax.exactness.stats.position_tests`, Bonferroni at a family-wise 1e-3) against the
  policy's own distribution computed from tunix's forward passes; plain sampling from the same
  policy (`VanillaRollout`) passes the same test, and the broken variant (the drafter built from the
  previous step's weights while the verify is told the current copy's q) is rejected by it.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

tunix = pytest.importorskip("tunix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import sentencepiece as spm  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.llama3 import model as llama3_lib  # noqa: E402
from tunix.models.qwen2 import model as qwen2_lib  # noqa: E402
from tunix.models.qwen3 import model as qwen3_lib  # noqa: E402
from tunix.rl import common as rl_common  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout, vanilla_rollout  # noqa: E402

import specjax as sj  # noqa: E402
from specjax.drafters.base import Drafter  # noqa: E402
from specjax.integrations import tunix_weights  # noqa: E402
from specjax.integrations.tunix import SpecjaxRollout, _build, _rollout  # noqa: E402

VOCAB = 64
# The pad id lies outside the policies' vocabulary, as a real tokenizer's pad token is one a policy
# does not sample: tunix reads every pad id in a completion as padding (`process_ids` masks it), so
# a sampled pad would make its log-probabilities those of another sequence.
PAD, BOS, EOS = VOCAB, 1, 2


class WordTokenizer(spm.SentencePieceProcessor):
  """Ids as words: "w5 w9" <-> [5, 9]; pad 64, BOS 1, EOS 2 (a SentencePiece processor, as
  tunix's `TokenizerAdapter` expects)."""

  def pad_id(self):
    return PAD

  def bos_id(self):
    return BOS

  def eos_id(self):
    return EOS

  def GetPieceSize(self):  # noqa: N802 - SentencePiece's name
    return VOCAB + 1

  def EncodeAsIds(self, text, **kwargs):  # noqa: N802
    return [int(word[1:]) for word in text.split()]

  def DecodeIds(self, ids, **kwargs):  # noqa: N802
    return " ".join(f"w{i}" for i in ids)


def _randomize(module, seed: int, scale: float = 0.3, head_scale: float = 1.0):
  """Every weight of `module` random (tunix initialises its MLPs to zero): matrices normal times
  `scale`, norms `1 + 0.1 N(0, 1)`, biases `0.1 N(0, 1)`; the output projection (or the tied
  embedding) times `head_scale`."""
  state = nnx.state(module, nnx.Param)
  leaves, tree = jax.tree.flatten(state)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  out = []
  for path, key, x in zip(paths, keys, leaves):
    noise = jax.random.normal(key, x.shape, jnp.float32)
    if "norm" in path:
      value = 1.0 + 0.1 * noise
    elif "bias" in path:
      value = 0.1 * noise
    else:
      value = scale * noise
      if "lm_head" in path or "input_embedding" in path:
        value = value * head_scale
    out.append(value.astype(x.dtype))
  nnx.update(module, jax.tree.unflatten(tree, out))
  return module


def qwen2(seed: int = 0, tied: bool = False, layers: int = 2, head_scale: float = 1.0):
  config = qwen2_lib.ModelConfig(num_layers=layers, vocab_size=VOCAB, embed_dim=32, hidden_dim=64,
                                 num_heads=4, head_dim=8, num_kv_heads=2, rope_theta=10_000,
                                 norm_eps=1e-6, use_tied_embedding=tied)
  return _randomize(qwen2_lib.Qwen2(config, rngs=nnx.Rngs(seed)), seed, head_scale=head_scale)


def qwen3(seed: int = 0):
  config = qwen3_lib.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=32, hidden_dim=64,
                                 num_heads=4, head_dim=8, num_kv_heads=2, rope_theta=10_000,
                                 norm_eps=1e-6, use_tied_embedding=True)
  return _randomize(qwen3_lib.Qwen3(config, rngs=nnx.Rngs(seed)), seed)


def llama3(seed: int = 0):
  config = llama3_lib.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=32, hidden_dim=64,
                                  num_heads=4, head_dim=8, num_kv_heads=2, rope_theta=10_000,
                                  norm_eps=1e-5, weight_tying=False)
  return _randomize(llama3_lib.Llama3(config, rngs=nnx.Rngs(seed)), seed)


PROMPTS = ["w5 w9 w3", "w7 w8 w9 w10 w11 w12", "w4", "w30 w31"]
CACHE = 64


def rollout_config(**overrides) -> base_rollout.RolloutConfig:
  fields = dict(max_tokens_to_generate=16, temperature=0.0, top_p=None, max_prompt_length=8,
                kv_cache_size=CACHE, return_logprobs=True)
  fields.update(overrides)
  return base_rollout.RolloutConfig(**fields)


def vanilla(module) -> vanilla_rollout.VanillaRollout:
  c = module.config
  return vanilla_rollout.VanillaRollout(module, WordTokenizer(), base_rollout.CacheConfig(
      cache_size=CACHE, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
      head_dim=c.head_dim))


def engine(module, **kwargs) -> SpecjaxRollout:
  return SpecjaxRollout(rollout_actor=module, tokenizer=WordTokenizer(), mesh=None,
                        rollout_config=rollout_config(), **kwargs)


def _same_rollouts(ours, theirs):
  assert len(ours.tokens) == len(theirs.tokens)
  for a, b in zip(ours.tokens, theirs.tokens):
    np.testing.assert_array_equal(a, b)
  assert ours.text == theirs.text
  np.testing.assert_array_equal(ours.left_padded_prompt_tokens, theirs.left_padded_prompt_tokens)


# ---------------------------------------------------------------------------------------------
# The converted policy


@pytest.mark.parametrize("make", [qwen2, functools.partial(qwen2, tied=True), qwen3, llama3],
                         ids=["qwen2", "qwen2_tied", "qwen3", "llama3"])
def test_converted_policy_computes_tunix_logits(make):
  module = make()
  tokens = jnp.asarray([[1, 5, 9, 3, 7, 8, 2, 11], [1, 4, 4, 6, 60, 61, 62, 63]], jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((8, 8), bool)), (2, 8, 8))
  want, _ = module(tokens, positions, None, mask)
  config = tunix_weights.model_config(module, 32)
  params = tunix_weights.policy_params(nnx.state(module, nnx.Param))
  policy = jax.jit(lambda p: tunix_weights.to_specjax(p, config))(params)  # traced weights
  got = policy(tokens, jnp.zeros((2,), jnp.int32)).logits
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_a_specjax_model_loads_into_a_tunix_module():
  module = qwen2(seed=5)
  model = sj.init_params(tunix_weights.model_config(module, 32), jax.random.key(2))
  state = nnx.state(module, nnx.Param)
  nnx.replace_by_pure_dict(state, tunix_weights.to_tunix(model))
  nnx.update(module, state)
  back = tunix_weights.to_specjax(tunix_weights.policy_params(nnx.state(module, nnx.Param)),
                                  model.config)
  jax.tree.map(np.testing.assert_array_equal, back.params, model.unstacked().params)


def test_an_unsupported_module_is_refused():
  with pytest.raises(ValueError, match="is not a supported tunix policy"):
    tunix_weights.model_config(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), 32)


# ---------------------------------------------------------------------------------------------
# Greedy identity and logprobs


@pytest.mark.parametrize("make", [qwen2, llama3], ids=["qwen2", "llama3"])
def test_greedy_rollouts_equal_vanilla_rollout(make):
  module = make()
  config = rollout_config()
  theirs = vanilla(module).generate(PROMPTS, config)
  ours = engine(module).generate(PROMPTS, config)
  _same_rollouts(ours, theirs)
  assert any(len(t) < config.max_tokens_to_generate for t in theirs.tokens)  # an EOS cut a row


@pytest.mark.parametrize("drafter", ["int4", "ngram", "draft_model", "callable"])
def test_every_drafter_gives_the_same_greedy_rollouts(drafter):
  module = qwen2()
  draft = {"int4": "int4", "ngram": sj.NGramDrafter(),
           "draft_model": qwen2(seed=7, layers=1),
           "callable": lambda policy: sj.self_drafter(policy, bits=8, group=32)}[drafter]
  config = rollout_config()
  _same_rollouts(engine(module, drafter=draft, num_draft=3).generate(PROMPTS, config),
                 vanilla(module).generate(PROMPTS, config))


def _tunix_logprobs(module, out, config):
  """tunix's `compute_per_token_logps` on the rollouts' tokens (completions padded with PAD)."""
  new = config.max_tokens_to_generate
  completions = np.full((len(out.tokens), new), PAD, np.int32)
  for b, t in enumerate(out.tokens):
    completions[b, :len(t)] = t
  graphdef, state = nnx.split(module)
  return np.asarray(rl_common.compute_per_token_logps(
      graphdef, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
      completion_tokens=jnp.asarray(completions), pad_id=PAD, eos_id=EOS,
      temperature=config.temperature))


@pytest.mark.parametrize("settings", [dict(temperature=0.7, top_p=0.9, seed=3),
                                      dict(temperature=0.0, top_p=None)],
                         ids=["t0.7_topp0.9", "greedy"])
def test_logprobs_equal_compute_per_token_logps(settings):
  module = qwen2()
  config = rollout_config(**settings)
  out = engine(module).generate(PROMPTS * 2, config)
  want = _tunix_logprobs(module, out, config)
  for b, (tokens, logprobs) in enumerate(zip(out.tokens, out.logprobs)):
    assert logprobs.shape == tokens.shape and logprobs.dtype == np.float32
    np.testing.assert_allclose(logprobs, want[b, :len(tokens)], atol=1e-5, rtol=1e-5)


def test_get_per_token_logps_is_the_policys():
  module = qwen2()
  eng = engine(module)
  out = eng.generate(PROMPTS, rollout_config())
  config = rollout_config(temperature=1.0)
  completions = jnp.asarray(np.stack([np.pad(t, (0, 16 - len(t)), constant_values=PAD)
                                      for t in out.tokens]))
  got = eng.get_per_token_logps(jnp.asarray(out.left_padded_prompt_tokens), completions)
  want = _tunix_logprobs(module, out, config)
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert (eng.pad_id(), eng.eos_id()) == (PAD, EOS)


# ---------------------------------------------------------------------------------------------
# Weight sync


def test_update_params_rebuilds_the_drafter_inside_the_program():
  first, second = qwen2(seed=0), qwen2(seed=1)
  eng = engine(first)
  config = rollout_config(max_tokens_to_generate=24)
  eng.generate(PROMPTS, config)
  eng.generate(PROMPTS[:2], config)  # the same weights: the same drafter
  assert eng.drafter_builds == 1
  compiled = (_rollout._cache_size(), _build._cache_size())
  # As RLCluster.sync_weights calls it: the trainer's nnx.Param state, under the transfer guard.
  with jax.transfer_guard_host_to_device("disallow_explicit"), \
       jax.transfer_guard_device_to_host("disallow_explicit"):
    eng.update_params(nnx.state(second, nnx.Param), (nnx.Param,))
  out = eng.generate(PROMPTS, config)
  _same_rollouts(out, vanilla(second).generate(PROMPTS, config))
  assert eng.drafter_builds == 2  # rebuilt from the new weights, by the same programs:
  assert (_rollout._cache_size(), _build._cache_size()) == compiled
  # The drafter is the new policy's copy: its drafts are accepted as a copy's are. A drafter
  # left with the first policy's weights drafts another model's tokens.
  fresh = eng.last_stats["acceptance_rate"]
  stale = engine(second, drafter=lambda policy: sj.self_drafter(_converted(first)))
  stale.generate(PROMPTS, config)
  assert fresh > 0.5 > 0.1 > stale.last_stats["acceptance_rate"], (fresh, stale.last_stats)
  # The module given at construction is never written.
  np.testing.assert_array_equal(first.final_norm.w[...], qwen2(seed=0).final_norm.w[...])
  np.testing.assert_array_equal(eng.model().final_norm.w[...], second.final_norm.w[...])


def _converted(module) -> sj.Model:
  return tunix_weights.to_specjax(tunix_weights.policy_params(nnx.state(module, nnx.Param)),
                                  tunix_weights.model_config(module, CACHE))


def _reward(prompts, completions, **kwargs):
  """More distinct words, more reward (a verifiable reward that varies between samples)."""
  return [float(len(set(c.split()))) for c in completions]


class GuardedRollout(SpecjaxRollout):
  """Records each `update_params` call and whether an explicit host-to-device transfer was
  refused there (tunix's transfer guard on)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.syncs = []

  def update_params(self, params, filter_types=None):
    try:
      jax.device_put(np.ones(2, np.float32))
      guarded = False
    except Exception:  # noqa: BLE001 - the guard's error type is JAX's internal one
      guarded = True
    self.syncs.append(guarded)
    super().update_params(params, filter_types)


@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_grpo_trains_two_steps_with_specjax_rollouts(placement):
  module = qwen2()
  reference = qwen2()
  auto = (jax.sharding.AxisType.Auto,) * 2  # as tunix.utils.mesh makes its meshes
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1], axis_types=auto)
  rollout_mesh = mesh if placement == "colocated" else jax.make_mesh(
      (1, 1), ("fsdp", "tp"), devices=jax.devices()[1:2], axis_types=auto)
  config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                    rl_cluster_lib.Role.ROLLOUT: rollout_mesh},
      rollout_engine=functools.partial(GuardedRollout, num_draft=3),
      offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optax.sgd(0.5), eval_every_n_steps=10, max_steps=2),
      rollout_config=rollout_config(temperature=0.9, top_p=1.0, max_tokens_to_generate=8,
                                    return_logprobs=False))
  cluster = rl_cluster_lib.RLCluster(actor=module, reference=reference,
                                     tokenizer=WordTokenizer(), cluster_config=config)
  assert isinstance(cluster.rollout, SpecjaxRollout)
  before = np.asarray(module.final_norm.w[...]).copy()
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=[_reward],
      algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.04))
  data = [{"prompts": np.array(batch)} for batch in (["w5 w9 w3", "w7 w8"], ["w4 w6", "w30 w31"],
                                                    ["w10", "w11 w12"])]
  learner.train(data)
  assert cluster.actor_trainer.train_steps == 2
  trained = nnx.to_pure_dict(nnx.state(cluster.actor_trainer.model, nnx.Param))
  assert not np.allclose(trained["final_norm"]["w"], before)  # the policy moved
  # The engine rolls out from the trained weights: on its own mesh, synced after each step by
  # `RLCluster.sync_weights` (tunix's transfer guard on); colocated, it shares the trainer's
  # variables (tunix then skips the sync, as with its vanilla engine).
  if placement == "separate":
    assert cluster.rollout.syncs == [True, True]
    leaf = cluster.rollout.params["final_norm"]["w"]
    assert leaf.sharding.mesh == rollout_mesh
  else:
    assert cluster.rollout.syncs == []
  synced = cluster.rollout.params
  for path, value in jax.tree_util.tree_flatten_with_path(trained)[0]:
    np.testing.assert_array_equal(value, functools.reduce(
        lambda node, key: node[key.key], path, synced))
  assert cluster.rollout.last_stats["rounds"] > 0
  # One drafter per weight version: the first step's, then each trained step's (the shared
  # variables' new arrays are seen as new weights too).
  assert cluster.rollout.drafter_builds == 2


# ---------------------------------------------------------------------------------------------
# Bad settings


@pytest.mark.parametrize("overrides,field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_tokens_to_generate=0), "max_tokens_to_generate"),
    (dict(kv_cache_size=20), "kv_cache_size"),
    (dict(tensor_parallel_size=4), "tensor_parallel_size"),
    (dict(rollout_vllm_sampling_kwargs={"min_p": 0.1}), "rollout_vllm_sampling_kwargs"),
    (dict(data_type=jnp.int8), "data_type"),
    (dict(eos_tokens="w2"), "eos_tokens"),
    (dict(seed="seven"), "seed"),
])
def test_bad_rollout_settings_are_refused_naming_the_field(overrides, field):
  eng = engine(qwen2())
  with pytest.raises(ValueError, match=field):
    eng.generate(PROMPTS, rollout_config(**overrides))


def test_a_beam_search_or_an_unknown_sampling_field_is_refused():
  eng = engine(qwen2())
  with pytest.raises(ValueError, match="beam_size"):
    eng.generate(PROMPTS, rollout_config(), beam_size=4)

  @dataclasses.dataclass
  class WithMinP(base_rollout.RolloutConfig):
    min_p: float | None = None

  with pytest.raises(ValueError, match="min_p"):
    eng.generate(PROMPTS, WithMinP(**dataclasses.asdict(rollout_config()), min_p=0.05))
  with pytest.raises(ValueError, match="drafter='int3'"):
    engine(qwen2(), drafter="int3")


# ---------------------------------------------------------------------------------------------
# Exactness (costly)

N = 2000  # rollouts per prompt
NEW = 10  # new tokens per rollout
ALPHA = 1e-3  # family-wise, Bonferroni over each run's position tests
CHI_PROMPTS = ["w5 w9 w3 w5 w9", "w7 w8 w7", "w40 w41 w42 w43"]
CHI_SETTINGS = {"t1": dict(temperature=1.0, top_p=1.0),
                "t0.7_topp0.9": dict(temperature=0.7, top_p=0.9)}
STEP = 0.03  # the previous step: every weight of the current policy moved by 3% of its spread


def _peaked_policy():
  """A policy whose next-token entropy is about a nat (as specjax's exactness harness makes its
  targets): prefixes stay shared by enough rollouts for the grouped test to reach deep."""
  return qwen2(seed=3, head_scale=6.0)


def _tunix_last_logits(module, prefixes):
  """tunix's own forward: the policy's logits after each prefix (no cache, causal mask)."""
  longest = max(len(p) for p in prefixes)
  tokens = np.zeros((len(prefixes), longest), np.int32)
  lengths = np.array([len(p) for p in prefixes])
  for i, p in enumerate(prefixes):
    tokens[i, :len(p)] = p
  positions = np.broadcast_to(np.arange(longest), tokens.shape)
  mask = np.tril(np.ones((longest, longest), bool))[None] & (positions < lengths[:, None])[:, None]
  logits, _ = jax.jit(lambda t, p, m: module(t, p, None, m))(tokens, positions, mask)
  return np.asarray(logits)[np.arange(len(prefixes)), lengths - 1]


def _fit(module, out, sampling):
  from scipy import stats as scipy_stats
  from specjax.exactness.stats import position_tests
  rows = [[BOS] + WordTokenizer().EncodeAsIds(p) for p in CHI_PROMPTS]
  tokens = np.stack([t for t in out.tokens]).reshape(len(CHI_PROMPTS), N, NEW)
  tests = [t for t in position_tests(rows, tokens, sampling, scipy_stats,
                                     functools.partial(_tunix_last_logits, module))
           if t.dof > 0 or t.impossible]
  return min(t.pvalue for t in tests), ALPHA / len(tests), len(tests)


def _chi_rollouts(eng_or_vanilla, name):
  config = rollout_config(max_tokens_to_generate=NEW, eos_tokens=[-1], seed=11,
                          return_logprobs=False, **CHI_SETTINGS[name])
  out = eng_or_vanilla.generate([p for p in CHI_PROMPTS for _ in range(N)], config)
  assert all(len(t) == NEW for t in out.tokens)  # no stop id: every rollout is whole
  return out


def _sampling(name) -> sj.Sampling:
  s = CHI_SETTINGS[name]
  return sj.Sampling(temperature=s["temperature"], top_p=None if s["top_p"] >= 1 else s["top_p"])


@pytest.mark.costly
@pytest.mark.parametrize("name", list(CHI_SETTINGS))
def test_sampled_rollouts_follow_the_policy(name):
  module = _peaked_policy()
  eng = engine(module, num_draft=4)
  out = _chi_rollouts(eng, name)
  acceptance = eng.last_stats["acceptance_rate"]
  assert 0.3 < acceptance < 0.999, eng.last_stats
  p, level, tests = _fit(module, out, _sampling(name))
  print(f"{name}: specjax min p = {p:.3g} over {tests} tests (level {level:.3g}), "
        f"acceptance {acceptance:.3f}")
  assert p > level
  # Plain sampling from the same policy (tunix's vanilla engine) passes the same test.
  p, level, tests = _fit(module, _chi_rollouts(vanilla(module), name), _sampling(name))
  print(f"{name}: vanilla min p = {p:.3g} over {tests} tests (level {level:.3g})")
  assert p > level


def _previous_step(module, seed: int = 99):
  """The policy before its last update: every weight moved by `STEP` times its own spread."""
  previous = nnx.clone(module)
  leaves, tree = jax.tree.flatten(nnx.state(previous, nnx.Param))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  moved = [x + STEP * jnp.maximum(jnp.std(x), 0.05) * jax.random.normal(key, x.shape, x.dtype)
           for key, x in zip(keys, leaves)]
  nnx.update(previous, jax.tree.unflatten(tree, moved))
  return previous


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StaleCopy(Drafter):
  """The broken variant: drafts from `stale` (the int8 copy of the previous step's weights), while
  the verify is told `current`'s q (the copy of the weights it verifies with) at the same
  prefixes: a cache-free forward of `current` over the sequence with the drafts written in."""

  stale: sj.ModelDrafter
  current: sj.Model

  taps = ()
  needs_hidden = False
  vocab_size = VOCAB

  def forwards_per_round(self, num_draft):
    return num_draft

  def init(self, tokens, lengths, buffer_len, prefill=None):
    return self.stale.init(tokens, lengths, buffer_len, prefill)

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, **kwargs):
    state, proposal = self.stale.propose(state, sequence, lengths, num_draft=num_draft,
                                         sampling=sampling, seeds=seeds)
    write = lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,))
    drafted = jax.vmap(write)(sequence, proposal.tokens, lengths)
    logits = self.current(drafted, jnp.zeros_like(lengths)).logits
    at = lengths[:, None] - 1 + jnp.arange(num_draft)[None]
    told = jnp.take_along_axis(logits, at[..., None], axis=1)
    return state, dataclasses.replace(proposal, logits=told)

  def observe(self, state, scored, block, emitted, count, lengths):
    return state


@pytest.mark.costly
def test_a_drafter_from_the_previous_step_verified_with_the_current_q_is_rejected():
  name = "t0.7_topp0.9"
  module = _peaked_policy()
  stale = sj.self_drafter(_converted(_previous_step(module)), bits=8)
  broken = engine(module, num_draft=4, drafter=lambda policy: StaleCopy(
      stale, sj.quantize(policy, 8, 32)))
  p, level, tests = _fit(module, _chi_rollouts(broken, name), _sampling(name))
  print(f"broken: min p = {p:.3g} over {tests} tests (level {level:.3g}), "
        f"acceptance {broken.last_stats['acceptance_rate']:.3f}")
  assert p < level
