// specjax's CPU kernels: the products of quantized weights (int8, or packed int4 per group, with
// optional int4 offsets) that cpu_gemv.cc's specjax_cpu_qgemv runs. `QuantMatrix` names a weight,
// `PrepareRows` quantizes rows of x for it once, `QuantRows` computes a range of its output rows
// from them: the pieces a caller that runs several products together can reuse.

#ifndef SPECJAX_KERNELS_CPU_QUANT_H_
#define SPECJAX_KERNELS_CPU_QUANT_H_

#include "cpu_common.h"

namespace {

// How far ahead of the bytes being read the kernel asks for the next ones: the hardware
// prefetcher alone leaves a stream that is consumed slower than DRAM delivers it latency-bound.
// The quantized case reads R rows as one contiguous span and prefetches 4 KiB ahead of its linear
// position (one core, int8, one row of x, a 151 MB matrix of 576 columns: 12 GB/s with per-row
// prefetch 1 KiB ahead, 18 with the linear 4 KiB; SmolLM2's 121 int8 products of a step: 10.6 ->
// 7.1 ms on 2 cores).
#ifndef SPECJAX_PREFETCH
#define SPECJAX_PREFETCH 4096
#endif
constexpr int64_t kPrefetchBytes = SPECJAX_PREFETCH;

// ---------------------------------------------------------------------------------------------
// Quantized weights. A weight row holds symmetric integers q per group of `group` input columns
// (a multiple of 32) with float32 scales [out, in / group]. int8: one signed byte per weight,
// row-major [out, in]. int4: [out, in / 2] bytes; in each run of 32 weights, byte j holds weight j
// in its low nibble and weight j + 16 in its high nibble, both stored as q + 8 (0..15).
//
// The rows of x are quantized too, per group of the same columns (symmetric int8: scale =
// max|x| / 127, q = round-half-even(x * (127 / max|x|))), and each run of 32 products is an
// integer dot product (vpmaddubsw + vpmaddwd, exact in int32) scaled by weight scale x row scale.
// That is the product `quant_reference` in kernel.py defines, and the arithmetic llama.cpp's
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

// A quantized weight [out, in] as the kernels read it (see above): int8 bytes or packed int4,
// float32 scales [out, in / group], optional int4 offsets (null: none).
struct QuantMatrix {
  const uint8_t* q;
  const float* scale;
  const float* offsets;
  int64_t out, n, group;
  int bits;

  // int4 in units of 64 weights (the permuted-x path), where n allows it.
  bool Units() const { return bits == 4 && n % 64 == 0; }
};

// Rows of x quantized once for a weight's columns and group: what `QuantRows` reads.
struct PreparedRows {
  int64_t m = 0;
  std::vector<int8_t> xq, xp;                 // quantized rows; permuted per unit (int4 units)
  std::vector<float> xs, scale8, sum8, xsum;  // row scales; unit factors; offsets' group sums
  std::vector<int32_t> xl;                    // VNNI lane sums (int8 and int4 without units)
};

// Quantizes `m` rows of x [m, w.n] for `w` into `p` (its buffers reused when large enough).
inline void PrepareRows(const QuantMatrix& w, const float* x, int64_t m, PreparedRows& p) {
  const int64_t n = w.n, groups = n / w.group;
  p.m = m;
  p.xq.resize(m * n);
  p.xs.resize(m * groups);
  QuantizeRows(x, m, n, w.group, p.xq.data(), p.xs.data());
  if (w.Units()) {
    const int64_t units = n / 64;
    p.xp.resize(m * n);
    PermuteUnits(p.xq.data(), m, n, p.xp.data());
    p.scale8.resize(m * units * 8);
    p.sum8.resize(m * units * 8);
    UnitFactors(p.xq.data(), p.xs.data(), m, n, w.group, p.scale8.data(), p.sum8.data());
    return;
  }
  if (kVnni) {
    p.xl.resize(m * groups * 8);
    XLaneSums(p.xq.data(), m, n, w.group, w.bits == 8 ? 128 : 8, p.xl.data());
  }
  if (w.offsets != nullptr) {  // per row and group: x scale times the integer sum over the group
    p.xsum.resize(m * groups);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        int32_t total = 0;
        for (int64_t i = 0; i < w.group; ++i) total += p.xq[r * n + g * w.group + i];
        p.xsum[r * groups + g] = static_cast<float>(total) * p.xs[r * groups + g];
      }
    }
  }
}

constexpr int64_t kMaxRows = 8;  // rows of x per pass over a weight

// y[row, o] for o in [r0, r1) and the prepared rows [row0, row0 + m) (m <= kMaxRows), y being
// [rows, out] from row row0.
inline void QuantRows(const QuantMatrix& w, const PreparedRows& p, int64_t row0, int64_t m,
                      float* y, int64_t r0, int64_t r1) {
  const int64_t n = w.n, out = w.out, groups = n / w.group;
  y += row0 * out;
  if (w.Units()) {
    const int64_t units = n / 64;
    const int8_t* xp = p.xp.data() + row0 * n;
    const float* s8 = p.scale8.data() + row0 * units * 8;
    const float* u8 = p.sum8.data() + row0 * units * 8;
    if (w.offsets == nullptr) {
      AnyInt4Rows<false>(w.q, w.scale, nullptr, xp, s8, u8, y, n, out, w.group, m, r0, r1);
    } else {
      AnyInt4Rows<true>(w.q, w.scale, w.offsets, xp, s8, u8, y, n, out, w.group, m, r0, r1);
    }
    return;
  }
  const int8_t* xq = p.xq.data() + row0 * n;
  const float* xs = p.xs.data() + row0 * groups;
  const float* xsum = w.offsets != nullptr ? p.xsum.data() + row0 * groups : nullptr;
  const int32_t* xl = kVnni ? p.xl.data() + row0 * groups * 8 : nullptr;
  if (w.bits == 8) {
    AnyIntRows<8, false>(w.q, w.scale, nullptr, xq, xs, nullptr, xl, y, n, out, w.group, m, r0, r1);
  } else if (w.offsets == nullptr) {
    AnyIntRows<4, false>(w.q, w.scale, nullptr, xq, xs, nullptr, xl, y, n, out, w.group, m, r0, r1);
  } else {
    AnyIntRows<4, true>(w.q, w.scale, w.offsets, xq, xs, xsum, xl, y, n, out, w.group, m, r0, r1);
  }
}

}  // namespace

#endif  // SPECJAX_KERNELS_CPU_QUANT_H_
