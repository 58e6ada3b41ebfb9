// specjax's CPU matrix-vector product, an XLA FFI custom call (see cpu_gemv.py).
//
// y[r, o] = sum_i x[r, i] * w[o, i] for a row-major float32 weight w [out, in] and up to eight rows
// of x at a time: the one-row decode step of the CPU layout and its small verify blocks, which
// should stream every weight once. The output rows of w are split into one part per thread of
// XLA's own intra-op pool (the FFI ThreadPool context): the caller takes parts as well, so the
// product never waits for a busy pool, and no thread of ours competes with XLA's for the cores.
// One row of x: each part computes four output rows at a time, which keeps four independent
// weight streams in flight. Several rows of x: each weight load serves all of them.
//
// Built by cpu_gemv.py with the host's compiler and -march=native; AVX2 and FMA are required
// (AVX-512 is used for the several-row case where the host has it).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "specjax's CPU matrix-vector product needs AVX2 and FMA"
#endif

namespace ffi = xla::ffi;

namespace {

inline float HorizontalSum(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

inline float DotRow(const float* __restrict w, const float* __restrict x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
  }
  float total = HorizontalSum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) total += w[i] * x[i];
  return total;
}

// Output rows [r0, r1) of y = w x, four rows at a time.
void Rows(const float* w, const float* x, float* y, int64_t n, int64_t r0, int64_t r1) {
  int64_t r = r0;
  const int64_t n16 = n - n % 16;
  for (; r + 4 <= r1; r += 4) {
    const float* w0 = w + r * n;
    const float* w1 = w0 + n;
    const float* w2 = w1 + n;
    const float* w3 = w2 + n;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
           a3 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(),
           b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n16; i += 16) {
      const __m256 xa = _mm256_loadu_ps(x + i), xb = _mm256_loadu_ps(x + i + 8);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xa, a0);
      b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i + 8), xb, b0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xa, a1);
      b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i + 8), xb, b1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xa, a2);
      b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i + 8), xb, b2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xa, a3);
      b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i + 8), xb, b3);
    }
    float s0 = HorizontalSum(_mm256_add_ps(a0, b0)), s1 = HorizontalSum(_mm256_add_ps(a1, b1));
    float s2 = HorizontalSum(_mm256_add_ps(a2, b2)), s3 = HorizontalSum(_mm256_add_ps(a3, b3));
    for (int64_t i = n16; i < n; ++i) {
      s0 += w0[i] * x[i];
      s1 += w1[i] * x[i];
      s2 += w2[i] * x[i];
      s3 += w3[i] * x[i];
    }
    y[r] = s0;
    y[r + 1] = s1;
    y[r + 2] = s2;
    y[r + 3] = s3;
  }
  for (; r < r1; ++r) y[r] = DotRow(w + r * n, x, n);
}

// Several rows of x (a verify block) share each weight load; accumulators are vectors of the
// widest registers -march=native allows, and `R` weight rows go at a time so that R * M
// accumulators fit the register file (32 vector registers with AVX-512, 16 without).
#if defined(__AVX512F__)
constexpr int kRows[9] = {0, 4, 8, 6, 4, 4, 4, 3, 2};
using Vec = __m512;
constexpr int64_t kWidth = 16;
inline Vec VecLoad(const float* p) { return _mm512_loadu_ps(p); }
inline Vec VecZero() { return _mm512_setzero_ps(); }
inline Vec VecFma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float VecSum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
constexpr int kRows[9] = {0, 4, 4, 3, 2, 2, 2, 1, 1};
using Vec = __m256;
constexpr int64_t kWidth = 8;
inline Vec VecLoad(const float* p) { return _mm256_loadu_ps(p); }
inline Vec VecZero() { return _mm256_setzero_ps(); }
inline Vec VecFma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float VecSum(Vec v) { return HorizontalSum(v); }
#endif

// Output rows [r0, r1) of y = x w^T for `M` rows of x (2 <= M <= 8), `R` weight rows at a time.
template <int M, int R>
void BlockRows(const float* w, const float* x, float* y, int64_t n, int64_t out, int64_t r0,
               int64_t r1) {
  const int64_t nv = n - n % kWidth;
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    Vec acc[R][M];
#pragma GCC unroll 8
    for (int k = 0; k < R; ++k)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[k][m] = VecZero();
    for (int64_t i = 0; i < nv; i += kWidth) {
      Vec wv[R];
#pragma GCC unroll 8
      for (int k = 0; k < R; ++k) wv[k] = VecLoad(w + (r + k) * n + i);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const Vec xv = VecLoad(x + m * n + i);
#pragma GCC unroll 8
        for (int k = 0; k < R; ++k) acc[k][m] = VecFma(wv[k], xv, acc[k][m]);
      }
    }
    for (int k = 0; k < R; ++k) {
      for (int m = 0; m < M; ++m) {
        float total = VecSum(acc[k][m]);
        for (int64_t i = nv; i < n; ++i) total += w[(r + k) * n + i] * x[m * n + i];
        y[m * out + r + k] = total;
      }
    }
  }
  if constexpr (R > 1) BlockRows<M, 1>(w, x, y, n, out, r, r1);
}

// Output rows [r0, r1) for `m` rows of x (1 <= m <= 8).
void AnyRows(const float* w, const float* x, float* y, int64_t n, int64_t out, int64_t m,
             int64_t r0, int64_t r1) {
  switch (m) {
    case 1: return Rows(w, x, y, n, r0, r1);
    case 2: return BlockRows<2, kRows[2]>(w, x, y, n, out, r0, r1);
    case 3: return BlockRows<3, kRows[3]>(w, x, y, n, out, r0, r1);
    case 4: return BlockRows<4, kRows[4]>(w, x, y, n, out, r0, r1);
    case 5: return BlockRows<5, kRows[5]>(w, x, y, n, out, r0, r1);
    case 6: return BlockRows<6, kRows[6]>(w, x, y, n, out, r0, r1);
    case 7: return BlockRows<7, kRows[7]>(w, x, y, n, out, r0, r1);
    default: return BlockRows<8, kRows[8]>(w, x, y, n, out, r0, r1);
  }
}

struct Job {
  const float* w;
  const float* x;
  float* y;
  int64_t n;
  int64_t out;
  int64_t m;  // rows of x (and y), at most kMaxRows
  int64_t parts;
};

constexpr int64_t kMaxRows = 8;

// The rows of part `i` of `parts`, cut on multiples of four.
inline void PartRows(const Job& job, int64_t i, int64_t* r0, int64_t* r1) {
  const int64_t quads = (job.out + 3) / 4;
  *r0 = std::min(job.out, 4 * (quads * i / job.parts));
  *r1 = std::min(job.out, 4 * (quads * (i + 1) / job.parts));
}

// One product shared between the caller and the tasks it schedules. Whoever comes first claims
// the next part, so the caller can do every part itself when the pool is busy (no deadlock when
// XLA runs several of these at once on its own threads); a task that starts late finds nothing
// left and only touches this (reference-counted) state, never the caller's stack.
struct Shared {
  Job job;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < job.parts;) {
      int64_t r0, r1;
      PartRows(job, i, &r0, &r1);
      AnyRows(job.w, job.x, job.y, job.n, job.out, job.m, r0, r1);
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

using Matrix = ffi::Buffer<ffi::F32, 2>;  // an alias: a macro argument cannot hold its comma

ffi::Error Gemv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Matrix w,
                ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = w.dimensions();
  const int64_t out = dims[0], n = dims[1];
  const auto x_dims = x.dimensions();
  if (x_dims.size() == 0 || x_dims.back() != n) {
    return ffi::Error::InvalidArgument("specjax_cpu_gemv: x's last axis must match w's second");
  }
  const int64_t rows = n == 0 ? 0 : static_cast<int64_t>(x.element_count()) / n;
  if (y->element_count() != static_cast<size_t>(rows * out)) {
    return ffi::Error::InvalidArgument("specjax_cpu_gemv: result has the wrong size");
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t r = 0; r < rows; r += kMaxRows) {  // each group of up to 8 rows reads w once
    const Job job{w.typed_data(), x.typed_data() + r * n, y->typed_data() + r * out, n, out,
                  std::min(kMaxRows, rows - r), out < 64 ? 1 : threads};
    if (job.parts == 1) {
      AnyRows(job.w, job.x, job.y, n, out, job.m, 0, out);
      continue;
    }
    auto shared = std::make_shared<Shared>();
    shared->job = job;
    for (int64_t i = 1; i < job.parts; ++i) pool.Schedule([shared] { shared->Work(); });
    shared->Work();
    while (shared->done.load(std::memory_order_acquire) < job.parts) _mm_pause();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_cpu_gemv, Gemv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Matrix>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
