"""Dequantization of GGML tensor types (the block formats of GGUF files), vectorised in NumPy.

Every function takes the raw bytes of a tensor as a `[n_blocks, type_size]` uint8 array and returns
`[n_blocks, block_size]` float32 values; `dequantize` wraps them for whole tensors and casts to the
requested dtype. The arithmetic is float32 throughout, in the order ggml's reference C code uses
(`(d * scale) * q - (dmin * min)`), so the results equal llama.cpp's and `gguf.quants.dequantize`
bit for bit. Nothing passes through float64.

Block layouts (bytes, little-endian; `d`, `m`, `dmin` are float16):

| type | block | bytes | layout |
|---|---|---|---|
| Q8_0 | 32 | 34 | d, 32 x int8 |
| Q4_0 | 32 | 18 | d, 16 bytes: low nibbles = values 0..15, high nibbles = 16..31; q - 8 |
| Q4_1 | 32 | 20 | d, m, 16 bytes of nibbles as Q4_0; d * q + m |
| Q5_0 | 32 | 22 | d, 32-bit high bits, nibbles as Q4_0; q - 16 |
| Q5_1 | 32 | 24 | d, m, 32-bit high bits, nibbles |
| Q4_K | 256 | 144 | d, dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of nibbles |
| Q5_K | 256 | 176 | as Q4_K plus 32 bytes of high bits before the nibbles |
| Q6_K | 256 | 210 | 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, d |
"""

from __future__ import annotations

import numpy as np

# type name -> (values per block, bytes per block)
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18),
          "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q4_K": (256, 144),
          "Q5_K": (256, 176), "Q6_K": (256, 210)}
SUPPORTED_TYPES = tuple(BLOCKS)


def _f16(raw: np.ndarray) -> np.ndarray:
  """`[n, 2]` bytes -> `[n, 1]` float32 of the little-endian float16 they hold."""
  return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
  """`[n, k]` bytes -> `[n, 2k]` uint8: the k low nibbles, then the k high nibbles."""
  return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
  """`[n, count // 8]` bytes -> `[n, count]` uint8 bits; bit j of the little-endian word."""
  return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")[:, :count]


def q8_0(raw):
  out = np.empty((raw.shape[0], 32), np.float32)  # one pass: int8 * f32 straight into out
  return np.multiply(raw[:, 2:].view(np.int8), _f16(raw[:, :2]), out=out)


def q4_0(raw):
  q = _nibbles(raw[:, 2:]).astype(np.int8) - np.int8(8)
  return _f16(raw[:, :2]) * q.astype(np.float32)


def q4_1(raw):
  q = _nibbles(raw[:, 4:]).astype(np.float32)
  return _f16(raw[:, :2]) * q + _f16(raw[:, 2:4])


def q5_0(raw):
  q = _nibbles(raw[:, 6:]) | (_high_bits(raw[:, 2:6], 32) << np.uint8(4))
  return _f16(raw[:, :2]) * (q.astype(np.int8) - np.int8(16)).astype(np.float32)


def q5_1(raw):
  q = _nibbles(raw[:, 8:]) | (_high_bits(raw[:, 4:8], 32) << np.uint8(4))
  return _f16(raw[:, :2]) * q.astype(np.float32) + _f16(raw[:, 2:4])


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block: `[n, 12]` -> two `[n, 8]` uint8.

  Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; scales/mins 4-7 take their low
  4 bits from the nibbles of bytes 8-11 and their top 2 bits from the top of bytes 0-3 / 4-7.
  """
  low, mid, top = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
  scales = np.concatenate([low & 63, (top & 0x0F) | ((low >> 6) << 4)], axis=-1)
  mins = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
  return scales, mins


def _k_quant(raw, q):
  """`(d * scale) * q - (dmin * min)` over eight sub-blocks of 32, q `[n, 8, 32]`."""
  n = raw.shape[0]
  scales, mins = _k_scales(raw[:, 4:16])
  d = (_f16(raw[:, :2]) * scales.astype(np.float32))[:, :, None]
  dm = (_f16(raw[:, 2:4]) * mins.astype(np.float32))[:, :, None]
  out = q.astype(np.float32)  # the same two float32 operations, in place: one buffer, not three
  np.multiply(out, d, out=out)
  np.subtract(out, dm, out=out)
  return out.reshape(n, 256)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
  """128 bytes -> `[n, 8, 32]`: chunk i of 32 bytes gives sub-block 2i (low) and 2i+1 (high)."""
  n = qs.shape[0]
  chunks = qs.reshape(n, 4, 1, 32)
  return np.concatenate([chunks & np.uint8(0x0F), chunks >> np.uint8(4)], axis=2).reshape(n, 8, 32)


def q4_k(raw):
  return _k_quant(raw, _k_nibbles(raw[:, 16:144]))


def q5_k(raw):
  n = raw.shape[0]
  # qh[l] bit j is the fifth bit of value l of sub-block j.
  high = np.unpackbits(np.ascontiguousarray(raw[:, 16:48]), axis=-1, bitorder="little")
  high = high.reshape(n, 32, 8).transpose(0, 2, 1)  # [n, sub-block, l]
  return _k_quant(raw, _k_nibbles(raw[:, 48:176]) | (high << np.uint8(4)))


def q6_k(raw):
  n = raw.shape[0]
  ql = raw[:, :128].reshape(n, 2, 2, 32)  # [n, half, (l, l+32), 32]
  qh = raw[:, 128:192].reshape(n, 2, 1, 32)  # [n, half, 1, 32]
  shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
  high = (qh >> shifts) & np.uint8(3)  # [n, half, 4, 32]: values l, l+32, l+64, l+96
  low = np.concatenate([ql & np.uint8(0x0F), ql >> np.uint8(4)], axis=2)  # same order
  q = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, 16, 16)
  scales = raw[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]: one per 16 values
  d = (_f16(raw[:, 208:210]) * scales)[:, :, None]
  out = q.astype(np.float32)
  np.multiply(out, d, out=out)
  return out.reshape(n, 256)


_BLOCK_FUNCTIONS = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1,
                    "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...], dtype,
               name: str = "tensor") -> np.ndarray:
  """The values of one GGUF tensor.

  Args:
    data: the tensor's bytes as the GGUF reader maps them (any shape, uint8 or the float type).
    type_name: the GGML type name ("Q4_K", "F16", ...).
    shape: the logical NumPy shape (row-major: GGUF's dimensions reversed).
    dtype: the output dtype.
    name: the tensor's name, for messages.

  Returns:
    A `shape` array of `dtype`.

  Raises:
    ValueError: an unsupported type, or a byte count that does not match `shape`.
  """
  dtype = np.dtype(dtype)
  if type_name not in BLOCKS:
    raise ValueError(f"GGUF tensor {name} has type {type_name}, which specjax cannot dequantize "
                     f"(supported: {', '.join(SUPPORTED_TYPES)})")
  block, size = BLOCKS[type_name]
  count = int(np.prod(shape))
  raw = np.asarray(data).reshape(-1).view(np.uint8)
  if count % block or raw.size != count // block * size:
    raise ValueError(f"GGUF tensor {name}: {raw.size} bytes of {type_name} do not hold shape "
                     f"{tuple(shape)}")
  if type_name == "F32":
    return raw.view(np.float32).reshape(shape).astype(dtype, copy=False)
  if type_name == "F16":
    return raw.view(np.float16).reshape(shape).astype(dtype)
  if type_name == "BF16":
    bits = raw.view(np.uint16).astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32).reshape(shape).astype(dtype, copy=False)
  values = _BLOCK_FUNCTIONS[type_name](raw.reshape(-1, size))  # [n_blocks, block] float32
  return values.reshape(shape).astype(dtype, copy=False)
