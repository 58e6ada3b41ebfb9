"""The panel layout of a float32 CPU weight: `PanelWeight`, read by the kernel's
`specjax_cpu_panel_gemv` (`cpu_gemv.cc`).

A weight `W [out, in]` is kept as panels of `PANEL` output columns, `panels[g, i, p] = W[g * PANEL
+ p, i]` (the last panel zero-padded): each panel is one contiguous stream, and every input column
gives whole vectors of outputs, which the kernel multiplies by each row of x broadcast. A block of
up to eight rows (a verify block) then costs about what one row does: the weight stream and the
arithmetic overlap, which the row-major layout's dot products did not manage (docs/benchmarks.md,
"Float32 weights in panels"). Any number of rows goes through the same kernel (a
prompt: each panel against every block of eight rows while it is in cache), so the layout needs no
second, row-major copy for XLA's dot.

Where the kernel is not built, or off CPU, the product is `einsum` over the panels (correct, but
XLA copies the weight into its own layout on every call): the CPU layout only uses panels where the
kernel is available (`specjax.models.cpu.layout.fuse_layer`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.cpu import host_memory
from specjax.models.cpu import rows
from specjax.kernels.cpu import kernel

PANEL = 48  # output columns per panel: `kPanel` in cpu_gemv.cc


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PanelWeight:
  """A float32 `[out, in]` matrix in the panel layout (a pytree: `panels` is its one leaf).

  Also a table of rows (`w[ids]`): a tied embedding in the CPU layout is one `PanelWeight`,
  looked up by token and read by the kernel as the output projection.

  Attributes:
    panels: `[ceil(out / PANEL), in, PANEL]`, `panels[g, i, p] = W[g * PANEL + p, i]`, zero past
      `out`.
    out: the matrix's output size (static).
  """

  panels: jax.Array
  out: int = dataclasses.field(metadata=dict(static=True))

  @property
  def in_features(self) -> int:
    return self.panels.shape[1]

  @property
  def shape(self) -> tuple[int, int]:
    """The matrix's shape, `[out, in]`."""
    return (self.out, self.in_features)

  @property
  def dtype(self):
    return self.panels.dtype

  @property
  def nbytes(self) -> int:
    return int(self.panels.nbytes)

  def dense(self) -> jax.Array:
    """The `[out, in]` matrix."""
    w = jnp.swapaxes(self.panels, 1, 2).reshape(-1, self.in_features)
    return w[:self.out]

  def __getitem__(self, ids) -> jax.Array:
    """Rows `ids` (integer ids, any shape) of the `[out, in]` matrix, `ids.shape + (in,)`: a tied
    embedding in panels is also the lookup table."""
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"PanelWeight rows are taken by integer ids, got {ids.dtype}")
    return self.panels[ids // PANEL, :, ids % PANEL]

  @property
  def T(self) -> jax.Array:  # noqa: N802 - the array attribute it stands in for
    """`[in, out]`, a new array (the layout has no transposed copy)."""
    return self.dense().T

  def __array__(self, dtype=None, copy=None):
    """numpy's view: the dense `[out, in]` matrix (a new array)."""
    w = np.asarray(self.dense())
    return w if dtype is None else w.astype(dtype)

  def astype(self, dtype):
    """Itself for float32; else the dense matrix in `dtype`."""
    return self if jnp.dtype(dtype) == self.dtype else self.dense().astype(dtype)

  def matmul(self, x: jax.Array, kernel: bool = True) -> jax.Array:
    """`x [..., in] -> [..., out]`: the kernel on CPU where it is built (and `kernel`), else
    `einsum` over the panels."""
    if x.shape[-1] != self.in_features:
      raise ValueError(f"x's last axis {x.shape[-1]} != the weight's input size "
                       f"{self.in_features}")
    if not (kernel and usable(x, self.panels)):
      return reference(x, self.panels, self.out)
    return _matvec(x, self.panels, self.out)


def pack(w) -> PanelWeight:
  """A float `[out, in]` matrix (a numpy or JAX array, or a transposed view of one) -> its panels
  (float32, computed in numpy into one new buffer, in 2 MiB pages where Linux offers them:
  `specjax.models.cpu.host_memory`). A traced matrix (inside a caller's `jax.jit`: a model built
  there from traced weights) is packed in jnp, the same panels, as the caller's program's own
  buffer."""
  if isinstance(w, jax.core.Tracer):
    return _pack_traced(w)
  w = np.asarray(w, dtype=np.float32)
  if w.ndim != 2:
    raise ValueError(f"pack needs a 2-D [out, in] matrix, got shape {w.shape}")
  out, n = w.shape
  groups = -(-out // PANEL)
  shape = (groups, n, PANEL)
  huge = (host_memory.empty(shape, np.float32)
          if groups * n * PANEL * 4 >= host_memory.HUGE_PAGE else None)
  panels = np.empty(shape, np.float32) if huge is None else huge
  full = out // PANEL
  panels[:full] = w[:full * PANEL].reshape(full, PANEL, n).transpose(0, 2, 1)
  if full < groups:
    panels[full] = 0.0
    panels[full, :, :out - full * PANEL] = w[full * PANEL:].T
  return PanelWeight(jnp.asarray(panels) if huge is None else host_memory.place(panels), out)


def _pack_traced(w) -> PanelWeight:
  """`pack` in jnp. From `w.T` (`[in, out]`, the canonical layout: the transpose a caller took
  to pass `[out, in]` cancels against this one), zero-padded to whole panels: `[in, groups,
  PANEL]` -> `[groups, in, PANEL]`, a transpose that moves runs of `PANEL` contiguous floats
  (an element-wise transpose of `[groups, PANEL, in]` took several times as long on XLA:CPU)."""
  if w.ndim != 2:
    raise ValueError(f"pack needs a 2-D [out, in] matrix, got shape {w.shape}")
  out, n = w.shape
  groups = -(-out // PANEL)
  columns = jnp.pad(jnp.swapaxes(w, 0, 1).astype(jnp.float32), ((0, 0), (0, groups * PANEL - out)))
  return PanelWeight(columns.reshape(n, groups, PANEL).transpose(1, 0, 2), out)


def is_panels(w) -> bool:
  return isinstance(w, PanelWeight)


def dense(w):
  """The `[out, in]` matrix of a CPU layout weight (a `PanelWeight`, a
  `specjax.models.cpu.rows.RowMajorWeight`); any other weight as it is."""
  return w.dense() if is_panels(w) or rows.is_rows(w) else w


def reference(x: jax.Array, panels: jax.Array, out: int) -> jax.Array:
  """The product in jnp (the kernel's oracle)."""
  y = jnp.einsum("...i,gip->...gp", x, panels, preferred_element_type=jnp.float32)
  return y.reshape(y.shape[:-2] + (-1,))[..., :out]


def usable(x: jax.Array, panels: jax.Array) -> bool:
  """Whether the product would reach the kernel on CPU (float32, built)."""
  return (x.dtype == jnp.float32 and panels.dtype == jnp.float32 and panels.ndim == 3
          and panels.shape[2] == PANEL and kernel.available())


def _kernel(x, panels, out):
  result = jax.ShapeDtypeStruct(x.shape[:-1] + (out,), x.dtype)
  return jax.ffi.ffi_call(kernel.PANEL_TARGET, result, vmap_method="sequential")(
      x, panels, out=np.int64(out))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _matvec(x, panels, out):
  return jax.lax.platform_dependent(x, panels, cpu=functools.partial(_kernel, out=out),
                                    default=functools.partial(reference, out=out))


@_matvec.defjvp
def _matvec_jvp(out, primals, tangents):
  (x, panels), (dx, dpanels) = primals, tangents
  return _matvec(x, panels, out), reference(dx, panels, out) + reference(x, dpanels, out)
