"""Orbax checkpoints: save/restore of a `specjax.Model`, and of any pytree (train states).

A specjax checkpoint is a directory:

```
path/
  specjax_model.json   the ModelConfig (with RopeScaling) and the format version
  params/              an Orbax `StandardCheckpointer` checkpoint of `model.params`
```

`load` validates the stored tree against the shapes the config implies before reading any array,
then restores straight into the requested sharding against an abstract target
(`jax.ShapeDtypeStruct` leaves that carry the sharding), so every device reads only its own shards
and the full model is never gathered on one device.

`save_tree` / `restore_tree` do the same for an arbitrary pytree (a train state: params,
optimizer state, step) with a JSON metadata record beside it. This module is the only Orbax user.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.transformer import Model, init_params
from specjax.models import quant

CONFIG_FILE = "specjax_model.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Config serialisation


def config_to_dict(config: ModelConfig) -> dict:
  """A JSON-ready dict of a `ModelConfig` (nested `RopeScaling` included)."""
  return dataclasses.asdict(config)


def config_from_dict(data: dict) -> ModelConfig:
  """The inverse of `config_to_dict`; unknown fields are an error rather than silently dropped."""
  data = dict(data)
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(data) - known)
  if unknown:
    raise ValueError(f"unknown ModelConfig fields {unknown}: the checkpoint was written by a "
                     "newer specjax")
  scaling = data.get("rope_scaling")
  if scaling is not None:
    data["rope_scaling"] = RopeScaling(**scaling)
  return ModelConfig(**data)


# ---------------------------------------------------------------------------------------------
# Orbax save / load


def _checkpointer():
  import orbax.checkpoint as ocp  # imported lazily: `import specjax` stays fast
  return ocp.StandardCheckpointer()


def _write_checkpoint(path: pathlib.Path, tree_dir: str, tree, record_file: str, record,
                      overwrite: bool) -> pathlib.Path:
  """Saves `tree` under `path / tree_dir`, then the JSON text `record()` as `path / record_file`.

  The record is written last (by process 0, through a temporary file): a directory without it is
  an interrupted save. An existing `path` is removed first when `overwrite`, else a ValueError.
  """
  if path.exists():
    if not overwrite:
      raise ValueError(f"{path} already exists (pass overwrite=True to replace it)")
    if jax.process_index() == 0:
      import shutil
      shutil.rmtree(path)
  with _checkpointer() as checkpointer:
    checkpointer.save(path / tree_dir, tree)
    checkpointer.wait_until_finished()
  if jax.process_index() == 0:
    tmp = path / (record_file + ".tmp")
    tmp.write_text(record() + "\n")
    tmp.replace(path / record_file)
  return path


def save(model: Model, path: str | os.PathLike, *, overwrite: bool = False) -> pathlib.Path:
  """Saves a model as an Orbax checkpoint with its architecture config beside the weights.

  Args:
    model: the `specjax.Model` to save (its arrays may be sharded over any mesh).
    path: the checkpoint directory to create.
    overwrite: replace an existing directory instead of raising.

  Returns:
    The absolute checkpoint directory.

  Raises:
    ValueError: `model` is not a `specjax.Model`, or `path` exists and `overwrite` is False.
  """
  if not isinstance(model, Model):
    raise ValueError(f"save expects a specjax.Model, got {type(model).__name__}")
  model = model.stacked().without_output_copy()  # one on-disk layout, whatever the platform's

  def record() -> str:  # the format version, the config and any quantization settings
    data = {"format_version": FORMAT_VERSION, "config": config_to_dict(model.config)}
    quantization = quant.quantization_of(model)
    if quantization is not None:
      data["quantization"] = quantization
    return json.dumps(data, indent=2, sort_keys=True)

  return _write_checkpoint(pathlib.Path(path).absolute(), PARAMS_DIR, model.params, CONFIG_FILE,
                           record, overwrite)


def read_quantization(path: str | os.PathLike) -> dict | None:
  """The quantization settings recorded by `save` for a quantized model, or None."""
  record = json.loads((pathlib.Path(path) / CONFIG_FILE).read_text())
  quantization = record.get("quantization")
  if quantization is None:
    return None
  try:
    asymmetric = quantization.get("asymmetric", False)  # absent in earlier checkpoints
    if not isinstance(asymmetric, bool):
      raise ValueError(f"asymmetric must be true or false, got {asymmetric!r}")
    bits = int(quantization["bits"])
    return {"bits": bits, "group": int(quantization["group"]),
            "embeddings": bool(quantization["embeddings"]), "asymmetric": asymmetric,
            "embed_bits": int(quantization.get("embed_bits", bits))}
  except (KeyError, TypeError, ValueError) as error:
    raise ValueError(f"corrupt {pathlib.Path(path) / CONFIG_FILE}: quantization {error!r}") from None


def read_config(path: str | os.PathLike) -> ModelConfig:
  """The `ModelConfig` stored in a specjax checkpoint directory."""
  path = pathlib.Path(path)
  if not path.is_dir():
    raise FileNotFoundError(f"no checkpoint directory at {path}")
  config_path = path / CONFIG_FILE
  if not config_path.is_file():
    hint = (" (it looks like a Hugging Face checkpoint: use specjax.from_hf or `specjax convert`)"
            if (path / "config.json").is_file() else "")
    raise ValueError(f"{path} is not a complete specjax checkpoint: {CONFIG_FILE} is missing "
                     f"(an interrupted save?){hint}")
  try:
    record = json.loads(config_path.read_text())
    version = record["format_version"]
    config_data = record["config"]
  except (json.JSONDecodeError, KeyError, TypeError) as error:
    raise ValueError(f"corrupt {config_path}: {error!r}") from None
  if version != FORMAT_VERSION:
    raise ValueError(f"{config_path} has format_version {version}; this specjax reads "
                     f"{FORMAT_VERSION}")
  try:
    return config_from_dict(config_data)
  except TypeError as error:
    raise ValueError(f"corrupt {config_path}: {error}") from None


def path_name(key_path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                  for k in key_path)


def flatten(tree) -> dict[str, Any]:
  return {path_name(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def nest_params(flat: dict[str, Any]) -> dict:
  """A `Model`'s parameter dict from its weights by flat name: `{"layers/wq": a, "embed": b}` ->
  `{"layers": {"wq": a}, "embed": b}`."""
  params: dict = {"layers": {}}
  for name, value in flat.items():
    if name.startswith("layers/"):
      params["layers"][name[len("layers/"):]] = value
    else:
      params[name] = value
  return params


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """`{"layers/wq": (L, E, H*D), ...}`: the parameter shapes a config implies."""
  abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0)).params)
  return {name: tuple(leaf.shape) for name, leaf in flatten(abstract).items()}


def check_param_shapes(found: dict[str, tuple[int, ...]], config: ModelConfig, where: str,
                       expected: dict[str, tuple[int, ...]] | None = None):
  """Raises a ValueError naming every missing, unexpected or mis-shaped tensor (against
  `expected`, default the float parameters `config` implies)."""
  expected = expected_shapes(config) if expected is None else expected
  missing = sorted(set(expected) - set(found))
  unexpected = sorted(set(found) - set(expected))
  wrong = [f"{name}: expected {expected[name]}, found {tuple(found[name])}"
           for name in sorted(set(expected) & set(found))
           if tuple(found[name]) != expected[name]]
  problems = []
  if missing:
    problems.append(f"missing tensors {missing}")
  if unexpected:
    problems.append(f"unexpected tensors {unexpected}")
  if wrong:
    problems.append("shape mismatch: " + "; ".join(wrong))
  if problems:
    raise ValueError(f"{where} does not match its config ({config.family}, "
                     f"{config.num_layers} layers): " + "; ".join(problems))


def resolve_sharding(sharding, abstract_params: dict) -> dict:
  """A pytree of shardings matching `abstract_params` from any accepted `sharding` argument."""
  if sharding is None:
    device = jax.local_devices()[0]
    return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), abstract_params)
  if isinstance(sharding, jax.sharding.Mesh):
    return _mesh_shardings(sharding, abstract_params)
  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda _: sharding, abstract_params)
  try:
    tree = jax.tree.map(lambda _, s: s, abstract_params, sharding,
                        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  except ValueError as error:
    raise ValueError("sharding must be a Sharding, a Mesh, or a pytree of shardings with the "
                     f"structure of model.params: {error}") from None
  for name, leaf in flatten(tree).items():
    if not isinstance(leaf, jax.sharding.Sharding):
      raise ValueError(f"sharding for {name} is {type(leaf).__name__}, not a jax Sharding")
  return tree


def _mesh_shardings(mesh, abstract_params: dict) -> dict:
  """Shardings from the logical-axis rules of `specjax.sharding` for a `Mesh`."""
  try:
    from specjax import parallel as sharding_lib
  except ImportError:
    raise ValueError("loading onto a Mesh needs specjax.sharding; pass a Sharding or a pytree "
                     "of shardings instead") from None
  return sharding_lib.param_shardings(abstract_params, mesh)


def load(path: str | os.PathLike, sharding=None, dtype=None) -> Model:
  """Restores a model saved with `save`.

  Args:
    path: the checkpoint directory.
    sharding: where the weights go: None (the first local device), one `jax.sharding.Sharding`
      for every leaf, a pytree of shardings with the structure of `model.params`, or a
      `jax.sharding.Mesh` (laid out by the logical-axis rules of `specjax.sharding`). Each device
      reads only its own shards.
    dtype: cast floating-point weights to this dtype while restoring; None keeps the stored dtype.

  Returns:
    The `specjax.Model`.

  Raises:
    FileNotFoundError: `path` is not a directory.
    ValueError: the directory is not a complete specjax checkpoint, is corrupt, or its tensors do
      not match the stored config.
  """
  path = pathlib.Path(path).absolute()
  config = read_config(path)
  params_dir = path / PARAMS_DIR
  if not params_dir.is_dir():
    raise ValueError(f"{path} is not a complete specjax checkpoint: {PARAMS_DIR}/ is missing")
  with _checkpointer() as checkpointer:
    try:
      stored = checkpointer.metadata(params_dir).item_metadata
      stored = flatten(stored.tree if hasattr(stored, "tree") else stored)
    except Exception as error:  # Orbax raises many types for unreadable metadata.
      raise ValueError(f"corrupt checkpoint {params_dir}: cannot read its metadata "
                       f"({type(error).__name__}: {error})") from None
    if not stored:
      raise ValueError(f"corrupt checkpoint {params_dir}: no tensors found")
    abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0)).params)
    quantization = read_quantization(path)
    if quantization is not None:
      abstract = quant.abstract_quantized(abstract, **quantization)
    check_param_shapes({k: tuple(v.shape) for k, v in stored.items()}, config, str(params_dir),
                       expected={name: tuple(leaf.shape) for name, leaf in flatten(abstract).items()})
    shardings = resolve_sharding(sharding, abstract)

    def target(name, leaf, leaf_sharding):
      stored_dtype = jnp.dtype(stored[name].dtype)
      want = stored_dtype
      if (dtype is not None and jnp.issubdtype(stored_dtype, jnp.floating)
          and not name.endswith("/scales")):  # quantization scales stay float32 (the CPU kernel)
        want = jnp.dtype(dtype)
      return jax.ShapeDtypeStruct(leaf.shape, want, sharding=leaf_sharding)

    names = jax.tree_util.tree_map_with_path(lambda kp, _: path_name(kp), abstract)
    abstract_target = jax.tree.map(target, names, abstract, shardings)
    try:
      params = checkpointer.restore(params_dir, abstract_target)
    except Exception as error:
      raise ValueError(f"corrupt checkpoint {params_dir}: restore failed "
                       f"({type(error).__name__}: {error})") from None
  return Model(params, config)



def put(array: np.ndarray, sharding) -> jax.Array:
  if sharding is None:
    return jnp.asarray(array)
  # Each device copies only its own shard from host memory.
  return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])



# ---------------------------------------------------------------------------------------------
# Arbitrary pytrees (train states)

TREE_META_FILE = "specjax_tree.json"
TREE_DIR = "tree"


def save_tree(path: str | os.PathLike, tree, metadata: dict | None = None, *,
              overwrite: bool = False) -> pathlib.Path:
  """Saves any pytree of arrays (e.g. a train state) with a JSON metadata record beside it.

  Args:
    path: the directory to create.
    tree: a pytree of `jax.Array` / NumPy leaves (dicts, lists, tuples, registered dataclasses).
    metadata: JSON-serialisable facts about the tree (configs, step, ...); read back by
      `read_tree_metadata`.
    overwrite: replace an existing directory instead of raising.

  Returns:
    The absolute directory.

  Raises:
    ValueError: `path` exists and `overwrite` is False, or `metadata` is not JSON-serialisable.
  """
  path = pathlib.Path(path).absolute()
  try:
    record = json.dumps({"format_version": FORMAT_VERSION, "metadata": metadata or {}},
                        indent=2, sort_keys=True)
  except TypeError as error:
    raise ValueError(f"save_tree metadata must be JSON-serialisable: {error}") from None
  return _write_checkpoint(path, TREE_DIR, tree, TREE_META_FILE, lambda: record, overwrite)


def read_tree_metadata(path: str | os.PathLike) -> dict:
  """The metadata dict stored by `save_tree` in `path`."""
  path = pathlib.Path(path)
  meta_path = path / TREE_META_FILE
  if not meta_path.is_file():
    raise ValueError(f"{path} is not a complete specjax tree checkpoint: {TREE_META_FILE} is "
                     "missing (an interrupted save?)")
  try:
    record = json.loads(meta_path.read_text())
    version, metadata = record["format_version"], record["metadata"]
  except (json.JSONDecodeError, KeyError, TypeError) as error:
    raise ValueError(f"corrupt {meta_path}: {error!r}") from None
  if version != FORMAT_VERSION:
    raise ValueError(f"{meta_path} has format_version {version}; this specjax reads "
                     f"{FORMAT_VERSION}")
  return metadata


def restore_tree(path: str | os.PathLike, abstract_tree) -> tuple[Any, dict]:
  """Restores a tree saved by `save_tree` into the structure, dtypes and shardings of a target.

  Args:
    path: the directory written by `save_tree`.
    abstract_tree: the pytree to restore into: `jax.ShapeDtypeStruct` leaves (with a `sharding`
      where wanted) or concrete arrays, e.g. `jax.eval_shape(init_state)`.

  Returns:
    `(tree, metadata)`.

  Raises:
    FileNotFoundError: `path` is not a directory.
    ValueError: an incomplete or corrupt checkpoint, or one whose tree does not match.
  """
  path = pathlib.Path(path).absolute()
  if not path.is_dir():
    raise FileNotFoundError(f"no checkpoint directory at {path}")
  metadata = read_tree_metadata(path)
  with _checkpointer() as checkpointer:
    try:
      tree = checkpointer.restore(path / TREE_DIR, abstract_tree)
    except Exception as error:  # Orbax raises many types for a mismatched or unreadable tree.
      raise ValueError(f"cannot restore {path / TREE_DIR}: {type(error).__name__}: {error}"
                       ) from None
  return tree, metadata
