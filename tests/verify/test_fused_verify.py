"""The fused verify kernels against `specjax.verify.rule.verify_reference`, in Pallas interpret
modes.

`TestFusedVerify` runs the TPU kernel's cases with `interpret=True`; `TestFusedVerifyTpuInterpret`
reruns a subset under `pltpu.InterpretParams()` (TPU memory semantics);
`TestFusedVerifyGpuInterpret` runs the GPU (Triton) kernel's body in interpret mode. Compiled runs
need a TPU or a GPU; on CPU the compiled paths are checked by exporting them for TPU and for CUDA
(the Mosaic / Triton custom call must be in the module). `TestFusedVerifyCompiled` (marker `tpu`)
and `TestFusedVerifyGpuCompiled` (marker `gpu`) rerun the interpret-mode cases compiled;
tests/conftest.py selects them only where jax has such a device. The GPU class has run on an H100
and an H200; the TPU class has not run on a TPU. Whether the Mosaic kernel compiles for each TPU
generation within its VMEM is checked by the TPU compiler itself in tests/tpu/.

The default selection keeps one shape per sampling setting and mode, the hand-worked cases, every
vocabulary size at small B and k, and the exports; `-m slow` adds every shape in every mode.
"""

import functools
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import specjax as sj
from specjax.core import sampling as S
from specjax.kernels import (GPU_EXPORT_DISABLED_CHECKS, BlockSizes, GpuBlockSizes,
                             fused_verify, fused_verify_gpu)
from specjax.verify.local import local_verify
from specjax.verify.rule import verify_reference
from specjax.kernels.common import tile_argmax

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"

SEED_KEY = jax.random.key(0x1234)

SAMPLINGS = [
    S.Sampling(),  # greedy
    S.Sampling(temperature=1.0),
    S.Sampling(temperature=0.6, top_k=7),
    S.Sampling(temperature=1.3, top_p=0.8),
    S.Sampling(temperature=0.9, top_k=40, top_p=0.95),
    S.Sampling(temperature=1.0, top_k=1),
]


def _case(rng, batch, num_draft, vocab, *, sampling, with_draft_logits, dtype=np.float32,
          closeness=0.5):
  """Target logits near the draft's; drafts sampled from the draft (point mass: half of them are
  the target's argmax), so that rejections and full acceptances both occur."""
  draft = rng.normal(size=(batch, num_draft + 1, vocab)).astype(np.float32) * 3
  target = draft + closeness * rng.normal(size=draft.shape).astype(np.float32)
  draft_logits = jnp.asarray(draft[:, :num_draft], dtype)
  seeds = jnp.asarray(rng.integers(0, 2**32, size=batch, dtype=np.uint64), jnp.uint32)
  positions = jnp.asarray(rng.integers(0, 1000, size=batch), jnp.int32)
  token_positions = positions[:, None] + jnp.arange(num_draft)
  if sampling.greedy:
    tokens = jnp.argmax(draft_logits, -1).astype(jnp.int32)
  else:
    tokens = S.sample_token(draft_logits, sampling, seeds[:, None], token_positions,
                            S.PURPOSE_DRAFT)
  if not with_draft_logits:  # a confident target whose argmax the drafter often proposes
    target_argmax = np.argmax(target[:, :num_draft], -1)
    np.put_along_axis(target[:, :num_draft], target_argmax[..., None],
                      np.take_along_axis(target[:, :num_draft], target_argmax[..., None], -1) + 6,
                      -1)
    tokens = jnp.where(rng.random(size=tokens.shape) < 0.7, target_argmax, tokens)
  return dict(target_logits=jnp.asarray(target, dtype),
              draft_logits=draft_logits if with_draft_logits else None,
              draft_tokens=tokens, seeds=seeds, positions=positions)


# (B, k, V, block_v, block_b): several ragged tiles, full row blocks; one tile of the whole axis,
# a partial last row block (5 = 2 + 2 + 1); V < 128, one row block; several tiles and a partial
# last row block (13 = 3 * 4 + 1).
SHAPES = ((8, 4, 1000, 256, 8), (5, 2, 384, 4096, 2), (8, 3, 90, 128, 8), (13, 5, 700, 128, 4))
# The default selection's cheaper versions (interpret mode pays per grid step): two ragged tiles,
# partial row blocks, V < 128.
FOCUSED_SHAPES = ((8, 4, 1000, 512, 8), (5, 2, 384, 4096, 2), (8, 3, 90, 128, 8),
                  (6, 3, 300, 128, 4))


class TestFusedVerify:
  INTERPRET = True

  def _verify(self, case, sampling, block_sizes=None):
    return fused_verify(**case, sampling=sampling, block_sizes=block_sizes,
                        interpret=self.INTERPRET)

  def _check(self, case, sampling, block_sizes=None):
    # The reference jitted (eagerly its sort and scans run op by op); the same function.
    want = jax.jit(lambda c: verify_reference(**c, sampling=sampling))(case)
    got = self._verify(case, sampling, block_sizes)
    chex.assert_trees_all_equal(got, want)
    return want

  # ---- hand-worked cases -------------------------------------------------------------------

  def test_greedy_hand_worked(self):
    # V = 5, k = 2. Target argmax per position: [3, 1, 4]; drafts [3, 2]:
    # position 0: draft 3 == argmax 3 -> accept; position 1: draft 2 != argmax 1 -> reject.
    # n = 1, tokens = [3 (accepted), 1 (target's argmax at the rejection), 0].
    target = jnp.array([[[0., 1., 2., 9., 3.],
                         [0., 8., 7., 1., 2.],
                         [1., 1., 1., 1., 5.]]], jnp.float32)
    case = dict(target_logits=target, draft_logits=None, draft_tokens=jnp.array([[3, 2]]),
                positions=jnp.array([4]), seeds=S.row_seeds(SEED_KEY, 1))
    got = self._verify(case, S.GREEDY)
    np.testing.assert_array_equal(got.num_accepted, [1])
    np.testing.assert_array_equal(got.tokens, [[3, 1, 0]])
    # Both drafts right: n = 2 and the bonus is the argmax of the last row, 4.
    case["draft_tokens"] = jnp.array([[3, 1]])
    got = self._verify(case, S.GREEDY)
    np.testing.assert_array_equal(got.tokens, [[3, 1, 4]])
    np.testing.assert_array_equal(got.num_accepted, [2])

  def test_greedy_nan_is_the_maximum_across_tiles(self):
    # V = 300 in tiles of 128, k = 2. A NaN is the maximum and the first NaN wins, as in
    # jnp.argmax (the reference's `first_argmax`). Position 0: 50 at id 10 (tile 0), NaN at 200
    # (tile 1): argmax 200 = draft 200 -> accept. Position 1: NaNs at 260 (tile 2) and 5 (tile 0):
    # argmax 5 != draft 7 -> reject, the correction is 5. Position 2 is never reached.
    target = np.zeros((1, 3, 300), np.float32)
    target[0, 0, 10] = 50.0
    target[0, 0, 200] = np.nan
    target[0, 1, [5, 260]] = np.nan
    case = dict(target_logits=jnp.asarray(target), draft_logits=None,
                draft_tokens=jnp.array([[200, 7]]), positions=jnp.array([4]),
                seeds=S.row_seeds(SEED_KEY, 1))
    got = self._verify(case, S.GREEDY, BlockSizes(128))
    np.testing.assert_array_equal(got.num_accepted, [1])
    np.testing.assert_array_equal(got.tokens, [[200, 5, 0]])
    self._check(case, S.GREEDY, BlockSizes(128))

  def test_top_k_one_is_greedy_for_any_seed(self):
    # top_k = 1 keeps only the argmax, so p is a point mass: a draft equal to it has
    # p(x) = 1 >= q(x) and is always accepted; any other has p(x) = 0 and is always rejected,
    # and the residual max(p - q, 0) is positive only at the argmax. Same tokens as greedy.
    rng = np.random.default_rng(1)
    target = jnp.asarray(rng.normal(size=(2, 4, 300)), jnp.float32)
    argmax = jnp.argmax(target, -1).astype(jnp.int32)
    drafts = argmax[:, :3].at[0, 1].set((argmax[0, 1] + 1) % 300)  # row 0 wrong at position 1
    draft_logits = jnp.asarray(rng.normal(size=(2, 3, 300)), jnp.float32)
    case = dict(target_logits=target, draft_logits=draft_logits, draft_tokens=drafts,
                positions=jnp.array([0, 9]))
    for seed in range(3):
      case["seeds"] = S.row_seeds(jax.random.key(seed), 2)
      got = self._verify(case, S.Sampling(top_k=1, temperature=2.0), BlockSizes(128))
      np.testing.assert_array_equal(got.num_accepted, [1, 3])
      np.testing.assert_array_equal(got.tokens[0], [argmax[0, 0], argmax[0, 1], 0, 0])
      np.testing.assert_array_equal(got.tokens[1], argmax[1])

  def test_top_p_hand_worked(self):
    # p = [0.5, 0.3, 0.15, 0.05] (logits = log p, T = 1). Descending cumulative mass 0.5, 0.8:
    # with top_p = 0.6 the nucleus is {0, 1}, renormalised to [0.625, 0.375, 0, 0].
    # A point-mass draft of token 3 has p(3) = 0 -> always rejected; the correction is drawn
    # from max(p - onehot(3), 0) = p, so it is 0 or 1, never 2 or 3.
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05], jnp.float32))
    sampling = S.Sampling(temperature=1.0, top_p=0.6)
    np.testing.assert_array_equal(jnp.isfinite(S.warp_logits(logits, sampling)),
                                  [True, True, False, False])
    target = jnp.broadcast_to(logits, (16, 2, 4))
    case = dict(target_logits=target, draft_logits=None,
                draft_tokens=jnp.full((16, 1), 3, jnp.int32),
                positions=jnp.zeros(16, jnp.int32), seeds=S.row_seeds(SEED_KEY, 16))
    got = self._verify(case, sampling)
    np.testing.assert_array_equal(got.num_accepted, np.zeros(16))
    assert set(np.asarray(got.tokens[:, 0]).tolist()) == {0, 1}  # 16 draws: both show up
    np.testing.assert_array_equal(got.tokens[:, 1], np.zeros(16))
    self._check(case, sampling)

  # ---- random sweep against the reference --------------------------------------------------

  @pytest.mark.parametrize("sampling", [
      setting if index in (0, 1, 4) else pytest.param(setting, marks=pytest.mark.slow)
      for index, setting in enumerate(SAMPLINGS)], ids=str)  # default: greedy, T, top-k + top-p
  def test_matches_reference_sweep(self, sampling):
    # One shape per setting, the drafter kind alternating: every shape, both drafter kinds.
    index = SAMPLINGS.index(sampling)
    self._sweep(sampling, index % 2 == 0, [FOCUSED_SHAPES[index % len(FOCUSED_SHAPES)]])

  @pytest.mark.slow
  @pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
  @pytest.mark.parametrize("with_draft_logits", [True, False], ids=["q", "point_mass"])
  def test_matches_reference_sweep_all_shapes(self, sampling, with_draft_logits):
    self._sweep(sampling, with_draft_logits, SHAPES)

  def _sweep(self, sampling, with_draft_logits, shapes):
    rng = np.random.default_rng(zlib.crc32(f"{sampling}{with_draft_logits}".encode()))
    accepted = []
    for batch, num_draft, vocab, block_v, block_b in shapes:
      case = _case(rng, batch, num_draft, vocab, sampling=sampling,
                   with_draft_logits=with_draft_logits)
      want = self._check(case, sampling, BlockSizes(block_v, block_b))
      accepted += [np.asarray(want.num_accepted) / num_draft]
    accepted = np.concatenate(accepted)
    # Not vacuous: the cases had rejections and accepted drafts.
    assert accepted.min() < 1 and accepted.max() > 0

  @pytest.mark.parametrize("sampling", [SAMPLINGS[0], pytest.param(
      SAMPLINGS[4], marks=pytest.mark.costly)], ids=str)  # thresholds: about 30 s each
  @pytest.mark.parametrize("with_draft_logits", [True, False], ids=["q", "point_mass"])
  def test_chunks_inside_a_tile(self, sampling, with_draft_logits):
    # The body walks each resident tile in chunks of block_c lanes (`over_chunks`), as it does on
    # TPU: several tiles of 1280 in chunks of 512 + 512 + 256 (the last tile ragged, 3000 = 2 x
    # 1280 + 440), then one whole-axis tile of 1000 in chunks 256 x 3 + 232 (a remainder that is
    # not lane-aligned). Tokens equal the reference's.
    rng = np.random.default_rng(7 + with_draft_logits)
    accepted = []
    for vocab, block_sizes in ((3000, BlockSizes(1280, 2, block_c=512)),
                               (1000, BlockSizes(4096, 4, block_c=256))):
      case = _case(rng, 5, 3, vocab, sampling=sampling, with_draft_logits=with_draft_logits)
      assert block_sizes.chunk(vocab) is not None  # really chunked
      want = self._check(case, sampling, block_sizes)
      accepted += [np.asarray(want.num_accepted) / 3]
    accepted = np.concatenate(accepted)
    assert accepted.min() < 1 and accepted.max() > 0  # not vacuous

  @pytest.mark.slow
  @pytest.mark.parametrize("sampling", SAMPLINGS[1:5], ids=str)
  def test_bfloat16_logits(self, sampling):
    rng = np.random.default_rng(3)
    case = _case(rng, 2, 3, 500, sampling=sampling, with_draft_logits=True, dtype=jnp.bfloat16)
    self._check(case, sampling, BlockSizes(256))

  @pytest.mark.slow
  def test_identical_models_accept_everything(self):
    # p == q: every ratio is 1, so all k drafts are accepted and the bonus comes from p.
    rng = np.random.default_rng(4)
    case = _case(rng, 3, 4, 600, sampling=S.Sampling(temperature=1.0), with_draft_logits=True,
                 closeness=0.0)
    case["target_logits"] = case["target_logits"].at[:, :4].set(case["draft_logits"])
    want = self._check(case, S.Sampling(temperature=1.0), BlockSizes(256))
    np.testing.assert_array_equal(want.num_accepted, [4, 4, 4])

  # ---- vocabulary sizes --------------------------------------------------------------------

  @pytest.mark.parametrize("vocab", [
      1000, 128256, *(pytest.param(v, marks=pytest.mark.slow) for v in (32000, 50257, 256000))])
  @pytest.mark.parametrize("sampling", [pytest.param(S.GREEDY, marks=pytest.mark.slow),
                                        S.Sampling(temperature=0.8)], ids=str)
  def test_vocab_sizes(self, vocab, sampling):
    rng = np.random.default_rng(vocab)
    case = _case(rng, 1, 2, vocab, sampling=sampling, with_draft_logits=True, closeness=0.05)
    # Put the target's maximum in the last vocabulary entry, i.e. in the ragged last tile.
    case["target_logits"] = case["target_logits"].at[0, 2, vocab - 1].set(50.0)
    # V = 1000: one tile of the whole axis; larger: 8192-lane tiles, the last one ragged.
    want = self._check(case, sampling, BlockSizes(8192))
    if sampling.greedy and want.num_accepted[0] == 2:
      assert want.tokens[0, 2] == vocab - 1

  @pytest.mark.slow
  @pytest.mark.parametrize("vocab", [50257, 256000])
  def test_vocab_sizes_with_thresholds(self, vocab):
    rng = np.random.default_rng(vocab + 1)
    sampling = S.Sampling(temperature=0.8, top_k=50, top_p=0.9)
    case = _case(rng, 1, 2, vocab, sampling=sampling, with_draft_logits=True, closeness=0.05)
    self._check(case, sampling, BlockSizes(32768))


class TestFusedVerifyTpuInterpret(TestFusedVerify):
  """The same cases under the TPU interpreter, which simulates every grid step's memory traffic
  and is slower: its sweep takes a subset, and the large vocabularies stay with the class above."""

  INTERPRET = pltpu.InterpretParams()

  @pytest.mark.parametrize("sampling", [SAMPLINGS[1], *[pytest.param(
      setting, marks=pytest.mark.slow) for setting in SAMPLINGS[:1] + SAMPLINGS[2:]]], ids=str)
  def test_matches_reference_sweep(self, sampling):
    super().test_matches_reference_sweep(sampling)

  @pytest.mark.slow
  def test_top_p_hand_worked(self):
    super().test_top_p_hand_worked()

  @pytest.mark.slow
  def test_top_k_one_is_greedy_for_any_seed(self):
    super().test_top_k_one_is_greedy_for_any_seed()

  @pytest.mark.slow
  @pytest.mark.parametrize("sampling", SAMPLINGS[1:2], ids=str)
  def test_bfloat16_logits(self, sampling):
    super().test_bfloat16_logits(sampling)

  test_matches_reference_sweep_all_shapes = None  # the class above runs them
  test_vocab_sizes = None
  test_vocab_sizes_with_thresholds = None

  @pytest.mark.slow
  @pytest.mark.parametrize("sampling", [SAMPLINGS[0], SAMPLINGS[4]], ids=str)
  @pytest.mark.parametrize("with_draft_logits", [True, False], ids=["q", "point_mass"])
  def test_chunks_inside_a_tile(self, sampling, with_draft_logits):
    super().test_chunks_inside_a_tile(sampling, with_draft_logits)


class TestFusedVerifyGpuInterpret(TestFusedVerify):
  """The GPU (Triton) kernel's body in interpret mode, on the same cases. `BlockSizes(block_v,
  block_b)` of a case maps to `GpuBlockSizes` with the same tile (every tile used here is a power
  of two, as Triton requires)."""

  def _verify(self, case, sampling, block_sizes=None):
    if block_sizes is not None:
      block_sizes = GpuBlockSizes(block_v=block_sizes.block_v,
                                  block_b=_next_power_of_two(block_sizes.block_b))
    return fused_verify_gpu(**case, sampling=sampling, block_sizes=block_sizes,
                            interpret=self.INTERPRET)

  @pytest.mark.parametrize("sampling", [SAMPLINGS[1], SAMPLINGS[4], *[pytest.param(
      setting, marks=pytest.mark.slow) for setting in (*SAMPLINGS[:1], *SAMPLINGS[2:4],
                                                       SAMPLINGS[5])]], ids=str)
  def test_matches_reference_sweep(self, sampling):
    super().test_matches_reference_sweep(sampling)

  @pytest.mark.parametrize("vocab", [1000, pytest.param(256000, marks=pytest.mark.slow)])
  @pytest.mark.parametrize("sampling", [S.Sampling(temperature=0.8)], ids=str)
  def test_vocab_sizes(self, vocab, sampling):
    super().test_vocab_sizes(vocab, sampling)

  @pytest.mark.slow
  @pytest.mark.parametrize("sampling", SAMPLINGS[1:2], ids=str)
  def test_bfloat16_logits(self, sampling):
    super().test_bfloat16_logits(sampling)

  test_vocab_sizes_with_thresholds = None
  test_chunks_inside_a_tile = None  # the Triton kernel has no chunk loop (BlockSizes.block_c)


# ---- compiled on a device (T6): the same cases, selected where the device exists -----------
# (tests/conftest.py skips `tpu` / `gpu` items when `jax.devices(platform)` has none; run them
# with e.g. `JAX_PLATFORMS=tpu,cpu pytest -m "tpu and not slow" tests/verify/test_fused_verify.py`).

@pytest.mark.tpu
class TestFusedVerifyCompiled(TestFusedVerify):
  """The TPU kernel compiled by Mosaic, on every case of the interpret-mode class."""

  INTERPRET = False


@pytest.mark.gpu
class TestFusedVerifyGpuCompiled(TestFusedVerifyGpuInterpret):
  """The GPU kernel compiled by Triton, on every case of its interpret-mode class."""

  INTERPRET = False


def _next_power_of_two(x: int) -> int:
  return 1 << (x - 1).bit_length()


def test_tile_argmax_takes_a_nan_as_the_maximum():
  """`tile_argmax` inside a Pallas kernel (interpret mode) gives `jnp.argmax`'s answer and the max:
  a NaN is the maximum and the first NaN wins; ties give the first id; an all -inf row its 0."""
  x = np.random.default_rng(11).normal(size=(8, 256)).astype(np.float32)
  x[1, [70, 20]] = np.nan  # the first NaN: 20
  x[2, 5], x[2, 100] = np.nan, 1e30  # a NaN beats a larger number: 5
  x[3] = -np.inf  # 0
  x[4, [200, 9]] = 1e3  # a tie: 9
  x[5, 255] = np.nan  # the last lane: 255

  def kernel(x_ref, best_ref, token_ref):
    ids = jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 1)
    best, token = tile_argmax(x_ref[...], ids)
    best_ref[...] = jnp.broadcast_to(best, best_ref.shape)
    token_ref[...] = jnp.broadcast_to(token, token_ref.shape)

  best, token = pl.pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((8, 128), jnp.float32),
                         jax.ShapeDtypeStruct((8, 128), jnp.int32)), interpret=True)(
                             jnp.asarray(x))
  np.testing.assert_array_equal(token[:, 0], jnp.argmax(jnp.asarray(x), axis=1))
  want = np.where(np.isnan(x).any(axis=1), np.nan, np.max(np.where(np.isnan(x), -np.inf, x), 1))
  np.testing.assert_array_equal(best[:, 0], want)  # NaN where the row has one


def test_gpu_block_sizes_are_powers_of_two():
  with pytest.raises(ValueError, match="power of two"):
    GpuBlockSizes(block_v=1000)
  with pytest.raises(ValueError, match="power of two"):
    GpuBlockSizes(block_b=3)
  blocks = GpuBlockSizes.get_default(50257, 4)
  assert blocks.block_v * 8 <= 8192 and blocks.block_b == 1  # R = 8 rows for k = 4
  assert GpuBlockSizes.get_default(90, 2).block_v == 128  # never wider than the vocabulary


# --------------------------------------------------------------------------------------------
# Block sizes.
# --------------------------------------------------------------------------------------------

def test_block_sizes_follow_the_tpu_tiling_rule():
  with pytest.raises(ValueError, match="multiple of 128"):
    BlockSizes(block_v=1000)
  with pytest.raises(ValueError, match="positive int"):
    BlockSizes(block_v=0)
  with pytest.raises(ValueError, match="positive int"):
    BlockSizes(block_b=0)
  assert BlockSizes(2048).tile(1000) == 1000  # whole axis: allowed by the (8, 128) rule
  assert BlockSizes(2048).tile(50257) == 2048
  assert BlockSizes(2048, block_b=8).rows(3) == 3  # clamped to the batch


def _pallas_call(fn, *args):
  """The `pallas_call` equation `fn(*args)` traces to (the kernel as Mosaic would receive it)."""
  def find(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        return eqn
      for param in eqn.params.values():
        inner = getattr(param, "jaxpr", None)
        inner = getattr(inner, "jaxpr", inner)
        if inner is not None and hasattr(inner, "eqns") and (found := find(inner)):
          return found
    return None
  return find(jax.make_jaxpr(fn)(*args).jaxpr)


def _vmem_bytes(eqn) -> int:
  """VMEM the lowered kernel needs: every block double-buffered plus the scratch, each padded to
  the (8 * (4 / itemsize), 128) tiles VMEM stores; read from the kernel's own BlockSpecs."""
  def padded(shape, dtype):
    itemsize = np.dtype(dtype).itemsize
    *lead, rows, lanes = shape
    rows = -(-rows // (8 * (4 // itemsize))) * (8 * (4 // itemsize))
    return int(np.prod(lead, dtype=np.int64)) * rows * (-(-lanes // 128) * 128) * itemsize
  total = 0
  for mapping in eqn.params["grid_mapping"].block_mappings:
    shape = tuple(getattr(d, "block_size", d) for d in mapping.block_shape)
    total += 2 * padded(shape, mapping.array_aval.dtype)
  scratch = eqn.params["grid_mapping"].num_scratch_operands
  for var in eqn.params["jaxpr"].invars[len(eqn.params["jaxpr"].invars) - scratch:]:
    total += padded(var.aval.shape, var.aval.dtype)
  return total


@pytest.mark.parametrize("device_kind", [None, "TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite"])
@pytest.mark.parametrize("vocab", [32000, 128256, 256000])
@pytest.mark.parametrize("num_draft,dtype", [(1, jnp.float32), (8, jnp.float32),
                                             (4, jnp.bfloat16)], ids=["k1-f32", "k8-f32", "k4-bf16"])
def test_lowered_kernel_fits_the_vmem_of_its_generation(device_kind, vocab, num_draft, dtype):
  # Independent of `BlockSizes.get_default`'s arithmetic: the blocks and scratch are read from
  # the pallas_call the kernel lowers to, and must fit the VMEM limit it asks Mosaic for (or the
  # 16 MiB scoped default without one), which must fit the generation's physical VMEM.
  from specjax.kernels.blocks import TPU_VMEM_BYTES, tpu_generation
  batch = 8
  args = (jax.ShapeDtypeStruct((batch, num_draft + 1, vocab), dtype),
          jax.ShapeDtypeStruct((batch, num_draft, vocab), dtype),
          jax.ShapeDtypeStruct((batch, num_draft), jnp.int32))
  fn = functools.partial(fused_verify, sampling=S.Sampling(0.8, top_k=50, top_p=0.9),
                         seeds=jnp.zeros(batch, jnp.uint32),
                         positions=jnp.zeros(batch, jnp.int32), device_kind=device_kind)
  eqn = _pallas_call(fn, *args)
  limit = eqn.params["compiler_params"].vmem_limit_bytes or 16 * 2**20
  assert _vmem_bytes(eqn) <= limit <= TPU_VMEM_BYTES[tpu_generation(device_kind)]
  logits_block = eqn.params["grid_mapping"].block_mappings[3].block_shape
  if device_kind in ("TPU v5 lite", "TPU v6 lite") and vocab <= 128256:
    assert logits_block[-1].block_size == vocab  # a row's whole vocabulary stays resident


# --------------------------------------------------------------------------------------------
# Sort-free thresholds against a float64 sort.
# --------------------------------------------------------------------------------------------

def test_radix_thresholds_equal_a_sort():
  rng = np.random.default_rng(5)
  for trial in range(9):  # few shapes (each compiles), many rows
    vocab = (7, 60, 255)[trial % 3]
    x = (rng.normal(size=(16, vocab)) * 3).astype(np.float32)
    if trial % 3 == 0:
      x = np.round(x)  # ties at the boundary
    top_k, top_p = int(rng.integers(1, vocab + 1)), float(rng.uniform(0.05, 1.0))
    got = np.isfinite(S.warp_logits(jnp.asarray(x), S.Sampling(1.0, top_k, top_p)))
    kth = -np.sort(-x, axis=-1)[:, top_k - 1:top_k]
    z = np.where(x >= kth, x, -np.inf).astype(np.float64)
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-z, axis=-1, kind="stable")
    cumulative = np.cumsum(np.take_along_axis(probs, order, -1), -1)
    cutoff = np.minimum((cumulative < top_p).sum(-1), vocab - 1)[:, None]
    threshold = np.take_along_axis(np.take_along_axis(z, order, -1), cutoff, -1)
    np.testing.assert_array_equal(got, z >= threshold)


# --------------------------------------------------------------------------------------------
# Dispatch and export.
# --------------------------------------------------------------------------------------------

def _abstract_args(batch=4, num_draft=4, vocab=32000, dtype=jnp.bfloat16, draft=True):
  args = (jax.ShapeDtypeStruct((batch, num_draft + 1, vocab), dtype),
          jax.ShapeDtypeStruct((batch, num_draft, vocab), dtype) if draft else None,
          jax.ShapeDtypeStruct((batch, num_draft), jnp.int32))
  kwargs = dict(seeds=jax.ShapeDtypeStruct((batch,), jnp.uint32),
                positions=jax.ShapeDtypeStruct((batch,), jnp.int32))
  return args, kwargs


@pytest.mark.parametrize("sampling", [S.GREEDY, S.Sampling(temperature=1.0),
                                      S.Sampling(temperature=0.7, top_k=50, top_p=0.9)], ids=str)
@pytest.mark.parametrize("draft", [True, False], ids=["q", "point_mass"])
def test_kernel_exports_for_tpu(sampling, draft):
  args, kwargs = _abstract_args(draft=draft)
  exported = jax.export.export(jax.jit(functools.partial(fused_verify, sampling=sampling)),
                               platforms=["tpu"])(*args, **kwargs)
  assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("sampling", [S.GREEDY, S.Sampling(temperature=0.7, top_k=50, top_p=0.9)],
                         ids=str)
@pytest.mark.parametrize("draft", [True, False], ids=["q", "point_mass"])
def test_kernel_exports_for_tpu_with_row_blocks(sampling, draft):
  # 8-row blocks, two ragged vocabulary tiles and a partial last row block (B = 20) through
  # the Mosaic lowering.
  args, kwargs = _abstract_args(batch=20, vocab=1000, draft=draft)
  fn = functools.partial(fused_verify, sampling=sampling, block_sizes=BlockSizes(512, 8))
  exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args, **kwargs)
  assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("sampling", [S.GREEDY, S.Sampling(temperature=1.0),
                                      S.Sampling(temperature=0.7, top_k=50, top_p=0.9)], ids=str)
@pytest.mark.parametrize("draft", [True, False], ids=["q", "point_mass"])
def test_gpu_kernel_exports_for_cuda(sampling, draft):
  # The Triton custom call is outside jax.export's stability guarantee: exporting it needs its
  # safety check disabled (GPU_EXPORT_DISABLED_CHECKS), and without that the export refuses.
  args, kwargs = _abstract_args(draft=draft)
  fn = jax.jit(functools.partial(fused_verify_gpu, sampling=sampling))
  exported = jax.export.export(fn, platforms=["cuda"],
                               disabled_checks=GPU_EXPORT_DISABLED_CHECKS)(*args, **kwargs)
  assert TRITON_CUSTOM_CALL in exported.mlir_module()
  if sampling.top_k:  # 4-row blocks (B = 4 here: one block)
    blocked = jax.jit(functools.partial(fused_verify_gpu, sampling=sampling,
                                        block_sizes=GpuBlockSizes(block_v=512, block_b=4)))
    exported = jax.export.export(blocked, platforms=["cuda"],
                                 disabled_checks=GPU_EXPORT_DISABLED_CHECKS)(*args, **kwargs)
    assert TRITON_CUSTOM_CALL in exported.mlir_module()
  if sampling == S.GREEDY and draft:
    with pytest.raises(ValueError, match="custom call"):
      jax.export.export(fn, platforms=["cuda"])(*args, **kwargs)


def test_tpu_kernel_has_no_gpu_lowering():
  # The TPU kernel (PrefetchScalarGridSpec, sequential grid axes with VMEM scratch) does not lower
  # for GPU; the GPU has its own kernel, which "auto" and "kernel" pick there.
  args, kwargs = _abstract_args()
  with pytest.raises(ValueError, match="gpu"):
    jax.export.export(jax.jit(functools.partial(fused_verify, sampling=S.GREEDY)),
                      platforms=["cuda"])(*args, **kwargs)


@pytest.mark.parametrize("platform,custom_call", [("tpu", "tpu_custom_call"), ("cpu", None),
                                                  ("cuda", TRITON_CUSTOM_CALL)])
def test_auto_dispatch_follows_the_lowering_platform(platform, custom_call):
  args, kwargs = _abstract_args()
  fn = functools.partial(local_verify, sampling=S.Sampling(temperature=1.0), impl="auto")
  text = jax.export.export(jax.jit(fn), platforms=[platform],
                           disabled_checks=GPU_EXPORT_DISABLED_CHECKS)(*args, **kwargs).mlir_module()
  for name in ("tpu_custom_call", TRITON_CUSTOM_CALL):
    assert (name in text) == (name == custom_call)


def test_dispatch_impls_agree_on_cpu():
  rng = np.random.default_rng(6)
  sampling = S.Sampling(temperature=1.0)
  case = _case(rng, 2, 3, 400, sampling=sampling, with_draft_logits=True)
  results = {impl: local_verify(**case, sampling=sampling, impl=impl)
             for impl in ("auto", "reference", "interpret")}
  for impl in ("auto", "interpret"):
    np.testing.assert_array_equal(results[impl].tokens, results["reference"].tokens)
  with pytest.raises(ValueError, match="impl"):
    local_verify(**case, sampling=sampling, impl="fast")


# --------------------------------------------------------------------------------------------
# The whole decode with the kernel path.
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_pair():
  from specjax.testing.models import tiny_config
  target = sj.init_params(tiny_config(vocab_size=61), jax.random.key(0))
  draft = sj.init_params(tiny_config(vocab_size=61, num_layers=1, embed_dim=16, mlp_dim=32),
                         jax.random.key(1))
  tokens = jnp.array([[5, 9, 2, 7, 1, 3], [3, 8, 0, 0, 0, 0]], jnp.int32)
  return target, draft, tokens, jnp.array([6, 2], jnp.int32)


@pytest.mark.parametrize("platform,custom_call", [("tpu", "tpu_custom_call"),
                                                  ("cuda", TRITON_CUSTOM_CALL)])
def test_decode_exports_with_the_kernel(tiny_pair, platform, custom_call):
  target, draft, tokens, lengths = tiny_pair

  def run(target, draft, tokens, lengths, rng):
    return sj.decode(target, draft, tokens, rng, lengths=lengths, max_new_tokens=8, num_draft=3,
                     sampling=sj.Sampling(temperature=1.0, top_k=20), verify_impl="auto").tokens

  text = jax.export.export(jax.jit(run), platforms=[platform],
                           disabled_checks=GPU_EXPORT_DISABLED_CHECKS)(
      target, draft, tokens, lengths, jax.random.key(3)).mlir_module()
  assert custom_call in text


@pytest.mark.parametrize("sampling", [pytest.param(S.GREEDY, marks=pytest.mark.slow),
                                      S.Sampling(temperature=1.0)], ids=str)
def test_decode_with_the_interpreted_kernel_equals_the_reference(tiny_pair, sampling):
  target, draft, tokens, lengths = tiny_pair
  outs = [sj.decode(target, draft, tokens, jax.random.key(9), lengths=lengths, max_new_tokens=10,
                    num_draft=3, sampling=sampling, verify_impl=impl)
          for impl in ("reference", "interpret")]
  np.testing.assert_array_equal(outs[1].tokens, outs[0].tokens)
  np.testing.assert_array_equal(outs[1].stats.accepted, outs[0].stats.accepted)
