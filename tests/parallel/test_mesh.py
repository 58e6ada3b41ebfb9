"""Sharding on 8 simulated CPU devices: rules, layouts, byte counts, sharded decoding, export.

Every equality test compares a sharded run with the single-device run of the same weights and rng:
data parallelism must not change a row's tokens, and tensor parallelism (which reorders float
sums) must not change an argmax or a Gumbel race on these models.
"""

import os
import pathlib
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import specjax as sj
from specjax.io import load, save
from specjax.loop import row_seeds
from specjax.parallel import ShardingRules
from specjax import parallel as sh
from specjax.verify import sharded as parallel_verify
from specjax.loop.decode import _decode, decode
from specjax.drafters import ModelDrafter
from specjax.drafters.tree import ModelTreeDrafter
from specjax.loop.generate import _generate
from specjax.testing.models import tiny_config
from specjax.verify.rule import verify_reference
from specjax.core.sampling import Sampling, warp_logits
from specjax.trees.structure import TreeSpec

MESH_SHAPES = [(1, 8), (8, 1), (2, 4), (4, 2)]  # (data, model)
SAMPLED = Sampling(temperature=0.8, top_k=30, top_p=0.9)
# heads 8 and mlp 64 split 8 ways; kv_heads 4 does not (the cache falls back to replicated heads
# on a model axis of 8: see test_cache_bytes_per_device).
TARGET_CONFIG = tiny_config(vocab_size=128, embed_dim=32, num_layers=2, num_heads=8,
                            num_kv_heads=4, head_dim=8, mlp_dim=64)
DRAFT_CONFIG = tiny_config(vocab_size=128, embed_dim=32, num_layers=1, num_heads=8,
                           num_kv_heads=4, head_dim=8, mlp_dim=64)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def models():
  return (sj.init_params(TARGET_CONFIG, jax.random.key(0)),
          sj.init_params(DRAFT_CONFIG, jax.random.key(5)))


@pytest.fixture(scope="module")
def prompts():
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (8, 6), 1, 128), np.int32)
  lengths = np.array([6, 3, 5, 1, 6, 2, 4, 6], np.int32)
  return tokens, lengths


@pytest.fixture(scope="module")
def single_device(models, prompts):
  """Reference tokens with everything on one device and no mesh."""
  target, draft = models
  tokens, lengths = prompts
  common = dict(lengths=lengths, max_new_tokens=NEW_TOKENS)
  return {
      "generate": sj.generate(target, tokens, jax.random.key(2), **common).tokens,
      "decode": decode(target, draft, tokens, jax.random.key(2), num_draft=3, **common).tokens,
      "decode_sampled": decode(target, draft, tokens, jax.random.key(3), num_draft=3,
                               sampling=SAMPLED, **common).tokens,
  }


# --------------------------------------------------------------------------------------------
# Rules and layouts.
# --------------------------------------------------------------------------------------------

def test_rules_fallback_rule():
  rules = ShardingRules()
  mesh_shape = {"data": 2, "model": 4}
  # fsdp is not in the mesh: batch uses data only, embed is replicated.
  assert rules.spec(("batch", "embed"), (8, 32), mesh_shape) == P("data", None)
  # 50257 is not divisible by 4: replicated. 6 is not divisible by 4 but by 2.
  assert rules.spec(("vocab",), (50257,), mesh_shape) == P(None)
  assert rules.spec(("batch",), (6,), {"data": 4}) == P(None)
  # A tuple rule keeps its longest dividing prefix.
  fsdp = {"data": 2, "fsdp": 4, "model": 1}
  assert rules.spec(("batch",), (16,), fsdp) == P(("data", "fsdp"))
  assert rules.spec(("batch",), (6,), fsdp) == P("data")
  # A mesh axis is used once per array: the second dim that maps to `model` is replicated.
  assert rules.spec(("heads", "mlp"), (8, 8), mesh_shape) == P("model", None)
  with pytest.raises(ValueError, match="unknown logical axis"):
    rules.spec(("rows",), (8,), mesh_shape)


def test_logical_axes_by_name():
  assert sh.logical_axes("layers/wq", 3) == ("layers", "embed", "heads")
  assert sh.logical_axes("layers/w_down", 3) == ("layers", "mlp", "embed")
  assert sh.logical_axes("embed", 2) == ("vocab", "embed")
  assert sh.logical_axes("layers/attn_norm", 2) == (None, None)
  # Flax / Hugging Face module names, per layer (unstacked) and with a bias.
  assert sh.logical_axes("model/layers_3/self_attn/k_proj/kernel", 2) == ("embed", "kv_heads")
  assert sh.logical_axes("model/layers_3/self_attn/q_proj/bias", 1) == ("heads",)
  assert sh.logical_axes("model/embed_tokens/embedding", 2) == ("vocab", "embed")
  assert sh.logical_axes("model/layers_0/input_layernorm/scale", 1) == (None,)
  assert sh.logical_axes("something/else", 2) == (None, None)
  rules = ShardingRules(param_axes=(("my_proj", ("embed", "mlp")),))
  assert sh.logical_axes("block/my_proj/kernel", 2, rules) == ("embed", "mlp")


def test_make_mesh():
  mesh = sj.make_mesh()
  assert dict(mesh.shape) == {"data": 1, "model": 8}  # one process: all devices tensor parallel
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert dict(sj.make_mesh((2, -1)).shape) == {"data": 2, "model": 4}
  assert dict(sj.make_mesh((2, 2, 2), ("data", "fsdp", "model")).shape) == {
      "data": 2, "fsdp": 2, "model": 2}
  with pytest.raises(ValueError, match="needs 6 devices"):
    sj.make_mesh((2, 3))


def test_param_shardings_of_abstract_params(models):
  """What the checkpoint loader restores into: the params pytree of ShapeDtypeStructs."""
  target, _ = models
  mesh = sj.make_mesh((2, 4))
  abstract = jax.eval_shape(lambda: target.params)
  shardings = sh.param_shardings(abstract, mesh)
  assert jax.tree.structure(shardings) == jax.tree.structure(target.params)
  assert shardings["layers"]["wq"].spec == P(None, None, "model")
  assert shardings["layers"]["wo"].spec == P(None, "model", None)
  assert shardings["embed"].spec == P("model", None)
  assert shardings["lm_head"].spec == P(None, "model")
  assert shardings["final_norm"].spec == P(None)
  assert sh.param_shardings(target, mesh) == shardings  # a Model works too


def _param_bytes_per_device(config, model_axis: int) -> int:
  """From the shapes: every matrix splits its heads / kv_heads / mlp / vocab dim over `model`;
  the three norms are replicated. float32."""
  c = config
  layers, e = c.num_layers, c.embed_dim
  split = (2 * c.vocab_size * e  # embed, lm_head
           + layers * e * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)  # wq wo wk wv
           + layers * 3 * e * c.mlp_dim)  # w_gate w_up w_down
  replicated = 2 * layers * e + e
  return 4 * (split // model_axis + replicated)


@pytest.mark.parametrize("shape, expected", [
    ((1, 1), 131712), ((1, 2), 66176), ((1, 4), 33408), ((1, 8), 17024), ((2, 4), 33408),
    ((8, 1), 131712)])
def test_param_bytes_per_device(models, shape, expected):
  target, _ = models
  devices = jax.devices()[:shape[0] * shape[1]]
  mesh = sj.make_mesh(shape, devices=devices)
  sharded = sj.shard(target, mesh)
  assert _param_bytes_per_device(TARGET_CONFIG, shape[1]) == expected
  assert sh.per_device_bytes(sharded.params) == expected
  for device in devices:  # every device holds the same amount
    held = sum(s.data.nbytes for leaf in jax.tree.leaves(sharded.params)
               for s in leaf.addressable_shards if s.device == device)
    assert held == expected


@pytest.mark.parametrize("shape, expected", [
    # k + v: 2 * L*B*S*KVH*D*4 = 262144 bytes in all, lengths 8*4 = 32.
    ((1, 2), 131072 + 32), ((1, 4), 65536 + 32),
    ((1, 8), 262144 + 32),  # kv_heads = 4 does not split 8 ways: replicated (fallback rule)
    ((8, 1), 32768 + 4), ((2, 4), 32768 + 16), ((4, 2), 32768 + 8)])
def test_cache_bytes_per_device(models, shape, expected):
  target, _ = models
  mesh = sj.make_mesh(shape, devices=jax.devices()[:shape[0] * shape[1]])
  cache = sh.shard_cache(target.init_cache(batch=8, max_len=64), mesh)
  assert cache.k.shape == (2, 8, 4, 64, 8)
  assert sh.per_device_bytes(cache) == expected


def test_compiled_generate_holds_a_sharded_cache(models, prompts):
  """Inside the jitted loop the cache is created and kept sharded: its per-device buffer is
  [L, B/data, KVH/model, S, D] and the full-size cache never appears."""
  target, _ = models
  tokens, lengths = prompts
  mesh = sj.make_mesh((2, 4))
  with sh.use_mesh(mesh):
    compiled = _generate.lower(sj.shard(target, mesh), jnp.asarray(tokens), jnp.asarray(lengths),
                               jax.random.key(0), jnp.int32(-1), None, None, jnp.int32(4),
                               sampling=Sampling(),
                               capacity=64, pad_id=0).compile()
  text = compiled.as_text()
  # S = 6 prompt + 64 capacity, rounded up to the stacked cache's slot multiple.
  slots = target.init_cache(8, 70).max_len
  assert slots == 96
  assert f"f32[2,4,1,{slots},8]" in text
  assert f"f32[2,8,4,{slots},8]" not in text


def test_constraints_only_under_a_mesh(models, prompts):
  target, _ = models
  tokens, _ = prompts
  lower = lambda: jax.jit(lambda m, t: m(t, jnp.zeros((8,), jnp.int32)).logits).lower(
      target, jnp.asarray(tokens)).as_text()
  assert "sharding_constraint" not in lower()
  with sh.use_mesh(sj.make_mesh((2, 4))):
    assert "sharding_constraint" in lower()


# --------------------------------------------------------------------------------------------
# Sharded generate and decode equal single-device.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", MESH_SHAPES)
def test_generate_greedy_matches_single_device(models, prompts, single_device, shape):
  target, _ = models
  tokens, lengths = prompts
  mesh = sj.make_mesh(shape)
  with sh.use_mesh(mesh):
    out = sj.generate(sj.shard(target, mesh), tokens, jax.random.key(2), lengths=lengths,
                      max_new_tokens=NEW_TOKENS)
  np.testing.assert_array_equal(out.tokens, single_device["generate"])
  if shape[0] > 1:
    assert out.tokens.sharding.spec[0] == "data"  # rows stayed data parallel to the end


def test_generate_with_sharded_params_and_no_mesh_context(models, prompts, single_device):
  """Without use_mesh, GSPMD propagates the parameters' shardings by itself."""
  target, _ = models
  tokens, lengths = prompts
  out = sj.generate(sj.shard(target, sj.make_mesh((2, 4))), tokens, jax.random.key(2),
                    lengths=lengths, max_new_tokens=NEW_TOKENS)
  np.testing.assert_array_equal(out.tokens, single_device["generate"])


def test_fsdp_mesh_restoring_a_checkpoint_into_it(models, prompts, single_device, tmp_path):
  """load(path, sharding=mesh) lays weights out by these rules; on a (data, fsdp, model) mesh
  the embedding dimension of the weights is split over fsdp as well."""
  target, _ = models
  tokens, lengths = prompts
  mesh = sj.make_mesh((2, 2, 2), ("data", "fsdp", "model"))
  save(target, tmp_path / "target")
  restored = load(tmp_path / "target", sharding=mesh)
  assert restored.params["layers"]["wq"].sharding.spec == P(None, "fsdp", "model")
  assert sh.per_device_bytes(restored.params) == _param_bytes_per_device(TARGET_CONFIG, 4)
  with sh.use_mesh(mesh):
    out = sj.generate(restored, tokens, jax.random.key(2), lengths=lengths,
                      max_new_tokens=NEW_TOKENS)
  np.testing.assert_array_equal(out.tokens, single_device["generate"])
  assert out.tokens.sharding.spec[0] == ("data", "fsdp")


# Mesh kinds: `jax.make_mesh`'s default (Explicit axes in JAX 0.10), `sj.make_mesh` (Auto) and a
# mixed mesh, each run outside any mesh context, inside `jax.set_mesh` and inside `sh.use_mesh`.
MESH_KINDS = ("explicit", "auto", "mixed")
CONTEXTS = ("none", "set_mesh", "use_mesh")


def _mesh(kind, shape):
  if kind == "auto":
    return sj.make_mesh(shape)
  explicit, auto = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
  types = (explicit, explicit) if kind == "explicit" else (explicit, auto)
  return jax.make_mesh(shape, ("data", "model"), axis_types=types)


def _context(name, mesh):
  import contextlib
  if name == "none":
    return contextlib.nullcontext()
  return jax.set_mesh(mesh) if name == "set_mesh" else sh.use_mesh(mesh)


def _grid():
  """Every (kind, shape, sampled, context); the default run keeps one case per kind and shape
  (alternating greedy/sampled and the context), the rest is marked slow."""
  cases = []
  for i, kind in enumerate(MESH_KINDS):
    for j, shape in enumerate([(2, 4), (1, 8), (8, 1)]):
      default = (bool((i + j) % 2), CONTEXTS[(i + 2 * j) % 3])
      for sampled in (False, True):
        for context in CONTEXTS:
          marks = () if (sampled, context) == default else (pytest.mark.slow,)
          cases.append(pytest.param(kind, shape, sampled, context, marks=marks,
                                    id=f"{kind}-{shape[0]}x{shape[1]}-"
                                       f"{'sampled' if sampled else 'greedy'}-{context}"))
  return cases


@pytest.mark.parametrize("kind, shape, sampled, context", _grid())
def test_decode_on_every_mesh_kind_matches_single_device(models, prompts, single_device, kind,
                                                         shape, sampled, context):
  target, draft = models
  tokens, lengths = prompts
  mesh = _mesh(kind, shape)
  target, draft = sj.shard(target, mesh), sj.shard(draft, mesh)
  sampling, key, expected = ((SAMPLED, 3, single_device["decode_sampled"]) if sampled
                             else (Sampling(), 2, single_device["decode"]))
  with _context(context, mesh):
    out = decode(target, draft, tokens, jax.random.key(key), lengths=lengths,
                 max_new_tokens=NEW_TOKENS, num_draft=3, sampling=sampling)
  np.testing.assert_array_equal(out.tokens, expected)
  if not sampled:
    np.testing.assert_array_equal(out.tokens, single_device["generate"])


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_verify_width_switch_on_a_mesh_matches_generate(models, prompts, single_device, kind):
  """A confidence stop with verify widths runs the target inside a `lax.switch` that only reads
  the sharded cache and writes the block after it: greedy still equals single-device generate,
  and rows do stop early (the switch is exercised)."""
  target, draft = models
  tokens, lengths = prompts
  mesh = _mesh(kind, (4, 2))
  target = sj.shard(target, mesh)
  drafter = ModelDrafter(sj.shard(draft, mesh), confidence=0.05)
  with jax.set_mesh(mesh):
    out = decode(target, drafter, tokens, jax.random.key(2), lengths=lengths,
                 max_new_tokens=NEW_TOKENS, num_draft=3, verify_widths=(1, 2, 3))
  np.testing.assert_array_equal(out.tokens, single_device["generate"])
  summary = out.stats.summary()
  assert 0 < summary["drafted"] < 3 * summary["rounds"]


TREES = {"dynamic": TreeSpec("dynamic", depth=3, width=2, num_nodes=6),
         "sampled": TreeSpec("sampled", branching=(2, 1, 1), replacement=False)}


@pytest.mark.parametrize("kind, shape, tree, sampled, context", [
    ("explicit", (2, 4), False, True, "set_mesh"),
    pytest.param("auto", (1, 8), True, False, "none", marks=pytest.mark.costly),
    pytest.param("mixed", (8, 1), True, True, "use_mesh", marks=pytest.mark.costly),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_parallel_head_on_a_mesh_matches_single_device(models, prompts, single_device, kind,
                                                       shape, tree, sampled, context):
  """A parallel MTP head (every draft of a round, or a tree's top-K per position, from one
  forward) on a sharded target: the same tokens as unsharded, greedy ones equal to generate."""
  from specjax.drafters.eagle import network as eagle
  from specjax.drafters.eagle.drafter import EagleDrafter
  target, _ = models
  tokens, lengths = prompts
  ids = list(range(0, TARGET_CONFIG.vocab_size, 2))
  config = eagle.head_config_for(TARGET_CONFIG, kind="mtp", draft_vocab_size=len(ids),
                                 parallel=2)
  head = eagle.init_head(config, target, jax.random.key(7), ids)
  common = dict(lengths=lengths, max_new_tokens=NEW_TOKENS,
                sampling=SAMPLED if sampled else Sampling())
  common.update(tree=TREES["dynamic"]) if tree else common.update(num_draft=4)
  expected = decode(target, EagleDrafter(head, target.params["embed"]), tokens,
                    jax.random.key(4), **common)
  mesh = _mesh(kind, shape)
  sharded = sj.shard(target, mesh)
  with _context(context, mesh):
    out = decode(sharded, EagleDrafter(head, sharded.params["embed"]), tokens,
                 jax.random.key(4), **common)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_tokens, expected.num_tokens)
  if not sampled:
    np.testing.assert_array_equal(out.tokens, single_device["generate"])
  assert int(np.sum(out.stats.accepted)) > 0
  np.testing.assert_array_equal(out.stats.draft_calls, out.stats.rounds * 2)


@pytest.mark.costly
@pytest.mark.parametrize("kind, shape, builder, context", [
    ("auto", (8, 1), "sampled", "none"),
    ("explicit", (2, 4), "dynamic", "set_mesh"),
    pytest.param("auto", (2, 4), "sampled", "use_mesh", marks=pytest.mark.slow),
    pytest.param("mixed", (8, 1), "dynamic", "none", marks=pytest.mark.slow),
    pytest.param("explicit", (1, 8), "sampled", "set_mesh", marks=pytest.mark.slow),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_tree_decode_on_a_mesh_matches_single_device(models, prompts, single_device, kind,
                                                     shape, builder, context):
  """Trees run in the same loop as chains, so they take the same meshes: sharded weights, with
  or without a mesh context, equal the unsharded run (and greedy equals generate)."""
  target, draft = models
  tokens, lengths = prompts
  greedy = builder == "dynamic"
  common = dict(lengths=lengths, max_new_tokens=NEW_TOKENS, tree=TREES[builder],
                sampling=Sampling() if greedy else SAMPLED)
  expected = decode(target, draft, tokens, jax.random.key(4), **common)
  mesh = _mesh(kind, shape)
  with _context(context, mesh):
    out = decode(sj.shard(target, mesh), sj.shard(draft, mesh), tokens, jax.random.key(4),
                 **common)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_tokens, expected.num_tokens)
  if greedy:
    np.testing.assert_array_equal(out.tokens, single_device["generate"])
  assert int(np.sum(out.stats.accepted)) > 0


@pytest.mark.costly
@pytest.mark.parametrize("kind", MESH_KINDS)
def test_generate_and_stream_on_an_explicit_or_mixed_mesh(models, prompts, single_device, kind):
  from specjax.loop.stream import decode_stream
  target, draft = models
  tokens, lengths = prompts
  mesh = _mesh(kind, (2, 4))
  target, draft = sj.shard(target, mesh), sj.shard(draft, mesh)
  with jax.set_mesh(mesh):
    out = sj.generate(target, tokens, jax.random.key(2), lengths=lengths,
                      max_new_tokens=NEW_TOKENS)
    rounds = list(decode_stream(target, draft, tokens, jax.random.key(3), lengths=lengths,
                                max_new_tokens=NEW_TOKENS, num_draft=3, sampling=SAMPLED))
  np.testing.assert_array_equal(out.tokens, single_device["generate"])
  for b in range(len(lengths)):
    streamed = np.concatenate([new[b] for new, _ in rounds])
    np.testing.assert_array_equal(streamed, single_device["decode_sampled"][b])


def test_models_on_different_meshes_raise_before_tracing(models, prompts):
  from specjax.core.tracing import TRACE_COUNTS
  target, draft = models
  tokens, lengths = prompts
  devices = jax.devices()
  target = sj.shard(target, sj.make_mesh((2, 4), devices=devices))
  draft = sj.shard(draft, sj.make_mesh((2, 4), devices=devices[::-1]))
  before = TRACE_COUNTS["decode"]
  with pytest.raises(ValueError, match="share one device mesh"):
    decode(target, draft, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=4)
  with pytest.raises(ValueError, match="share one device mesh"):
    with jax.set_mesh(sj.make_mesh((4, 2))):
      sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=4)
  assert TRACE_COUNTS["decode"] == before


def test_rules_are_part_of_the_compiled_program_key(models, prompts):
  """Changing the rules between two calls on the same mesh recompiles (no stale program)."""
  target, _ = models
  tokens, lengths = prompts
  mesh = sj.make_mesh((2, 4))
  target = sj.shard(target, mesh)
  replicated_rows = ShardingRules(batch=None)
  with sh.use_mesh(mesh):
    first = sj.generate(target, tokens, jax.random.key(2), lengths=lengths, max_new_tokens=4)
  with sh.use_mesh(mesh, replicated_rows):
    second = sj.generate(target, tokens, jax.random.key(2), lengths=lengths, max_new_tokens=4)
  assert first.tokens.sharding.spec[0] == "data"
  assert tuple(second.tokens.sharding.spec)[:1] in ((), (None,))  # new rules, not a cached program
  np.testing.assert_array_equal(first.tokens, second.tokens)


@pytest.mark.costly
def test_decode_under_a_vocab_split_mesh_verifies_shard_by_shard(models, prompts, monkeypatch):
  """Inside `use_mesh`, decode's verify runs `sharded_verify` (no full-vocabulary gather) and
  still returns the single-device tokens."""
  target, draft = models
  tokens, lengths = prompts
  calls = []
  original = parallel_verify.sharded_verify
  monkeypatch.setattr(parallel_verify, "sharded_verify",
                      lambda *a, **k: calls.append(1) or original(*a, **k))
  common = dict(lengths=lengths, max_new_tokens=NEW_TOKENS, num_draft=2, sampling=SAMPLED)
  expected = decode(target, draft, tokens, jax.random.key(4), **common).tokens
  assert not calls  # no mesh: the plain reference
  mesh = sj.make_mesh((2, 4))
  with sh.use_mesh(mesh):
    out = decode(sj.shard(target, mesh), sj.shard(draft, mesh), tokens, jax.random.key(4),
                 **common)
  assert calls  # traced through the vocab-sharded rule
  np.testing.assert_array_equal(out.tokens, expected)


# --------------------------------------------------------------------------------------------
# Vocab-sharded verify.
# --------------------------------------------------------------------------------------------

VERIFY_SAMPLINGS = [
    Sampling(), Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=5),
    Sampling(temperature=1.0, top_p=0.8), Sampling(temperature=0.9, top_k=20, top_p=0.6)]


def _verify_inputs(seed: int, batch: int = 8, k: int = 4, vocab: int = 128):
  keys = jax.random.split(jax.random.key(seed), 3)
  target = 2.0 * jax.random.normal(keys[0], (batch, k + 1, vocab))
  draft = target[:, :k] + 0.5 * jax.random.normal(keys[1], (batch, k, vocab))
  draft_tokens = jax.random.categorical(keys[2], draft).astype(jnp.int32)
  positions = 3 * jnp.arange(batch, dtype=jnp.int32) + 5
  return target, draft, draft_tokens, row_seeds(jax.random.key(seed), batch), positions


@pytest.mark.parametrize("sampling", VERIFY_SAMPLINGS, ids=str)
@pytest.mark.parametrize("point_mass", [False, True])
def test_sharded_verify_equals_reference(sampling, point_mass):
  mesh = sj.make_mesh((2, 4))
  target, draft, draft_tokens, seed_words, positions = _verify_inputs(0, batch=32)
  draft = None if point_mass else draft
  expected = jax.jit(lambda t, d: verify_reference(
      t, d, draft_tokens, sampling=sampling, seeds=seed_words, positions=positions))(target, draft)
  got = jax.jit(lambda t, d: parallel_verify.sharded_verify(
      t, d, draft_tokens, sampling=sampling, seeds=seed_words, positions=positions,
      mesh=mesh))(target, draft)
  np.testing.assert_array_equal(got.num_accepted, expected.num_accepted)
  np.testing.assert_array_equal(got.tokens, expected.tokens)
  assert got.tokens.sharding.spec[0] == "data"  # rows stay split over data
  if not point_mass:  # both the accept path and the correction path were exercised
    assert 0 < int(jnp.sum(expected.num_accepted)) < 32 * 4


@pytest.mark.costly
@pytest.mark.parametrize("shape, vocab", [
    ((1, 8), 128), pytest.param((2, 4), 100, marks=pytest.mark.slow),
    pytest.param((8, 1), 128, marks=pytest.mark.slow)])
def test_sharded_verify_other_layouts(shape, vocab):
  """All 8 devices on the vocabulary, a vocabulary that needs padding, no vocab split."""
  mesh = sj.make_mesh(shape)
  sampling = Sampling(temperature=0.9, top_k=20, top_p=0.8)
  target, draft, draft_tokens, seed_words, positions = _verify_inputs(11, vocab=vocab)
  expected = verify_reference(target, draft, draft_tokens, sampling=sampling, seeds=seed_words,
                              positions=positions)
  # Compiled (the caller's situation); eagerly, the radix rounds' collectives run op by op.
  run = jax.jit(lambda *args: parallel_verify.sharded_verify(
      *args[:3], sampling=sampling, seeds=args[3], positions=args[4], mesh=mesh))
  got = run(target, draft, draft_tokens, seed_words, positions)
  np.testing.assert_array_equal(got.tokens, expected.tokens)
  np.testing.assert_array_equal(got.num_accepted, expected.num_accepted)


@pytest.mark.parametrize("sampling", [
    Sampling(temperature=1.0, top_k=7), Sampling(temperature=1.0, top_p=0.5),
    Sampling(temperature=0.6, top_k=40, top_p=0.95)], ids=str)
def test_sharded_warp_keeps_the_same_tokens(sampling):
  """The top-k / top-p thresholds found across shards keep exactly the reference's token set,
  over 256 random rows (and a row of ties, which are kept or dropped together)."""
  logits = 3.0 * jax.random.normal(jax.random.key(4), (256, 128))
  logits = logits.at[0].set(jnp.round(logits[0]))  # many exact ties
  expected = warp_logits(logits, sampling)
  got = parallel_verify.sharded_warp_logits(logits, sampling, mesh=sj.make_mesh((1, 8)))
  assert got.sharding.spec[-1] == "model"
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected))
  np.testing.assert_allclose(np.where(np.isfinite(got), got, 0),
                             np.where(np.isfinite(expected), expected, 0), rtol=0, atol=0)


def test_sharded_verify_never_gathers_the_vocabulary():
  """In the compiled program no device ever holds a [B, k+1, V] or [B, V] float array."""
  mesh = sj.make_mesh((2, 4))
  target, draft, draft_tokens, seed_words, positions = _verify_inputs(0)
  shard = NamedSharding(mesh, P("data", None, "model"))
  target, draft = jax.device_put(target, shard), jax.device_put(draft, shard)
  text = jax.jit(lambda t, d: parallel_verify.sharded_verify(
      t, d, draft_tokens, sampling=VERIFY_SAMPLINGS[-1], seeds=seed_words, positions=positions,
      mesh=mesh)).lower(target, draft).compile().as_text()
  assert "f32[4,5,32]" in text  # the local slice: 8/2 rows, k+1, 128/4 vocab
  assert not re.search(r"f32\[\d+,5,128\]", text) and not re.search(r"f32\[\d+,128\]", text)


# --------------------------------------------------------------------------------------------
# Export for TPU.
# --------------------------------------------------------------------------------------------

def _abstract_model(model, mesh):
  """The model as `ShapeDtypeStruct`s carrying the shardings `sj.shard` would give it."""
  shardings = sh.param_shardings(model, mesh)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        model.params, shardings)
  return sj.Model(params, model.config)


def _export_decode_on_a_2x4_mesh(models, make_drafter, shape=(2, 4), **static):
  """`_decode` exported for TPU under a (2, 4) mesh (or `shape`) from abstract sharded weights:
  the target, `make_drafter(abstract draft model)`, 8 prompts of 16 tokens split over "data"."""
  target, draft = models
  mesh = sj.make_mesh(shape)
  rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  args = (
      _abstract_model(target, mesh),
      make_drafter(_abstract_model(draft, mesh)),
      jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=NamedSharding(mesh, P("data", None))),
      jax.ShapeDtypeStruct((8,), jnp.int32, sharding=rows),
      jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated),
      jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
      jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
  )
  with sh.use_mesh(mesh):
    exported = jax.export.export(_decode, platforms=["tpu"])(
        *args, sampling=SAMPLED, capacity=64, pad_id=0, **static)
  return exported, mesh


def test_export_decode_for_tpu_on_a_2x4_mesh(models):
  exported, mesh = _export_decode_on_a_2x4_mesh(models, ModelDrafter, num_draft=4,
                                                verify_impl="reference")
  assert exported.platforms == ("tpu",)
  assert exported.nr_devices == 8
  in_specs = [s.spec for s in exported.in_shardings_jax(mesh)]
  assert in_specs[0] == P("model", None)  # target embed [V, E]
  assert P(None, None, "model") in in_specs  # wq / w_gate / w_up
  assert in_specs[-5] == P("data", None)  # the prompts
  text = exported.mlir_module()
  assert 'sdy.mesh @mesh = <["data"=2, "model"=4]>' in text
  assert 'sdy.sharding<@mesh, [{"model"}, {}]>' in text
  assert "sdy.sharding_constraint" in text  # the forward pass's activation layout came along


@pytest.mark.parametrize("shape", [(8, 1), (2, 4)])
def test_export_tree_decode_for_tpu_on_a_mesh(models, shape):
  """A tree on sharded TPU weights. Rows split only, (8, 1): the Mosaic tree kernel runs inside
  the verify's shard_map on each device's rows (Mosaic kernels cannot be partitioned
  automatically). The vocabulary split too, (2, 4): the tree rule runs over each device's
  vocabulary slice (`specjax.verify.tree_sharded`), and no device holds a row's whole vocabulary
  of the tree's nodes."""
  spec = TREES["sampled"]
  exported, _ = _export_decode_on_a_2x4_mesh(
      models, lambda draft: ModelTreeDrafter(draft, spec), shape=shape, num_draft=spec.depth,
      verify_impl="auto")
  assert exported.platforms == ("tpu",) and exported.nr_devices == 8
  text = exported.mlir_module()
  assert "sdy.manual_computation" in text  # inside shard_map
  if shape == (8, 1):
    assert "tpu_custom_call" in text  # the fused tree kernel
  else:
    # The shard_map body works on local slices: 8 / 2 rows, 1 + nodes, 128 / 4 ids (that the
    # compiled program holds no gathered vocabulary is tests/verify/test_tree_sharded.py's check).
    vocab, nodes = TARGET_CONFIG.vocab_size, spec.size + 1
    assert f"tensor<4x{nodes}x{vocab // 4}xf32>" in text


# --------------------------------------------------------------------------------------------
# Multi-host: two processes on localhost, 4 CPU devices each.
# --------------------------------------------------------------------------------------------

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # about 1.5 minutes: two processes each compile generate and decode
def test_two_processes_match_single_process(tmp_path, models, prompts, single_device):
  worker = pathlib.Path(__file__).with_name("multihost_worker.py")
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
  env["JAX_PLATFORMS"] = "cpu"
  procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(port), str(tmp_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  logs = [p.communicate(timeout=240)[0] for p in procs]
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  for i in range(2):
    result = np.load(tmp_path / f"tokens_{i}.npz")
    assert int(result["process_count"]) == 2 and int(result["device_count"]) == 8
    assert tuple(result["mesh_shape"]) == (2, 4)  # processes along data, local devices on model
    np.testing.assert_array_equal(result["generate"], single_device["generate"])
    np.testing.assert_array_equal(result["decode"], single_device["decode"])


def test_shard_places_an_unstacked_model_in_the_stacked_layout():
  """`Model.for_platform()` gives per-layer weights on CPU; `sj.shard` stacks them again so the
  layer axis exists to shard and the same weights land on the mesh."""
  model = sj.init_params(tiny_config(), jax.random.key(0))
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  placed = sj.shard(model.for_platform("cpu"), mesh)  # per-layer, fused projections
  assert placed.is_stacked
  for name, weight in model.params["layers"].items():
    np.testing.assert_array_equal(np.asarray(placed.params["layers"][name]), np.asarray(weight))
    assert isinstance(placed.params["layers"][name].sharding, NamedSharding)


@pytest.mark.costly
def test_decode_inside_the_callers_jit_on_an_explicit_mesh_equals_one_device():
  """A user's own `jax.jit` around `sj.decode` and `sj.generate` under
  `jax.set_mesh(jax.make_mesh(...))` (Explicit axes, JAX's default): the library runs under
  `auto_axes` there and returns the single-device tokens."""
  target = sj.init_params(tiny_config(), jax.random.key(0))
  draft = sj.init_params(tiny_config(), jax.random.key(1))
  tokens = jax.random.randint(jax.random.key(2), (8, 6), 3, target.vocab_size, jnp.int32)
  lengths = jnp.array([6, 3, 5, 6, 2, 4, 6, 1], jnp.int32)
  sampling = Sampling(temperature=0.8, top_k=20)
  want = sj.decode(target, draft, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=8,
                   num_draft=3, sampling=sampling).tokens
  want_generate = sj.generate(target, tokens, jax.random.key(3), lengths=lengths,
                              max_new_tokens=8).tokens
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  t, d = sj.shard(target, mesh), sj.shard(draft, mesh)

  @jax.jit
  def step(t, d, tokens, lengths, rng):
    out = sj.decode(t, d, tokens, rng, lengths=lengths, max_new_tokens=8, num_draft=3,
                    sampling=sampling)
    return out.tokens, sj.generate(t, tokens, rng, lengths=lengths, max_new_tokens=8).tokens

  with jax.set_mesh(mesh):
    got, got_generate = step(t, d, tokens, lengths, jax.random.key(3))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_generate), np.asarray(want_generate))


# --------------------------------------------------------------------------------------------
# Inside the caller's own jit with no mesh context: the mesh comes from the arguments' types.
# --------------------------------------------------------------------------------------------

def _mesh_of_kind(kind: str, shape):
  if kind == "auto":  # sj.make_mesh: Auto axes, the arrays' types carry the mesh, open specs
    return sj.make_mesh(shape)
  return jax.make_mesh(shape, ("data", "model"))  # Explicit axes: specs in the types too


@pytest.mark.costly
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_decode_inside_the_callers_jit_without_a_mesh_context_equals_one_device(
    models, prompts, single_device, kind):
  """`jax.jit(step)(sj.shard(target, mesh), ...)` with no `jax.set_mesh`: before the library
  read the mesh from the arguments' types, Explicit axes failed to trace (a gather without an
  output sharding) and Auto axes failed to export for TPU (see the next test)."""
  target, draft = models
  tokens, lengths = prompts
  mesh = _mesh_of_kind(kind, (2, 4))
  t, d = sj.shard(target, mesh), sj.shard(draft, mesh)

  @jax.jit
  def step(t, d, tokens, lengths):
    out = sj.decode(t, d, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=NEW_TOKENS,
                    num_draft=3, sampling=SAMPLED)
    return out.tokens, sj.generate(t, tokens, jax.random.key(2), lengths=lengths,
                                   max_new_tokens=NEW_TOKENS).tokens

  got, got_generate = step(t, d, jnp.asarray(tokens), jnp.asarray(lengths))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(single_device["decode_sampled"]))
  np.testing.assert_array_equal(np.asarray(got_generate), np.asarray(single_device["generate"]))


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("shape", [(8, 1), (1, 8), (2, 4)])
def test_export_for_tpu_inside_the_callers_jit_without_a_mesh_context(models, kind, shape):
  """The default decode (verify_impl "auto": the fused Pallas kernel on TPU) over `sj.shard`
  weights, inside the caller's jit, exported for TPU with no mesh active: the kernel runs per
  shard inside the verify's shard_map (a Mosaic custom call in the module), where GSPMD alone
  raised "Mosaic kernels cannot be automatically partitioned"."""
  target, draft = models
  mesh = _mesh_of_kind(kind, shape)
  t, d = sj.shard(target, mesh), sj.shard(draft, mesh)

  def step(t, d, tokens, rng):
    return sj.decode(t, ModelDrafter(d), tokens, rng, max_new_tokens=4, num_draft=2,
                     sampling=SAMPLED).tokens

  tokens = jnp.ones((8, 6), jnp.int32)
  exported = jax.export.export(jax.jit(step), platforms=["tpu"])(t, d, tokens, jax.random.key(0))
  text = exported.mlir_module()
  assert exported.nr_devices == 8
  assert "tpu_custom_call" in text and "sdy.manual_computation" in text


@pytest.mark.costly
def test_decode_inside_the_callers_shard_map_equals_one_device(models, prompts, single_device):
  """Inside the caller's `shard_map` (rows split over 8 devices, weights replicated) each device
  decodes its own row with no collective: the single-device tokens, and it exports for TPU with
  the fused kernel."""
  target, draft = models
  tokens, lengths = prompts
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

  def rows(t, d, tokens, lengths):
    return sj.decode(t, ModelDrafter(d), tokens, jax.random.key(0), lengths=lengths,
                     max_new_tokens=NEW_TOKENS, num_draft=3, sampling=SAMPLED).tokens

  specs = dict(mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=P("data"))
  run = jax.jit(jax.shard_map(rows, check_vma=False, **specs))
  got = run(target, draft, jnp.asarray(tokens), jnp.asarray(lengths))
  # A row's streams are keyed by (rng, row index): on one device per row every row is row 0, so
  # compare with the single-device run of each row alone.
  for row in range(tokens.shape[0]):
    alone = sj.decode(target, draft, tokens[row:row + 1], jax.random.key(0),
                      lengths=lengths[row:row + 1], max_new_tokens=NEW_TOKENS, num_draft=3,
                      sampling=SAMPLED).tokens
    np.testing.assert_array_equal(np.asarray(got[row:row + 1]), np.asarray(alone))
  exported = jax.export.export(run, platforms=["tpu"])(target, draft, jnp.asarray(tokens),
                                                        jnp.asarray(lengths))
  assert "tpu_custom_call" in exported.mlir_module()
  # With shard_map's default check_vma=True the loop's carry would mix per-device and replicated
  # types: one clear error before anything is traced, saying what to do.
  with pytest.raises(ValueError, match="check_vma=False"):
    jax.jit(jax.shard_map(rows, **specs))(target, draft, jnp.asarray(tokens), jnp.asarray(lengths))
