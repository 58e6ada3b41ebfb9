"""Cache writes: one explicit-index scatter, equal to a plain per-entry reference for every batch
size (16 and 17 straddle the old unrolled/batched switch), on one device and on 8-device meshes
with Auto and Explicit axes, including writes that reach or pass the end of the buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import specjax as sj
from specjax.core.cache import write_block, write_kv_block, write_stacked_block

L, KVH, S, D, T = 3, 2, 12, 4, 4


def _reference(stacked, block, starts):
  """`stacked[:, b, :, starts[b] + t] = block[:, b, t]` entry by entry; slots >= S are dropped."""
  out = np.array(stacked)
  for b, start in enumerate(np.asarray(starts)):
    for t in range(block.shape[2]):
      if start + t < out.shape[3]:
        out[:, b, :, start + t] = block[:, b, t]
  return out


def _case(batch, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  stacked = jax.random.normal(k1, (L, batch, KVH, S, D))
  block = jax.random.normal(k2, (L, batch, T, KVH, D))
  # Every row somewhere, and the last rows at the very end: S - T fills the buffer exactly, the
  # others would run past it by 1..T - 1 entries (dropped, never clamped onto earlier slots).
  starts = jax.random.randint(k3, (batch,), 0, S - T + 1)
  starts = starts.at[-4:].set(jnp.array([S - T, S - T + 1, S - 2, S - 1]))
  return stacked, block, starts


@pytest.mark.parametrize("batch", [16, 17])
def test_stacked_write_equals_reference(batch):
  stacked, block, starts = _case(batch)
  expected = _reference(stacked, np.asarray(block), starts)
  got = jax.jit(write_stacked_block, donate_argnums=0)(stacked.copy(), block, starts)
  np.testing.assert_array_equal(got, expected)
  # The single-layer write (Flax decoder template) is the same scatter on one layer.
  layer = write_block(stacked[1], block[1], starts)
  np.testing.assert_array_equal(layer, expected[1])


def _meshes():
  yield "auto_8x1", sj.make_mesh((8, 1))
  yield "explicit_8x1", jax.make_mesh((8, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  yield "explicit_2x4", jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


@pytest.mark.parametrize("batch", [16, 17])
@pytest.mark.parametrize("name,mesh", list(_meshes()), ids=lambda x: x if isinstance(x, str) else "")
def test_stacked_write_under_a_mesh_equals_one_device(batch, name, mesh):
  stacked, block, starts = _case(batch, seed=1)
  expected = _reference(stacked, np.asarray(block), starts)
  rows = "data" if batch % mesh.shape["data"] == 0 else None  # 17 rows: replicated
  heads = "model" if KVH % mesh.shape["model"] == 0 else None
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  stacked = put(stacked, P(None, rows, heads))
  block = put(block, P(None, rows, None, heads))
  starts = put(starts, P(rows))
  with jax.set_mesh(mesh):
    got = jax.jit(write_stacked_block, donate_argnums=0)(stacked, block, starts)
  np.testing.assert_array_equal(got, expected)
  assert got.sharding.spec[:3] == stacked.sharding.spec[:3]  # the cache stays where it was


# The compiled program's structure as users get it: XLA:CPU's default fusion emitters (the tests
# otherwise compile with the older ones, tests/conftest.py, which expand the scatter into a loop).
USERS_EMITTERS = {"xla_cpu_use_fusion_emitters": True}


def test_batch_sharded_write_is_local_and_in_place():
  """Under an 8x1 mesh the compiled write neither gathers nor copies the cache: no collective, and
  the only ops with the per-device cache shape are the donated parameter and the scatter."""
  mesh = sj.make_mesh((8, 1))
  stacked, block, starts = _case(32, seed=2)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  args = put(stacked, P(None, "data")), put(block, P(None, "data")), put(starts, P("data"))
  with jax.set_mesh(mesh):
    lowered = jax.jit(write_stacked_block, donate_argnums=0).lower(*args)
    hlo = lowered.compile(USERS_EMITTERS).as_text()
  assert "input_output_alias" in hlo
  for collective in ("all-gather", "all-to-all", "all-reduce", "collective-permute"):
    assert collective not in hlo
  local = f"f32[{L},4,{KVH},{S},{D}]"
  producers = [line.split("=", 1)[0].split()[-1] + " " + line.split("=", 1)[1].split("(", 1)[0]
               for line in hlo.splitlines()
               if "=" in line and line.split("=", 1)[1].lstrip().startswith(local)]
  assert producers and all("parameter" in p or "scatter" in p for p in producers), producers



def _moves(hlo: str, shapes) -> list[str]:
  """Instructions of a compiled CPU program that copy or transpose into one of `shapes`."""
  found = []
  for line in hlo.splitlines():
    if "=" not in line:
      continue
    name, rest = line.split("=", 1)
    if not any(rest.lstrip().startswith(shape) for shape in shapes):
      continue
    op = rest.split("(", 1)[0].split()[-1]
    if op in ("copy", "transpose") or "copy" in name or "transpose" in name:
      found.append(line.strip()[:120])
  return found


@pytest.mark.parametrize("width", [1, 5])
@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_compiled_forward_moves_no_cache_slab(layout, width):
  """A jitted forward (donated cache) neither transposes a layer's cache slab for attention nor
  copies the cache: the stacked scan reads each layer's [B, KVH, S, D] slab as it lies, and the
  unrolled loop updates its per-layer buffers in place. (Head width 64 and 256 slots, so that
  XLA:CPU picks the same dot kernels as for real models; with a `btkgd` output of the value
  product, or the old [L, B, S, KVH, D] layout, this program holds a transposed slab per layer.)"""
  config = sj.ModelConfig(vocab_size=64, embed_dim=64, num_layers=2, num_heads=6,
                          num_kv_heads=2, head_dim=64, mlp_dim=96)
  model = sj.init_params(config, jax.random.key(0))
  model = model if layout == "stacked" else model.unstacked()
  cache = model.init_cache(1, 256)
  fwd = jax.jit(lambda m, tokens, starts, c: m(tokens, starts, c), donate_argnums=3)
  hlo = fwd.lower(model, jnp.ones((1, width), jnp.int32), jnp.full((1,), 9, jnp.int32),
                  cache).compile().as_text()
  transposed = {"f32[1,2,64,256]", "f32[2,64,256]", "f32[1,256,2,64]", "f32[256,2,64]"}
  assert not _moves(hlo, transposed), _moves(hlo, transposed)
  if layout == "unstacked":
    assert not _moves(hlo, {"f32[1,2,256,64]", "f32[2,256,64]"})


@pytest.mark.parametrize("cache_layout", ["stacked", "per_layer"])
@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_deferred_write_equals_the_forward_write(layout, cache_layout):
  """`forward(..., write_cache=False)` leaves the cache unread-only, gives the same logits, and
  its `block_kv` written with `write_kv_block` (also into a cache of the other layout, and
  zero-padded past the block) gives the forward's own cache on every valid slot."""
  config = sj.ModelConfig(vocab_size=64, embed_dim=64, num_layers=3, num_heads=4,
                          num_kv_heads=2, head_dim=16, mlp_dim=96)
  model = sj.init_params(config, jax.random.key(0))
  model = model if layout == "stacked" else model.unstacked()
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 64)
  starts = jnp.array([0, 0], jnp.int32)
  cache = model.init_cache(2, 32)
  cache = cache.unstacked() if cache_layout == "per_layer" else cache.stacked()
  cache = model(tokens, starts, cache).cache  # a filled prefix
  block, at = tokens[:, :3], jnp.array([9, 5], jnp.int32)
  written = model(block, at, cache)
  deferred = model(block, at, cache, write_cache=False)
  assert deferred.cache is None and written.block_kv is None
  np.testing.assert_array_equal(deferred.logits, written.logits)
  got = write_kv_block(cache, deferred.block_kv.padded(5), at)
  assert got.per_layer == cache.per_layer
  np.testing.assert_array_equal(got.lengths, at + 5)
  for a, b in zip(jax.tree.leaves(got.stacked().k) + jax.tree.leaves(got.stacked().v),
                  jax.tree.leaves(written.cache.stacked().k)
                  + jax.tree.leaves(written.cache.stacked().v)):
    valid = (np.arange(32)[None] < np.asarray(at + 3)[:, None])[None, :, None, :, None]
    np.testing.assert_array_equal(np.asarray(a) * valid, np.asarray(b) * valid)
