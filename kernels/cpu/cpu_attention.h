// specjax's CPU kernels: attention of a few query rows over a KV cache and a block, the arithmetic
// of specjax_cpu_attention (cpu_attention.cc): `AttendRows` computes a range of query rows.

#ifndef SPECJAX_KERNELS_CPU_ATTENTION_H_
#define SPECJAX_KERNELS_CPU_ATTENTION_H_

#include "cpu_common.h"

namespace {

// Attention of a few query rows over a KV cache and the block itself (specjax_cpu_attention): on
// XLA:CPU the two small batched products of a decode step's attention cost tens of microseconds
// each per layer, against a few microseconds of arithmetic. Per key/value
// head: scores of its G query heads x T rows against every key (cache slots, then block), the
// scale, the optional soft cap, the visibility mask (an invisible key scores float32's lowest,
// as the jnp reference writes it), a softmax, and the probability-weighted sum of values. The
// query rows of all heads are cut into one contiguous range per part of XLA's intra-op pool (see
// Attention); with AVX-512, 16 keys per block of scores and 16-wide values (docs/benchmarks.md,
// "Quiet rerun after the CPU attention kernel's rework").

// exp(x) for 8 floats: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative
// error about 2e-7), 2^n through the exponent bits; x below -87.3 gives 0, above 88.7 clamps.
// Exp8 and Exp16's constants (one method, two vector widths): the clamp range, log2(e), ln 2 split
// in a high part exact in float32 and the low remainder, and e^r's polynomial from degree 6 down.
constexpr float kExpHi = 88.7f, kExpLo = -87.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline __m256 Exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(kExpHi), lo = _mm256_set1_ps(kExpLo);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
#pragma GCC unroll 5
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
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
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLo), _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kExpHi)), _mm512_set1_ps(kExpLo));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
#pragma GCC unroll 5
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
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

// Attention of query rows [f0, f1) (of all B * KVH * G * T, ordered (b, head, g, t)) over a cache
// segment and a block segment (see `Attention` in cpu_attention.cc for the layouts).
struct AttentionArgs {
  const float* q;         // [B, T, KVH, G, D]
  const float* keys[2];   // [B, KVH, S0, D] (cache), [B, KVH, S1, D] (block)
  const float* values[2];
  const bool* visible;    // [B, T, S0 + S1]
  float* out;             // [B, KVH, G, T, D]
  int64_t b_n, t_n, kvh, g_n, d, s0, s1;
  float scale, softcap;
};

inline void AttendRows(const AttentionArgs& a, int64_t f0, int64_t f1) {
  const int64_t t_n = a.t_n, kvh = a.kvh, g_n = a.g_n, d = a.d, s0 = a.s0, s1 = a.s1;
  const int64_t s = s0 + s1;
  const int64_t rows = g_n * t_n;  // query rows per key/value head, ordered (g, t)
#if defined(__AVX512F__)
  const int64_t block = d % 16 == 0 ? 16 : 8;  // keys per block of scores
#else
  const int64_t block = 8;
#endif
  const int64_t stride = (s + 15) / 16 * 16;  // a row of scores, padded to whole key blocks
  const float lowest = -std::numeric_limits<float>::max();
  const bool* vis = a.visible;
  const float scale = a.scale, softcap = a.softcap;

  std::vector<float> scores((std::min<int64_t>(rows, f1 - f0)) * stride);
  std::vector<char> uses_t(t_n);
  std::vector<float> inverse(rows);
  for (int64_t head = f0 / rows; head * rows < f1; ++head) {
    const int64_t b = head / kvh, h = head % kvh;
    const int64_t r0 = std::max(f0, head * rows) - head * rows;
    const int64_t r1 = std::min(f1, (head + 1) * rows) - head * rows;
    const int64_t n = r1 - r0;
    const float* keys[2] = {a.keys[0] + head * s0 * d, a.keys[1] + head * s1 * d};
    const float* values[2] = {a.values[0] + head * s0 * d, a.values[1] + head * s1 * d};
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
        const float* query = a.q + (((b * t_n + t) * kvh + h) * g_n + g) * d;
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
        o[k] = a.out + (head * rows + r) * d;
      }
      switch (m) {
        case 4: WeightedColumns<4>(p, values, s0, stop, d, inverse.data() + i, o); break;
        case 3: WeightedColumns<3>(p, values, s0, stop, d, inverse.data() + i, o); break;
        case 2: WeightedColumns<2>(p, values, s0, stop, d, inverse.data() + i, o); break;
        default: WeightedColumns<1>(p, values, s0, stop, d, inverse.data() + i, o); break;
      }
    }
  }
}

}  // namespace

#endif  // SPECJAX_KERNELS_CPU_ATTENTION_H_
