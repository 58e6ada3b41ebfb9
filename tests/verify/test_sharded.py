"""The verify under meshes: the fused kernel inside `shard_map`, token-identical to one device.

* Export for TPU of the whole `sj.decode` with `verify_impl="auto"` under (8, 1), (1, 8) and (2, 4)
  meshes (`sj.make_mesh`, Auto axes, and `jax.make_mesh`, Explicit axes): the Mosaic call
  (`tpu_custom_call`) is there and sits inside a `shard_map` (`sdy.manual_computation`): the fused
  kernel on each device's rows when only the batch is split, the Pallas vocabulary reductions
  (`kernels/vocab_reduce.py`) combined with collectives where the vocabulary is
  split.
* `verify_tokens` with every implementation under every mesh equals the reference on one device.
* Interpret-mode decodes under those meshes equal the single-device decode token for token.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.core import sampling as S
from specjax.verify.dispatch import verify_tokens
from specjax.testing.models import tiny_config
from specjax.verify import sharded as parallel_verify
from specjax.verify.rule import verify_reference

SHAPES = [(8, 1), (1, 8), (2, 4)]
SAMPLED = sj.Sampling(temperature=1.0, top_k=20, top_p=0.9)


def _mesh(maker, shape):
  if maker == "sj":
    return sj.make_mesh(shape)
  return jax.make_mesh(shape, ("data", "model"))  # Explicit axes: JAX 0.10's default


@pytest.fixture(scope="module")
def pair():
  target = sj.init_params(tiny_config(vocab_size=64), jax.random.key(0))
  draft = sj.init_params(tiny_config(vocab_size=64, num_layers=1, embed_dim=16, mlp_dim=32),
                         jax.random.key(1))
  tokens = jnp.array([[5, 9, 2, 7, 1, 3]] * 4 + [[3, 8, 4, 0, 0, 0]] * 4, jnp.int32)
  lengths = jnp.array([6] * 4 + [3] * 4, jnp.int32)
  return target, draft, tokens, lengths


def _manual_computation_holds_the_kernel(text: str) -> bool:
  """Whether a `tpu_custom_call` is inside an `sdy.manual_computation` region (directly, or in a
  function called from one)."""
  callees = set()
  for match in re.finditer(r"sdy\.manual_computation", text):
    region = text[match.end():text.index("sdy.return", match.end())]  # the body, to its return
    if "tpu_custom_call" in region:
      return True
    callees.update(re.findall(r"call @([\w.$-]+)", region))
  while callees:
    name = callees.pop()
    found = re.search(r"func\.func (?:private )?@" + re.escape(name) + r"\(.*?\n  }", text,
                      re.DOTALL)
    if found and "tpu_custom_call" in found.group(0):
      return True
    if found:
      callees.update(re.findall(r"call @([\w.$-]+)", found.group(0)))
  return False


@pytest.mark.parametrize("maker", ["sj", "jax"])  # Auto axes; Explicit (under auto_axes)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_exports_the_kernel_inside_shard_map(pair, maker, shape):
  target, draft, tokens, lengths = pair
  mesh = _mesh(maker, shape)
  target, draft = sj.shard(target, mesh), sj.shard(draft, mesh)

  def run(target, draft, tokens, lengths, rng):
    return sj.decode(target, draft, tokens, rng, lengths=lengths, max_new_tokens=8, num_draft=3,
                     sampling=SAMPLED, verify_impl="auto").tokens

  with jax.set_mesh(mesh):
    text = jax.export.export(jax.jit(run), platforms=["tpu"])(
        target, draft, tokens, lengths, jax.random.key(3)).mlir_module()
  assert "tpu_custom_call" in text
  assert _manual_computation_holds_the_kernel(text)


def _verify_case(seed, batch=8, num_draft=3, vocab=100):
  rng = np.random.default_rng(seed)
  draft = rng.normal(size=(batch, num_draft + 1, vocab)).astype(np.float32) * 3
  target = draft + 0.5 * rng.normal(size=draft.shape).astype(np.float32)
  tokens = np.argmax(draft[:, :num_draft], -1)
  tokens = np.where(rng.random(tokens.shape) < 0.7, tokens,
                    rng.integers(0, vocab, size=tokens.shape))
  return dict(target_logits=jnp.asarray(target), draft_logits=jnp.asarray(draft[:, :num_draft]),
              draft_tokens=jnp.asarray(tokens, jnp.int32),
              seeds=S.row_seeds(jax.random.key(seed), batch),
              positions=jnp.asarray(rng.integers(0, 50, size=batch), jnp.int32))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("impl,sampling", [
    ("interpret", SAMPLED), *[pytest.param(i, x, marks=pytest.mark.slow) for i, x in (
        ("interpret", S.GREEDY), ("reference", S.GREEDY), ("reference", SAMPLED))]],
    ids=["interpret-sampled", "interpret-greedy", "reference-greedy", "reference-sampled"])
def test_verify_tokens_under_a_mesh_equals_one_device(shape, impl, sampling):
  # V = 100 does not divide 8 or 4 vocabulary shards: the padded path.
  case = _verify_case(sum(shape) + len(impl))
  want = verify_reference(**case, sampling=sampling)
  mesh = sj.make_mesh(shape)
  got = jax.jit(lambda c: verify_tokens(**c, sampling=sampling, impl=impl, mesh=mesh))(case)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.num_accepted, want.num_accepted)


def test_a_direct_decode_call_on_sharded_models_verifies_inside_shard_map(pair, monkeypatch):
  """No ambient mesh: the models' mesh is activated for the call, so the verify is shard-mapped
  (a bare Mosaic call would not partition on a TPU)."""
  target, draft, tokens, lengths = pair
  calls = []
  original = parallel_verify.sharded_verify
  monkeypatch.setattr(parallel_verify, "sharded_verify",
                      lambda *a, **k: calls.append(k["mesh"].shape) or original(*a, **k))
  mesh = sj.make_mesh((8, 1))
  sj.decode(sj.shard(target, mesh), sj.shard(draft, mesh), tokens, jax.random.key(5),
            lengths=lengths, max_new_tokens=4, num_draft=2, sampling=SAMPLED,
            verify_impl="reference")
  assert calls and dict(calls[0]) == {"data": 8, "model": 1}


def _decode(target, draft, tokens, lengths, sampling, impl):
  return sj.decode(target, draft, tokens, jax.random.key(7), lengths=lengths, max_new_tokens=6,
                   num_draft=3, sampling=sampling, verify_impl=impl)


@pytest.mark.costly
@pytest.mark.parametrize("maker,shape,sampling", [
    ("sj", (2, 4), SAMPLED), ("jax", (1, 8), SAMPLED),
    *[pytest.param(m, s, x, marks=pytest.mark.slow)
      for m in ("sj", "jax") for s in SHAPES for x in (S.GREEDY, SAMPLED)
      if (m, s, x) not in (("sj", (2, 4), SAMPLED), ("jax", (1, 8), SAMPLED))]],
    ids=lambda v: str(v) if not isinstance(v, S.Sampling) else ("greedy" if v.greedy else "sampled"))
def test_interpret_decode_under_a_mesh_equals_one_device(pair, maker, shape, sampling):
  target, draft, tokens, lengths = pair
  want = _decode(target, draft, tokens, lengths, sampling, "reference")
  mesh = _mesh(maker, shape)
  got = _decode(sj.shard(target, mesh), sj.shard(draft, mesh), tokens, lengths, sampling,
                "interpret")
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.num_tokens), np.asarray(want.num_tokens))
