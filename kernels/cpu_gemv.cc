// specjax's CPU matrix-vector products, XLA FFI custom calls (see cpu_gemv.py).
//
// specjax_cpu_gemv: y[r, o] = sum_i x[r, i] * w[o, i] for a row-major float32 weight w [out, in],
// up to eight rows of x per pass over w: the decode step of the CPU layout (one row), its verify
// blocks and a draft model's catch-up (a few rows), which should stream every weight once.
// specjax_cpu_qgemv: the same product for a quantized weight (int8 or packed int4 per group, see
// below), read at its narrow width.
// specjax_cpu_attention: a decode step's (or a verify block's) attention over the KV cache and the
// block, reading no cache slot that no query sees (see the end of the file).
//
// The output rows of w are split into one part per thread of XLA's own intra-op pool (the FFI
// ThreadPool context): the caller takes parts as well, so the product never waits for a busy
// pool, and no thread of ours competes with XLA's for the cores. One row of x: four output rows at
// a time, four weight streams in flight. Several rows: a few weight rows at a time against all of
// them (see TileRows), with software prefetch ahead of each.
//
// Built by cpu_gemv.py with the host's compiler and -march=native; AVX2 and FMA are required
// (AVX-512 widens the float32 several-row case where the host has it).

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
using Vec = __m512;
constexpr int64_t kWidth = 16;
inline Vec VecLoad(const float* p) { return _mm512_loadu_ps(p); }
inline Vec VecZero() { return _mm512_setzero_ps(); }
inline Vec VecFma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float VecSum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
using Vec = __m256;
constexpr int64_t kWidth = 8;
inline Vec VecLoad(const float* p) { return _mm256_loadu_ps(p); }
inline Vec VecZero() { return _mm256_setzero_ps(); }
inline Vec VecFma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float VecSum(Vec v) { return HorizontalSum(v); }
#endif

// How far ahead of the bytes being read the kernel asks for the next ones: the hardware
// prefetcher alone leaves a stream that is consumed slower than DRAM delivers it latency-bound.
// The float32 several-row case prefetches each weight row 1 KiB ahead. The quantized case reads
// R rows as one contiguous span and prefetches 4 KiB ahead of its linear position (one core, int8,
// one row of x, a 151 MB matrix of 576 columns: 12 GB/s with per-row prefetch 1 KiB ahead, 18
// with the linear 4 KiB; SmolLM2's 121 int8 products of a step: 10.6 -> 7.1 ms on 2 cores).
#ifndef SPECJAX_PREFETCH
#define SPECJAX_PREFETCH 4096
#endif
constexpr int64_t kPrefetchBytes = SPECJAX_PREFETCH;
#ifndef SPECJAX_PREFETCH_F32
#define SPECJAX_PREFETCH_F32 1024
#endif
constexpr int64_t kPrefetchF32Bytes = SPECJAX_PREFETCH_F32;
#ifndef SPECJAX_PREFETCH_F32_L2
#define SPECJAX_PREFETCH_F32_L2 4096
#endif
constexpr int64_t kPrefetchF32L2Bytes = SPECJAX_PREFETCH_F32_L2;

// y[m, r + k] for `R` weight rows starting at row r and `M` rows of x: R * M accumulators; each
// weight load serves M rows of x, each x load R weight rows.
template <int M, int R, bool Prefetch, bool PrefetchL2 = false>
inline void Tile(const float* w, const float* x, float* y, int64_t n, int64_t out, int64_t r) {
  const int64_t nv = n - n % kWidth;
  Vec acc[R][M];
#pragma GCC unroll 8
  for (int k = 0; k < R; ++k)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[k][m] = VecZero();
  for (int64_t i = 0; i < nv; i += kWidth) {
    Vec wv[R];
#pragma GCC unroll 8
    for (int k = 0; k < R; ++k) {
      const float* row = w + (r + k) * n + i;
      if constexpr (Prefetch) {
        if (i % 16 == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchF32Bytes, _MM_HINT_T0);
          if constexpr (PrefetchL2) {
            _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchF32L2Bytes, _MM_HINT_T1);
          }
        }
      }
      wv[k] = VecLoad(row);
    }
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

// Weight rows per tile for `M` rows of x (2 <= M <= 8). With one weight row at a time (M
// accumulators) the weight is one sequential stream, but every weight load is matched by M loads
// of x: fine for two or three rows of x while they sit in L1, slow beyond. So from four rows on,
// or when the rows of x outgrow `kXInL1Bytes`, `R` weight rows go at a time: as many as R * M
// accumulators plus R weight vectors and one x vector leave in the register file (32 vectors with
// AVX-512: R = 4 up to six rows, 3 for seven and eight; 16 with AVX2: 4, 3, then 2 up to six,
// then 1), and each weight row is also prefetched into L2 `kPrefetchF32L2Bytes` ahead. Measured
// out of cache on one core of an AMD EPYC (Zen 5, AVX-512) over the Qwen2.5 1.5B layer shapes:
// six rows 97 -> 67 ms per 1.5 GB with four weight rows at a time, and 22 -> 26 GB/s more with
// the L2 prefetch; two rows of 8960 columns 25 -> 35 GB/s; two rows of 1536 columns stay faster
// one weight row at a time (36 against 30 GB/s).
template <int M>
constexpr int TileRows() {
  if (kWidth == 16) return M <= 6 ? 4 : 3;
  return M <= 2 ? 4 : M == 3 ? 3 : M <= 6 ? 2 : 1;
}
constexpr int64_t kXInL1Bytes = 32 * 1024;

// Output rows [r0, r1) of y = x w^T for `M` rows of x (2 <= M <= 8), one weight row or
// `TileRows<M>()` at a time (see above).
template <int M>
void BlockRows(const float* w, const float* x, float* y, int64_t n, int64_t out, int64_t r0,
               int64_t r1) {
  constexpr int R = TileRows<M>();
  constexpr bool prefetch = kPrefetchF32Bytes > 0;
  int64_t r = r0;
  if (R > 1 && (M >= 4 || M * n * static_cast<int64_t>(sizeof(float)) > kXInL1Bytes)) {
    for (; r + R <= r1; r += R) Tile<M, R, prefetch, true>(w, x, y, n, out, r);
  }
  for (; r < r1; ++r) Tile<M, 1, prefetch, false>(w, x, y, n, out, r);
}

// Output rows [r0, r1) for `m` rows of x (1 <= m <= 8).
void AnyRows(const float* w, const float* x, float* y, int64_t n, int64_t out, int64_t m,
             int64_t r0, int64_t r1) {
  switch (m) {
    case 1: return Rows(w, x, y, n, r0, r1);
    case 2: return BlockRows<2>(w, x, y, n, out, r0, r1);
    case 3: return BlockRows<3>(w, x, y, n, out, r0, r1);
    case 4: return BlockRows<4>(w, x, y, n, out, r0, r1);
    case 5: return BlockRows<5>(w, x, y, n, out, r0, r1);
    case 6: return BlockRows<6>(w, x, y, n, out, r0, r1);
    case 7: return BlockRows<7>(w, x, y, n, out, r0, r1);
    default: return BlockRows<8>(w, x, y, n, out, r0, r1);
  }
}

// ---------------------------------------------------------------------------------------------
// Quantized weights. A weight row holds symmetric integers q per group of `group` input columns
// (a multiple of 32) with float32 scales [out, in / group]. int8: one signed byte per weight,
// row-major [out, in]. int4: [out, in / 2] bytes; in each run of 32 weights, byte j holds weight j
// in its low nibble and weight j + 16 in its high nibble, both stored as q + 8 (0..15).
//
// The rows of x are quantized too, per group of the same columns (symmetric int8: scale =
// max|x| / 127, q = round-half-even(x * (127 / max|x|))), and each run of 32 products is an
// integer dot product (vpmaddubsw + vpmaddwd, exact in int32) scaled by weight scale x row scale.
// That is the product `quant_reference` in cpu_gemv.py defines, and the arithmetic llama.cpp's
// CPU path uses for its 8-bit formats: widening every weight to float32 in registers cost three
// times the instructions and left the kernel compute-bound at half the memory bandwidth.

// Rows of x quantized per group: values [m, n] int8, scales [m, n / group].
void QuantizeRows(const float* x, int64_t m, int64_t n, int64_t group, int8_t* xq, float* xs) {
  const int64_t groups = n / group;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = x + r * n + g * group;
      float top = 0.0f;
      for (int64_t i = 0; i < group; ++i) top = std::max(top, std::fabs(v[i]));
      const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
      xs[r * groups + g] = top / 127.0f;
      for (int64_t i = 0; i < group; ++i) {
        const float t = std::nearbyint(v[i] * inverse);  // round half to even
        xq[r * n + g * group + i] = static_cast<int8_t>(std::clamp(t, -127.0f, 127.0f));
      }
    }
  }
}

// 32 int4 weights of a row from weight i as the unsigned bytes stored (q + 8, 0..15).
inline __m256i Nibbles32(const uint8_t* row, int64_t i) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i / 2));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(b, mask);                       // weights i .. i + 15
  const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), mask);   // weights i + 16 .. i + 31
  return _mm256_set_m128i(high, low);
}

// 32 weights of a row as signed bytes, starting at weight i.
template <int Bits>
inline __m256i LoadWeights32(const uint8_t* row, int64_t i) {
  if constexpr (Bits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i));
  } else {
    return _mm256_sub_epi8(Nibbles32(row, i), _mm256_set1_epi8(8));
  }
}

// Eight int32 partial sums of w . x over 32 signed bytes each (|w|, |x| <= 127: the int16 pair
// sums of vpmaddubsw cannot saturate).
inline __m256i Dot32(__m256i abs_w, __m256i w, __m256i x) {
  const __m256i signed_x = _mm256_sign_epi8(x, w);  // x * sign(w): |w| * that = w * x
  return _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w, signed_x), _mm256_set1_epi16(1));
}

// With VNNI (AVX-VNNI, or AVX-512 VNNI on 256-bit registers) one vpdpbusd multiplies unsigned by
// signed bytes and adds each four adjacent products into an int32 lane: the same lanes as
// Dot32's two instructions, in one. The weights go in unsigned, offset (int8: w + 128, the sign
// bit flipped; int4: q + 8 as stored), and each group's lanes then drop offset * (the lane's sum of
// x over the group), precomputed per row of x (XLaneSums): every int32 lane, and so the result,
// is exactly Dot32's.
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool kVnni = true;
inline __m256i DpBusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#else
constexpr bool kVnni = false;
inline __m256i DpBusd(__m256i acc, __m256i, __m256i) { return acc; }
#endif

// 32 weights of a row as the unsigned bytes VNNI takes: int8 w + 128, int4 q + 8 as stored.
template <int Bits>
inline __m256i LoadOffsetWeights32(const uint8_t* row, int64_t i) {
  if constexpr (Bits == 8) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    return Nibbles32(row, i);
  }
}

// Per row of x and group: eight int32 lanes, lane l `offset` times the sum of the bytes
// 4l .. 4l + 3 of every 32-byte run of the group (the lanes DpBusd accumulates into): what each
// lane drops at the group's end.
void XLaneSums(const int8_t* xq, int64_t m, int64_t n, int64_t group, int32_t offset,
               int32_t* lanes) {
  const int64_t groups = n / group;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      int32_t* out = lanes + (r * groups + g) * 8;
      std::fill(out, out + 8, 0);
      for (int64_t i = 0; i < group; ++i) out[(i % 32) / 4] += offset * xq[r * n + g * group + i];
    }
  }
}

// y[m, r + k] for R weight rows from row r and M (<= 4) quantized rows of x.
template <int Bits, int M, int R, bool Prefetch>
inline void IntTile(const uint8_t* q, const float* scale, const int8_t* xq, const float* xs,
                    const int32_t* xl, float* y, int64_t n, int64_t out, int64_t group,
                    int64_t r) {
  const int64_t row_bytes = Bits == 8 ? n : n / 2;
  const int64_t groups = n / group;
  __m256 acc[R][M];
#pragma GCC unroll 8
  for (int k = 0; k < R; ++k)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[k][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i sums[R][M];
#pragma GCC unroll 8
    for (int k = 0; k < R; ++k)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) sums[k][m] = _mm256_setzero_si256();
    for (int64_t i = g * group; i < (g + 1) * group; i += 32) {
      __m256i xv[M];
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
        xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * n + i));
      if constexpr (Prefetch) {
        // The R rows are one contiguous span, consumed R * step bytes per step: ask for the bytes
        // a fixed distance ahead of that linear position.
        constexpr int64_t step = Bits == 8 ? 32 : 16;
        const char* ahead = reinterpret_cast<const char*>(q + r * row_bytes) +
                            R * (Bits == 8 ? i : i / 2) + kPrefetchBytes;
#pragma GCC unroll 8
        for (int64_t p = 0; p < R * step; p += 64) _mm_prefetch(ahead + p, _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int k = 0; k < R; ++k) {
        const uint8_t* row = q + (r + k) * row_bytes;
        if constexpr (kVnni) {
          const __m256i u = LoadOffsetWeights32<Bits>(row, i);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) sums[k][m] = DpBusd(sums[k][m], u, xv[m]);
        } else {
          const __m256i w = LoadWeights32<Bits>(row, i);
          const __m256i abs_w = _mm256_sign_epi8(w, w);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m)
            sums[k][m] = _mm256_add_epi32(sums[k][m], Dot32(abs_w, w, xv[m]));
        }
      }
    }
    if constexpr (kVnni) {  // drop the offset times each lane's sum of x over the group
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m256i offset = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            xl + (m * groups + g) * 8));
#pragma GCC unroll 8
        for (int k = 0; k < R; ++k) sums[k][m] = _mm256_sub_epi32(sums[k][m], offset);
      }
    }
#pragma GCC unroll 8
    for (int k = 0; k < R; ++k) {
      const float ws = scale[(r + k) * groups + g];
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
        acc[k][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[k][m]),
                                    _mm256_set1_ps(ws * xs[m * groups + g]), acc[k][m]);
    }
  }
  for (int k = 0; k < R; ++k)
    for (int m = 0; m < M; ++m) y[m * out + r + k] = HorizontalSum(acc[k][m]);
}

template <int Bits, int M, int R, int M0>
inline void IntPasses(const uint8_t* q, const float* scale, const int8_t* xq, const float* xs,
                      const int32_t* xl, float* y, int64_t n, int64_t out, int64_t group,
                      int64_t r) {
  if constexpr (M0 < M) {
    constexpr int mm = M - M0 < 4 ? M - M0 : 4;
    const int64_t groups = n / group;
    IntTile<Bits, mm, R, M0 == 0>(q, scale, xq + M0 * n, xs + M0 * groups, xl + M0 * groups * 8,
                                  y + M0 * out, n, out, group, r);
    IntPasses<Bits, M, R, M0 + 4>(q, scale, xq, xs, xl, y, n, out, group, r);
  }
}

// Output rows [r0, r1) for M rows of x: R weight rows at a time (one row of x: four, two rows:
// two, else one), the rows of x in passes of at most four over the same (L1-resident) weights.
template <int Bits, int M>
void IntRows(const uint8_t* q, const float* scale, const int8_t* xq, const float* xs,
             const int32_t* xl, float* y, int64_t n, int64_t out, int64_t group, int64_t r0,
             int64_t r1) {
  constexpr int R = M == 1 ? 4 : M == 2 ? 2 : 1;
  int64_t r = r0;
  for (; r + R <= r1; r += R) IntPasses<Bits, M, R, 0>(q, scale, xq, xs, xl, y, n, out, group, r);
  for (; r < r1; ++r) IntPasses<Bits, M, 1, 0>(q, scale, xq, xs, xl, y, n, out, group, r);
}

template <int Bits>
void AnyIntRows(const uint8_t* q, const float* scale, const int8_t* xq, const float* xs,
                const int32_t* xl, float* y, int64_t n, int64_t out, int64_t group, int64_t m,
                int64_t r0, int64_t r1) {
  switch (m) {
    case 1: return IntRows<Bits, 1>(q, scale, xq, xs, xl, y, n, out, group, r0, r1);
    case 2: return IntRows<Bits, 2>(q, scale, xq, xs, xl, y, n, out, group, r0, r1);
    case 3: return IntRows<Bits, 3>(q, scale, xq, xs, xl, y, n, out, group, r0, r1);
    case 4: return IntRows<Bits, 4>(q, scale, xq, xs, xl, y, n, out, group, r0, r1);
    case 5: return IntRows<Bits, 5>(q, scale, xq, xs, xl, y, n, out, group, r0, r1);
    case 6: return IntRows<Bits, 6>(q, scale, xq, xs, xl, y, n, out, group, r0, r1);
    case 7: return IntRows<Bits, 7>(q, scale, xq, xs, xl, y, n, out, group, r0, r1);
    default: return IntRows<Bits, 8>(q, scale, xq, xs, xl, y, n, out, group, r0, r1);
  }
}

constexpr int64_t kMaxRows = 8;

// One block of up to kMaxRows rows of x: a function of an output-row range.
struct Job {
  std::function<void(int64_t, int64_t)> rows;  // computes output rows [r0, r1) for every x row
  int64_t out;
  int64_t parts;
};

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

// Runs `job` over the caller and XLA's intra-op pool, its parts cut on multiples of four rows.
void Run(ffi::ThreadPool& pool, Job job) {
  const int64_t out = job.out;
  auto quads = [rows = std::move(job.rows), out](int64_t q0, int64_t q1) {
    rows(std::min(out, 4 * q0), std::min(out, 4 * q1));
  };
  RunParts(pool, (out + 3) / 4, job.parts, std::move(quads));
}

int64_t Parts(ffi::ThreadPool& pool, int64_t out) {
  return out < 64 ? 1 : std::max<int64_t>(1, pool.num_threads());
}

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
  for (int64_t r = 0; r < rows; r += kMaxRows) {  // each group of up to 8 rows reads w once
    const float* wp = w.typed_data();
    const float* xp = x.typed_data() + r * n;
    float* yp = y->typed_data() + r * out;
    const int64_t m = std::min(kMaxRows, rows - r);
    Run(pool, Job{[=](int64_t r0, int64_t r1) { AnyRows(wp, xp, yp, n, out, m, r0, r1); }, out,
                  Parts(pool, out)});
  }
  return ffi::Error::Success();
}

using Scales = ffi::Buffer<ffi::F32, 2>;

// x [..., in] float32, q [out, in] (int8 as bytes) or [out, in / 2] (int4), scales
// [out, in / group] float32 -> y [..., out] float32.
ffi::Error QuantGemv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                     Scales scales, ffi::ResultBuffer<ffi::F32> y, int64_t bits, int64_t group) {
  if (bits != 8 && bits != 4) return ffi::Error::InvalidArgument("specjax_cpu_qgemv: bits 8 or 4");
  const auto type = q.element_type();
  if ((bits == 8 && type != ffi::DataType::S8) || (bits == 4 && type != ffi::DataType::U8) ||
      q.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("specjax_cpu_qgemv: q must be 2-D int8 (8 bits) or uint8 (4)");
  }
  const int64_t out = q.dimensions()[0];
  const int64_t n = bits == 8 ? q.dimensions()[1] : 2 * q.dimensions()[1];
  const auto x_dims = x.dimensions();
  if (x_dims.size() == 0 || x_dims.back() != n) {
    return ffi::Error::InvalidArgument("specjax_cpu_qgemv: x's last axis must match q's");
  }
  if (group <= 0 || group % 32 != 0 || n % group != 0 || scales.dimensions()[0] != out ||
      scales.dimensions()[1] != n / group) {
    return ffi::Error::InvalidArgument("specjax_cpu_qgemv: group or scales do not fit q");
  }
  const int64_t rows = n == 0 ? 0 : static_cast<int64_t>(x.element_count()) / n;
  if (y->element_count() != static_cast<size_t>(rows * out)) {
    return ffi::Error::InvalidArgument("specjax_cpu_qgemv: result has the wrong size");
  }
  const int64_t groups = n / group;
  std::vector<int8_t> xq(rows * n);
  std::vector<float> xs(rows * groups);
  QuantizeRows(x.typed_data(), rows, n, group, xq.data(), xs.data());
  std::vector<int32_t> xl(kVnni ? rows * groups * 8 : 0);
  if (kVnni) XLaneSums(xq.data(), rows, n, group, bits == 8 ? 128 : 8, xl.data());
  for (int64_t r = 0; r < rows; r += kMaxRows) {
    const uint8_t* qp = static_cast<const uint8_t*>(q.untyped_data());
    const float* sp = scales.typed_data();
    const int8_t* xp = xq.data() + r * n;
    const float* xsp = xs.data() + r * groups;
    const int32_t* xlp = kVnni ? xl.data() + r * groups * 8 : nullptr;
    float* yp = y->typed_data() + r * out;
    const int64_t m = std::min(kMaxRows, rows - r);
    auto fn = bits == 8
        ? std::function<void(int64_t, int64_t)>([=](int64_t r0, int64_t r1) {
            AnyIntRows<8>(qp, sp, xp, xsp, xlp, yp, n, out, group, m, r0, r1);
          })
        : std::function<void(int64_t, int64_t)>([=](int64_t r0, int64_t r1) {
            AnyIntRows<4>(qp, sp, xp, xsp, xlp, yp, n, out, group, m, r0, r1);
          });
    Run(pool, Job{std::move(fn), out, Parts(pool, out)});
  }
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// Attention of a few query rows over a KV cache and the block itself (specjax_cpu_attention): on
// XLA:CPU the two small batched products of a decode step's attention (3 key/value heads x 264
// slots of 64) cost about 40 us each, against a few microseconds of arithmetic. Per key/value
// head: scores of its G query heads x T rows against every key (cache slots, then block), the
// scale, the optional soft cap, the visibility mask (an invisible key scores float32's lowest,
// as the jnp reference writes it), a softmax, and the probability-weighted sum of values. The
// query rows of all heads are cut into one contiguous range per part of XLA's intra-op pool (see
// Attention); with AVX-512, 16 keys per block of scores and 16-wide values (SmolLM2's verify block
// of 7 rows: 56 -> 27 us per layer, its step 10.4 -> 6.7 us, at a load of 3.4 on 2 cores).

// exp(x) for 8 floats: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative
// error about 2e-7), 2^n through the exponent bits; x below -87.3 gives 0, above 88.7 clamps.
inline __m256 Exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.7f), lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// The dot products of `query` with eight key rows of `d` floats, as one vector.
inline __m256 Dot8(const float* query, const float* const* keys, int64_t d) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 x = _mm256_loadu_ps(query + i);
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[k] + i), acc[k]);
  }
  const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// o[c0 : c0 + 8 * N] = inverse * sum_j p[j] * value_j[c0 : c0 + 8 * N] over the cache's keys
// (values[0], s0 rows) then the block's (values[1]).
template <int N>
inline void WeightedValues(const float* p, const float* const* values, int64_t s0, int64_t s,
                           int64_t d, int64_t c0, __m256 inverse, float* o) {
  __m256 acc[N];
#pragma GCC unroll 8
  for (int c = 0; c < N; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < s; ++j) {
    if (p[j] == 0.0f) continue;  // an invisible key (its value row is not read), or underflow
    const float* value = (j < s0 ? values[0] + j * d : values[1] + (j - s0) * d) + c0;
    const __m256 weight = _mm256_set1_ps(p[j]);
#pragma GCC unroll 8
    for (int c = 0; c < N; ++c) acc[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + 8 * c), acc[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < N; ++c) _mm256_storeu_ps(o + c0 + 8 * c, _mm256_mul_ps(acc[c], inverse));
}

#if defined(__AVX512F__)
// Dot16 / Exp16: the AVX-512 forms of the scores and the exponential (host with AVX-512 only).

// exp(x) for 16 floats, Exp8's method.
inline __m512 Exp16(__m512 x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(bits));
}

// The dot products of `query` with 16 key rows of `d` floats (d a multiple of 16), as one vector:
// one accumulator per key, then a transposing tree of adds (45 shuffles and adds for 16 sums).
inline __m512 Dot16(const float* query, const float* const* keys, int64_t d) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 x = _mm512_loadu_ps(query + i);
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_fmadd_ps(x, _mm512_loadu_ps(keys[k] + i), acc[k]);
  }
  // In each 128-bit chunk: pairs of keys (a, b, a, b), then quads (a, b, c, d) of partial sums.
  __m512 pairs[8], quads[4], octs[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                             _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d u = _mm512_castps_pd(pairs[2 * i]), v = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
  }
  // Chunks: keys 8i..8i+3 in chunks 0-1, 8i+4..8i+7 in chunks 2-3; then all 16 in order.
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    octs[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                            _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(octs[0], octs[1], 0x88),
                       _mm512_shuffle_f32x4(octs[0], octs[1], 0xDD));
}
#endif

inline Vec VecSet1(float v) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(v);
#else
  return _mm256_set1_ps(v);
#endif
}

// o_r[c0 : c0 + N * kWidth] = inverse[r] * sum_j p_r[j] * value_j[c0 : ...] for R query rows at
// once (each value vector loaded once for all R), over keys j < limit: the cache's (values[0],
// s0 rows), then the block's (values[1]). A key that none of the R rows sees is not read.
template <int R, int N>
inline void WeightedRows(const float* const* p, const float* const* values, int64_t s0,
                         int64_t limit, int64_t d, int64_t c0, const float* inverse,
                         float* const* o) {
  Vec acc[R][N];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < N; ++c) acc[r][c] = VecZero();
  for (int64_t j = 0; j < limit; ++j) {
    bool any = false;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) any |= p[r][j] != 0.0f;
    if (!any) continue;  // an invisible key (its value row is not read), or underflow
    const float* value = (j < s0 ? values[0] + j * d : values[1] + (j - s0) * d) + c0;
    Vec weight[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) weight[r] = VecSet1(p[r][j]);
#pragma GCC unroll 4
    for (int c = 0; c < N; ++c) {
      const Vec v = VecLoad(value + kWidth * c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][c] = VecFma(weight[r], v, acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const Vec scale = VecSet1(inverse[r]);
#pragma GCC unroll 4
    for (int c = 0; c < N; ++c) {
      const Vec out = VecFma(acc[r][c], scale, VecZero());
#if defined(__AVX512F__)
      _mm512_storeu_ps(o[r] + c0 + kWidth * c, out);
#else
      _mm256_storeu_ps(o[r] + c0 + kWidth * c, out);
#endif
    }
  }
}

// All d columns of R rows: column blocks of kColumnVecs vectors (R * kColumnVecs accumulators
// fit the register file), then single vectors, then (AVX-512 with d = 8 mod 16) one 8-column
// block per row.
constexpr int kColumnVecs = kWidth == 16 ? 4 : 2;
template <int R>
void WeightedColumns(const float* const* p, const float* const* values, int64_t s0,
                     int64_t limit, int64_t d, const float* inverse, float* const* o) {
  int64_t c0 = 0;
  for (; c0 + kColumnVecs * kWidth <= d; c0 += kColumnVecs * kWidth) {
    WeightedRows<R, kColumnVecs>(p, values, s0, limit, d, c0, inverse, o);
  }
  for (; c0 + kWidth <= d; c0 += kWidth) {
    WeightedRows<R, 1>(p, values, s0, limit, d, c0, inverse, o);
  }
  for (; c0 < d; c0 += 8) {
    for (int r = 0; r < R; ++r) {
      WeightedValues<1>(p[r], values, s0, limit, d, c0, _mm256_set1_ps(inverse[r]), o[r]);
    }
  }
}

// Eight scores of one query row (lanes j .. j + 7 of `row`, keys j .. j + 7): times the scale,
// soft-capped, and float32's lowest where the row does not see the key (`seen`: its bools).
// Lanes at or past `s` (the padding to whole key blocks) score the lowest too.
inline void FinishScores8(__m256 dots, float scale, float softcap, const bool* seen, int64_t j,
                          int64_t s, float* row) {
  const float lowest = -std::numeric_limits<float>::max();
  __m256 score = _mm256_mul_ps(dots, _mm256_set1_ps(scale));
  if (j + 8 <= s && softcap <= 0.0f) {
    const __m256i flags = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(seen + j)));
    const __m256 hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(flags, _mm256_setzero_si256()));
    _mm256_storeu_ps(row + j, _mm256_blendv_ps(score, _mm256_set1_ps(lowest), hidden));
    return;
  }
  alignas(32) float eight[8];
  _mm256_store_ps(eight, score);
  for (int64_t k = 0; k < 8; ++k) {
    float value = eight[k];
    if (softcap > 0.0f) value = softcap * std::tanh(value / softcap);
    row[j + k] = j + k < s && seen[j + k] ? value : lowest;
  }
}

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
#if defined(__AVX512F__)
  const int64_t block = d % 16 == 0 ? 16 : 8;  // keys per block of scores
#else
  const int64_t block = 8;
#endif
  const int64_t stride = (s + 15) / 16 * 16;  // a row of scores, padded to whole key blocks
  const float lowest = -std::numeric_limits<float>::max();
  const bool* vis = visible.typed_data();

  // Rows [f0, f1) of all B * KVH * rows, head by head.
  auto part = [&](int64_t f0, int64_t f1) {
    std::vector<float> scores((std::min<int64_t>(rows, f1 - f0)) * stride);
    std::vector<char> uses_t(t_n);
    std::vector<float> inverse(rows);
    for (int64_t head = f0 / rows; head * rows < f1; ++head) {
      const int64_t b = head / kvh, h = head % kvh;
      const int64_t r0 = std::max(f0, head * rows) - head * rows;
      const int64_t r1 = std::min(f1, (head + 1) * rows) - head * rows;
      const int64_t n = r1 - r0;
      const float* keys[2] = {k0.typed_data() + head * s0 * d, k1.typed_data() + head * s1 * d};
      const float* values[2] = {v0.typed_data() + head * s0 * d, v1.typed_data() + head * s1 * d};
      std::fill(uses_t.begin(), uses_t.end(), 0);
      for (int64_t r = r0; r < std::min(r1, r0 + t_n); ++r) uses_t[r % t_n] = 1;
      // Scores, block by block of keys; `limit`: the end of the last block some row sees.
      int64_t limit = 0;
      for (int64_t j = 0; j < s; j += block) {
        const int64_t count = std::min<int64_t>(block, s - j);
        bool seen = false;
        for (int64_t t = 0; t < t_n && !seen; ++t) {
          if (!uses_t[t]) continue;
          for (int64_t jj = j; jj < j + count; ++jj) seen |= vis[(b * t_n + t) * s + jj];
        }
        if (!seen) {
          for (int64_t i = 0; i < n; ++i)
            std::fill_n(scores.data() + i * stride + j, block, lowest);
          continue;
        }
        limit = j + count;
        const float* key_rows[16];
        for (int64_t k = 0; k < block; ++k) {
          // A short block repeats its last key.
          const int64_t jj = j + std::min<int64_t>(k, count - 1);
          key_rows[k] = jj < s0 ? keys[0] + jj * d : keys[1] + (jj - s0) * d;
        }
        for (int64_t i = 0; i < n; ++i) {
          const int64_t g = (r0 + i) / t_n, t = (r0 + i) % t_n;
          const float* query = q.typed_data() + (((b * t_n + t) * kvh + h) * g_n + g) * d;
          const bool* seen_row = vis + (b * t_n + t) * s;
          float* row = scores.data() + i * stride;
#if defined(__AVX512F__)
          if (block == 16) {
            const __m512 dots = Dot16(query, key_rows, d);
            FinishScores8(_mm512_castps512_ps256(dots), scale, softcap, seen_row, j, s, row);
            FinishScores8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(dots), 1)),
                          scale, softcap, seen_row, j + 8, s, row);
            continue;
          }
#endif
          FinishScores8(Dot8(query, key_rows, d), scale, softcap, seen_row, j, s, row);
        }
      }
      // Lanes past the last key score minus infinity: exp gives 0 even for a row that sees no
      // key (whose scores are all the lowest float, a uniform softmax as in the jnp reference).
      for (int64_t i = 0; i < n; ++i) {
        std::fill(scores.data() + i * stride + s, scores.data() + (i + 1) * stride,
                  -std::numeric_limits<float>::infinity());
      }
      // Softmax per row over the padded row (unseen keys give exp(lowest - top) = 0).
      bool blind = false;  // some row sees no key: its uniform weights span every key
      for (int64_t i = 0; i < n; ++i) {
        float* row = scores.data() + i * stride;
        float total = 0.0f;
#if defined(__AVX512F__)
        __m512 top16 = _mm512_set1_ps(lowest);
        for (int64_t j = 0; j < stride; j += 16) {
          top16 = _mm512_max_ps(top16, _mm512_loadu_ps(row + j));
        }
        const float top = _mm512_reduce_max_ps(top16);
        const __m512 shift = _mm512_set1_ps(top);
        __m512 total16 = _mm512_setzero_ps();
        for (int64_t j = 0; j < stride; j += 16) {
          const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift));
          _mm512_storeu_ps(row + j, e);
          total16 = _mm512_add_ps(total16, e);
        }
        total = _mm512_reduce_add_ps(total16);
#else
        __m256 top8 = _mm256_set1_ps(lowest);
        for (int64_t j = 0; j < stride; j += 8) {
          top8 = _mm256_max_ps(top8, _mm256_loadu_ps(row + j));
        }
        alignas(32) float tops[8];
        _mm256_store_ps(tops, top8);
        const float top = *std::max_element(tops, tops + 8);
        const __m256 shift = _mm256_set1_ps(top);
        __m256 total8 = _mm256_setzero_ps();
        for (int64_t j = 0; j < stride; j += 8) {
          const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift));
          _mm256_storeu_ps(row + j, e);
          total8 = _mm256_add_ps(total8, e);
        }
        total = HorizontalSum(total8);
#endif
        inverse[i] = 1.0f / total;
        blind |= top == lowest;
      }
      // The weighted values, four rows at a time.
      const int64_t stop = blind ? s : std::min(limit, s);
      for (int64_t i = 0; i < n; i += 4) {
        const int64_t m = std::min<int64_t>(4, n - i);
        const float* p[4];
        float* o[4];
        for (int64_t k = 0; k < m; ++k) {
          const int64_t r = r0 + i + k;
          p[k] = scores.data() + (i + k) * stride;
          o[k] = out->typed_data() + (head * rows + r) * d;
        }
        switch (m) {
          case 4: WeightedColumns<4>(p, values, s0, stop, d, inverse.data() + i, o); break;
          case 3: WeightedColumns<3>(p, values, s0, stop, d, inverse.data() + i, o); break;
          case 2: WeightedColumns<2>(p, values, s0, stop, d, inverse.data() + i, o); break;
          default: WeightedColumns<1>(p, values, s0, stop, d, inverse.data() + i, o); break;
        }
      }
    }
  };
  const int64_t total_rows = b_n * kvh * rows;
  // Threads pay where a part has work enough to cover a task's hand-off (a few microseconds).
  const int64_t parts =
      rows * s * d >= 4096 ? std::min<int64_t>(total_rows, pool.num_threads()) : 1;
  RunParts(pool, total_rows, parts, part);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_cpu_gemv, Gemv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Matrix>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_cpu_qgemv, QuantGemv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Scales>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group"));

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
