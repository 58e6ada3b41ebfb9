// specjax's CPU matrix-vector products, XLA FFI custom calls (see cpu_gemv.py).
//
// specjax_cpu_gemv: y[r, o] = sum_i x[r, i] * w[o, i] for a row-major float32 weight w [out, in],
// up to eight rows of x per pass over w: the decode step of the CPU layout (one row), its verify
// blocks and a draft model's catch-up (a few rows), which should stream every weight once.
// specjax_cpu_qgemv: the same product for a quantized weight (int8 or packed int4 per group, see
// below), read at its narrow width; specjax_cpu_qgemv_offsets: int4 with a per-group offset.
// specjax_cpu_attention (cpu_attention.cc): a decode step's (or a verify block's) attention over
// the KV cache and the block, reading no cache slot that no query sees.
//
// The output rows of w are split into one part per thread of XLA's own intra-op pool (the FFI
// ThreadPool context): the caller takes parts as well, so the product never waits for a busy
// pool, and no thread of ours competes with XLA's for the cores. One row of x: four output rows at
// a time, four weight streams in flight. Several rows: a few weight rows at a time against all of
// them (see TileRows), with software prefetch ahead of each.
//
// Built by cpu_gemv.py with the host's compiler and -march=native, with cpu_attention.cc into one
// library; AVX2 and FMA are required (AVX-512 widens the float32 several-row case where the host
// has it). cpu_common.h holds what the two sources share (vectors, the thread-pool split).

#include "cpu_common.h"

namespace {

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

// y[m, r + k] for R weight rows from row r and M (<= 4) quantized rows of x. With offsets (int4
// with a per-group offset: w = scale * (q - 8) + offset), each group also adds offset times the
// row of x's sum over the group (`xsum`, precomputed as x scale times the integer sum).
template <int Bits, int M, int R, bool Prefetch, bool Offsets>
inline void IntTile(const uint8_t* q, const float* scale, const float* off, const int8_t* xq,
                    const float* xs, const float* xsum, const int32_t* xl, float* y, int64_t n,
                    int64_t out, int64_t group, int64_t r) {
  const int64_t row_bytes = Bits == 8 ? n : n / 2;
  const int64_t groups = n / group;
  __m256 acc[R][M];
#pragma GCC unroll 8
  for (int k = 0; k < R; ++k)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[k][m] = _mm256_setzero_ps();
  float extra[R][M];
#pragma GCC unroll 8
  for (int k = 0; k < R; ++k)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) extra[k][m] = 0.0f;
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
      if constexpr (Offsets) {
        const float o = off[(r + k) * groups + g];
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) extra[k][m] += o * xsum[m * groups + g];
      }
    }
  }
  for (int k = 0; k < R; ++k)
    for (int m = 0; m < M; ++m) y[m * out + r + k] = HorizontalSum(acc[k][m]) + extra[k][m];
}

template <int Bits, bool Offsets, int M, int R, int M0>
inline void IntPasses(const uint8_t* q, const float* scale, const float* off, const int8_t* xq,
                      const float* xs, const float* xsum, const int32_t* xl, float* y, int64_t n,
                      int64_t out, int64_t group, int64_t r) {
  if constexpr (M0 < M) {
    constexpr int mm = M - M0 < 4 ? M - M0 : 4;
    const int64_t groups = n / group;
    IntTile<Bits, mm, R, M0 == 0, Offsets>(q, scale, off, xq + M0 * n, xs + M0 * groups,
                                           xsum + M0 * groups, xl + M0 * groups * 8,
                                           y + M0 * out, n, out, group, r);
    IntPasses<Bits, Offsets, M, R, M0 + 4>(q, scale, off, xq, xs, xsum, xl, y, n, out, group, r);
  }
}

// Output rows [r0, r1) for M rows of x: R weight rows at a time (one row of x: four, two rows:
// two, else one), the rows of x in passes of at most four over the same (L1-resident) weights.
template <int Bits, bool Offsets, int M>
void IntRows(const uint8_t* q, const float* scale, const float* off, const int8_t* xq,
             const float* xs, const float* xsum, const int32_t* xl, float* y, int64_t n,
             int64_t out, int64_t group, int64_t r0, int64_t r1) {
  constexpr int R = M == 1 ? 4 : M == 2 ? 2 : 1;
  int64_t r = r0;
  for (; r + R <= r1; r += R)
    IntPasses<Bits, Offsets, M, R, 0>(q, scale, off, xq, xs, xsum, xl, y, n, out, group, r);
  for (; r < r1; ++r)
    IntPasses<Bits, Offsets, M, 1, 0>(q, scale, off, xq, xs, xsum, xl, y, n, out, group, r);
}

template <int Bits, bool Offsets>
void AnyIntRows(const uint8_t* q, const float* scale, const float* off, const int8_t* xq,
                const float* xs, const float* xsum, const int32_t* xl, float* y, int64_t n,
                int64_t out, int64_t group, int64_t m, int64_t r0, int64_t r1) {
#define SPECJAX_INT_ROWS(M) \
  IntRows<Bits, Offsets, M>(q, scale, off, xq, xs, xsum, xl, y, n, out, group, r0, r1)
  switch (m) {
    case 1: return SPECJAX_INT_ROWS(1);
    case 2: return SPECJAX_INT_ROWS(2);
    case 3: return SPECJAX_INT_ROWS(3);
    case 4: return SPECJAX_INT_ROWS(4);
    case 5: return SPECJAX_INT_ROWS(5);
    case 6: return SPECJAX_INT_ROWS(6);
    case 7: return SPECJAX_INT_ROWS(7);
    default: return SPECJAX_INT_ROWS(8);
  }
#undef SPECJAX_INT_ROWS
}

// int4 where n is a multiple of 64, in units of 64 weights: one 32-byte load of a row holds two
// runs of 32 (bytes 0-15: run a, weights j and j + 16 in byte j's nibbles; bytes 16-31: run b),
// so its low nibbles are [a 0-15 | b 0-15] and its high ones [a 16-31 | b 16-31]: two VNNI
// products against x permuted the same way (`PermuteUnits`) put run a's sums in lanes 0-3 and run
// b's in lanes 4-7, with no unpacking beyond a mask and a shift. The nibbles go in unsigned (u =
// q + 8, 0..15), so w = scale * u + lower with lower = offset - 8 * scale (symmetric: offset 0):
// each unit adds cvt(sums) * (scale x row scale) + lower * (the run's sum of x) / 4 per lane,
// both as [run a x4 | run b x4] vectors. Every lane is summed once at the end.

// x rows [m, n] int8 -> the same bytes per unit of 64 as [0-15, 32-47 | 16-31, 48-63].
void PermuteUnits(const int8_t* xq, int64_t m, int64_t n, int8_t* out) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < n; i += 64) {
      const int8_t* s = xq + r * n + i;
      int8_t* d = out + r * n + i;
      std::copy(s, s + 16, d);
      std::copy(s + 32, s + 48, d + 16);
      std::copy(s + 16, s + 32, d + 32);
      std::copy(s + 48, s + 64, d + 48);
    }
  }
}

// Per row of x and unit: [xs(a) x4 | xs(b) x4] and [xs(a) * sum(run a) / 4 x4 | the same for b].
void UnitFactors(const int8_t* xq, const float* xs, int64_t m, int64_t n, int64_t group,
                 float* scale8, float* sum8) {
  const int64_t groups = n / group, units = n / 64;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t u = 0; u < units; ++u) {
      for (int half = 0; half < 2; ++half) {
        const int64_t i = u * 64 + half * 32;
        int32_t total = 0;
        for (int64_t j = 0; j < 32; ++j) total += xq[r * n + i + j];
        const float x_scale = xs[r * groups + i / group];
        for (int lane = 0; lane < 4; ++lane) {
          scale8[(r * units + u) * 8 + half * 4 + lane] = x_scale;
          sum8[(r * units + u) * 8 + half * 4 + lane] = x_scale * static_cast<float>(total) * 0.25f;
        }
      }
    }
  }
}

// A weight row's per-group floats for the unit at weight i: [v(a) x4 | v(b) x4].
inline __m256 UnitPair(const float* row, int64_t i, int64_t group) {
  if (group == 32) {
    const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(row + i / 32)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  }
  return _mm256_set1_ps(row[i / group]);
}

// Eight int32 lanes: unsigned bytes u times signed bytes x, four adjacent products per lane.
inline __m256i UnsignedDot(__m256i acc, __m256i u, __m256i x) {
  if constexpr (kVnni) {
    return DpBusd(acc, u, x);
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x),
                                                   _mm256_set1_epi16(1)));
  }
}

// y[m, r + k] for R weight rows from row r and M (<= 4) rows of x (permuted, with their unit
// factors).
template <int M, int R, bool Prefetch, bool Offsets>
inline void Int4Tile(const uint8_t* q, const float* scale, const float* off, const int8_t* xp,
                     const float* scale8, const float* sum8, float* y, int64_t n, int64_t out,
                     int64_t group, int64_t r) {
  const int64_t row_bytes = n / 2, groups = n / group, units = n / 64;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 acc[R][M];
#pragma GCC unroll 8
  for (int k = 0; k < R; ++k)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[k][m] = _mm256_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {
    const int64_t i = u * 64;
    if constexpr (Prefetch) {
      const char* ahead = reinterpret_cast<const char*>(q + r * row_bytes) + R * (i / 2) +
                          kPrefetchBytes;
#pragma GCC unroll 8
      for (int64_t p = 0; p < R * 32; p += 64) _mm_prefetch(ahead + p, _MM_HINT_T0);
    }
    __m256i xlo[M], xhi[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      xlo[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * n + i));
      xhi[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * n + i + 32));
    }
#pragma GCC unroll 8
    for (int k = 0; k < R; ++k) {
      const __m256i b = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(q + (r + k) * row_bytes + i / 2));
      const __m256i lo = _mm256_and_si256(b, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
      const __m256 ws = UnitPair(scale + (r + k) * groups, i, group);
      __m256 lower = _mm256_mul_ps(ws, _mm256_set1_ps(-8.0f));
      if constexpr (Offsets) lower = _mm256_add_ps(lower, UnitPair(off + (r + k) * groups, i, group));
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m256i sums = UnsignedDot(UnsignedDot(_mm256_setzero_si256(), lo, xlo[m]), hi,
                                         xhi[m]);
        const __m256 xsv = _mm256_loadu_ps(scale8 + (m * units + u) * 8);
        const __m256 xsum = _mm256_loadu_ps(sum8 + (m * units + u) * 8);
        acc[k][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(ws, xsv), acc[k][m]);
        acc[k][m] = _mm256_fmadd_ps(lower, xsum, acc[k][m]);
      }
    }
  }
  for (int k = 0; k < R; ++k)
    for (int m = 0; m < M; ++m) y[m * out + r + k] = HorizontalSum(acc[k][m]);
}

template <bool Offsets, int M, int R, int M0>
inline void Int4Passes(const uint8_t* q, const float* scale, const float* off, const int8_t* xp,
                       const float* scale8, const float* sum8, float* y, int64_t n, int64_t out,
                       int64_t group, int64_t r) {
  if constexpr (M0 < M) {
    constexpr int mm = M - M0 < 4 ? M - M0 : 4;
    const int64_t units = n / 64;
    Int4Tile<mm, R, M0 == 0, Offsets>(q, scale, off, xp + M0 * n, scale8 + M0 * units * 8,
                                      sum8 + M0 * units * 8, y + M0 * out, n, out, group, r);
    Int4Passes<Offsets, M, R, M0 + 4>(q, scale, off, xp, scale8, sum8, y, n, out, group, r);
  }
}

template <bool Offsets, int M>
void Int4Rows(const uint8_t* q, const float* scale, const float* off, const int8_t* xp,
              const float* scale8, const float* sum8, float* y, int64_t n, int64_t out,
              int64_t group, int64_t r0, int64_t r1) {
  constexpr int R = M == 1 ? 4 : M == 2 ? 2 : 1;
  int64_t r = r0;
  for (; r + R <= r1; r += R)
    Int4Passes<Offsets, M, R, 0>(q, scale, off, xp, scale8, sum8, y, n, out, group, r);
  for (; r < r1; ++r)
    Int4Passes<Offsets, M, 1, 0>(q, scale, off, xp, scale8, sum8, y, n, out, group, r);
}

template <bool Offsets>
void AnyInt4Rows(const uint8_t* q, const float* scale, const float* off, const int8_t* xp,
                 const float* scale8, const float* sum8, float* y, int64_t n, int64_t out,
                 int64_t group, int64_t m, int64_t r0, int64_t r1) {
#define SPECJAX_INT4_ROWS(M) \
  Int4Rows<Offsets, M>(q, scale, off, xp, scale8, sum8, y, n, out, group, r0, r1)
  switch (m) {
    case 1: return SPECJAX_INT4_ROWS(1);
    case 2: return SPECJAX_INT4_ROWS(2);
    case 3: return SPECJAX_INT4_ROWS(3);
    case 4: return SPECJAX_INT4_ROWS(4);
    case 5: return SPECJAX_INT4_ROWS(5);
    case 6: return SPECJAX_INT4_ROWS(6);
    case 7: return SPECJAX_INT4_ROWS(7);
    default: return SPECJAX_INT4_ROWS(8);
  }
#undef SPECJAX_INT4_ROWS
}

constexpr int64_t kMaxRows = 8;

// One block of up to kMaxRows rows of x: a function of an output-row range.
struct Job {
  std::function<void(int64_t, int64_t)> rows;  // computes output rows [r0, r1) for every x row
  int64_t out;
  int64_t parts;
};

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
// [out, in / group] float32, offsets (int4 only; null: none) [out, in / group] float32 ->
// y [..., out] float32.
ffi::Error QuantProduct(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& q,
                        Scales& scales, const float* offsets, ffi::ResultBuffer<ffi::F32>& y,
                        int64_t bits, int64_t group) {
  if (bits != 8 && bits != 4) return ffi::Error::InvalidArgument("specjax_cpu_qgemv: bits 8 or 4");
  if (offsets != nullptr && bits != 4) {
    return ffi::Error::InvalidArgument("specjax_cpu_qgemv: offsets need bits 4");
  }
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
  if (bits == 4 && n % 64 == 0) {  // units of 64 weights (see Int4Tile)
    const int64_t units = n / 64;
    std::vector<int8_t> xp(rows * n);
    PermuteUnits(xq.data(), rows, n, xp.data());
    std::vector<float> scale8(rows * units * 8), sum8(rows * units * 8);
    UnitFactors(xq.data(), xs.data(), rows, n, group, scale8.data(), sum8.data());
    for (int64_t r = 0; r < rows; r += kMaxRows) {
      const uint8_t* qp = static_cast<const uint8_t*>(q.untyped_data());
      const float* sp = scales.typed_data();
      const int8_t* xpp = xp.data() + r * n;
      const float* s8 = scale8.data() + r * units * 8;
      const float* u8 = sum8.data() + r * units * 8;
      float* yp = y->typed_data() + r * out;
      const int64_t m = std::min(kMaxRows, rows - r);
      std::function<void(int64_t, int64_t)> fn;
      if (offsets == nullptr) {
        fn = [=](int64_t r0, int64_t r1) {
          AnyInt4Rows<false>(qp, sp, nullptr, xpp, s8, u8, yp, n, out, group, m, r0, r1);
        };
      } else {
        fn = [=](int64_t r0, int64_t r1) {
          AnyInt4Rows<true>(qp, sp, offsets, xpp, s8, u8, yp, n, out, group, m, r0, r1);
        };
      }
      Run(pool, Job{std::move(fn), out, Parts(pool, out)});
    }
    return ffi::Error::Success();
  }
  std::vector<int32_t> xl(kVnni ? rows * groups * 8 : 0);
  if (kVnni) XLaneSums(xq.data(), rows, n, group, bits == 8 ? 128 : 8, xl.data());
  // Per row of x and group: x scale times the integer sum of x over the group (the offsets' term).
  std::vector<float> xsum(offsets != nullptr ? rows * groups : 0);
  if (offsets != nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        int32_t total = 0;
        for (int64_t i = 0; i < group; ++i) total += xq[r * n + g * group + i];
        xsum[r * groups + g] = static_cast<float>(total) * xs[r * groups + g];
      }
    }
  }
  for (int64_t r = 0; r < rows; r += kMaxRows) {
    const uint8_t* qp = static_cast<const uint8_t*>(q.untyped_data());
    const float* sp = scales.typed_data();
    const int8_t* xp = xq.data() + r * n;
    const float* xsp = xs.data() + r * groups;
    const float* xsump = offsets != nullptr ? xsum.data() + r * groups : nullptr;
    const int32_t* xlp = kVnni ? xl.data() + r * groups * 8 : nullptr;
    float* yp = y->typed_data() + r * out;
    const int64_t m = std::min(kMaxRows, rows - r);
    std::function<void(int64_t, int64_t)> fn;
    if (bits == 8) {
      fn = [=](int64_t r0, int64_t r1) {
        AnyIntRows<8, false>(qp, sp, nullptr, xp, xsp, nullptr, xlp, yp, n, out, group, m, r0, r1);
      };
    } else if (offsets == nullptr) {
      fn = [=](int64_t r0, int64_t r1) {
        AnyIntRows<4, false>(qp, sp, nullptr, xp, xsp, nullptr, xlp, yp, n, out, group, m, r0, r1);
      };
    } else {
      fn = [=](int64_t r0, int64_t r1) {
        AnyIntRows<4, true>(qp, sp, offsets, xp, xsp, xsump, xlp, yp, n, out, group, m, r0, r1);
      };
    }
    Run(pool, Job{std::move(fn), out, Parts(pool, out)});
  }
  return ffi::Error::Success();
}

ffi::Error QuantGemv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                     Scales scales, ffi::ResultBuffer<ffi::F32> y, int64_t bits, int64_t group) {
  return QuantProduct(pool, x, q, scales, nullptr, y, bits, group);
}

// The same with int4 per-group offsets [out, in / group] (`QuantizedWeight.offsets`).
ffi::Error QuantGemvOffsets(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                            Scales scales, Scales offsets, ffi::ResultBuffer<ffi::F32> y,
                            int64_t bits, int64_t group) {
  if (offsets.dimensions()[0] != scales.dimensions()[0] ||
      offsets.dimensions()[1] != scales.dimensions()[1]) {
    return ffi::Error::InvalidArgument("specjax_cpu_qgemv_offsets: offsets must match scales");
  }
  return QuantProduct(pool, x, q, scales, offsets.typed_data(), y, bits, group);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_cpu_qgemv_offsets, QuantGemvOffsets,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Scales>()
                                  .Arg<Scales>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group"));
