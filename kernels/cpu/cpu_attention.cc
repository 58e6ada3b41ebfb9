// specjax_cpu_attention: the XLA FFI handler over cpu_attention.h's arithmetic (kernel.py builds
// it with cpu_gemv.cc into one library; cpu_common.h holds what they share).

#include "cpu_attention.h"

namespace {

// q [B, T, KVH, G, D], cache keys/values [B, KVH, S0, D], block keys/values [B, KVH, S1, D],
// visible [B, T, S0 + S1] -> out [B, KVH, G, T, D].
//
// Each (batch row, key/value head) has G * T query rows, ordered (g, t). All B * KVH * G * T rows
// are cut into one contiguous range per part of the pool (SmolLM2's 3 heads x 3 x 7 rows of a
// verify block: 32 + 31 rows on 2 cores, not two heads against one). Within a head, a part's rows
// share each block of keys (16 with AVX-512, else 8; a block no row of the part sees is not
// read), then each row's softmax, then the weighted values four rows at a time.
ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k0,
                     ffi::Buffer<ffi::F32> v0,
                     ffi::Buffer<ffi::F32> k1, ffi::Buffer<ffi::F32> v1,
                     ffi::Buffer<ffi::PRED> visible, ffi::ResultBuffer<ffi::F32> out, float scale,
                     float softcap) {
  const auto qd = q.dimensions(), cd = k0.dimensions(), bd = k1.dimensions();
  if (qd.size() != 5 || cd.size() != 4 || bd.size() != 4) {
    return ffi::Error::InvalidArgument("specjax_cpu_attention: q 5-D, keys/values 4-D");
  }
  const int64_t b_n = qd[0], t_n = qd[1], kvh = qd[2], g_n = qd[3], d = qd[4];
  const int64_t s0 = cd[2], s1 = bd[2], s = s0 + s1;
  if (cd[0] != b_n || cd[1] != kvh || cd[3] != d || bd[0] != b_n || bd[1] != kvh || bd[3] != d ||
      v0.dimensions() != k0.dimensions() || v1.dimensions() != k1.dimensions() || d % 8 != 0 ||
      visible.element_count() != static_cast<size_t>(b_n * t_n * s)) {
    return ffi::Error::InvalidArgument("specjax_cpu_attention: shapes do not fit");
  }
  const int64_t rows = g_n * t_n;  // query rows per key/value head, ordered (g, t)
  // Rows [f0, f1) of all B * KVH * rows, head by head.
  const AttentionArgs args{q.typed_data(), {k0.typed_data(), k1.typed_data()},
                          {v0.typed_data(), v1.typed_data()}, visible.typed_data(),
                          out->typed_data(), b_n, t_n, kvh, g_n, d, s0, s1, scale, softcap};
  auto part = [args](int64_t f0, int64_t f1) { AttendRows(args, f0, f1); };
  const int64_t total_rows = b_n * kvh * rows;
  // Threads pay where a part has work enough to cover a task's hand-off (a few microseconds).
  const int64_t parts =
      rows * s * d >= 4096 ? std::min<int64_t>(total_rows, pool.num_threads()) : 1;
  RunParts(pool, total_rows, parts, part);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_cpu_attention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));
