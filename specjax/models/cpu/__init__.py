"""The CPU layout of a model: per-layer fused weights in 2 MiB pages (`layout`, `host_memory`) and
the C++ kernels that read them, float32 and int8/int4 (`kernel` builds and binds `cpu_gemv.cc` with
`cpu_quant.h`, and `cpu_attention.cc` with `cpu_attention.h`)."""
