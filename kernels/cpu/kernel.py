"""The CPU layout's small products and attention as hand-written XLA FFI custom calls, built into
one library: `cpu_gemv.cc` (float32 and quantized products; the quantized arithmetic in
`cpu_quant.h`) and `cpu_attention.cc` (its arithmetic in `cpu_attention.h`), sharing
`cpu_common.h` (vectors, the split over XLA's intra-op pool).

A batch-1 decode step on CPU is a chain of about a hundred matrix-vector products that should each
stream their weight at memory bandwidth. XLA:CPU's dot reaches that on one large product but loses
time on every small one (thread hand-offs per op; docs/benchmarks.md, "Why a hand-written CPU
kernel" and "CPU forward"). `cpu_gemv.cc` splits each product's output rows between the caller and
the threads of XLA's own intra-op pool; a block of up to eight input rows (a verify block) reads
each weight once for all of them. The CPU layout's float32 weights are in panels
(`specjax.models.cpu.panels`, target `PANEL_TARGET`): eight rows then cost about what one does, and
any number of rows (a prompt) goes through the same kernel. `matvec` (target `TARGET`) is the
product of a row-major `[out, in]` weight, up to eight rows at a time.

The kernel is compiled on first use with the host's C++ compiler (`$CXX`, else g++ / c++ / clang++),
`-O3 -march=native` (plus the flags in `$SPECJAX_CPU_KERNEL_FLAGS`, e.g. `-mno-avx512f` to build the
AVX2 code paths on a host with AVX-512), against `jax.ffi.include_dir()`, and cached under
`$SPECJAX_CACHE_DIR` (default `~/.cache/specjax`) keyed by the sources, compiler, flags, jaxlib and
CPU, beside the SHA-256 of the built file: a cached library whose bytes do not match it (a truncated
or replaced file) is rebuilt, not loaded. The build and the registration happen once per process,
under a lock. Where it cannot be built (no compiler, not x86-64, no AVX2/FMA) or
`SPECJAX_CPU_KERNELS=0`, `available()` is False, `status()` says why, and the CPU layout uses XLA's
dot: same results up to float32 summation order, only slower. The choice is made once per process,
so set the variable before the first call.

`matvec` lowers to the kernel only on CPU (`lax.platform_dependent`; elsewhere, and for any other
dtype, it is `einsum`), differentiates through `einsum` (`custom_jvp`), and is vmapped one call per
batch element.

`attention_kernel` is a decode step's (or verify block's) attention of up to eight query rows over
the cache and the block: XLA:CPU spends tens of microseconds on each of its two small batched
products per layer; the kernel computes them in one call per layer and skips the cache slots no
query sees (the unfilled end of the buffer). On CPU only, float32, head sizes that are multiples of
8 (`attention_usable`). Its math is `specjax.models.layers.attention_reference`, which the decoder
runs everywhere else (`specjax.models.layers.segment_attention` chooses).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import threading

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = pathlib.Path(__file__).with_name("cpu_gemv.cc")
# Compiled together into one library; the header is part of its cache key.
SOURCES = (SOURCE, SOURCE.with_name("cpu_attention.cc"))
HEADERS = tuple(SOURCE.with_name(name) for name in ("cpu_common.h", "cpu_quant.h",
                                                     "cpu_attention.h"))
TARGET = "specjax_cpu_gemv"
PANEL_TARGET = "specjax_cpu_panel_gemv"
QUANT_TARGET = "specjax_cpu_qgemv"
QUANT_OFFSETS_TARGET = "specjax_cpu_qgemv_offsets"
ATTENTION_TARGET = "specjax_cpu_attention"
_log = logging.getLogger(__name__)


def _compiler() -> str:
  for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
    if candidate and shutil.which(candidate):
      return shutil.which(candidate)
  raise RuntimeError("no C++ compiler found (set CXX)")


def _cpu_signature() -> str:
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return platform.processor()
  lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
  return "\n".join(sorted(set(lines)))


def _cache_dir() -> pathlib.Path:
  base = os.environ.get("SPECJAX_CACHE_DIR")
  if base:
    return pathlib.Path(base)
  return pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "specjax"


def build(source_dir: pathlib.Path | None = None) -> pathlib.Path:
  """Compiles `SOURCES` (or finds them compiled) into one shared library and returns its path.

  `source_dir`: a directory holding files of the same names to build instead (another version of
  the kernel, e.g. for `benchmarks/experiments/kernel_ab.py`); cached under its own key like any
  source."""
  if platform.machine().lower() not in ("x86_64", "amd64"):
    raise RuntimeError(f"the kernel is written for x86-64 (AVX2 + FMA), not {platform.machine()}")
  sources, headers = SOURCES, HEADERS
  if source_dir is not None:
    sources = tuple(pathlib.Path(source_dir) / f.name for f in SOURCES)
    headers = tuple(pathlib.Path(source_dir) / f.name for f in HEADERS)
  cxx = _compiler()
  flags = ["-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-pthread", "-w",
           f"-I{jax.ffi.include_dir()}"]
  flags += os.environ.get("SPECJAX_CPU_KERNEL_FLAGS", "").split()
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
  import jaxlib
  texts = [f.read_text() for f in sources + headers]
  key = hashlib.sha256("\0".join([*texts, cxx, version, *flags, jaxlib.__version__,
                                  _cpu_signature()]).encode()).hexdigest()[:16]
  directory = _cache_dir() / "cpu_kernels"
  library = directory / f"cpu_gemv-{key}.so"
  digest = library.with_name(library.name + ".sha256")
  with _BUILD_LOCK:
    if library.exists() and digest.exists():
      if digest.read_text().strip() == _sha256(library):
        return library
      _log.warning("specjax: %s does not match the SHA-256 recorded when it was built; "
                   "rebuilding it", library)
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".cpu_gemv-{key}.{os.getpid()}.{threading.get_ident()}.so"
    done = subprocess.run([cxx, *flags, *map(str, sources), "-o", str(partial)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
      partial.unlink(missing_ok=True)
      raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
    # The digest first, then the library, each renamed into place atomically: a concurrent build
    # of the same key by another process writes the same bytes; a reader that finds a library
    # whose digest does not match rebuilds instead of loading it.
    partial_digest = partial.with_name(partial.name + ".sha256")
    partial_digest.write_text(_sha256(partial) + "\n")
    os.replace(partial_digest, digest)
    os.replace(partial, library)
    return library


def _sha256(path: pathlib.Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


_BUILD_LOCK = threading.Lock()


def status() -> tuple[bool, str]:
  """(whether the kernel is built and registered, and a line saying where or why not).

  Decided once per process; threads that ask at the same time wait for the first answer (one
  build, one registration)."""
  with _STATUS_LOCK:
    return _status()


_STATUS_LOCK = threading.Lock()


@functools.cache
def _status() -> tuple[bool, str]:
  if os.environ.get("SPECJAX_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
    return False, "disabled by SPECJAX_CPU_KERNELS"
  try:
    library = build()
    register(library)
  except Exception as error:  # noqa: BLE001 - any failure means "use XLA's dot"
    _log.warning("specjax: the CPU matrix-vector kernel is unavailable (%s); XLA's dot is used",
                 error)
    return False, str(error)
  return True, f"built at {library}"


# The library's handlers, by the module attribute that names their FFI target.
_HANDLERS = {"TARGET": "specjax_cpu_gemv", "PANEL_TARGET": "specjax_cpu_panel_gemv",
             "QUANT_TARGET": "specjax_cpu_qgemv",
             "QUANT_OFFSETS_TARGET": "specjax_cpu_qgemv_offsets",
             "ATTENTION_TARGET": "specjax_cpu_attention"}


def register(library: pathlib.Path, suffix: str = "") -> dict[str, str]:
  """Loads a built library and registers its handlers as CPU FFI targets named after them plus
  `suffix` ("" for the library `status()` uses). Returns {module attribute: target name}, what
  `targets` takes."""
  loaded = ctypes.cdll.LoadLibrary(str(library))
  names = {}
  for attribute, symbol in _HANDLERS.items():
    names[attribute] = symbol + suffix
    jax.ffi.register_ffi_target(names[attribute], jax.ffi.pycapsule(getattr(loaded, symbol)),
                                platform="cpu")
  return names


@contextlib.contextmanager
def targets(names: dict[str, str]):
  """Within the block, functions traced call the FFI targets `names` (from `register` with a
  suffix: another build of the kernel) instead of this module's. For comparing two builds in one
  process (`benchmarks/experiments/kernel_ab.py`); clear JAX's caches first
  (`jax.clear_caches()`), or a trace made outside the block is reused."""
  saved = {attribute: globals()[attribute] for attribute in names}
  globals().update(names)
  try:
    yield
  finally:
    globals().update(saved)


def available() -> bool:
  return status()[0]


def usable(x: jax.Array, w: jax.Array) -> bool:
  """Whether `matvec(x, w)` would reach the kernel on CPU (float32, built)."""
  return (x.dtype == jnp.float32 and w.dtype == jnp.float32 and w.ndim == 2
          and x.shape[-1] == w.shape[1] and available())


def _reference(x, w):
  return jnp.einsum("...i,oi->...o", x, w)


def _kernel(x, w):
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[0],), x.dtype)
  return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w)


@jax.custom_jvp
def _matvec(x, w):
  return jax.lax.platform_dependent(x, w, cpu=_kernel, default=_reference)


@_matvec.defjvp
def _matvec_jvp(primals, tangents):
  (x, w), (dx, dw) = primals, tangents
  return _matvec(x, w), _reference(dx, w) + _reference(x, dw)


def matvec(x: jax.Array, w: jax.Array) -> jax.Array:
  """`x [..., in] . w [out, in]^T -> [..., out]`: the kernel on CPU where `usable`, else einsum."""
  if x.shape[-1] != w.shape[-1]:
    raise ValueError(f"matvec: x's last axis {x.shape[-1]} != w's {w.shape[-1]}")
  if not usable(x, w):
    return _reference(x, w)
  return _matvec(x, w)


# ------------------------------------------------------------------------------------------------
# Quantized weights (`specjax.models.quant.QuantizedWeight`): int8 `[out, in]` or packed int4
# `[out, in / 2]` with float32 scales `[out, in / group]` (and, int4 only, optional float32
# offsets `[out, in / group]`), widened and scaled in registers.


def dequantize(values: jax.Array, scales: jax.Array, *, bits: int, group: int,
               dtype=jnp.float32, offsets: jax.Array | None = None) -> jax.Array:
  """The float weight `[..., out, in]` that quantized `values` and `scales` (and `offsets`) stand
  for (the format's reference: see `specjax.models.quant`): `scale * q (+ offset)` per group.
  int4 bytes hold, per run of 32 weights, weight j in the low nibble of byte j and weight j + 16
  in the high nibble, each as q + 8."""
  if bits == 8:
    q = values.astype(dtype)
  else:
    low = (values & 15).astype(jnp.int32) - 8
    high = (values >> 4).astype(jnp.int32) - 8
    shape = values.shape[:-1] + (values.shape[-1] // 16, 16)
    q = jnp.concatenate([low.reshape(shape), high.reshape(shape)], axis=-1)
    q = q.reshape(values.shape[:-1] + (2 * values.shape[-1],)).astype(dtype)
  n = q.shape[-1]
  grouped = q.reshape(q.shape[:-1] + (n // group, group)) * scales[..., None].astype(dtype)
  if offsets is not None:
    grouped = grouped + offsets[..., None].astype(dtype)
  return grouped.reshape(q.shape)


def quantize_rows(x: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
  """Rows of x quantized per group of `group` columns, as the kernel does: int8 `[..., in]`
  (round half to even of `x * (127 / max|x|)`) and float32 scales `[..., in / group]`
  (`max|x| / 127`)."""
  grouped = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // group, group))
  top = jnp.max(jnp.abs(grouped), axis=-1)
  inverse = jnp.where(top > 0, jnp.float32(127.0) / jnp.where(top > 0, top, 1.0), 0.0)
  q = jnp.clip(jnp.round(grouped * inverse[..., None]), -127, 127).astype(jnp.int8)
  return q.reshape(x.shape), top / jnp.float32(127.0)


def quant_reference(x: jax.Array, values: jax.Array, scales: jax.Array, *, bits: int,
                    group: int, offsets: jax.Array | None = None) -> jax.Array:
  """The CPU product of a quantized weight, in jnp (the kernel's oracle): the rows of x quantized
  per group (`quantize_rows`), exact integer dot products per group, scaled by weight scale x row
  scale and summed; with `offsets`, plus each group's offset times the quantized row's sum over
  the group (integer sum x row scale). `[..., in] -> [..., out]` float32."""
  xq, xs = quantize_rows(x, group)
  n = x.shape[-1]
  wq = dequantize(values, jnp.ones_like(scales), bits=bits, group=group, dtype=jnp.int32)
  wq = wq.reshape(wq.shape[:-1] + (n // group, group))  # [out, G, g]
  xg = xq.astype(jnp.int32).reshape(xq.shape[:-1] + (n // group, group))  # [..., G, g]
  dots = jnp.einsum("...gi,ogi->...og", xg, wq, preferred_element_type=jnp.int32)
  out = jnp.sum(dots.astype(jnp.float32) * (scales * xs[..., None, :]), axis=-1)
  if offsets is not None:
    xsum = jnp.sum(xg, axis=-1).astype(jnp.float32) * xs  # [..., G]
    out = out + jnp.einsum("...g,og->...o", xsum, offsets)
  return out


def dequant_product(x: jax.Array, values: jax.Array, scales: jax.Array, *, bits: int,
                    group: int, offsets: jax.Array | None = None) -> jax.Array:
  """The TPU/GPU product of a quantized weight: `x . dequantize(values, scales, offsets)^T` with
  float activations (XLA fuses the convert and scale into the dot's operand). Also its derivative
  everywhere."""
  w = dequantize(values, scales, bits=bits, group=group, dtype=x.dtype, offsets=offsets)
  return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)


def quant_usable(x: jax.Array, bits: int, group: int) -> bool:
  """Whether `quant_matvec` would reach the kernel on CPU for this input."""
  return x.dtype == jnp.float32 and bits in (4, 8) and group % 32 == 0 and available()


def _quant_kernel(x, values, scales, offsets, *, bits, group):
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (values.shape[0],), jnp.float32)
  if offsets is None:
    return jax.ffi.ffi_call(QUANT_TARGET, out, vmap_method="sequential")(
        x, values, scales, bits=bits, group=group)
  return jax.ffi.ffi_call(QUANT_OFFSETS_TARGET, out, vmap_method="sequential")(
      x, values, scales, offsets, bits=bits, group=group)


def _reference_with(x, values, scales, offsets, *, bits, group):
  return quant_reference(x, values, scales, bits=bits, group=group, offsets=offsets)


def _dequant_with(x, values, scales, offsets, *, bits, group):
  return dequant_product(x, values, scales, bits=bits, group=group, offsets=offsets)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def _quant_matvec(x, values, scales, offsets, bits, group, kernel):
  cpu = functools.partial(_quant_kernel if kernel else _reference_with, bits=bits, group=group)
  default = functools.partial(_dequant_with, bits=bits, group=group)
  return jax.lax.platform_dependent(x, values, scales, offsets, cpu=cpu, default=default)


@_quant_matvec.defjvp
def _quant_matvec_jvp(bits, group, kernel, primals, tangents):
  (x, values, scales, offsets), (dx, _, dscales, doffsets) = primals, tangents
  out = _quant_matvec(x, values, scales, offsets, bits, group, kernel)
  grad = (dequant_product(dx, values, scales, bits=bits, group=group, offsets=offsets)
          + dequant_product(x, values, dscales, bits=bits, group=group))
  if offsets is not None:  # each offset multiplies its group's sum of x
    sums = jnp.sum(x.reshape(x.shape[:-1] + (x.shape[-1] // group, group)), axis=-1)
    grad = grad + jnp.einsum("...g,og->...o", sums, doffsets,
                             preferred_element_type=jnp.float32)
  return out, grad


def quant_matvec(x: jax.Array, values: jax.Array, scales: jax.Array, *, bits: int,
                 group: int, offsets: jax.Array | None = None) -> jax.Array:
  """`x [..., in]` times a quantized `[out, in]` weight -> `[..., out]` float32.

  On CPU the rows of x are quantized per group as well and the dot products are integer
  (`quant_reference`): the kernel where `quant_usable` (the weight is read at its narrow width),
  else the same arithmetic in jnp. On TPU/GPU the weight is dequantized inside the dot and x stays
  float (`dequant_product`). Derivatives follow `dequant_product`. `values` int8 `[out, in]`
  (bits 8) or uint8 `[out, in / 2]` (bits 4); `scales` float32 `[out, in / group]`; `offsets`
  None or (bits 4) float32 `[out, in / group]`."""
  if offsets is not None and bits != 4:
    raise ValueError(f"offsets need bits 4, got bits {bits}")
  return _quant_matvec(x, values, scales, offsets, bits, group, quant_usable(x, bits, group))


# ------------------------------------------------------------------------------------------------
# Attention of a few query rows over a cache and the block (a decode step, a verify block).


def attention_usable(q, keys) -> bool:
  """Whether `attention_kernel` takes these inputs on CPU: two segments (a cache and a block),
  float32, a head size that is a multiple of 8, and at most `8` query rows (`B * T`), as a decode
  step or a verify block has."""
  return (len(keys) == 2 and all(a.dtype == jnp.float32 for a in (q, *keys))
          and q.shape[-1] % 8 == 0 and q.shape[0] * q.shape[1] <= 8 and available())


def attention_kernel(q, keys, values, masks, *, scale: float, softcap: float | None):
  """`specjax.models.layers.attention_reference`'s result through the kernel (CPU only; see
  `attention_usable`). Not differentiable (decode only; training runs the cache-free forward)."""
  b, t, kvh, g, d = q.shape
  out = jax.ShapeDtypeStruct((b, kvh, g, t, d), jnp.float32)
  (k0, k1), (v0, v1) = keys, values
  return jax.ffi.ffi_call(ATTENTION_TARGET, out, vmap_method="sequential")(
      q, k0, v0, k1, v1, jnp.concatenate(masks, axis=-1), scale=np.float32(scale),
      softcap=np.float32(softcap or 0.0))

