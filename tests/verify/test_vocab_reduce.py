"""`specjax.kernels.vocab_reduce.PallasVocab` (interpret mode) against the jnp reductions, and the
greedy verify that runs on its argmax on TPU (`specjax.verify.local`).

The kernels flatten `[B, T, V]` token-major where `B` is a multiple of 8 and `T` not (a bitcast of
the layout XLA:TPU gives such logits), batch-major otherwise, and do not pad the vocabulary: a
partial last tile is masked. Both orders, a vocabulary that is not a multiple of 128 and one of
several tiles with a partial last one are checked here, with NaNs, ties and all -inf rows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core import sampling as S
from specjax.kernels import vocab_reduce
from specjax.kernels.vocab_reduce import PallasVocab, flatten_order
from specjax.verify.local import local_verify
from specjax.verify.rule import LocalVocab, verify_reference

SHAPES = [(8, 7, 300), (3, 5, 256), (16, 3, vocab_reduce.MAX_BLOCK_V + 260), (8, 1, 130)]


def test_flatten_order():
  assert flatten_order((64, 7, 151936)) == "token"
  assert flatten_order((8, 3, 10)) == "token"
  assert flatten_order((1, 7, 10)) == "batch"
  assert flatten_order((64, 8, 10)) == "batch"
  assert flatten_order((64, 1, 10)) == "batch"
  assert flatten_order((64, 10)) == "batch"


def _logits(shape, seed):
  x = np.random.default_rng(seed).normal(size=shape).astype(np.float32) * 3
  x[0, 0, [7, 3]] = np.nan  # the first NaN wins: 3
  x[1, -1, :] = -np.inf  # argmax 0
  x[-1, 0, [shape[-1] - 1, 11]] = 1e3  # a tie: 11
  x[2 % shape[0], 0, shape[-1] - 1] = 1e4  # the last lane (in a partial tile where there is one)
  return jnp.asarray(x)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reductions_equal_jnp(shape):
  x = _logits(shape, sum(shape))
  pallas, local = PallasVocab(interpret=True), LocalVocab()
  np.testing.assert_array_equal(pallas.argmax(x), local.argmax(x))
  clean = jnp.where(jnp.isnan(x), 0.0, x)  # (XLA:CPU's max does not always propagate a NaN)
  np.testing.assert_array_equal(pallas.max(clean), local.max(clean))
  finite = jnp.where(jnp.isfinite(x), x, 0.0)
  np.testing.assert_allclose(pallas.sum(finite), local.sum(finite), rtol=1e-5, atol=1e-4)
  thresholds = jnp.stack([jnp.full(shape[:-1], -jnp.inf), jnp.zeros(shape[:-1]),
                          jnp.full(shape[:-1], 2.0)], axis=-1)
  np.testing.assert_array_equal(pallas.sum_at_least(clean, None, thresholds),
                                local.sum_at_least(clean, None, thresholds))
  weights = jnp.exp(jnp.minimum(clean, 10.0) / 10)
  np.testing.assert_allclose(pallas.sum_at_least(clean, weights, thresholds),
                             local.sum_at_least(clean, weights, thresholds), rtol=1e-5)


def _greedy_case(batch, k, vocab, seed):
  rng = np.random.default_rng(seed)
  target = rng.normal(size=(batch, k + 1, vocab)).astype(np.float32)
  argmax = target.argmax(-1)
  # Drafts: the target's argmax up to a random row-wise point, then a different token.
  cut = rng.integers(0, k + 1, size=batch)
  drafts = np.where(np.arange(k)[None] < cut[:, None], argmax[:, :k], (argmax[:, :k] + 1) % vocab)
  target[0, 0, [5, 2]] = target[0, 0].max() + 1  # a tie: 2
  drafts[0, 0] = 2
  return dict(target_logits=jnp.asarray(target), draft_logits=None,
              draft_tokens=jnp.asarray(drafts, jnp.int32),
              seeds=jnp.arange(batch, dtype=jnp.uint32), positions=jnp.arange(batch) * 3)


@pytest.mark.parametrize("num_drafted", [False, True])
def test_greedy_interpret_on_token_major_logits_equals_the_reference(num_drafted):
  case = _greedy_case(16, 6, 300, 1)
  assert flatten_order(case["target_logits"].shape) == "token"
  extra = dict(num_drafted=jnp.arange(16, dtype=jnp.int32) % 7) if num_drafted else {}
  got = local_verify(**case, sampling=S.GREEDY, impl="interpret", **extra)
  want = verify_reference(**case, sampling=S.GREEDY, **extra)
  np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert 0 < int(want.num_accepted.sum()) < 16 * 6


def test_tpu_greedy_on_token_major_logits_lowers_the_argmax_kernel():
  """For TPU, `impl="auto"` greedy at B = 8, k + 1 = 7 runs the vocabulary argmax kernel, not the
  fused verify kernel (whose batch-major blocks made XLA copy the logits); sampling, and a batch
  that is not a multiple of 8, keep the fused kernel."""
  def text(batch, sampling):
    args = (jax.ShapeDtypeStruct((batch, 7, 1024), jnp.float32), None,
            jax.ShapeDtypeStruct((batch, 6), jnp.int32))
    kwargs = dict(seeds=jax.ShapeDtypeStruct((batch,), jnp.uint32),
                  positions=jax.ShapeDtypeStruct((batch,), jnp.int32))
    fn = functools.partial(local_verify, sampling=sampling, impl="auto")
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args, **kwargs).mlir_module()

  greedy = text(8, S.GREEDY)
  assert "vocab_argmax" in greedy and "fused_verify" not in greedy
  for batch, sampling in ((8, S.Sampling(temperature=1.0)), (3, S.GREEDY)):
    other = text(batch, sampling)
    assert "fused_verify" in other and "vocab_argmax" not in other
