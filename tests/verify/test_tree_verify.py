"""The fused tree verify kernels against `specjax.verify.tree_rule`'s reference, token for token.

`verify_tree(..., impl=...)` walks the per-node decisions of a kernel (`tree_node_results`: TPU
Mosaic / interpret; `tree_node_results_gpu`: Triton / interpret) and must return exactly the
reference's `path`, `num_accepted` and `tokens` for every rule ("match", "iid",
"without_replacement"), greedy and sampled with temperature, top-k and top-p, on random trees
(random parent structures, invalid nodes, a row with no valid node, vocabularies that are not a
multiple of the tile, batches that are not a multiple of the row block). Modes: `interpret=True`,
`pltpu.InterpretParams()` (TPU memory semantics) and the GPU kernel interpreted; compiled paths
are checked by exporting for TPU (the Mosaic call) and CUDA (the Triton call). Broken kernel
variants (one random stream shared by all nodes; `s` or the residual not renormalised) must fail
the same equality check. The default selection keeps a handful of cases; `-m slow` runs the grid.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from specjax.verify import tree_rule
from specjax.kernels.blocks import BlockSizes
from specjax.kernels.fused_verify_gpu import GPU_EXPORT_DISABLED_CHECKS, GpuBlockSizes
from specjax.kernels.tree_common import TileSteps, node_noise
from specjax.kernels.tree_verify import tree_node_results
from specjax.kernels.tree_verify_gpu import tree_node_results_gpu
from specjax.core.sampling import Sampling, row_seeds
from specjax.trees.structure import Tree
# The kernel-inspection helpers of the chain kernel's tests.
from tests.verify.test_fused_verify import _pallas_call, _vmem_bytes

RULES = ("match", "iid", "without_replacement")
SAMPLINGS = {
    "greedy": Sampling(),
    "t1": Sampling(temperature=1.0),
    "t0.7_topk7": Sampling(temperature=0.7, top_k=7),
    "t1.3_topp0.8": Sampling(temperature=1.3, top_p=0.8),
    "t0.9_topk40_topp0.95": Sampling(temperature=0.9, top_k=40, top_p=0.95),
}
# (B, N, V, block_v, block_b, max_children, depth_slack): three ragged tiles and a partial row
# block (5 = 2 + 2 + 1); a whole-axis tile of V < 128; four tiles, full row blocks; two ragged
# tiles, one row per block. depth_slack = -1 walks with max_depth one below the deepest node
# (the walk stops at the bound).
SHAPES = ((5, 9, 300, 128, 2, 3, 0), (3, 6, 90, 128, 2, 2, 0), (4, 12, 1000, 256, 4, 4, 0),
          (2, 16, 700, 512, 1, 5, -1))
# Wide trees (6 children at the root, 6 more nodes below them) over 32 rows, two ragged tiles,
# with a flatter target and a sharper draft further from it: many sibling tests after
# rejections, where a wrong residual or a wrong `s` shows.
WIDE = 4
SHAPES += ((32, 12, 200, 128, 8, 6, 0),)


def random_case(seed, batch, num_nodes, vocab, *, max_children, rule, sampling, depth_slack=0):
  """A random tree whose children are likely under the target, so that walks go deep.

  Parents are random earlier nodes, recent ones favoured (at most `max_children` children each;
  "wide" trees, `max_children = num_nodes / 2`: the first half under the root, no hot tokens);
  about 15% of nodes are invalid and row 1 has no valid node. The target favours 3 "hot" tokens
  per node. "match" children are hot tokens of their parent, mostly in order of preference
  (sometimes a random token); sampled children are drawn
  from the softmax of their draft row (the parent's target row plus noise): i.i.d. for "iid",
  distinct for "without_replacement". Siblings share the draft row, except that every third
  non-first sibling gets a perturbed copy (the rules read the first child's row).
  """
  rng = np.random.default_rng(seed)
  parents = np.full((batch, num_nodes), -1)
  depths = np.ones((batch, num_nodes), np.int64)
  wide = max_children == num_nodes // 2  # the first half under the root, the rest under them
  for b in range(batch):
    counts = np.zeros(num_nodes + 1, np.int64)
    for i in range(num_nodes):
      options = np.array([p for p in range(-1, i) if counts[p + 1] < max_children])
      if wide:
        options = np.array([-1]) if i < max_children else options[options >= 0]
      weights = (options + 3.0) ** 2  # favour recent nodes: deep trees
      parent = int(rng.choice(options, p=weights / weights.sum()))
      parents[b, i], counts[parent + 1] = parent, counts[parent + 1] + 1
      depths[b, i] = 1 if parent < 0 else depths[b, parent] + 1
  valid = rng.random((batch, num_nodes)) > 0.15
  if batch > 1:
    valid[1] = False  # a row with no children at all
  target = rng.normal(size=(batch, num_nodes + 1, vocab)).astype(np.float32) * 2
  hot = np.stack([[rng.choice(vocab, 3, replace=False) for _ in range(num_nodes + 1)]
                  for _ in range(batch)])  # [B, N + 1, 3]
  boost = np.array([10.0, 9.0, 8.0], np.float32)  # most mass on them; hot[..., 0] first
  if not wide:
    np.put_along_axis(target, hot, np.take_along_axis(target, hot, -1) + boost, -1)
  noise = (1.5 if wide else 0.8) * rng.normal(size=target.shape).astype(np.float32)
  draft_rows = (1.6 if wide else 1.0) * (target + noise)  # wide: a sharper draft
  logits = np.zeros((batch, num_nodes, vocab), np.float32)
  tokens = np.zeros((batch, num_nodes), np.int64)
  temperature = sampling.temperature or 1.0
  for b in range(batch):
    for parent in range(-1, num_nodes):
      children = np.flatnonzero(parents[b] == parent)
      if not len(children):
        continue
      row = draft_rows[b, parent + 1]
      if rule == "match":
        picks = hot[b, parent + 1] if rng.random() < 0.8 else rng.permutation(hot[b, parent + 1])
        picks = np.where(rng.random(len(children)) < 0.1, rng.integers(0, vocab, len(children)),
                         np.resize(picks, len(children)))
      else:
        probs = np.exp((row - row.max()) / temperature)
        probs /= probs.sum()
        picks = rng.choice(vocab, len(children), replace=rule == "iid", p=probs)
      for rank, child in enumerate(children):
        tokens[b, child] = picks[rank]
        logits[b, child] = row + (0.5 * rng.normal(size=vocab) if rank and rank % 3 == 0 else 0)
  tree = Tree(jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32),
              jnp.asarray(depths, jnp.int32), jnp.asarray(valid), jnp.asarray(logits))
  kwargs = dict(rule=rule, sampling=sampling, seeds=row_seeds(jax.random.key(seed), batch),
                positions=jnp.asarray(rng.integers(0, 500, batch), jnp.int32),
                max_depth=int(depths.max()) + depth_slack, max_children=max_children)
  return jnp.asarray(target), tree, kwargs


def kernel_impl(mode, block_v, block_b, tile_steps=None):
  """The per-node kernel of `mode` with the given tiles, as a `verify_tree(impl=...)` callable."""
  extra = {} if tile_steps is None else dict(tile_steps=tile_steps)
  if mode == "gpu_interpret":
    return functools.partial(tree_node_results_gpu, interpret=True,
                             block_sizes=GpuBlockSizes(block_v, block_b), **extra)
  interpret = pltpu.InterpretParams() if mode == "tpu_interpret" else True
  return functools.partial(tree_node_results, interpret=interpret,
                           block_sizes=BlockSizes(block_v, block_b), **extra)


def assert_same(got, want):
  np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
  np.testing.assert_array_equal(got.path, want.path)
  np.testing.assert_array_equal(got.tokens, want.tokens)


def check(mode, rule, setting, shape_ids, tile_steps=None):
  """Kernel == reference on the `SHAPES` listed; returns the reference's num_accepted."""
  accepted = []
  for index in shape_ids:
    batch, nodes, vocab, block_v, block_b, children, slack = SHAPES[index]
    target, tree, kwargs = random_case(1000 * index + RULES.index(rule), batch, nodes, vocab,
                                       max_children=children, rule=rule,
                                       sampling=SAMPLINGS[setting], depth_slack=slack)
    verify = lambda impl: jax.jit(functools.partial(tree_rule.verify_tree, impl=impl, **kwargs))
    want = verify("reference")(target, tree)
    assert_same(verify(kernel_impl(mode, block_v, block_b, tile_steps))(target, tree), want)
    accepted.append(np.asarray(want.num_accepted))
  return np.concatenate(accepted)


# --------------------------------------------------------------------------------------------
# Hand-worked cases.
# --------------------------------------------------------------------------------------------

# Root children: node 0 (token 2), node 1 (token 4); node 2 (token 5) is node 0's child, node 3
# (token 1) node 2's child. Extended rows: 0 root, 1..4 nodes 0..3.
HAND_TREE = Tree(tokens=jnp.array([[2, 4, 5, 1]], jnp.int32),
                 parents=jnp.array([[-1, -1, 0, 2]], jnp.int32),
                 depths=jnp.array([[1, 1, 2, 3]], jnp.int32), valid=jnp.ones((1, 4), bool))


def hand_logits(argmaxes, vocab=6):
  logits = np.zeros((1, len(argmaxes), vocab), np.float32)
  logits[0, np.arange(len(argmaxes)), argmaxes] = 3.0
  return jnp.asarray(logits)


@pytest.mark.parametrize("mode", ["interpret", "gpu_interpret"])
def test_greedy_hand_worked(mode):
  # Argmax per extended row: root 2, node 0 -> 5, node 1 -> 0, node 2 -> 3, node 3 -> 0.
  # Root's argmax 2 = node 0's token: accept node 0; its argmax 5 = node 2's token: accept; node
  # 2's argmax 3 != node 3's token 1: stop. path [0, 2], tokens [2, 5, 3 (the correction), 0].
  kwargs = dict(rule="match", sampling=Sampling(), seeds=jnp.zeros(1, jnp.uint32),
                positions=jnp.array([7]), max_depth=3, impl=kernel_impl(mode, 128, 1))
  got = tree_rule.verify_tree(hand_logits([2, 5, 0, 3, 0]), HAND_TREE, **kwargs)
  np.testing.assert_array_equal(got.num_accepted, [2])
  np.testing.assert_array_equal(got.path, [[0, 2, 0]])
  np.testing.assert_array_equal(got.tokens, [[2, 5, 3, 0]])
  # Node 2's argmax 1 = node 3's token: the walk reaches the depth bound, bonus = node 3's 4.
  got = tree_rule.verify_tree(hand_logits([2, 5, 0, 1, 4]), HAND_TREE, **kwargs)
  np.testing.assert_array_equal(got.tokens, [[2, 5, 1, 4]])
  np.testing.assert_array_equal(got.num_accepted, [3])


# HAND_TREE's shape with tokens in three tiles of 128 (V = 300).
NAN_TREE = dataclasses.replace(HAND_TREE, tokens=jnp.array([[130, 4, 260, 1]], jnp.int32))


@pytest.mark.parametrize("mode", ["interpret", "gpu_interpret"])
def test_greedy_nan_is_the_maximum_across_tiles(mode):
  # A NaN is the maximum and the first NaN wins, as in the reference's `first_argmax`. Root: 50 at
  # id 4 (tile 0, node 1's token), NaN at 130 (tile 1): argmax 130 = node 0's token, accept. Node
  # 0: 40 at id 0, NaNs at 260 and 270 (tile 2): argmax 260 = node 2's token, accept. Node 2:
  # NaNs at 7 and 9: argmax 7 != node 3's token 1, stop. path [0, 2], tokens [130, 260, 7, 0].
  logits = np.zeros((1, 5, 300), np.float32)
  logits[0, 0, 4], logits[0, 0, 130] = 50.0, np.nan
  logits[0, 1, 0], logits[0, 1, [260, 270]] = 40.0, np.nan
  logits[0, 3, [9, 7]] = np.nan
  kwargs = dict(rule="match", sampling=Sampling(), seeds=jnp.zeros(1, jnp.uint32),
                positions=jnp.array([7]), max_depth=3)
  got = tree_rule.verify_tree(jnp.asarray(logits), NAN_TREE, impl=kernel_impl(mode, 128, 1),
                              **kwargs)
  np.testing.assert_array_equal(got.num_accepted, [2])
  np.testing.assert_array_equal(got.path, [[0, 2, 0]])
  np.testing.assert_array_equal(got.tokens, [[130, 260, 7, 0]])
  assert_same(got, tree_rule.verify_tree(jnp.asarray(logits), NAN_TREE, impl="reference",
                                         **kwargs))


@pytest.mark.parametrize("rule", [pytest.param("iid", marks=pytest.mark.slow),
                                  "without_replacement"])
def test_top_k_one_is_greedy_for_any_seed(rule):
  # top_k = 1 makes every p_n a point mass at its argmax: a child equal to it has r(c) = 1 >=
  # s(c) > u s(c) (accepted whatever u), any other child r(c) = 0 (rejected), and after a
  # rejection max(p - s, 0) is still positive only at the argmax, so the residual is p again.
  # The walk is the greedy one: root argmax 2 = node 0, then 5 = node 2, then 3 != 1 -> 3.
  draft = np.random.default_rng(0).normal(size=(1, 4, 6)).astype(np.float32)
  tree = Tree(HAND_TREE.tokens, HAND_TREE.parents, HAND_TREE.depths, HAND_TREE.valid,
              jnp.asarray(draft))
  for seed in range(3):
    got = tree_rule.verify_tree(hand_logits([2, 5, 0, 3, 0]), tree, rule=rule,
                                sampling=Sampling(temperature=2.0, top_k=1),
                                seeds=row_seeds(jax.random.key(seed), 1), positions=jnp.array([3]),
                                max_depth=3, impl=kernel_impl("interpret", 128, 1))
    np.testing.assert_array_equal(got.tokens, [[2, 5, 3, 0]])


# --------------------------------------------------------------------------------------------
# Random trees against the reference.
# --------------------------------------------------------------------------------------------

# (mode, rule, setting, shape): one shape each, cheap enough for the default selection.
DEFAULT_CASES = [("interpret", "match", "greedy", 0),
                 ("interpret", "match", "t0.9_topk40_topp0.95", 1),
                 ("interpret", "iid", "t1", WIDE),
                 ("interpret", "without_replacement", "t1", WIDE),
                 ("tpu_interpret", "match", "t1", 1),
                 ("gpu_interpret", "iid", "t1", 0)]


@pytest.mark.parametrize("mode,rule,setting,shape", DEFAULT_CASES)
def test_kernel_equals_reference(mode, rule, setting, shape):
  accepted = check(mode, rule, setting, [shape])
  # Not vacuous: some walks stop at the root, some go deeper (wide trees: past the root).
  assert accepted.min() == 0 and accepted.max() >= (1 if shape == WIDE else 2)


@pytest.mark.parametrize("rule,setting", [
    ("match", "greedy"),
    pytest.param("without_replacement", "t0.9_topk40_topp0.95", marks=pytest.mark.costly)])
def test_chunks_inside_a_tile_equal_the_reference(rule, setting):
  # The body walks each resident tile in chunks of block_c lanes, as on TPU: tiles of 640 in
  # chunks of 256 + 256 + 128 over V = 1000 (the last tile ragged), then one whole-axis tile of
  # 700 in chunks 256 x 2 + 188 (a remainder that is not lane-aligned).
  accepted = []
  for index, (vocab, sizes) in enumerate(((1000, BlockSizes(640, 2, block_c=256)),
                                          (700, BlockSizes(1024, 4, block_c=256)))):
    assert sizes.chunk(vocab) is not None  # really chunked
    target, tree, kwargs = random_case(77 + index, 4, 9, vocab, max_children=3, rule=rule,
                                       sampling=SAMPLINGS[setting])
    verify = lambda impl: jax.jit(functools.partial(tree_rule.verify_tree, impl=impl, **kwargs))
    want = verify("reference")(target, tree)
    assert_same(verify(functools.partial(tree_node_results, interpret=True,
                                         block_sizes=sizes))(target, tree), want)
    accepted.append(np.asarray(want.num_accepted))
  assert np.concatenate(accepted).max() > 0  # not vacuous: walks went below the root


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(SAMPLINGS))
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mode", ["interpret", "tpu_interpret", "gpu_interpret"])
def test_kernel_equals_reference_grid(mode, rule, setting):
  accepted = check(mode, rule, setting, range(len(SHAPES)))
  assert accepted.min() == 0 and accepted.max() >= 2


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES)
def test_bfloat16_logits(rule):
  target, tree, kwargs = random_case(7, 3, 8, 500, max_children=3, rule=rule,
                                     sampling=SAMPLINGS["t0.9_topk40_topp0.95"])
  target = target.astype(jnp.bfloat16)
  tree = Tree(tree.tokens, tree.parents, tree.depths, tree.valid, tree.logits.astype(jnp.bfloat16))
  assert_same(tree_rule.verify_tree(target, tree, impl="pallas", **kwargs),
              tree_rule.verify_tree(target, tree, **kwargs))


# --------------------------------------------------------------------------------------------
# Power: broken kernels fail the same check.
# --------------------------------------------------------------------------------------------

def _shared_stream(seeds, positions, nodes, vocab_ids, purpose):
  return node_noise(seeds, positions, 0 * nodes, vocab_ids, purpose)  # every node: node 0's


def _s_not_renormalised(s, is_token, mass):
  del mass
  return jnp.where(is_token, 0.0, s)  # the rejected token removed, the rest not rescaled


def _residual_not_renormalised(r, s, mass):
  return jnp.where(mass > 0, jnp.maximum(r - s, 0.0), r)


BROKEN = {"shared_stream": TileSteps(noise=_shared_stream),
          "s_not_renormalised": TileSteps(remove=_s_not_renormalised),
          "residual_not_renormalised": TileSteps(residual=_residual_not_renormalised)}


# Each on the rule, setting and mode of a DEFAULT_CASES entry, over shapes where the exact kernel
# passes (that entry's; shape 0 in the slow grid). Rows that differ from the reference (seeded):
# shared stream 3 of 8, s not renormalised 2 of 32, residual not renormalised 3 of 32.
@pytest.mark.parametrize("broken,case,shapes", [
    ("shared_stream", 1, [0, 1]), ("s_not_renormalised", 3, [WIDE]),
    pytest.param("residual_not_renormalised", 2, [WIDE], marks=pytest.mark.slow)])
def test_broken_kernels_fail_the_check(broken, case, shapes):
  mode, rule, setting, _ = DEFAULT_CASES[case]
  with pytest.raises(AssertionError):
    check(mode, rule, setting, shapes, tile_steps=BROKEN[broken])


# --------------------------------------------------------------------------------------------
# Dispatch, validation, export.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["auto", *(pytest.param(impl, marks=pytest.mark.slow)
                                           for impl in ("pallas", "interpret"))])
def test_impls_on_cpu_equal_the_reference(impl):
  # On CPU "pallas" and "interpret" run the kernel in the interpreter, "auto" the reference.
  target, tree, kwargs = random_case(3, 3, 7, 200, max_children=3, rule="iid",
                                     sampling=SAMPLINGS["t1"])
  verify = lambda impl: jax.jit(functools.partial(tree_rule.verify_tree, impl=impl, **kwargs))
  assert_same(verify(impl)(target, tree), verify("reference")(target, tree))


def test_bad_input_raises_value_error():
  target, tree, kwargs = random_case(4, 2, 5, 100, max_children=2, rule="iid",
                                     sampling=SAMPLINGS["t1"])
  with pytest.raises(ValueError, match="impl"):
    tree_rule.verify_tree(target, tree, impl="fast", **kwargs)
  no_logits = Tree(tree.tokens, tree.parents, tree.depths, tree.valid)
  with pytest.raises(ValueError, match="draft logits"):
    tree_rule.verify_tree(target, no_logits, impl="pallas", **kwargs)
  with pytest.raises(ValueError, match="target_logits"):
    tree_rule.verify_tree(target[:, :3], tree, impl="pallas", **kwargs)
  with pytest.raises(ValueError, match="max_children=200"):
    tree_rule.verify_tree(target, tree, impl="pallas", **{**kwargs, "max_children": 200})


def _abstract(batch=4, num_nodes=16, vocab=32000, dtype=jnp.bfloat16):
  spec = jax.ShapeDtypeStruct
  tree = Tree(spec((batch, num_nodes), jnp.int32), spec((batch, num_nodes), jnp.int32),
              spec((batch, num_nodes), jnp.int32), spec((batch, num_nodes), bool),
              spec((batch, num_nodes, vocab), dtype))
  return (spec((batch, num_nodes + 1, vocab), dtype), tree, spec((batch,), jnp.uint32),
          spec((batch,), jnp.int32))


def _export(platform, rule, sampling, impl="pallas"):
  def run(target, tree, seeds, positions):
    return tree_rule.verify_tree(target, tree, rule=rule, sampling=sampling, seeds=seeds,
                                 positions=positions, max_depth=4, max_children=3, impl=impl)
  return jax.export.export(jax.jit(run), platforms=[platform],
                           disabled_checks=GPU_EXPORT_DISABLED_CHECKS)(*_abstract()).mlir_module()


@pytest.mark.parametrize("platform,custom_call", [("tpu", "tpu_custom_call"),
                                                  ("cuda", "__gpu$xla.gpu.triton")])
@pytest.mark.parametrize("rule,setting", [
    ("match", "greedy"), ("without_replacement", "t0.9_topk40_topp0.95"),
    *(pytest.param(rule, setting, marks=pytest.mark.slow)
      for rule, setting in (("match", "t0.9_topk40_topp0.95"), ("iid", "t1")))])
def test_pallas_exports(platform, custom_call, rule, setting):
  assert custom_call in _export(platform, rule, SAMPLINGS[setting])


@pytest.mark.parametrize("platform,custom_call", [("tpu", "tpu_custom_call"), ("cpu", None),
                                                  ("cuda", "__gpu$xla.gpu.triton")])
def test_auto_follows_the_lowering_platform(platform, custom_call):
  text = _export(platform, "iid", SAMPLINGS["t1"], impl="auto")
  for name in ("tpu_custom_call", "__gpu$xla.gpu.triton"):
    assert (name in text) == (name == custom_call)


def test_kernel_impl_has_no_cpu_branch():
  # "kernel" (the chain dispatch's name) compiles the kernel where lowered; CPU has none.
  assert "tpu_custom_call" in _export("tpu", "match", SAMPLINGS["greedy"], impl="kernel")
  with pytest.raises(NotImplementedError, match="platform cpu"):  # jax: no branch for CPU
    _export("cpu", "match", SAMPLINGS["greedy"], impl="kernel")


@pytest.mark.parametrize("device_kind,num_nodes,vocab,rule", [
    (None, 16, 128256, "without_replacement"), ("TPU v5 lite", 60, 256000, "match"),
    *(pytest.param(kind, n, v, rule, marks=pytest.mark.slow)
      for kind in (None, "TPU v5 lite", "TPU v5p") for n, v in ((16, 128256), (60, 256000))
      for rule in ("match", "without_replacement"))])
def test_lowered_kernel_fits_vmem(device_kind, num_nodes, vocab, rule):
  # Blocks (double-buffered) and scratch read from the pallas_call the kernel lowers to must fit
  # the VMEM limit it asks Mosaic for, which must fit the generation's VMEM.
  from specjax.kernels.blocks import TPU_VMEM_BYTES, tpu_generation
  target, tree, seeds, positions = _abstract(8, num_nodes, vocab)
  fn = functools.partial(tree_node_results, rule=rule,
                         sampling=SAMPLINGS["t0.9_topk40_topp0.95"], max_children=4,
                         device_kind=device_kind)
  eqn = _pallas_call(lambda t, tr, s, p: fn(t, tr, seeds=s, positions=p), target, tree, seeds,
                     positions)
  limit = eqn.params["compiler_params"].vmem_limit_bytes or 16 * 2**20  # Mosaic's default
  assert _vmem_bytes(eqn) <= limit <= TPU_VMEM_BYTES[tpu_generation(device_kind)]


@pytest.mark.costly
@pytest.mark.parametrize("sampling", [Sampling(temperature=0.0),
                                      Sampling(temperature=0.8, top_k=5)], ids=["greedy", "t0.8"])
def test_tree_decode_through_the_kernel_equals_the_reference_rule(sampling):
  """`sj.decode(..., tree=..., verify_impl=...)` reaches the tree kernel: the interpreted kernel
  gives the reference rule's tokens (sampled children from a draft model: the sampled rule), and
  greedy is `sj.generate`; the TPU export of the same call holds the Mosaic kernel."""
  import specjax as sj
  from specjax.testing.models import tiny_config

  target = sj.init_params(tiny_config(vocab_size=61, num_layers=2), jax.random.key(0))
  draft = sj.init_params(tiny_config(vocab_size=61, num_layers=1), jax.random.key(1))
  tokens = jnp.asarray([[3, 9, 4, 9, 4, 0], [7, 1, 2, 5, 8, 6]], jnp.int32)
  lengths = jnp.asarray([5, 6], jnp.int32)
  spec = sj.TreeSpec("sampled", branching=(2, 2, 1), replacement=False)
  run = lambda impl: sj.decode(target, draft, tokens, jax.random.key(3), lengths=lengths,
                               max_new_tokens=10, sampling=sampling, tree=spec, verify_impl=impl)
  reference, kernel = run("reference"), run("interpret")
  np.testing.assert_array_equal(kernel.tokens, reference.tokens)
  np.testing.assert_array_equal(kernel.num_tokens, reference.num_tokens)
  if sampling.greedy:
    plain = sj.generate(target, tokens, jax.random.key(3), lengths=lengths, max_new_tokens=10)
    np.testing.assert_array_equal(kernel.tokens, plain.tokens)
  else:
    exported = jax.export.export(
        jax.jit(lambda t, d, x, n: sj.decode(t, d, x, jax.random.key(3), lengths=n,
                                             max_new_tokens=10, sampling=sampling, tree=spec,
                                             verify_impl="kernel").tokens),
        platforms=["tpu"])(target, draft, tokens, lengths)
    assert "tpu_custom_call" in exported.mlir_module()
