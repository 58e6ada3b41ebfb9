"""Pallas kernels of specjax (installed as `specjax.kernels`).

`fused_verify` is the fused rejection-sampling verify (tiles over the vocabulary; TPU Mosaic and
interpret mode); `verify_dispatch` picks it or the jnp reference per lowering platform.
"""

from specjax.kernels.dispatch import VERIFY_IMPLS, verify_dispatch
from specjax.kernels.fused_verify import BlockSizes, fused_verify, fused_verify_reference

__all__ = ["BlockSizes", "VERIFY_IMPLS", "fused_verify", "fused_verify_reference",
           "verify_dispatch"]
