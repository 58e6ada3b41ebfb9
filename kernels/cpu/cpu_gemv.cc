// specjax's CPU matrix-vector products, XLA FFI custom calls (see kernel.py).
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
// pool, and no thread of ours competes with XLA's for the cores. With AVX-512, up to six rows of x
// that fit in L1 (one row included) read one weight row at a time, a single prefetched stream;
// more rows, or longer ones, a few weight rows at a time against all of them (see TileRows). With
// AVX2, one row of x goes four output rows at a time.
//
// Built by kernel.py with the host's compiler and -march=native, with cpu_attention.cc into one
// library; AVX2 and FMA are required (AVX-512 widens the float32 several-row case where the host
// has it). cpu_common.h holds what the two sources share (vectors, the thread-pool split);
// cpu_quant.h the quantized products' arithmetic.

#include "cpu_quant.h"

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
// The float32 several-row case prefetches each weight row 1 KiB ahead (the quantized case:
// kPrefetchBytes in cpu_quant.h).
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
      // GCC folds this load into each of the R FMAs below (R * M loads of x where M suffice).
      // Pinning it to a register is faster alone but not in the model: see TileRows.
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

// Weight rows per tile for `M` rows of x (1 <= M <= 8). With one weight row at a time (M
// accumulators) the weight is one sequential stream, but every weight load is matched by M loads
// of x: fine for a few rows of x while they sit in L1, slow beyond. So past `kOneStreamRows` rows
// (three with AVX2, six with AVX-512), or when the rows of x outgrow `XInL1Bytes`, `R` weight
// rows go at a time: as many as R * M accumulators plus R weight vectors and one x vector leave
// in the register file (32 vectors with AVX-512: R = 4 up to six rows, 3 for seven and eight; 16
// with AVX2: 4, 3, then 2 up to six, then 1), and each weight row is also prefetched into L2
// `kPrefetchF32L2Bytes` ahead.
//
// These thresholds were set by paired runs of two builds (`benchmarks/experiments/kernel_ab.py`;
// docs/benchmarks.md, "The CPU kernel's several-row tiles" and "A faster `generate`"): one weight
// row at a time wins for a single row and for a few rows that fit in L1 (three to six rows of
// SmolLM2's 576-column matrices tiled ran slower), tiles win from 24 KB of x. GCC folds the x
// load into every FMA of a tile (R x M + R loads where R + M suffice); pinning x to a register
// (`asm("" : "+v"(xv))`) helped a standalone build but not the whole model, so it is not done.
template <int M>
constexpr int TileRows() {
  if (kWidth == 16) return M <= 6 ? 4 : 3;
  return M <= 2 ? 4 : M == 3 ? 3 : M <= 6 ? 2 : 1;
}
constexpr int64_t XInL1Bytes(int m) { return m == 1 || kWidth == 8 ? 32 * 1024 : 24 * 1024; }
constexpr int kOneStreamRows = kWidth == 16 ? 6 : 3;

// Output rows [r0, r1) of y = x w^T for `M` rows of x (1 <= M <= 8), one weight row or
// `TileRows<M>()` at a time (see above).
template <int M>
void BlockRows(const float* w, const float* x, float* y, int64_t n, int64_t out, int64_t r0,
               int64_t r1) {
  constexpr int R = TileRows<M>();
  constexpr bool prefetch = kPrefetchF32Bytes > 0;
  int64_t r = r0;
  if (R > 1 && (M > kOneStreamRows ||
                M * n * static_cast<int64_t>(sizeof(float)) > XInL1Bytes(M))) {
    for (; r + R <= r1; r += R) Tile<M, R, prefetch, true>(w, x, y, n, out, r);
  }
  for (; r < r1; ++r) Tile<M, 1, prefetch, false>(w, x, y, n, out, r);
}

// Output rows [r0, r1) for `m` rows of x (1 <= m <= 8).
void AnyRows(const float* w, const float* x, float* y, int64_t n, int64_t out, int64_t m,
             int64_t r0, int64_t r1) {
  switch (m) {
    case 1: return kWidth == 16 ? BlockRows<1>(w, x, y, n, out, r0, r1) : Rows(w, x, y, n, r0, r1);
    case 2: return BlockRows<2>(w, x, y, n, out, r0, r1);
    case 3: return BlockRows<3>(w, x, y, n, out, r0, r1);
    case 4: return BlockRows<4>(w, x, y, n, out, r0, r1);
    case 5: return BlockRows<5>(w, x, y, n, out, r0, r1);
    case 6: return BlockRows<6>(w, x, y, n, out, r0, r1);
    case 7: return BlockRows<7>(w, x, y, n, out, r0, r1);
    default: return BlockRows<8>(w, x, y, n, out, r0, r1);
  }
}

// ------------------------------------------------------------------------------------------------
// The panel layout (specjax_cpu_panel_gemv): a float32 weight [out, in] kept as panels of
// kPanel output columns, w[g, i, p] = W[g * kPanel + p, i] for g < ceil(out / kPanel) (the last
// panel zero-padded), each panel one contiguous stream. Every input column i gives one weight
// vector per kWidth outputs, and each row of x enters as a broadcast scalar: a tile of C weight
// vectors and M rows of x is C weight loads and M broadcasts for C * M FMAs, with its accumulators
// in registers for the whole row and no horizontal sums. Rows of x are first transposed into
// blocks of kMaxRows, `xt[b][i][kMaxRows]` (zero-padded), so a tile's broadcasts read one line.
// More than kMaxRows rows (a prompt) go block after block over each panel while it sits in L2.
// Every line of each panel row is prefetched `kPrefetchPanelBytes` ahead, and seven rows run as
// eight (an eighth row of zeros: 21 accumulators were slower than 24); the measurements that set
// both, and the panels against the row-major tiles, are in docs/benchmarks.md ("Float32 weights
// in panels").
constexpr int64_t kPanel = 48;
#ifndef SPECJAX_PREFETCH_PANEL
#define SPECJAX_PREFETCH_PANEL 8192
#endif
constexpr int64_t kPrefetchPanelBytes = SPECJAX_PREFETCH_PANEL;
constexpr int kRegisters = kWidth == 16 ? 32 : 16;
constexpr int64_t kPanelChunk = 256;

inline void VecStore(float* p, Vec v) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(p, v);
#else
  _mm256_storeu_ps(p, v);
#endif
}

// The first `count` (< kWidth) lanes of v.
inline void VecStorePart(float* p, Vec v, int64_t count) {
  alignas(64) float lanes[kWidth];
  VecStore(lanes, v);
  std::copy(lanes, lanes + count, p);
}

// y[m, o + col + j] for rows m < `rows` (<= M) and the C * kWidth columns of panel `p` from
// `col`: xt is a block of transposed rows (stride kMaxRows), y's rows `out` apart, `o` the
// panel's first output. With few accumulators, two sets take alternate input columns (the FMA
// latency, not the loads, would bound one set).
template <int M, int C>
inline void PanelTile(const float* p, int64_t n, int64_t col, const float* xt, float* y,
                      int64_t out, int64_t o, int64_t rows) {
  constexpr int S = M * C <= 8 && 2 * M * C + C + 1 <= kRegisters ? 2 : 1;
  Vec total[C][M];
  for (int k = 0; k < C; ++k)
    for (int m = 0; m < M; ++m) total[k][m] = VecZero();
  Vec acc[S][C][M];
  auto step = [&](int s, int64_t i) __attribute__((always_inline)) {
    const float* row = p + i * kPanel + col;
    Vec wv[C];
#pragma GCC unroll 8
    for (int k = 0; k < C; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(row + k * kWidth) + kPrefetchPanelBytes,
                   _MM_HINT_T0);
      wv[k] = VecLoad(row + k * kWidth);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const Vec xv = VecSet1(xt[i * kMaxRows + m]);
#pragma GCC unroll 8
      for (int k = 0; k < C; ++k) acc[s][k][m] = VecFma(wv[k], xv, acc[s][k][m]);
    }
  };
  // Input columns in chunks of kPanelChunk, each summed from zero and then added to the total:
  // the rounding of a sum grows with its length (n is up to 8960 here).
  for (int64_t start = 0; start < n; start += kPanelChunk) {
    const int64_t end = std::min(n, start + kPanelChunk);
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
      for (int k = 0; k < C; ++k)
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[s][k][m] = VecZero();
    int64_t i = start;
    for (; i + S <= end; i += S) {
#pragma GCC unroll 2
      for (int s = 0; s < S; ++s) step(s, i + s);
    }
    for (; i < end; ++i) step(0, i);
    for (int s = 0; s < S; ++s)
      for (int k = 0; k < C; ++k)
        for (int m = 0; m < M; ++m) total[k][m] = VecAdd(total[k][m], acc[s][k][m]);
  }
  for (int k = 0; k < C; ++k) {
    const int64_t first = o + col + k * kWidth;
    if (first >= out) break;
    for (int m = 0; m < M && m < rows; ++m) {
      if (first + kWidth <= out) {
        VecStore(y + m * out + first, total[k][m]);
      } else {
        VecStorePart(y + m * out + first, total[k][m], out - first);
      }
    }
  }
}

// Panel g of w against one block of `rows` (1..kMaxRows) transposed rows of x.
template <int M>
inline void PanelBlockRows(const float* w, int64_t n, int64_t g, const float* xt, float* y,
                           int64_t out, int64_t rows) {
  const float* p = w + g * n * kPanel;
  const int64_t o = g * kPanel;
  if constexpr (kWidth == 16) {
    PanelTile<M, kPanel / 16>(p, n, 0, xt, y, out, o, rows);
  }
}

void PanelBlock(const float* w, int64_t n, int64_t g, const float* xt, float* y, int64_t out,
                int64_t rows) {
  switch (rows) {
    case 1: return PanelBlockRows<1>(w, n, g, xt, y, out, rows);
    case 2: return PanelBlockRows<2>(w, n, g, xt, y, out, rows);
    case 3: return PanelBlockRows<3>(w, n, g, xt, y, out, rows);
    case 4: return PanelBlockRows<4>(w, n, g, xt, y, out, rows);
    case 5: return PanelBlockRows<5>(w, n, g, xt, y, out, rows);
    case 6: return PanelBlockRows<6>(w, n, g, xt, y, out, rows);
    default: return PanelBlockRows<8>(w, n, g, xt, y, out, rows);  // seven as eight (see above)
  }
}

// AVX2 (16 vector registers): panel g against every block of rows, one chunk of kChunkAvx2 input
// columns at a time, each chunk's sum added to the row's total. A chunk of the panel (6 KiB) is
// read from memory once and stays in L1 while every block goes through it, two rows of x against
// the panel's 48 columns per pass (one pass for one row), where a pass of 16 columns over the
// whole panel read a one-row product's panel three times from L3 or memory. The chunk size and
// the paired runs against the three-pass code are in docs/benchmarks.md ("The float32 panels on
// an AVX2 host").
#ifndef SPECJAX_CHUNK_AVX2
#define SPECJAX_CHUNK_AVX2 32
#endif
constexpr int64_t kChunkAvx2 = SPECJAX_CHUNK_AVX2;
constexpr int kPanelVecs = kPanel / kWidth;

// The sum over input columns [start, end) of panel p against M transposed rows of x (from zero).
template <int M>
__attribute__((always_inline)) inline void PanelChunkSum(const float* p, int64_t start,
                                                         int64_t end, const float* xt,
                                                         Vec (&sum)[kPanelVecs][M]) {
  for (int k = 0; k < kPanelVecs; ++k)
    for (int m = 0; m < M; ++m) sum[k][m] = VecZero();
  for (int64_t i = start; i < end; ++i) {
    const float* row = p + i * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchPanelBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchPanelBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchPanelBytes + 128, _MM_HINT_T0);
    Vec xv[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) xv[m] = VecSet1(xt[i * kMaxRows + m]);
#pragma GCC unroll 8
    for (int k = 0; k < kPanelVecs; ++k) {
      const Vec wv = VecLoad(row + k * kWidth);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) sum[k][m] = VecFma(wv, xv[m], sum[k][m]);
    }
  }
}

// Adds the chunk's sum for M rows to their totals in `acc` (rows kPanel apart).
template <int M>
inline void PanelChunkRows(const float* p, int64_t start, int64_t end, const float* xt,
                           float* acc) {
  Vec sum[kPanelVecs][M];
  PanelChunkSum<M>(p, start, end, xt, sum);
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < kPanelVecs; ++k) {
      float* a = acc + m * kPanel + k * kWidth;
      VecStore(a, VecAdd(VecLoad(a), sum[k][m]));
    }
}

// Every row of x against panel g into y; the totals of a call with one row stay in registers
// (the same additions, in the same order, as through `acc`: a row's result does not depend on
// how many rows the call has).
void PanelAllRows(const float* w, int64_t n, int64_t g, const float* xt, int64_t rows, float* y,
                  int64_t out, std::vector<float>& acc) {
  const float* p = w + g * n * kPanel;
  const int64_t o = g * kPanel;
  const int64_t width = std::min(kPanel, out - o);
  if (rows == 1) {
    Vec total[kPanelVecs];
    for (int k = 0; k < kPanelVecs; ++k) total[k] = VecZero();
    for (int64_t start = 0; start < n; start += kChunkAvx2) {
      Vec sum[kPanelVecs][1];
      PanelChunkSum<1>(p, start, std::min(n, start + kChunkAvx2), xt, sum);
      for (int k = 0; k < kPanelVecs; ++k) total[k] = VecAdd(total[k], sum[k][0]);
    }
    for (int64_t k = 0; k < kPanelVecs && k * kWidth < width; ++k) {
      if ((k + 1) * kWidth <= width) {
        VecStore(y + o + k * kWidth, total[k]);
      } else {
        VecStorePart(y + o + k * kWidth, total[k], width - k * kWidth);
      }
    }
    return;
  }
  const int64_t blocks = (rows + kMaxRows - 1) / kMaxRows;
  acc.assign(blocks * kMaxRows * kPanel, 0.0f);
  for (int64_t start = 0; start < n; start += kChunkAvx2) {
    const int64_t end = std::min(n, start + kChunkAvx2);
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = xt + b * n * kMaxRows;
      float* ab = acc.data() + b * kMaxRows * kPanel;
      const int64_t m = std::min(kMaxRows, rows - b * kMaxRows);
      for (int64_t r = 0; r < m; r += 2) {
        if (m - r == 1) {
          PanelChunkRows<1>(p, start, end, xb + r, ab + r * kPanel);
        } else {
          PanelChunkRows<2>(p, start, end, xb + r, ab + r * kPanel);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(acc.data() + r * kPanel, acc.data() + r * kPanel + width, y + r * out + o);
  }
}

// x [rows, n] -> blocks of kMaxRows rows, each [n][kMaxRows], zero-padded.
void TransposeRows(const float* x, int64_t rows, int64_t n, std::vector<float>& xt) {
  const int64_t blocks = (rows + kMaxRows - 1) / kMaxRows;
  xt.assign(blocks * n * kMaxRows, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    float* dst = xt.data() + b * n * kMaxRows;
    const int64_t m = std::min(kMaxRows, rows - b * kMaxRows);
    for (int64_t r = 0; r < m; ++r) {
      const float* src = x + (b * kMaxRows + r) * n;
      for (int64_t i = 0; i < n; ++i) dst[i * kMaxRows + r] = src[i];
    }
  }
}

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

using Panels = ffi::Buffer<ffi::F32, 3>;

// x [..., in] float32, w [ceil(out / kPanel), in, kPanel] float32 (the panel layout) ->
// y [..., out]. Any number of rows: the panels are split between the threads; each goes through
// every block of kMaxRows rows of x while it is in cache.
ffi::Error PanelGemv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Panels w,
                     ffi::ResultBuffer<ffi::F32> y, int64_t out) {
  const auto dims = w.dimensions();
  const int64_t panels = dims[0], n = dims[1];
  if (dims[2] != kPanel || out <= 0 || panels != (out + kPanel - 1) / kPanel) {
    return ffi::Error::InvalidArgument(
        "specjax_cpu_panel_gemv: w must be [ceil(out / 48), in, 48]");
  }
  const auto x_dims = x.dimensions();
  if (x_dims.size() == 0 || x_dims.back() != n) {
    return ffi::Error::InvalidArgument(
        "specjax_cpu_panel_gemv: x's last axis must match w's second");
  }
  const int64_t rows = n == 0 ? 0 : static_cast<int64_t>(x.element_count()) / n;
  if (y->element_count() != static_cast<size_t>(rows * out)) {
    return ffi::Error::InvalidArgument("specjax_cpu_panel_gemv: result has the wrong size");
  }
  if (rows == 0) return ffi::Error::Success();
  thread_local std::vector<float> xt;
  TransposeRows(x.typed_data(), rows, n, xt);
  const float* wp = w.typed_data();
  const float* xp = xt.data();
  float* yp = y->typed_data();
  const int64_t blocks = (rows + kMaxRows - 1) / kMaxRows;
  auto work = [=](int64_t g0, int64_t g1) {
    if constexpr (kWidth != 16) {  // AVX2
      thread_local std::vector<float> acc;
      for (int64_t g = g0; g < g1; ++g) PanelAllRows(wp, n, g, xp, rows, yp, out, acc);
      return;
    }
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t b = 0; b < blocks; ++b) {
        PanelBlock(wp, n, g, xp + b * n * kMaxRows, yp + b * kMaxRows * out, out,
                   std::min(kMaxRows, rows - b * kMaxRows));
      }
    }
  };
  const int64_t parts = panels < 2 ? 1 : std::max<int64_t>(1, pool.num_threads());
  RunParts(pool, panels, std::min(parts, panels), std::move(work));
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
  const QuantMatrix w{static_cast<const uint8_t*>(q.untyped_data()), scales.typed_data(), offsets,
                      out, n, group, static_cast<int>(bits)};
  PreparedRows prepared;
  PrepareRows(w, x.typed_data(), rows, prepared);
  float* y_data = y->typed_data();
  const PreparedRows* p = &prepared;
  for (int64_t r = 0; r < rows; r += kMaxRows) {  // each group of up to 8 rows reads w once
    const int64_t m = std::min(kMaxRows, rows - r);
    Run(pool, Job{[=](int64_t r0, int64_t r1) { QuantRows(w, *p, r, m, y_data, r0, r1); }, out,
                  Parts(pool, out)});
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_cpu_panel_gemv, PanelGemv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Panels>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("out"));

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
