"""A fast reader of the GGUF container: metadata, tensor directory, memory-mapped tensor bytes.

`gguf.GGUFReader` builds a NumPy memmap view for every element of every metadata array, which
takes tens of seconds on a 262k-token vocabulary (Gemma 3). This reader parses the same header
(GGUF v2/v3, little-endian) in one pass over the bytes, returns plain Python values, and maps the
tensor data without copying. Type names come from `gguf.GGMLQuantizationType`.

Layout: magic "GGUF", u32 version, u64 tensor count, u64 metadata count, then the metadata
(key string, u32 value type, value), the tensor infos (name, u32 n_dims, u64 dims fastest-first,
u32 ggml type, u64 offset) and, at the next multiple of `general.alignment` (default 32), the data.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pathlib
import struct

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor of a GGUF file.

  Attributes:
    name: e.g. "blk.0.attn_q.weight".
    type_name: the GGML type ("F32", "Q4_K", ...).
    shape: the NumPy (row-major) shape, GGUF's dimensions reversed: `[out, in]` for a matrix.
    data: the raw bytes, memory-mapped (uint8).
  """

  name: str
  type_name: str
  shape: tuple[int, ...]
  data: np.ndarray


class GGUFFile:
  """A parsed GGUF file: `metadata` (key -> value) and `tensors` (name -> `TensorInfo`)."""

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    if not self.path.is_file():
      raise FileNotFoundError(f"no GGUF file at {self.path}")
    with open(self.path, "rb") as stream:
      try:
        self._map = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
      except ValueError:  # an empty file cannot be mapped
        raise ValueError(f"{self.path} is not a GGUF file (empty)") from None
    try:
      self._parse()
    except (struct.error, IndexError, UnicodeDecodeError, KeyError) as error:
      raise ValueError(f"{self.path} is not a readable GGUF file (truncated or corrupt header: "
                       f"{type(error).__name__}: {error})") from None

  def _parse(self):
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    buf = self._map
    if buf[:4] != b"GGUF":
      raise ValueError(f"{self.path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
      raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
    self.version = version
    self._pos = 24
    self.metadata: dict = {}
    for _ in range(kv_count):
      key = self._string()
      self.metadata[key] = self._value(self._unpack("<I"))
    infos = []
    for _ in range(tensor_count):
      name = self._string()
      n_dims = self._unpack("<I")
      dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
      self._pos += 8 * n_dims
      kind, offset = self._unpack("<I"), self._unpack("<Q")
      infos.append((name, dims, kind, offset))
    alignment = int(self.metadata.get("general.alignment", 32))
    start = -(-self._pos // alignment) * alignment
    whole = np.frombuffer(buf, np.uint8)
    self.tensors: dict[str, TensorInfo] = {}
    for name, dims, kind, offset in infos:
      try:
        qtype = GGMLQuantizationType(kind)
      except ValueError:
        raise ValueError(f"{self.path}: tensor {name} has unknown GGML type id {kind}") from None
      block, size = GGML_QUANT_SIZES[qtype]
      count = int(np.prod(dims))
      nbytes = count // block * size
      begin = start + offset
      if begin + nbytes > len(buf):
        raise ValueError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
      self.tensors[name] = TensorInfo(name, qtype.name, tuple(int(d) for d in reversed(dims)),
                                      whole[begin:begin + nbytes])

  def _unpack(self, fmt: str):
    value, = struct.unpack_from(fmt, self._map, self._pos)
    self._pos += struct.calcsize(fmt)
    return value

  def _string(self) -> str:
    length = self._unpack("<Q")
    text = self._map[self._pos:self._pos + length].decode("utf-8", errors="replace")
    self._pos += length
    return text

  def _value(self, kind: int):
    if kind == _STRING:
      return self._string()
    if kind == _ARRAY:
      item, count = self._unpack("<I"), self._unpack("<Q")
      if item == _STRING:
        return [self._string() for _ in range(count)]
      if item in _NUMPY:
        values = np.frombuffer(self._map, _NUMPY[item], count, self._pos)
        self._pos += values.nbytes
        return values.tolist() if count <= 64 else values.copy()
      return [self._value(item) for _ in range(count)]
    if kind not in _SCALARS:
      raise ValueError(f"{self.path}: unknown GGUF metadata value type {kind}")
    value = self._unpack(_SCALARS[kind])
    if kind == 6:  # float32: the shortest decimal that round-trips (1e-05, not 9.99999974e-06)
      value = float(str(np.float32(value)))
    return value

  def get(self, key: str, default=None):
    return self.metadata.get(key, default)
