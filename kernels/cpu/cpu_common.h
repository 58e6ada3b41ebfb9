// specjax's CPU kernels (cpu_gemv.cc, cpu_attention.cc): what both use. Each translation unit
// gets its own copy (an anonymous namespace): inline functions and templates only.

#ifndef SPECJAX_KERNELS_CPU_COMMON_H_
#define SPECJAX_KERNELS_CPU_COMMON_H_

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>
#include <memory>

#include "xla/ffi/api/ffi.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "specjax's CPU kernels need AVX2 and FMA"
#endif

namespace ffi = xla::ffi;

namespace {

inline float HorizontalSum(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// Several rows of x (a verify block) share each weight load; accumulators are vectors of the
// widest registers -march=native allows, and `R` weight rows go at a time so that R * M
// accumulators fit the register file (32 vector registers with AVX-512, 16 without).
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kWidth = 16;
inline Vec VecLoad(const float* p) { return _mm512_loadu_ps(p); }
inline Vec VecZero() { return _mm512_setzero_ps(); }
inline Vec VecFma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float VecSum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec VecAdd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
#else
using Vec = __m256;
constexpr int64_t kWidth = 8;
inline Vec VecLoad(const float* p) { return _mm256_loadu_ps(p); }
inline Vec VecZero() { return _mm256_setzero_ps(); }
inline Vec VecFma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float VecSum(Vec v) { return HorizontalSum(v); }
inline Vec VecAdd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
#endif

inline Vec VecSet1(float v) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(v);
#else
  return _mm256_set1_ps(v);
#endif
}


// Runs fn(i0, i1) over `count` items in `parts` near-equal contiguous parts, shared between the
// caller and the tasks it schedules on XLA's intra-op pool; returns when every part is done.
// Whoever comes first claims the next part, so the caller can do every part itself when the pool
// is busy (no deadlock when XLA runs several of these at once on its own threads); a task that
// starts late finds nothing left and only touches the (reference-counted) state, which holds fn:
// it never reads the caller's stack.
template <typename Fn>
void RunParts(ffi::ThreadPool& pool, int64_t count, int64_t parts, Fn fn) {
  if (parts <= 1) {
    fn(0, count);
    return;
  }
  struct State {
    Fn fn;
    int64_t count, parts;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};

    State(Fn f, int64_t c, int64_t p) : fn(std::move(f)), count(c), parts(p) {}

    void Work() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
        fn(count * i / parts, count * (i + 1) / parts);
        done.fetch_add(1, std::memory_order_acq_rel);
      }
    }
  };
  auto state = std::make_shared<State>(std::move(fn), count, parts);
  for (int64_t i = 1; i < parts; ++i) pool.Schedule([state] { state->Work(); });
  state->Work();
  while (state->done.load(std::memory_order_acquire) < parts) _mm_pause();
}

}  // namespace

#endif  // SPECJAX_KERNELS_CPU_COMMON_H_
