"""The CPU layout of a model: per-layer fused weights in 2 MiB pages (`layout`, `host_memory`), the
float32 ones in panels (`panels`), read by the C++ kernels of `specjax.kernels.cpu` (the checkout's
`kernels/cpu/`: `kernel` builds and binds `cpu_gemv.cc` with `cpu_quant.h`, and `cpu_attention.cc`
with `cpu_attention.h`)."""
