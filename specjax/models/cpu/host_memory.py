"""Host memory for CPU weights: 2 MiB pages where Linux offers them.

A model in the CPU layout (`Model.for_platform("cpu")`, `specjax.models.cpu.layout`) and a quantized
copy of it (`specjax.quantize`) keep their weights in huge pages (`on_huge_pages`); their values
and everything else stay as they are.
"""

from __future__ import annotations

import mmap
import sys
import weakref

import jax
import numpy as np

HUGE_PAGE = 2 << 20


def on_huge_pages(x):
  """`x` (a single-device CPU array of at least `HUGE_PAGE` bytes) copied into memory that Linux is
  asked to back with 2 MiB pages (transparent huge pages, `madvise(MADV_HUGEPAGE)`); anything else
  (a traced array inside a caller's jit included), or on a host without them, `x` itself. Same
  values either way.

  Why: a verify block's products do much arithmetic per weight load (several rows of x), so the
  weight stream must keep arriving while the cores multiply. In 4 KiB pages every page of every
  weight row is a TLB miss, and the hardware prefetchers stop at each page's end; in 2 MiB pages
  neither happens. XLA's CPU allocator takes ordinary pages (under the common `madvise` setting of
  /sys/kernel/mm/transparent_hugepage/enabled). The gain is on verify blocks; a one-row step
  barely changes (docs/benchmarks.md, "Weights in 2 MiB pages").

  The copy is handed to JAX without a further copy (`jax.device_put` aliases a suitably aligned
  host buffer on CPU); the array keeps the mapping alive, and it is unmapped when the array is
  freed."""
  if (not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or x.nbytes < HUGE_PAGE
      or not sys.platform.startswith("linux")
      or not hasattr(mmap, "MADV_HUGEPAGE") or len(x.devices()) != 1
      or next(iter(x.devices())).platform != "cpu" or x.is_deleted()):
    return x
  if _PLACED.get(id(x)) is x:  # already placed here: no second copy
    return x
  host = np.asarray(x)
  copy = empty(host.shape, host.dtype)
  if copy is None:
    return x
  copy[...] = host
  return place(copy, x.sharding)


def empty(shape, dtype) -> np.ndarray | None:
  """An uninitialised numpy array in memory Linux is asked to back with 2 MiB pages, or None where
  that cannot be had (fill it, then `place` it)."""
  if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
    return None
  count = int(np.prod(shape))
  size = -(-max(count * np.dtype(dtype).itemsize, 1) // HUGE_PAGE) * HUGE_PAGE
  try:
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
  except (OSError, ValueError):
    return None
  return np.frombuffer(buffer, dtype, count=count).reshape(shape)


def place(host: np.ndarray, sharding=None) -> jax.Array:
  """A filled array from `empty` handed to JAX without a copy (remembered, so that
  `on_huge_pages` does not copy it again)."""
  out = jax.device_put(host, sharding, may_alias=True)
  _PLACED[id(out)] = out
  return out


_PLACED: "weakref.WeakValueDictionary[int, jax.Array]" = weakref.WeakValueDictionary()


def weights_on_huge_pages(params):
  """`on_huge_pages` over every array of a parameter tree (quantized weights' leaves included)."""
  return jax.tree.map(on_huge_pages, params)
