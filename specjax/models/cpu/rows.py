"""The row-major layout of a float CPU weight: `RowMajorWeight`, an `[out, in]` matrix read by
XLA's dot, or by the kernel's row-major product (`specjax_cpu_gemv`, `cpu_gemv.cc`) for blocks of
up to `KERNEL_ROWS` rows where the model uses the kernel.

The CPU layout (`specjax.models.cpu.layout`) keeps its fused projections this way where the kernel
is not built; where it is, in panels (`specjax.models.cpu.panels.PanelWeight`). Its own leaf type
tells it apart from a canonical float projection, which lies `[in, out]`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.cpu import kernel as cpu_gemv

# Blocks of up to this many rows (B * T) go through the kernel when the model uses it: every weight
# is read once for all rows (the kernel's own limit per pass).
KERNEL_ROWS = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowMajorWeight:
  """A float `[out, in]` matrix stored row-major (a pytree: `w` is its one leaf).

  Attributes:
    w: `[out, in]`.
  """

  w: jax.Array

  @property
  def shape(self) -> tuple[int, int]:
    """The matrix's shape, `[out, in]`."""
    return self.w.shape

  @property
  def dtype(self):
    return self.w.dtype

  def dense(self) -> jax.Array:
    """The `[out, in]` matrix."""
    return self.w

  def __array__(self, dtype=None, copy=None):
    """numpy's view: the `[out, in]` matrix."""
    w = np.asarray(self.w)
    return w if dtype is None else w.astype(dtype)

  def matmul(self, x: jax.Array, kernel: bool = False) -> jax.Array:
    """`x [..., in] -> [..., out]`: with `kernel`, the kernel for a block of up to `KERNEL_ROWS`
    rows (where it is usable, else `einsum`); otherwise XLA's dot."""
    if kernel and math.prod(x.shape[:-1]) <= KERNEL_ROWS:
      return cpu_gemv.matvec(x, self.w)
    return jnp.einsum("...i,oi->...o", x, self.w)


def is_rows(w) -> bool:
  return isinstance(w, RowMajorWeight)
