"""Memory-mapped reading of `.safetensors` files (single or sharded checkpoints), and of the JSON
files beside them."""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np

# Hugging Face dtype names in safetensors headers -> numpy dtypes (bfloat16 via ml_dtypes).
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                       "BOOL": "bool"}


class SafetensorsFiles:
  """Zero-copy, memory-mapped access to the tensors of one or more `.safetensors` files.

  The `safetensors` package validates each file and lists its tensors; the arrays themselves are
  read through `numpy.memmap` so that bfloat16 (which NumPy's safetensors backend cannot return)
  maps onto `ml_dtypes.bfloat16` without a copy or a detour through another framework.
  """

  def __init__(self, files: list[pathlib.Path]):
    from safetensors import safe_open

    self._where: dict[str, tuple[pathlib.Path, str, tuple[int, ...], int, int]] = {}
    self._maps: dict[pathlib.Path, np.memmap] = {}
    for file in files:
      if not file.is_file():
        raise ValueError(f"safetensors file {file} is missing")
      try:
        with safe_open(str(file), framework="numpy") as handle:
          listed = set(handle.keys())
        with open(file, "rb") as stream:
          header_len = int.from_bytes(stream.read(8), "little")
          header = json.loads(stream.read(header_len))
      except Exception as error:  # SafetensorError, JSON, OS errors: all mean the same here.
        raise ValueError(f"corrupt safetensors file {file}: {error}") from None
      data_start = 8 + header_len
      for name, entry in header.items():
        if name == "__metadata__":
          continue
        if name not in listed or entry["dtype"] not in _SAFETENSORS_DTYPES:
          raise ValueError(f"{file}: tensor {name} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        self._where[name] = (file, entry["dtype"], tuple(entry["shape"]), data_start + begin,
                             data_start + end)

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def names(self) -> list[str]:
    return list(self._where)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._where[name][2]

  def dtype(self, name: str) -> np.dtype:
    return jnp.dtype(_SAFETENSORS_DTYPES[self._where[name][1]])

  def get(self, name: str) -> np.ndarray:
    file, dtype, shape, begin, end = self._where[name]
    if file not in self._maps:
      self._maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
    return self._maps[file][begin:end].view(self.dtype(name)).reshape(shape)


def read_json(path: pathlib.Path):
  """The parsed JSON file `path`; a ValueError naming it when it is corrupt."""
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as error:
    raise ValueError(f"corrupt {path}: {error}") from None


def safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
  index = path / "model.safetensors.index.json"
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
      raise ValueError(f"corrupt {index}: {error!r}") from None
    return [path / name for name in sorted(set(weight_map.values()))]
  single = path / "model.safetensors"
  if single.is_file():
    return [single]
  found = sorted(path.glob("*.safetensors"))
  if found:
    return found
  other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pth"))
  hint = f" (found {other}: re-save with safe_serialization=True)" if other else ""
  raise ValueError(f"no safetensors weights in {path}{hint}")

