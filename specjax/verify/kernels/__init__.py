"""Pallas kernels of specjax (installed as `specjax.verify.kernels`).

`fused_verify` is the fused rejection-sampling verify (tiles over the vocabulary; TPU Mosaic and
interpret mode), `fused_verify_gpu` the same for GPUs (Triton); `local_verify` picks one of them
or the jnp reference per lowering platform, on one device's rows. `vocab_reduce.PallasVocab` holds
the local reductions of the vocabulary-sharded rule. The mesh-aware front door is
`specjax.verify.dispatch.verify_tokens`.
"""

from specjax.verify.kernels.dispatch import VERIFY_IMPLS, local_verify, local_vocab_ops
from specjax.verify.kernels.fused_verify import BlockSizes, fused_verify, fused_verify_reference
from specjax.verify.kernels.fused_verify_gpu import (GPU_EXPORT_DISABLED_CHECKS, GpuBlockSizes,
                                                     fused_verify_gpu)
from specjax.verify.kernels.vocab_reduce import PallasVocab

__all__ = ["BlockSizes", "GPU_EXPORT_DISABLED_CHECKS", "GpuBlockSizes", "PallasVocab",
           "VERIFY_IMPLS", "fused_verify", "fused_verify_gpu", "fused_verify_reference",
           "local_verify", "local_vocab_ops"]
