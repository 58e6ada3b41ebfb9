"""The CPU layout of a decoder layer's projections, and the one function that applies them.

At batch 1 a decode step is a chain of matrix-vector products that should stream every weight once
at memory bandwidth; a verify block of 2-9 rows should cost little more. XLA:CPU reaches neither
with the canonical `[in, out]` matrices, and the fastest orientation differs between the two
(measured on SmolLM2-135M's shapes, 2 cores, 30 layers each; `benchmarks/cpu_forward.py`):

* one row: `[1, in] x [out, in]^T` (a row-major matrix-vector product) beats `[1, in] x [in, out]`
  for every projection (q/k/v 65 vs 82 us, out 55 vs 63, down 109 vs 139);
* two or more rows: the same `[out, in]` matrix is the slowest form (XLA packs it for a GEMM),
  while two independent `[in, out / 2]` column halves run one per core and are the fastest
  (5 rows, down: 179 vs 306 us for `[out, in]`).

So the CPU layout keeps each projection twice, fused where that saves products (query/key/value
as one matrix, gate/up as one): a *step* copy `[out, in]` (`<name>_t`) used when the block has a
single row, and a *block* copy of two column halves (`<name>_halves`) used otherwise. A step reads
only the step copy, so the bytes read per token (the bandwidth floor) are unchanged; the price is
memory for a second copy of the layer weights. `split_layer` restores the canonical weights.

When the model uses it (`Model.cpu_kernel`), one-row products and blocks of up to `KERNEL_ROWS`
rows read the step copy through `specjax.kernels.cpu_gemv` (a hand-written XLA FFI kernel, compiled
on first use), which streams it faster than XLA's dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.kernels import cpu_gemv
from specjax.models.config import ModelConfig

# Blocks of up to this many rows (B * T) go through the kernel when the model uses it: every weight
# is read once for all rows. Measured on SmolLM2-135M's shapes (30 layers, 2 cores): 1-5 rows
# 9-15% faster than XLA's dot on the same layout; from 6 rows on XLA's GEMM on the halves is as
# fast or faster.
KERNEL_ROWS = 5

# fused name: (canonical parts, concatenated along the output axis)
_PROJECTIONS = (("wqkv", ("wq", "wk", "wv")), ("wo", ("wo",)), ("w_gate_up", ("w_gate", "w_up")),
                ("w_down", ("w_down",)))


def is_cpu_layer(lp: dict) -> bool:
  return "wqkv_t" in lp


def fuse_layer(lp: dict) -> dict:
  """Canonical per-layer weights -> the CPU layout (step copies `[out, in]`, block halves)."""
  if is_cpu_layer(lp):
    return lp
  out = dict(lp)
  for fused, parts in _PROJECTIONS:
    w = jnp.concatenate([jnp.asarray(lp[name]) for name in parts], axis=-1)  # [in, out]
    for name in parts:
      del out[name]
    out[fused + "_t"] = w.T.copy()
    cut = w.shape[-1] // 2
    out[fused + "_halves"] = (w[:, :cut].copy(), w[:, cut:].copy())
  if all(name in lp for name in ("bq", "bk", "bv")):
    out["bqkv"] = jnp.concatenate([lp[name] for name in ("bq", "bk", "bv")], axis=-1)
    for name in ("bq", "bk", "bv"):
      del out[name]
  return out


def split_layer(lp: dict, c: ModelConfig) -> dict:
  """The CPU layout -> canonical per-layer weights (exact: the step copies, transposed back)."""
  if not is_cpu_layer(lp):
    return lp
  out = dict(lp)
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  sizes = {"wqkv": (q, kv, kv), "wo": (c.embed_dim,), "w_gate_up": (c.mlp_dim, c.mlp_dim),
           "w_down": (c.embed_dim,)}
  for fused, parts in _PROJECTIONS:
    w = out.pop(fused + "_t").T
    del out[fused + "_halves"]
    offsets = [sum(sizes[fused][:i]) for i in range(1, len(parts))]
    out.update((name, part.copy()) for name, part in zip(parts, jnp.split(w, offsets, axis=-1)))
  if "bqkv" in out:
    out.update(zip(("bq", "bk", "bv"), jnp.split(out.pop("bqkv"), [q, q + kv], axis=-1)))
  return out


def project(h: jax.Array, lp: dict, fused: str, kernel: bool = False) -> jax.Array:
  """`h [B, T, in] -> [B, T, out]` through the CPU layout's projection `fused` (see the module
  docstring): the step copy for a single row, the two halves otherwise; with `kernel`, blocks of up
  to `KERNEL_ROWS` rows read the step copy through `cpu_gemv.matvec`."""
  rows = h.shape[0] * h.shape[1]
  if kernel and rows <= KERNEL_ROWS:
    return cpu_gemv.matvec(h, lp[fused + "_t"])
  if rows == 1:
    return jnp.einsum("bti,oi->bto", h, lp[fused + "_t"])
  return jnp.concatenate([jnp.einsum("bti,io->bto", h, w) for w in lp[fused + "_halves"]],
                         axis=-1)
