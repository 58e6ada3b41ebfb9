"""The hardware-specific kernels of specjax (the checkout's top-level `kernels/`, installed as
`specjax.kernels`; README.md here says what is where).

`fused_verify` is the fused rejection-sampling verify (tiles over the vocabulary; TPU Mosaic and
interpret mode), `fused_verify_gpu` the same for GPUs (Triton); `tree_verify` / `tree_verify_gpu`
decide a draft tree's nodes the same way. `vocab_reduce.PallasVocab` holds the local reductions of
the vocabulary-sharded rule. `cpu/` holds the C++ kernels of the CPU model layout and the module
that builds and binds them (`specjax.kernels.cpu.kernel`).

The jnp references these kernels equal, and the dispatch that picks a kernel or a reference, are
specjax's own: `specjax.verify.rule.verify_reference`, `specjax.verify.local.local_verify` (one
device's rows) and `specjax.verify.dispatch.verify_tokens` (the mesh-aware front door).
"""

from specjax.kernels.fused_verify import BlockSizes, fused_verify
from specjax.kernels.fused_verify_gpu import (GPU_EXPORT_DISABLED_CHECKS, GpuBlockSizes,
                                              fused_verify_gpu)
from specjax.kernels.vocab_reduce import PallasVocab

__all__ = ["BlockSizes", "GPU_EXPORT_DISABLED_CHECKS", "GpuBlockSizes", "PallasVocab",
           "fused_verify", "fused_verify_gpu"]
