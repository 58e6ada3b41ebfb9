"""Orbax save/load: bitwise round trips, restore into a 2x4 mesh, and clear errors on bad dirs."""

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import specjax as sj
from specjax.io import load, save
from specjax.models import RopeScaling
from specjax.io import orbax as checkpoint
from specjax.models import gemma_style
from specjax.testing.models import tiny_config


def _bits(x) -> np.ndarray:
  x = np.asarray(x)
  return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


def _assert_bitwise_equal(a: sj.Model, b: sj.Model):
  assert a.config == b.config
  flat_a = checkpoint.flatten(a.params)
  flat_b = checkpoint.flatten(b.params)
  assert flat_a.keys() == flat_b.keys()
  for name in flat_a:
    assert flat_a[name].dtype == flat_b[name].dtype, name
    np.testing.assert_array_equal(_bits(flat_a[name]), _bits(flat_b[name]), err_msg=name)


CONFIGS = {
    "llama_scaled_rope": tiny_config(rope_theta=500_000.0, rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64), bos_id=1, eos_id=2),
    "qwen_bias_qk_norm": tiny_config(qkv_bias=True, qk_norm=True, tie_embeddings=True,
                                     family="qwen3"),
    "gemma2": gemma_style(tiny_config(query_pre_attn_scalar=16.0)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_is_bitwise(tmp_path, name, dtype):
  model = sj.init_params(CONFIGS[name], jax.random.key(3), dtype)
  if CONFIGS[name].qkv_bias:  # zero-initialised: give them bits worth checking
    layers = dict(model.params["layers"], bq=jax.random.normal(jax.random.key(4),
                                                               model.params["layers"]["bq"].shape,
                                                               dtype))
    model = sj.Model(dict(model.params, layers=layers), model.config)
  save(model, tmp_path / "ckpt")
  restored = load(tmp_path / "ckpt")
  _assert_bitwise_equal(model, restored)
  assert checkpoint.read_config(tmp_path / "ckpt") == model.config


def test_saving_the_cpu_layout_writes_the_stacked_checkpoint(tmp_path):
  """A model in CPU's layout (per-layer, fused projections, an output copy) saves as the plain
  stacked checkpoint: bitwise the same weights as saving the model it came from."""
  model = sj.init_params(CONFIGS["llama_scaled_rope"], jax.random.key(5))
  save(model.for_platform("cpu"), tmp_path / "ckpt")
  _assert_bitwise_equal(model, load(tmp_path / "ckpt"))


def test_restored_model_runs_identically(tmp_path):
  model = sj.init_params(CONFIGS["llama_scaled_rope"], jax.random.key(0))
  save(model, tmp_path / "ckpt")
  restored = load(tmp_path / "ckpt")
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  starts = jnp.zeros((2,), jnp.int32)
  np.testing.assert_array_equal(model(tokens, starts).logits, restored(tokens, starts).logits)


def test_load_casts_dtype(tmp_path):
  model = sj.init_params(CONFIGS["gemma2"], jax.random.key(1), jnp.bfloat16)
  save(model, tmp_path / "ckpt")
  restored = load(tmp_path / "ckpt", dtype=jnp.float32)
  for name, leaf in checkpoint.flatten(restored.params).items():
    assert leaf.dtype == jnp.float32, name
    np.testing.assert_array_equal(
        leaf, np.asarray(checkpoint.flatten(model.params)[name]).astype(np.float32))


def _mesh_2x4():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets 8 CPU devices)")
  return jax.make_mesh((2, 4), ("data", "model"))


def test_restore_into_2x4_mesh(tmp_path):
  mesh = _mesh_2x4()
  model = sj.init_params(CONFIGS["llama_scaled_rope"], jax.random.key(2), jnp.bfloat16)
  save(model, tmp_path / "ckpt")
  spec = {
      "embed": P("model", None), "final_norm": P(), "lm_head": P(None, "model"),
      "layers": {"attn_norm": P(), "mlp_norm": P(), "wq": P("data", None, "model"),
                 "wk": P(None, None, "model"), "wv": P(None, None, "model"),
                 "wo": P(None, "model", None), "w_gate": P(None, "data", "model"),
                 "w_up": P(None, None, "model"), "w_down": P(None, "model", "data")},
  }
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), spec,
                           is_leaf=lambda x: isinstance(x, P))
  restored = load(tmp_path / "ckpt", sharding=shardings)
  _assert_bitwise_equal(model, restored)
  flat_shardings = checkpoint.flatten(shardings)
  for name, leaf in checkpoint.flatten(restored.params).items():
    assert leaf.sharding == flat_shardings[name], name
    expected_shard = flat_shardings[name].shard_shape(leaf.shape)
    assert len(leaf.addressable_shards) == 8
    for shard in leaf.addressable_shards:
      assert shard.data.shape == expected_shard, name
  # The embedding really is split: each device holds a quarter of the vocabulary.
  assert restored.params["embed"].addressable_shards[0].data.shape == (16, 32)


def test_restore_with_one_sharding_for_every_leaf(tmp_path):
  mesh = _mesh_2x4()
  model = sj.init_params(CONFIGS["qwen_bias_qk_norm"], jax.random.key(5))
  save(model, tmp_path / "ckpt")
  replicated = NamedSharding(mesh, P())
  restored = load(tmp_path / "ckpt", sharding=replicated)
  _assert_bitwise_equal(model, restored)
  assert all(leaf.sharding == replicated for leaf in jax.tree.leaves(restored.params))


def test_save_refuses_to_overwrite(tmp_path):
  model = sj.init_params(tiny_config(), jax.random.key(0))
  save(model, tmp_path / "ckpt")
  with pytest.raises(ValueError, match="already exists"):
    save(model, tmp_path / "ckpt")
  other = sj.init_params(tiny_config(), jax.random.key(1))
  save(other, tmp_path / "ckpt", overwrite=True)
  _assert_bitwise_equal(other, load(tmp_path / "ckpt"))


# ----------------------------------------------------------------------------------------------
# Bad directories


@pytest.fixture(name="saved")
def _saved(tmp_path) -> pathlib.Path:
  model = sj.init_params(tiny_config(), jax.random.key(0))
  return save(model, tmp_path / "ckpt")


def test_missing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
    load(tmp_path / "nowhere")


def test_interrupted_save_without_config(saved):
  (saved / checkpoint.CONFIG_FILE).unlink()
  with pytest.raises(ValueError, match="not a complete specjax checkpoint.*specjax_model.json"):
    load(saved)


def test_hugging_face_directory_is_pointed_to_from_hf(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(ValueError, match="from_hf"):
    load(tmp_path)


def test_missing_params_directory(saved):
  shutil.rmtree(saved / checkpoint.PARAMS_DIR)
  with pytest.raises(ValueError, match="params/ is missing"):
    load(saved)


def test_corrupt_config_json(saved):
  (saved / checkpoint.CONFIG_FILE).write_text('{"format_version": 1, "config": {"vocab_')
  with pytest.raises(ValueError, match="corrupt"):
    load(saved)


def test_config_with_unknown_field(saved):
  record = json.loads((saved / checkpoint.CONFIG_FILE).read_text())
  record["config"]["mixture_of_experts"] = 8
  (saved / checkpoint.CONFIG_FILE).write_text(json.dumps(record))
  with pytest.raises(ValueError, match="mixture_of_experts"):
    load(saved)


def test_corrupt_orbax_metadata(saved):
  (saved / checkpoint.PARAMS_DIR / "_METADATA").write_text("not json")
  with pytest.raises(ValueError, match="corrupt checkpoint"):
    load(saved)


def test_missing_array_data(saved):
  data_files = [p for p in (saved / checkpoint.PARAMS_DIR).rglob("*")
                if p.is_file() and p.parent.name == "d"]
  assert data_files
  for p in data_files:
    p.unlink()
  with pytest.raises(ValueError, match="corrupt checkpoint"):
    load(saved)


def _rewrite_config(path, **changes):
  record = json.loads((path / checkpoint.CONFIG_FILE).read_text())
  record["config"].update(changes)
  (path / checkpoint.CONFIG_FILE).write_text(json.dumps(record))


def test_shape_mismatch(saved):
  _rewrite_config(saved, mlp_dim=96)
  with pytest.raises(ValueError, match=r"shape mismatch: layers/w_down: expected \(2, 96, 32\), "
                     r"found \(2, 64, 32\)"):
    load(saved)


def test_missing_tensor(tmp_path):
  model = sj.init_params(tiny_config(), jax.random.key(0))
  layers = {k: v for k, v in model.params["layers"].items() if k != "wk"}
  save(sj.Model(dict(model.params, layers=layers), model.config), tmp_path / "ckpt")
  with pytest.raises(ValueError, match=r"missing tensors \['layers/wk'\]"):
    load(tmp_path / "ckpt")


def test_config_expects_tensors_the_checkpoint_lacks(saved):
  _rewrite_config(saved, qkv_bias=True)
  with pytest.raises(ValueError, match=r"missing tensors \['layers/bk', 'layers/bq', 'layers/bv'\]"):
    load(saved)


def test_unexpected_tensor(saved):
  _rewrite_config(saved, tie_embeddings=True)
  with pytest.raises(ValueError, match=r"unexpected tensors \['lm_head'\]"):
    load(saved)


def test_bad_sharding_argument(saved):
  with pytest.raises(ValueError, match="sharding"):
    load(saved, sharding={"embed": None})


def test_config_dict_round_trip():
  config = dataclasses.replace(CONFIGS["gemma2"], rope_scaling=RopeScaling(kind="linear",
                                                                              factor=2.0))
  assert checkpoint.config_from_dict(json.loads(json.dumps(
      checkpoint.config_to_dict(config)))) == config


def test_restore_onto_a_mesh_by_logical_axis_rules(tmp_path):
  from specjax import parallel as sharding_lib
  mesh = _mesh_2x4()
  model = sj.init_params(CONFIGS["gemma2"], jax.random.key(6))
  save(model, tmp_path / "ckpt")
  restored = load(tmp_path / "ckpt", sharding=mesh)
  _assert_bitwise_equal(model, restored)
  expected = checkpoint.flatten(sharding_lib.param_shardings(model, mesh))
  for name, leaf in checkpoint.flatten(restored.params).items():
    assert leaf.sharding == expected[name], name


def test_save_tree_round_trip(tmp_path):
  """Any pytree (a train state: params, optimizer moments, step) with its metadata."""
  from specjax.io.orbax import read_tree_metadata, restore_tree, save_tree
  model = sj.init_params(tiny_config(vocab_size=32), jax.random.key(0))
  state = {"params": model.params, "mu": jax.tree.map(jnp.zeros_like, model.params),
           "step": jnp.asarray(7, jnp.int32), "rng": jax.random.key_data(jax.random.key(3))}
  meta = {"model_config": checkpoint.config_to_dict(model.config), "lr": 1e-3}
  save_tree(tmp_path / "state", state, meta)
  restored, got_meta = restore_tree(tmp_path / "state", jax.eval_shape(lambda: state))
  assert got_meta == meta and read_tree_metadata(tmp_path / "state") == meta
  for name, leaf in checkpoint.flatten(restored).items():
    np.testing.assert_array_equal(leaf, checkpoint.flatten(state)[name], err_msg=name)
  with pytest.raises(ValueError, match="already exists"):
    save_tree(tmp_path / "state", state)
  with pytest.raises(ValueError, match="JSON-serialisable"):
    save_tree(tmp_path / "other", state, {"bad": object()})
  with pytest.raises(ValueError, match="cannot restore"):
    restore_tree(tmp_path / "state", {"step": jax.ShapeDtypeStruct((3,), jnp.float32)})
  (tmp_path / "state" / "specjax_tree.json").unlink()
  with pytest.raises(ValueError, match="interrupted save"):
    restore_tree(tmp_path / "state", jax.eval_shape(lambda: state))
  with pytest.raises(FileNotFoundError):
    restore_tree(tmp_path / "missing", state)
