"""The CPU layout's small products as a hand-written kernel: an XLA FFI custom call (`cpu_gemv.cc`).

A batch-1 decode step on CPU is a chain of about a hundred matrix-vector products that should each
stream their weight at memory bandwidth. XLA:CPU's dot reaches that on one large product but loses
time on every small one (thread hand-offs per op): on SmolLM2-135M's shapes the 30 layers' products
took 17.5 ms (24 GB/s) where the machine reads 32.8 GB/s; the kernel takes 15.4 ms
(`benchmarks/cpu_forward.py`). `cpu_gemv.cc` splits each product's output rows between the caller
and the threads of XLA's own intra-op pool; a block of up to eight input rows (a verify block)
reads each weight once for all of them.

The kernel is compiled on first use with the host's C++ compiler (`$CXX`, else g++ / c++ /
clang++), `-O3 -march=native`, against `jax.ffi.include_dir()`, and cached under
`$SPECJAX_CACHE_DIR` (default `~/.cache/specjax`) keyed by the source, compiler, flags, jaxlib and
CPU. Where it cannot be built (no compiler, not x86-64, no AVX2/FMA) or `SPECJAX_CPU_KERNELS=0`,
`available()` is False, `status()` says why, and the CPU layout uses XLA's dot: same results up to
float32 summation order, only slower. The choice is made once per process, so set the variable
before the first call.

`matvec` lowers to the kernel only on CPU (`lax.platform_dependent`; elsewhere, and for any other
dtype, it is `einsum`), differentiates through `einsum` (`custom_jvp`), and is vmapped one call per
batch element.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess

import jax
import jax.numpy as jnp

SOURCE = pathlib.Path(__file__).with_name("cpu_gemv.cc")
TARGET = "specjax_cpu_gemv"
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


def build() -> pathlib.Path:
  """Compiles `cpu_gemv.cc` (or finds it compiled) and returns the shared library's path."""
  if platform.machine().lower() not in ("x86_64", "amd64"):
    raise RuntimeError(f"the kernel is written for x86-64 (AVX2 + FMA), not {platform.machine()}")
  cxx = _compiler()
  flags = ["-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-pthread", "-w",
           f"-I{jax.ffi.include_dir()}"]
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
  import jaxlib
  key = hashlib.sha256("\0".join([SOURCE.read_text(), cxx, version, *flags, jaxlib.__version__,
                                  _cpu_signature()]).encode()).hexdigest()[:16]
  directory = _cache_dir() / "cpu_kernels"
  library = directory / f"cpu_gemv-{key}.so"
  if library.exists():
    return library
  directory.mkdir(parents=True, exist_ok=True)
  partial = directory / f".cpu_gemv-{key}.{os.getpid()}.so"
  done = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(partial)], capture_output=True,
                        text=True, timeout=600)
  if done.returncode != 0:
    partial.unlink(missing_ok=True)
    raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
  os.replace(partial, library)  # atomic: a concurrent build of the same key is harmless
  return library


@functools.cache
def status() -> tuple[bool, str]:
  """(whether the kernel is built and registered, and a line saying where or why not)."""
  if os.environ.get("SPECJAX_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
    return False, "disabled by SPECJAX_CPU_KERNELS"
  try:
    library = build()
    handler = ctypes.cdll.LoadLibrary(str(library)).specjax_cpu_gemv
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
  except Exception as error:  # noqa: BLE001 - any failure means "use XLA's dot"
    _log.warning("specjax: the CPU matrix-vector kernel is unavailable (%s); XLA's dot is used",
                 error)
    return False, str(error)
  return True, f"built at {library}"


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
