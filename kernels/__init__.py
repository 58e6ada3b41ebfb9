"""Pallas kernels of specjax (installed as `specjax.kernels`).

`fused_verify` is the fused rejection-sampling verify (tiles over the vocabulary; TPU Mosaic and
interpret mode), `fused_verify_gpu` the same for GPUs (Triton); `verify_dispatch` picks one of them
or the jnp reference per lowering platform.
"""

from specjax.kernels.dispatch import VERIFY_IMPLS, verify_dispatch
from specjax.kernels.fused_verify import BlockSizes, fused_verify, fused_verify_reference
from specjax.kernels.fused_verify_gpu import (GPU_EXPORT_DISABLED_CHECKS, GpuBlockSizes,
                                              fused_verify_gpu)

__all__ = ["BlockSizes", "GPU_EXPORT_DISABLED_CHECKS", "GpuBlockSizes", "VERIFY_IMPLS",
           "fused_verify", "fused_verify_gpu", "fused_verify_reference", "verify_dispatch"]
