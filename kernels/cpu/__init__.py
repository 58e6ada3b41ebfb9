"""The CPU kernels: C++ XLA FFI custom calls (`cpu_gemv.cc` with `cpu_quant.h`, `cpu_attention.cc`
with `cpu_attention.h`, both with `cpu_common.h`), compiled on first use and bound by `kernel`
(`matvec`, `attention`, `available`, `status`). The layout they read is `specjax.models.cpu`'s."""
