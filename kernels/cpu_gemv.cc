// specjax's CPU matrix-vector product, an XLA FFI custom call (see cpu_gemv.py).
//
// y[r, o] = sum_i x[r, i] * w[o, i] for a row-major float32 weight w [out, in] and up to eight rows
// of x at a time: the one-row decode step of the CPU layout and its small verify blocks, which
// should stream every weight once. The rows of w are split between the calling thread and a small
// pool of persistent workers that spin briefly between calls (a decode step issues about a hundred
// of these products back to back, so a sleeping hand-off per product would cost more than the
// product), then sleep on a condition variable. One row of x: each thread computes four output
// rows at a time, which keeps four independent weight streams in flight. Several rows of x: each
// weight load serves all of them.
//
// Built by cpu_gemv.py with the host's compiler and -march=native; AVX2 and FMA are required
// (AVX-512 is used for the several-row case where the host has it).

#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

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

// How long an idle worker spins before it sleeps: longer than the gap between two products of a
// decode step (tens of microseconds), short enough not to hold a core from the rest of XLA's work.
constexpr std::chrono::microseconds kSpin(200);

// The rows of part `i` of `parts`, cut on multiples of four.
inline void PartRows(const Job& job, int64_t i, int64_t* r0, int64_t* r1) {
  const int64_t quads = (job.out + 3) / 4;
  *r0 = std::min(job.out, 4 * (quads * i / job.parts));
  *r1 = std::min(job.out, 4 * (quads * (i + 1) / job.parts));
}

class Pool {
 public:
  explicit Pool(int threads) : pid_(getpid()) {
    for (int i = 1; i < threads; ++i) std::thread([this, i] { Work(i); }).detach();
    workers_ = threads - 1;
  }

  int64_t threads() const { return workers_ + 1; }
  pid_t pid() const { return pid_; }

  // Runs `job` on the caller and the workers; false (nothing done) if another caller holds the
  // pool, in which case the caller computes alone.
  bool Run(const Job& job) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    job_ = job;
    pending_.store(workers_, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    int64_t r0, r1;
    PartRows(job, 0, &r0, &r1);
    AnyRows(job.w, job.x, job.y, job.n, job.out, job.m, r0, r1);
    while (pending_.load(std::memory_order_acquire) > 0) _mm_pause();
    return true;
  }

 private:
  void Work(int index) {
    uint64_t seen = 0;
    for (;;) {
      auto idle_since = std::chrono::steady_clock::now();
      int spins = 0;
      uint64_t now;
      while ((now = generation_.load(std::memory_order_acquire)) == seen) {
        _mm_pause();
        if (++spins < 1024) continue;
        spins = 0;
        if (std::chrono::steady_clock::now() - idle_since < kSpin) continue;
        std::unique_lock<std::mutex> lock(sleep_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_seq_cst);
        idle_since = std::chrono::steady_clock::now();
      }
      seen = now;
      const Job job = job_;
      int64_t r0, r1;
      PartRows(job, index, &r0, &r1);
      AnyRows(job.w, job.x, job.y, job.n, job.out, job.m, r0, r1);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  const pid_t pid_;
  int workers_ = 0;
  Job job_{};
  std::mutex busy_;
  std::mutex sleep_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};
};

int PoolThreads() {
  const char* env = std::getenv("SPECJAX_CPU_THREADS");
  int threads = env != nullptr ? std::atoi(env) : 0;
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(threads, 1, 64);
}

std::mutex pool_mutex;
Pool* pool = nullptr;

// The process's pool (a new one after a fork: a child has none of its parent's threads).
Pool* GetPool() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (pool == nullptr || pool->pid() != getpid()) pool = new Pool(PoolThreads());  // never freed
  return pool;
}

using Matrix = ffi::Buffer<ffi::F32, 2>;  // an alias: a macro argument cannot hold its comma

ffi::Error Gemv(ffi::Buffer<ffi::F32> x, Matrix w, ffi::ResultBuffer<ffi::F32> y) {
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
  Pool* p = GetPool();
  for (int64_t r = 0; r < rows; r += kMaxRows) {  // each group of up to 8 rows reads w once
    Job job{w.typed_data(), x.typed_data() + r * n, y->typed_data() + r * out, n, out,
            std::min(kMaxRows, rows - r), p->threads()};
    if (out < 64 || !p->Run(job)) AnyRows(job.w, job.x, job.y, n, out, job.m, 0, out);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_cpu_gemv, Gemv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Matrix>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
