// CPU kernels for float32 that torch's CPU ops run poorly at serving shapes.
//
// What it is: functions compiled at first use by cpu_kernels.py (c++ -O3
// -march=native -fopenmp-simd) and called through ctypes, splitting their work over
// one pool of threads (the int8 matmul, the fused decode step and the glue between a
// layer's matmuls are described where they are defined, further down):
// - plimsoll_paged_decode_attention_f32: the decode half of
//   attention_torch.paged_attention's contract, one query per sequence against its
//   context read straight from the paged KV cache (no gather copy). Work is split by
//   sequence; each reads its K rows once to score every query head (GQA: query head
//   h reads KV head h / (H / Hkv)) and its V rows once to sum them (float32 with
//   head_dim 64 or 128: unrolled, each row in registers for its group of heads, the
//   next block prefetched).
//   plimsoll_paged_decode_attention_bf16 reads a bfloat16 cache (a --dtype bfloat16 engine's).
// - plimsoll_small_batch_linear_f32: x @ W.T + bias for a few rows of x (decode at
//   low concurrency), split by output rows so each thread streams its part of W
//   from memory once; at these shapes the matmul is bound by reading W.
// - plimsoll_paged_attention_f32 (further down): the ragged contract, prefill and mixed steps,
//   in tiles of a few queries of one sequence; plimsoll_paged_attention_bf16 over a bf16 cache.
// - plimsoll_bf16_linear_f32: the small-batch matmul against bfloat16 weights.
// - the glue between a layer's matmuls (add_rms_norm, rope_store, silu_mul) in float32, and in
//   _bf16 variants for a bfloat16 model's glued layers; plimsoll_to_bf16 rounds float32 to bf16.
// What it is not: large matmuls (oneDNN does those) or GPU
// kernels (Triton).
//
// Layouts (row-major, contiguous):
//   q            [B, H, D]
//   k/v_cache    [num_blocks, block_size, Hkv, D] float32, or [.., Hkv, D + 4] int8 (kv_int8.py)
//   block_tables [B, max_blocks] int32 (entries past a context are never read)
//   context_lens [B] int32
//   out          [B, H, D]
//   x [M, K], W [N, K], bias [N] or null, y [M, N]
#include <pthread.h>
#include <unistd.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

// The worker pool every kernel splits its work over.
//
// What it is: threads created once per process (grown to the most any call asked for),
// each with its own mailbox. A call posts one task per helper it needs, runs task 0
// itself, then runs any task no helper has taken yet (so a host too busy to wake a helper
// costs no more than running serially) and waits for the ones taken. A helper spins on
// its mailbox for ~200 us (PLIMSOLL_POOL_SPIN_US) after its last task, yielding its core after the first
// PAUSE_US (a decode step calls a kernel every few tens of microseconds, so it is usually
// still awake for the next one), and then sleeps on a condition variable. Starting and
// joining std::threads per call, as the kernels did before, cost ~50-100 us a call and
// ~150 calls a decode step on a 2-core host.
// Safe with several engines in one process: one call at a time owns the pool, and a
// call that finds it busy starts its own threads (the old way) instead of waiting.
// Safe across fork: the child (a template worker of `plimsoll serve`) has none of the
// parent's threads, so a fork handler drops the pool there and the child's first call
// builds a new one.
// What it is not: a general task scheduler (no nesting, no work stealing).
namespace pool {

// PLIMSOLL_POOL_SPIN_US (read when the pool starts) moves SPIN_US; 0: sleep right after each task.
int64_t spin_us() {
  static const int64_t us = [] {
    const char* env = std::getenv("PLIMSOLL_POOL_SPIN_US");
    return env != nullptr && *env != '\0' ? std::max<int64_t>(0, std::atoll(env)) : int64_t{200};
  }();
  return us;
}
constexpr int64_t PAUSE_US = 20;
constexpr int64_t MAX_HELPERS = 255;
constexpr uint64_t CLAIMED = uint64_t{1} << 63;  // set in `posted` by whoever runs the task

using TaskFn = void (*)(const void* ctx, int64_t task);

struct alignas(64) Mailbox {
  // Generation of the last task posted to this helper; CLAIMED once the helper or the
  // caller has taken it (a compare-and-swap, so exactly one of them runs it).
  std::atomic<uint64_t> posted{0};
  std::atomic<uint64_t> done{0};  // generation of the last task the helper finished
  std::atomic<bool> sleeping{false};
  std::mutex m;
  std::condition_variable cv;
  TaskFn fn = nullptr;
  const void* ctx = nullptr;
  int64_t task = 0;
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

void helper_loop(Mailbox* box) {
  uint64_t seen = 0;
  auto fresh = [&](uint64_t p) { return (p & CLAIMED) == 0 && p != seen; };
  for (;;) {
    uint64_t p = box->posted.load(std::memory_order_acquire);
    if (!fresh(p)) {
      // Spin on the core for the first PAUSE_US, then yield it between looks: on a host with
      // more runnable threads than cores (torch's OpenMP threads, other processes) a spinning
      // helper must not hold a core that another thread needs.
      const auto start = std::chrono::steady_clock::now();
      const auto until = start + std::chrono::microseconds(spin_us());
      const auto yield_after = std::min(until, start + std::chrono::microseconds(PAUSE_US));
      bool yielding = false;
      for (int i = 0; !fresh(p); ++i) {
        if (yielding) {
          std::this_thread::yield();
        } else {
          cpu_relax();
        }
        p = box->posted.load(std::memory_order_acquire);
        if ((yielding || (i & 63) == 63) && !fresh(p)) {
          const auto now = std::chrono::steady_clock::now();
          if (now > until) break;
          yielding = now > yield_after;
        }
      }
    }
    if (!fresh(p)) {
      std::unique_lock<std::mutex> lock(box->m);
      box->sleeping.store(true);
      box->cv.wait(lock, [&] { return fresh(p = box->posted.load()); });
      box->sleeping.store(false);
    }
    seen = p;
    // The caller may have taken the task while this thread was waking up: then skip it.
    if (box->posted.compare_exchange_strong(p, p | CLAIMED, std::memory_order_acq_rel)) {
      box->fn(box->ctx, box->task);
      box->done.store(seen, std::memory_order_release);
    }
  }
}

struct Pool {
  std::mutex busy;  // held by the call that owns the pool
  std::vector<Mailbox*> boxes;
  uint64_t generation = 0;

  // Helpers are never joined or freed: they live as long as the process.
  void grow(int64_t helpers) {
    while (static_cast<int64_t>(boxes.size()) < helpers) {
      auto* box = new Mailbox;
      std::thread(helper_loop, box).detach();
      boxes.push_back(box);
    }
  }
};

std::mutex g_create;
Pool* g_pool = nullptr;
// How parallel() splits a call: THREADS starts and joins threads for the call (as before the pool,
// for A/B timing), POOL posts to the helpers above, OPENMP runs it as a parallel region of the
// OpenMP runtime torch itself uses (built with -fopenmp only where that runtime is libgomp.so.1,
// so the library binds to torch's copy). OpenMP is the default where built: oneDNN's matmuls run
// on the same team, whose workers spin for a while after each region, so the next kernel's work
// starts on them at once. With a pool of its own beside them, a helper and an OpenMP worker
// fought for the second core after every matmul, and the caller often ran the whole call alone
// (decode attention, 64 sequences: 1.0 ms a layer alone, 1.8 right after a matmul).
enum Mode : int64_t { THREADS = 0, POOL = 1, OPENMP = 2 };
#if defined(_OPENMP)
constexpr int64_t kDefaultMode = OPENMP;
#else
constexpr int64_t kDefaultMode = POOL;
#endif
std::atomic<int64_t> g_mode{kDefaultMode};

// GNU libgomp is not usable in a child forked after the parent ran a parallel region (the
// child's team names threads it does not have, and the next region waits on them forever; torch's
// own matmuls hang there too): a forked child's kernels use the pool, which rebuilds itself.
void pool_after_fork() {
  int64_t openmp = OPENMP;
  g_mode.compare_exchange_strong(openmp, POOL);
}
const int g_fork_handler = pthread_atfork(nullptr, nullptr, pool_after_fork);

void drop_after_fork() {
  // The child's copy of the pool names threads that do not exist in it: leak it, and
  // the creation lock too (it may have been held by a parent thread at the fork).
  g_pool = nullptr;
  new (&g_create) std::mutex;
}

Pool* get() {
  std::lock_guard<std::mutex> lock(g_create);
  if (g_pool == nullptr) {
    static const int registered = pthread_atfork(nullptr, nullptr, drop_after_fork);
    (void)registered;
    g_pool = new Pool;
  }
  return g_pool;
}

// Runs f(0) .. f(n - 1), each once, over n threads (the caller runs f(0)); returns when all are done.
template <typename F>
void parallel(int64_t n, const F& f) {
  if (n <= 1) {
    if (n == 1) f(0);
    return;
  }
  const int64_t mode = g_mode.load(std::memory_order_relaxed);
#if defined(_OPENMP)
  if (mode == OPENMP && !omp_in_parallel()) {
    // A team smaller than n (OMP_THREAD_LIMIT, a busy runtime) takes the tasks in turn.
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(n, 1024)))
    {
      const int64_t team = omp_get_num_threads();
      for (int64_t t = omp_get_thread_num(); t < n; t += team) f(t);
    }
    return;
  }
#endif
  const TaskFn call = [](const void* ctx, int64_t task) { (*static_cast<const F*>(ctx))(task); };
  Pool* p = get();
  std::unique_lock<std::mutex> owner(p->busy, std::try_to_lock);
  if (!owner.owns_lock() || n - 1 > MAX_HELPERS || mode == THREADS) {
    std::vector<std::thread> threads;  // another call holds the pool: threads of our own
    for (int64_t t = 1; t < n; ++t) threads.emplace_back([&f, t] { f(t); });
    f(0);
    for (auto& th : threads) th.join();
    return;
  }
  p->grow(n - 1);
  const uint64_t gen = ++p->generation;
  for (int64_t t = 1; t < n; ++t) {
    Mailbox* box = p->boxes[t - 1];
    box->fn = call;
    box->ctx = &f;
    box->task = t;
    box->posted.store(gen);
    if (box->sleeping.load()) {
      std::lock_guard<std::mutex> lock(box->m);
      box->cv.notify_one();
    }
  }
  f(0);
  for (int64_t t = 1; t < n; ++t) {
    Mailbox* box = p->boxes[t - 1];
    uint64_t expected = gen;
    // A helper that has not woken yet (a busy host) does not hold the call up: its task runs here.
    if (box->posted.compare_exchange_strong(expected, gen | CLAIMED, std::memory_order_acq_rel)) {
      f(t);
      continue;
    }
    for (int i = 0; box->done.load(std::memory_order_acquire) != gen; ++i) {
      if (i < 100000) {
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
  }
}

}  // namespace pool

// The pool's helper count (threads started so far) and a no-op call that runs `n` empty
// tasks over it: cpu_kernels.py's tests and benchmarks read the overhead of a call with them.
extern "C" int64_t plimsoll_pool_threads() {
  pool::Pool* p = pool::get();
  std::lock_guard<std::mutex> lock(p->busy);
  return static_cast<int64_t>(p->boxes.size());
}

extern "C" void plimsoll_pool_enable(int64_t on) { pool::g_mode.store(on != 0 ? pool::kDefaultMode : pool::THREADS); }

// Sets how calls split their work (0 threads per call, 1 the pool, 2 OpenMP) and returns the
// mode before, or -1 (nothing changed) for a mode this build cannot run.
extern "C" int64_t plimsoll_parallel_mode(int64_t mode) {
#if defined(_OPENMP)
  const bool ok = mode >= pool::THREADS && mode <= pool::OPENMP;
#else
  const bool ok = mode == pool::THREADS || mode == pool::POOL;
#endif
  return ok ? pool::g_mode.exchange(mode) : -1;
}

extern "C" int64_t plimsoll_parallel_mode_get() { return pool::g_mode.load(); }

extern "C" int64_t plimsoll_pool_noop(int64_t n, int64_t use_pool) {
  std::atomic<int64_t> ran{0};
  auto f = [&ran](int64_t) { ran.fetch_add(1); };
  if (use_pool) {
    pool::parallel(n, f);
  } else {
    std::vector<std::thread> threads;
    for (int64_t t = 1; t < n; ++t) threads.emplace_back(f, t);
    f(0);
    for (auto& th : threads) th.join();
  }
  return ran.load();
}

namespace {

// 16 float lanes: one AVX-512 register, two AVX2 ones, or a plain array elsewhere (GCC 12
// turns vector-extension int8 -> float conversions into scalar ones, hence intrinsics).
constexpr int64_t kLanes = 16;
#if defined(__AVX512F__)
struct F16 {
  __m512 v;
};
inline F16 zero16() { return {_mm512_setzero_ps()}; }
inline F16 load_f32(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F16 load_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline F16 fma16(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F16 affine16(F16 q, float s, float z) { return {_mm512_fmadd_ps(q.v, _mm512_set1_ps(s), _mm512_set1_ps(z))}; }
inline F16 add16(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline float sum16(F16 a) { return _mm512_reduce_add_ps(a.v); }
inline F16 set16(float x) { return {_mm512_set1_ps(x)}; }
inline void store16(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
#elif defined(__AVX2__) && defined(__FMA__)
struct F16 {
  __m256 lo, hi;
};
inline F16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 load_f32(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F16 load_i8(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline F16 fma16(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 affine16(F16 q, float s, float z) {
  const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
  return {_mm256_fmadd_ps(q.lo, vs, vz), _mm256_fmadd_ps(q.hi, vs, vz)};
}
inline F16 add16(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline float sum16(F16 a) {
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_add_ps(a.lo, a.hi));
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
inline F16 set16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline void store16(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
#else
struct F16 {
  float v[kLanes];
};
inline F16 zero16() { return {}; }
inline F16 load_f32(const float* p) {
  F16 r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline F16 load_i8(const int8_t* p) {
  F16 r;
  for (int64_t l = 0; l < kLanes; ++l) r.v[l] = static_cast<float>(p[l]);
  return r;
}
inline F16 fma16(F16 a, F16 b, F16 c) {
  for (int64_t l = 0; l < kLanes; ++l) c.v[l] += a.v[l] * b.v[l];
  return c;
}
inline F16 affine16(F16 q, float s, float z) {
  for (int64_t l = 0; l < kLanes; ++l) q.v[l] = q.v[l] * s + z;
  return q;
}
inline F16 add16(F16 a, F16 b) {
  for (int64_t l = 0; l < kLanes; ++l) a.v[l] += b.v[l];
  return a;
}
inline float sum16(F16 a) {
  float t = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) t += a.v[l];
  return t;
}
inline F16 set16(float x) {
  F16 r;
  for (int64_t l = 0; l < kLanes; ++l) r.v[l] = x;
  return r;
}
inline void store16(float* p, F16 a) { std::memcpy(p, a.v, sizeof(a.v)); }
#endif

// The element a cache holds: float32 rows of D values, or int8 rows of D values followed
// by their float32 scale (attention/kv_int8.py: a row is D + 4 bytes).
template <typename T>
struct Cache;

template <>
struct Cache<float> {
  static int64_t row_len(int64_t d) { return d; }
  static float scale(const float*, int64_t) { return 1.f; }
};

template <>
struct Cache<int8_t> {
  static int64_t row_len(int64_t d) { return d + 4; }
  static float scale(const int8_t* row, int64_t d) {
    float s;
    std::memcpy(&s, row + d, sizeof s);
    return s;
  }
};

// A bfloat16 value (the cache of a --dtype bfloat16 engine): float32's upper 16 bits.
struct Bf16 {
  uint16_t bits;
  explicit operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
};

template <>
struct Cache<Bf16> {
  static int64_t row_len(int64_t d) { return d; }
  static float scale(const Bf16*, int64_t) { return 1.f; }
};

template <typename T>
struct Args {
  const float* q;
  const T* k_cache;
  const T* v_cache;
  const int32_t* block_tables;
  const int32_t* context_lens;
  float* out;
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;
};

// Calls visit(t, row) for tokens t = 0 .. ctx-1 of one sequence, in order, where row
// points at that token's [Hkv, row_len] slice of the cache: blocks are walked through the
// block table, each one read front to back.
template <typename T, typename Visit>
void for_each_token(const T* cache, const int32_t* table, int64_t ctx, int64_t bs, int64_t token_stride,
                    Visit visit) {
  for (int64_t start = 0; start < ctx; start += bs) {
    const T* block = cache + static_cast<int64_t>(table[start / bs]) * bs * token_stride;
    const int64_t n = std::min(bs, ctx - start);
    for (int64_t o = 0; o < n; ++o) visit(start + o, block + o * token_stride);
  }
}

// exp(x) for 16 (AVX-512) or 8 (AVX2) floats: 2^n * p(r) with n = round(x log2 e), r = x - n ln 2
// (ln 2 in two parts) and p the degree-6 Taylor polynomial on |r| <= ln 2 / 2 (relative error
// ~2e-7, against std::exp's 1 ulp). Inputs below -87.3 give exp(-87.3) ~ 1e-38, not 0: only
// softmax uses it, where such a weight is 0 to float32 after the sum.
#if defined(__AVX512F__)
inline __m512 exp_vec(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
constexpr int64_t kExpLanes = 16;
inline void exp_store(float* p, float mx, float& sum) {
  const __m512 e = exp_vec(_mm512_sub_ps(_mm512_loadu_ps(p), _mm512_set1_ps(mx)));
  _mm512_storeu_ps(p, e);
  sum += _mm512_reduce_add_ps(e);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_vec(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
constexpr int64_t kExpLanes = 8;
inline void exp_store(float* p, float mx, float& sum) {
  const __m256 e = exp_vec(_mm256_sub_ps(_mm256_loadu_ps(p), _mm256_set1_ps(mx)));
  _mm256_storeu_ps(p, e);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, e);
  for (const float l : lanes) sum += l;
}
#else
constexpr int64_t kExpLanes = 1;
inline void exp_store(float* p, float mx, float& sum) {
  *p = std::exp(*p - mx);
  sum += *p;
}
#endif

// s[0..n) <- softmax(s[0..n)), in place.
inline void softmax(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  float sum = 0.f;
  int64_t t = 0;
  for (; t + kExpLanes <= n; t += kExpLanes) exp_store(s + t, mx, sum);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

// One sequence, all heads: its blocks are walked in order and each token's K (then
// V) row of Hkv x D values is read once, contiguously, for every head. Splitting the
// work by (sequence, KV head) instead reads each row in three strided pieces, which
// the hardware prefetcher turns into three full reads (measured ~3x slower).
template <typename T>
void attend_seq(const Args<T>& a, int64_t seq, std::vector<float>& scores) {
  const int64_t heads = a.num_heads;
  const int64_t group = heads / a.num_kv_heads;
  const int64_t d_len = a.head_dim;
  const int64_t row_len = Cache<T>::row_len(d_len);
  const int64_t ctx = a.context_lens[seq];
  const int64_t bs = a.block_size;
  const int32_t* table = a.block_tables + seq * a.max_blocks;
  const float* q = a.q + seq * heads * d_len;  // [H, D]
  float* out = a.out + seq * heads * d_len;    // [H, D]
  const int64_t token_stride = a.num_kv_heads * row_len;
  scores.resize(static_cast<size_t>(heads * ctx));
  float* s = scores.data();  // [H, ctx]

  for_each_token(a.k_cache, table, ctx, bs, token_stride, [&](int64_t t, const T* row) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* k = row + (h / group) * row_len;
      const float* qh = q + h * d_len;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < d_len; ++d) dot += qh[d] * static_cast<float>(k[d]);
      s[h * ctx + t] = dot * Cache<T>::scale(k, d_len) * a.scale;
    }
  });
  for (int64_t h = 0; h < heads; ++h) softmax(s + h * ctx, ctx);
  std::fill(out, out + heads * d_len, 0.f);
  for_each_token(a.v_cache, table, ctx, bs, token_stride, [&](int64_t t, const T* row) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* v = row + (h / group) * row_len;
      const float w = s[h * ctx + t] * Cache<T>::scale(v, d_len);
      float* oh = out + h * d_len;
#pragma omp simd
      for (int64_t d = 0; d < d_len; ++d) oh[d] += w * static_cast<float>(v[d]);
    }
  });
}

// 16 cache values as float32 lanes: float32 as they are, bfloat16 widened (its bits shifted up).
inline F16 load_row(const float* p) { return load_f32(p); }
inline F16 load_row(const Bf16* p) {
#if defined(__AVX512F__)
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16))};
#elif defined(__AVX2__) && defined(__FMA__)
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16))};
#else
  F16 r;
  for (int64_t l = 0; l < kLanes; ++l) r.v[l] = static_cast<float>(p[l]);
  return r;
#endif
}

// bfloat16 from float32 rounded to the nearest even (as torch converts); a NaN stays a quiet NaN.
inline uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// One value, and 16 float32 lanes, stored as float32 or rounded to bfloat16.
inline void put(float* p, float v) { *p = v; }
inline void put(Bf16* p, float v) { p->bits = to_bf16_bits(v); }
inline void store_row(float* p, F16 a) { store16(p, a); }
inline void store_row(Bf16* p, F16 a) {
#if defined(__AVX512F__)
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
#else
  alignas(64) float t[kLanes];
  store16(t, a);
  for (int64_t l = 0; l < kLanes; ++l) put(p + l, t[l]);
#endif
}

// Queries rows 0 .. rows - 1 of one sequence over its float32 (or bfloat16) cache, head_dim NV x 16: query i
// sits at position first + i and sees tokens 0 .. first + i (causal; a decode row is rows = 1,
// first = ctx - 1). q and out are [rows, H, D]. Each token's K and V row of a KV head is
// loaded into registers once for every query row and head that reads it, the loops over D
// are unrolled, and the next block's row at the same offset is prefetched (blocks lie
// anywhere in the cache, so the hardware prefetcher stops at each block's end).
template <int64_t NV, typename T = float>
void attend_rows_f32(const float* q, float* out, int64_t rows, int64_t first, const T* k_cache,
                     const T* v_cache, const int32_t* table, int64_t heads, int64_t kv_heads, int64_t bs,
                     float scale, std::vector<float>& scores) {
  constexpr int64_t D = NV * kLanes;
  const int64_t group = heads / kv_heads, token_stride = kv_heads * D;
  const int64_t span = first + rows;  // tokens the last row sees
  scores.resize(static_cast<size_t>(rows * heads * span));
  float* s = scores.data();  // [rows, H, span]
  const int64_t lines = (token_stride * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  auto walk = [&](const T* cache, auto&& visit) {
    for (int64_t start = 0; start < span; start += bs) {
      const T* block = cache + static_cast<int64_t>(table[start / bs]) * bs * token_stride;
      const bool more = start + bs < span;
      const T* next = more ? cache + static_cast<int64_t>(table[start / bs + 1]) * bs * token_stride : block;
      const int64_t n = std::min(bs, span - start);
      for (int64_t o = 0; o < n; ++o) {
#if defined(__AVX2__) || defined(__AVX512F__)
        if (more) {
          const char* line = reinterpret_cast<const char*>(next + o * token_stride);
          for (int64_t l = 0; l < lines; ++l) _mm_prefetch(line + 64 * l, _MM_HINT_T0);
        }
#endif
        const int64_t t = start + o;
        visit(t, std::max<int64_t>(0, t - first), block + o * token_stride);  // rows i >= t - first see t
      }
    }
  };
  walk(k_cache, [&](int64_t t, int64_t i0, const T* row) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      F16 k[NV];
      for (int64_t j = 0; j < NV; ++j) k[j] = load_row(row + g * D + j * kLanes);
      for (int64_t i = i0; i < rows; ++i) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const float* qh = q + (i * heads + h) * D;
          F16 acc = zero16();
          for (int64_t j = 0; j < NV; ++j) acc = fma16(load_f32(qh + j * kLanes), k[j], acc);
          s[(i * heads + h) * span + t] = sum16(acc) * scale;
        }
      }
    }
  });
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t h = 0; h < heads; ++h) softmax(s + (i * heads + h) * span, first + i + 1);
  }
  std::fill(out, out + rows * heads * D, 0.f);
  walk(v_cache, [&](int64_t t, int64_t i0, const T* row) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      F16 v[NV];
      for (int64_t j = 0; j < NV; ++j) v[j] = load_row(row + g * D + j * kLanes);
      for (int64_t i = i0; i < rows; ++i) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const F16 w = set16(s[(i * heads + h) * span + t]);
          float* oh = out + (i * heads + h) * D;
          for (int64_t j = 0; j < NV; ++j) store16(oh + j * kLanes, fma16(w, v[j], load_f32(oh + j * kLanes)));
        }
      }
    }
  });
}

#if defined(__AVX512F__)
// The 16 lanes' sums of 16 vectors, lane t of the result holding acc[t]'s sum: a tree of
// 128-bit-lane shuffles and adds (~3 ops a vector, against ~8 for one horizontal sum each).
inline __m512 sum16x16(const __m512* acc) {
  __m512 x[8], y[4];
  for (int k = 0; k < 8; ++k) {  // lanes 0-7: acc[2k]'s 8 partial sums, lanes 8-15: acc[2k + 1]'s
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], 0xEE));
  }
  for (int k = 0; k < 4; ++k) {  // 128-bit lane m: token 4k + m's 4 partial sums
    y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xDD));
  }
  const __m512 z0 = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
  const __m512 z1 = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(3, 2, 3, 2)));
  // w's element 4m + k holds token 4k + m.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, w);
}

// attend_rows_f32 for a tile of several query rows (prefill), AVX-512: per KV head, scores for
// 16 tokens at a time per (row, head) with one reduction tree instead of 16 horizontal sums,
// and the weighted sum of V kept in registers for a few (row, head) pairs at a time instead of
// read and written back for every token. Same contract and result (to rounding). A bfloat16
// cache's 16 K rows are widened once into a float32 buffer for all the tile's rows and heads,
// its V rows as they are read.
template <int64_t NV, typename T>
void attend_tile_f32(const float* q, float* out, int64_t rows, int64_t first, const T* k_cache,
                     const T* v_cache, const int32_t* table, int64_t heads, int64_t kv_heads, int64_t bs,
                     float scale, std::vector<float>& scores) {
  constexpr int64_t D = NV * kLanes;
  constexpr int64_t kPairs = 24 / NV;  // (row, head) pairs whose V sums stay in registers together
  const int64_t group = heads / kv_heads, token_stride = kv_heads * D;
  const int64_t span = first + rows;
  const int64_t padded = (span + 15) / 16 * 16;
  scores.resize(static_cast<size_t>(rows * heads * padded + D));
  float* s = scores.data();  // [rows, H, padded], then D zeros (the row read past the context)
  float* zero_row = s + rows * heads * padded;
  std::fill(zero_row, zero_row + D, 0.f);
  auto row_of = [&](const T* cache, int64_t t) {
    return cache + static_cast<int64_t>(table[t / bs]) * bs * token_stride + (t % bs) * token_stride;
  };
  alignas(64) float widened[std::is_same_v<T, float> ? 1 : 16 * D];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < kv_heads; ++g) {
    for (int64_t t0 = 0; t0 < span; t0 += 16) {
      const float* k_rows[16];
      for (int64_t o = 0; o < 16; ++o) {
        if (t0 + o >= span) {
          k_rows[o] = zero_row;
          continue;
        }
        const T* kr = row_of(k_cache, t0 + o) + g * D;
        if constexpr (std::is_same_v<T, float>) {
          k_rows[o] = kr;
        } else {
          for (int64_t j = 0; j < NV; ++j) store16(widened + o * D + j * kLanes, load_row(kr + j * kLanes));
          k_rows[o] = widened + o * D;
        }
      }
      for (int64_t i = std::max<int64_t>(0, t0 - first); i < rows; ++i) {  // rows that see a token of the 16
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const float* qh = q + (i * heads + h) * D;
          __m512 qv[NV];
          for (int64_t j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(qh + j * kLanes);
          __m512 acc[16];
          for (int64_t o = 0; o < 16; ++o) {
            acc[o] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k_rows[o]));
            for (int64_t j = 1; j < NV; ++j) acc[o] = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(k_rows[o] + j * kLanes), acc[o]);
          }
          _mm512_storeu_ps(s + (i * heads + h) * padded + t0, _mm512_mul_ps(sum16x16(acc), vscale));
        }
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      float* sr = s + (i * heads + h) * padded;
      softmax(sr, first + i + 1);
      std::fill(sr + first + i + 1, sr + padded, 0.f);  // tokens after the row's own: weight 0
    }
  }
  for (int64_t g = 0; g < kv_heads; ++g) {
    const int64_t pairs = rows * group;  // pair p: row p / group, head g * group + p % group
    for (int64_t p0 = 0; p0 < pairs; p0 += kPairs) {
      const int64_t np = std::min(kPairs, pairs - p0);
      const float* w[kPairs];
      float* o_rows[kPairs];
      for (int64_t p = 0; p < np; ++p) {
        const int64_t i = (p0 + p) / group, h = g * group + (p0 + p) % group;
        w[p] = s + (i * heads + h) * padded;
        o_rows[p] = out + (i * heads + h) * D;
      }
      const int64_t last = first + (p0 + np - 1) / group + 1;  // tokens the batch's last row sees
      __m512 acc[kPairs][NV];
      for (int64_t p = 0; p < kPairs; ++p)
        for (int64_t j = 0; j < NV; ++j) acc[p][j] = _mm512_setzero_ps();
      for (int64_t t = 0; t < last; ++t) {
        const T* vr = row_of(v_cache, t) + g * D;
        __m512 v[NV];
        for (int64_t j = 0; j < NV; ++j) v[j] = load_row(vr + j * kLanes).v;
        for (int64_t p = 0; p < np; ++p) {
          const __m512 wt = _mm512_set1_ps(w[p][t]);
          for (int64_t j = 0; j < NV; ++j) acc[p][j] = _mm512_fmadd_ps(wt, v[j], acc[p][j]);
        }
      }
      for (int64_t p = 0; p < np; ++p)
        for (int64_t j = 0; j < NV; ++j) _mm512_storeu_ps(o_rows[p] + j * kLanes, acc[p][j]);
    }
  }
}
#endif

template <int64_t NV, typename T>
void attend_seq_f32(const Args<T>& a, int64_t seq, std::vector<float>& scores) {
  const int64_t offset = seq * a.num_heads * NV * kLanes;
  attend_rows_f32<NV, T>(a.q + offset, a.out + offset, 1, a.context_lens[seq] - 1, a.k_cache, a.v_cache,
                      a.block_tables + seq * a.max_blocks, a.num_heads, a.num_kv_heads, a.block_size, a.scale,
                      scores);
}

template <typename T>
void attend(const Args<T>& a, int64_t seq, std::vector<float>& scores) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, Bf16>) {
    if (a.head_dim == 64) return attend_seq_f32<4, T>(a, seq, scores);
    if (a.head_dim == 128) return attend_seq_f32<8, T>(a, seq, scores);
  }
  attend_seq(a, seq, scores);
}

template <typename T>
int paged_decode_attention(const float* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                           const int32_t* context_lens, float* out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           float scale, int64_t num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0) return 1;
  for (int64_t b = 0; b < num_seqs; ++b) {
    if (context_lens[b] <= 0 || context_lens[b] > max_blocks * block_size) return 2;
  }
  const Args<T> a{q, k_cache, v_cache, block_tables, context_lens, out,
                  num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale};
  const int64_t workers = std::max<int64_t>(1, std::min(num_threads, num_seqs));
  pool::parallel(workers, [&a, num_seqs, workers](int64_t w) {
    thread_local std::vector<float> scores;
    // Interleaved sequences: neighbours in a batch tend to have similar context lengths.
    for (int64_t b = w; b < num_seqs; b += workers) attend(a, b, scores);
  });
  return 0;
}

}  // namespace

extern "C" int plimsoll_paged_decode_attention_f32(
    const float* q, const float* k_cache, const float* v_cache, const int32_t* block_tables,
    const int32_t* context_lens, float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads) {
  return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads,
                                num_kv_heads, head_dim, block_size, max_blocks, scale, num_threads);
}

// The same over a bfloat16 cache (a --dtype bfloat16 engine's); the query and out stay float32.
extern "C" int plimsoll_paged_decode_attention_bf16(
    const float* q, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* block_tables,
    const int32_t* context_lens, float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads) {
  return paged_decode_attention(q, reinterpret_cast<const Bf16*>(k_cache), reinterpret_cast<const Bf16*>(v_cache),
                                block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads, head_dim,
                                block_size, max_blocks, scale, num_threads);
}

// The same over an int8 cache (--kv-cache-dtype int8): rows of head_dim int8 values and
// their float32 scale; head_dim is the values' count, not the row's.
extern "C" int plimsoll_paged_decode_attention_kv_int8(
    const float* q, const int8_t* k_cache, const int8_t* v_cache, const int32_t* block_tables,
    const int32_t* context_lens, float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads) {
  return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads,
                                num_kv_heads, head_dim, block_size, max_blocks, scale, num_threads);
}

// Ragged attention (prefill, chunked prefill, prefix-cache hits and decode rows in one call):
// sequence b's q_len = cu_q[b + 1] - cu_q[b] queries (rows cu_q[b] .. of q and out, [N, H, D])
// are the last q_len positions of its context_lens[b] tokens, all already in the cache; query i
// sees tokens 0 .. ctx - q_len + i. Float32 or bfloat16 cache, head_dim 64 or 128. Work goes out in tiles
// of up to kTileRows queries of one sequence (each K and V row is read once per tile) to threads
// as they finish, sequence by sequence (a causal prefill's last tiles cost the most).
// Returns 0, or a code: 1 heads, 2 a context length, 3 head_dim.
constexpr int64_t kTileRows = 8;

namespace {

// One tile: the AVX-512 tile kernel for several rows where it is built, else row by row.
template <int64_t NV, typename T>
void attend_tile(const float* q, float* out, int64_t rows, int64_t first, const T* k_cache,
                 const T* v_cache, const int32_t* table, int64_t heads, int64_t kv_heads, int64_t bs,
                 float scale, std::vector<float>& scores) {
#if defined(__AVX512F__)
  if (rows > 1) return attend_tile_f32<NV, T>(q, out, rows, first, k_cache, v_cache, table, heads, kv_heads, bs, scale, scores);
#endif
  attend_rows_f32<NV, T>(q, out, rows, first, k_cache, v_cache, table, heads, kv_heads, bs, scale, scores);
}

template <typename T>
int paged_attention(const float* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                    const int32_t* cu_q, const int32_t* context_lens, float* out, int64_t num_seqs,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                    int64_t max_blocks, float scale, int64_t num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0) return 1;
  if (head_dim != 64 && head_dim != 128) return 3;
  struct Tile {
    int64_t seq, r0, rows, cost;
  };
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = cu_q[b + 1] - cu_q[b], ctx = context_lens[b];
    if (q_len < 0 || q_len > ctx || ctx > max_blocks * block_size) return 2;
    for (int64_t r0 = 0; r0 < q_len; r0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, q_len - r0);
      tiles.push_back({b, r0, rows, rows * (ctx - q_len + r0 + rows)});
    }
  }
  // A sequence's tiles stay together (its K and V stay in cache while threads share them), the
  // costliest sequences and, within one, the costliest tiles first.
  std::vector<int64_t> seq_cost(static_cast<size_t>(num_seqs), 0);
  for (const Tile& t : tiles) seq_cost[static_cast<size_t>(t.seq)] += t.cost;
  std::sort(tiles.begin(), tiles.end(), [&seq_cost](const Tile& x, const Tile& y) {
    const int64_t cx = seq_cost[static_cast<size_t>(x.seq)], cy = seq_cost[static_cast<size_t>(y.seq)];
    if (cx != cy) return cx > cy;
    if (x.seq != y.seq) return x.seq < y.seq;
    return x.cost > y.cost;
  });
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
  const int64_t row_floats = num_heads * head_dim;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min(num_threads, n_tiles));
  pool::parallel(workers, [&](int64_t) {
    thread_local std::vector<float> scores;
    for (int64_t k = next.fetch_add(1); k < n_tiles; k = next.fetch_add(1)) {
      const Tile& tile = tiles[static_cast<size_t>(k)];
      const int64_t row = cu_q[tile.seq] + tile.r0;
      const int64_t first = context_lens[tile.seq] - (cu_q[tile.seq + 1] - cu_q[tile.seq]) + tile.r0;
      const int32_t* table = block_tables + tile.seq * max_blocks;
      const float* tq = q + row * row_floats;
      float* to = out + row * row_floats;
      if (head_dim == 64) {
        attend_tile<4>(tq, to, tile.rows, first, k_cache, v_cache, table, num_heads, num_kv_heads, block_size,
                       scale, scores);
      } else {
        attend_tile<8>(tq, to, tile.rows, first, k_cache, v_cache, table, num_heads, num_kv_heads, block_size,
                       scale, scores);
      }
    }
  });
  return 0;
}

}  // namespace

extern "C" int plimsoll_paged_attention_f32(const float* q, const float* k_cache, const float* v_cache,
                                            const int32_t* block_tables, const int32_t* cu_q,
                                            const int32_t* context_lens, float* out, int64_t num_seqs,
                                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                            int64_t block_size, int64_t max_blocks, float scale,
                                            int64_t num_threads) {
  return paged_attention(q, k_cache, v_cache, block_tables, cu_q, context_lens, out, num_seqs, num_heads,
                         num_kv_heads, head_dim, block_size, max_blocks, scale, num_threads);
}

// The same over a bfloat16 cache; the query and out stay float32.
extern "C" int plimsoll_paged_attention_bf16(const float* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                             const int32_t* block_tables, const int32_t* cu_q,
                                             const int32_t* context_lens, float* out, int64_t num_seqs,
                                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                             int64_t block_size, int64_t max_blocks, float scale,
                                             int64_t num_threads) {
  return paged_attention(q, reinterpret_cast<const Bf16*>(k_cache), reinterpret_cast<const Bf16*>(v_cache),
                         block_tables, cu_q, context_lens, out, num_seqs, num_heads, num_kv_heads, head_dim,
                         block_size, max_blocks, scale, num_threads);
}

namespace {

// dot[j] = x[j] . w for J rows of x (row stride k_len) and one row w: each element of w is
// loaded once for all J rows (measured ~15% faster at 4 rows than a dot product per row).
template <int J>
inline void dots(const float* x, const float* w, int64_t k_len, float* dot) {
  const float *x0 = x, *x1 = x + k_len, *x2 = x + 2 * k_len, *x3 = x + 3 * k_len;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  if constexpr (J == 4) {
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t k = 0; k < k_len; ++k) {
      const float wk = w[k];
      s0 += x0[k] * wk;
      s1 += x1[k] * wk;
      s2 += x2[k] * wk;
      s3 += x3[k] * wk;
    }
  } else if constexpr (J == 2) {
#pragma omp simd reduction(+ : s0, s1)
    for (int64_t k = 0; k < k_len; ++k) {
      const float wk = w[k];
      s0 += x0[k] * wk;
      s1 += x1[k] * wk;
    }
  } else {
#pragma omp simd reduction(+ : s0)
    for (int64_t k = 0; k < k_len; ++k) s0 += x0[k] * w[k];
  }
  const float all[4] = {s0, s1, s2, s3};
  for (int j = 0; j < J; ++j) dot[j] = all[j];
}

// y[m, n] (=, or += with Accumulate) x[m] . w[n] + bias[n] for output rows n_begin .. n_end - 1.
template <bool Accumulate>
void matmul_rows(const float* x, const float* w, const float* bias, float* y, int64_t m_len, int64_t n_begin,
                 int64_t n_end, int64_t n_len, int64_t k_len) {
  float d[4];
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float* wn = w + n * k_len;
    const float b = bias != nullptr ? bias[n] : 0.f;
    auto put = [&](int64_t m0, int j_len) {
      for (int j = 0; j < j_len; ++j) {
        float& out = y[(m0 + j) * n_len + n];
        out = Accumulate ? out + d[j] + b : d[j] + b;
      }
    };
    int64_t m = 0;
    for (; m + 4 <= m_len; m += 4) {
      dots<4>(x + m * k_len, wn, k_len, d);
      put(m, 4);
    }
    for (; m + 2 <= m_len; m += 2) {
      dots<2>(x + m * k_len, wn, k_len, d);
      put(m, 2);
    }
    for (; m < m_len; ++m) {
      dots<1>(x + m * k_len, wn, k_len, d);
      put(m, 1);
    }
  }
}

void linear_rows(const float* x, const float* w, const float* bias, float* y, int64_t m_len, int64_t n_begin,
                 int64_t n_end, int64_t n_len, int64_t k_len) {
  matmul_rows<false>(x, w, bias, y, m_len, n_begin, n_end, n_len, k_len);
}

}  // namespace

namespace {
void blocked_rows(const float* x, const float* w, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                  int64_t n_len, int64_t k_len);
constexpr int64_t kSmallLinearRows = 1;  // one row: a row of W at a time (matmul_rows); more: register blocks
}  // namespace

extern "C" int plimsoll_small_batch_linear_f32(const float* x, const float* w, const float* bias, float* y,
                                               int64_t m_len, int64_t n_len, int64_t k_len, int64_t num_threads) {
  if (m_len <= 0 || n_len <= 0 || k_len <= 0) return 1;
  // A thread is worth starting only for a few hundred KB of W.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, n_len * k_len / 65536));
  const int64_t chunk = (n_len + workers - 1) / workers;
  pool::parallel(workers, [=](int64_t i) {
    const int64_t n0 = std::min(n_len, i * chunk), n1 = std::min(n_len, (i + 1) * chunk);
    if (m_len <= kSmallLinearRows || bias != nullptr) {
      linear_rows(x, w, bias, y, m_len, n0, n1, n_len, k_len);
    } else {
      blocked_rows(x, w, y, m_len, n0, n1, n_len, k_len);
    }
  });
  return 0;
}

// plimsoll_bf16_linear_f32: y = x @ W.T + bias for a few float32 rows of x and bfloat16 W
// [N, K] (K a multiple of 16; a --dtype bfloat16 engine's decode, where torch's bf16 matmul
// streams W at well under the memory bandwidth). Same split as the float32 kernel; each 16
// weights are widened in registers once for a block of up to 4 rows of x.
namespace {

// MB rows of x against one row of W, its 16-weight blocks dealt round-robin to C chains of
// multiply-adds (one chain would wait on each one). Rows of W are read one after another, so
// the hardware prefetcher sees one stream across them (4 rows at a time, each only ~1 KB of
// bf16 here, measured 3x slower from memory).
template <int64_t MB, int64_t C>
inline void bf16_row(const float* xm, const Bf16* wn, float bias, float* ym, int64_t n_len, int64_t k_len) {
  F16 acc[C][MB];
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < MB; ++i) acc[c][i] = zero16();
  int64_t k = 0;
  for (; k + C * kLanes <= k_len; k += C * kLanes) {
    for (int64_t c = 0; c < C; ++c) {
      const F16 wk = load_row(wn + k + c * kLanes);
      for (int64_t i = 0; i < MB; ++i) acc[c][i] = fma16(load_f32(xm + i * k_len + k + c * kLanes), wk, acc[c][i]);
    }
  }
  for (; k < k_len; k += kLanes) {
    const F16 wk = load_row(wn + k);
    for (int64_t i = 0; i < MB; ++i) acc[0][i] = fma16(load_f32(xm + i * k_len + k), wk, acc[0][i]);
  }
  for (int64_t i = 0; i < MB; ++i) {
    F16 total = acc[0][i];
    for (int64_t c = 1; c < C; ++c) total = add16(total, acc[c][i]);
    ym[i * n_len] = sum16(total) + bias;
  }
}

void bf16_rows(const float* x, const Bf16* w, const float* bias, float* y, int64_t m_len, int64_t n_begin,
               int64_t n_end, int64_t n_len, int64_t k_len) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const Bf16* wn = w + n * k_len;
    const float b = bias != nullptr ? bias[n] : 0.f;
    int64_t m = 0;
    for (; m + 4 <= m_len; m += 4) bf16_row<4, 2>(x + m * k_len, wn, b, y + m * n_len + n, n_len, k_len);
    for (; m < m_len; ++m) bf16_row<1, 4>(x + m * k_len, wn, b, y + m * n_len + n, n_len, k_len);
  }
}

}  // namespace

extern "C" int plimsoll_bf16_linear_f32(const float* x, const uint16_t* w, const float* bias, float* y,
                                        int64_t m_len, int64_t n_len, int64_t k_len, int64_t num_threads) {
  if (m_len <= 0 || n_len <= 0 || k_len <= 0 || k_len % kLanes != 0) return 1;
  const Bf16* wb = reinterpret_cast<const Bf16*>(w);
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, n_len * k_len / 131072));
  const int64_t chunk = (n_len + workers - 1) / workers;
  pool::parallel(workers, [=](int64_t i) {
    bf16_rows(x, wb, bias, y, m_len, std::min(n_len, i * chunk), std::min(n_len, (i + 1) * chunk), n_len, k_len);
  });
  return 0;
}

// plimsoll_int8_linear_f32: y = x @ dequant(W_int8).T + bias, W int8 [N, K] with a float
// scale (and, when `offset` is not null, a float offset) per group of `group` consecutive
// inputs of a row: w = scale * q + offset (scale [N, K / group]; group = K is one per output
// row). Same split as the float32 kernel: each thread streams its rows of W once (about a
// quarter of the float32 bytes). Each 16 weights are converted to float and dequantised in
// registers (one multiply-add, shared by a block of rows of x) and then meet x in plain float
// multiply-adds; the accumulators stay vectors across groups, so a group costs no horizontal
// reduction (a per-group reduction measured 3-9x slower than one scale per row).
namespace {


// MB rows of x against NB rows of W: each 16 weights are dequantised once and meet MB rows,
// and each 16 values of x meet NB weight rows (NB x MB accumulators: 2 x 8 where 32 vector
// registers hold them, else 1 x 4).
template <int64_t MB, int64_t NB, int64_t G>
inline void int8_rows_block(const float* xm, const int8_t* wn, const float* sn, const float* zn, const float* bias,
                            float* ym, int64_t n_len, int64_t k_len, int64_t gs, int64_t groups) {
  F16 acc[NB][MB];
  for (int64_t j = 0; j < NB; ++j)
    for (int64_t i = 0; i < MB; ++i) acc[j][i] = zero16();
  const int64_t size = G > 0 ? G : gs;
  for (int64_t g = 0; g < groups; ++g) {
    float s[NB], z[NB];
    for (int64_t j = 0; j < NB; ++j) {
      s[j] = sn[j * groups + g];
      z[j] = zn != nullptr ? zn[j * groups + g] : 0.f;
    }
    for (int64_t k = g * size; k < (g + 1) * size; k += kLanes) {
      F16 wk[NB];
      for (int64_t j = 0; j < NB; ++j) wk[j] = affine16(load_i8(wn + j * k_len + k), s[j], z[j]);
      for (int64_t i = 0; i < MB; ++i) {
        const F16 xv = load_f32(xm + i * k_len + k);
        for (int64_t j = 0; j < NB; ++j) acc[j][i] = fma16(xv, wk[j], acc[j][i]);
      }
    }
  }
  for (int64_t j = 0; j < NB; ++j)
    for (int64_t i = 0; i < MB; ++i) ym[i * n_len + j] = sum16(acc[j][i]) + (bias != nullptr ? bias[j] : 0.f);
}

// G > 0: the group size as a compile-time constant (a multiple of 16); G = 0 takes it from
// `group` (any multiple of 16, e.g. a whole row).
template <int64_t G>
void int8_linear_rows_g(const float* x, const int8_t* w, const float* scale, const float* offset,
                        const float* bias, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                        int64_t n_len, int64_t k_len, int64_t group) {
  const int64_t gs = G > 0 ? G : group;
  const int64_t groups = k_len / gs;
  // A shift for a compile-time group; a run-time one is a whole row in practice (no division).
  auto group_of = [gs, groups](int64_t k) -> int64_t { return G > 0 ? k / G : groups == 1 ? 0 : k / gs; };
#if defined(__AVX512F__)
  // Pairs of W rows over blocks of 8 rows of x; what is left goes row by row below.
  int64_t p = n_begin;
  const int64_t m8 = m_len / 8 * 8;
  if (m8 > 0) {
    for (; p + 2 <= n_end; p += 2) {
      const float* zn = offset != nullptr ? offset + p * groups : nullptr;
      const float* bn = bias != nullptr ? bias + p : nullptr;
      for (int64_t m = 0; m < m8; m += 8)
        int8_rows_block<8, 2, G>(x + m * k_len, w + p * k_len, scale + p * groups, zn, bn, y + m * n_len + p, n_len,
                                 k_len, gs, groups);
    }
    for (; p < n_end; ++p) {
      const float* zn = offset != nullptr ? offset + p * groups : nullptr;
      const float* bn = bias != nullptr ? bias + p : nullptr;
      for (int64_t m = 0; m < m8; m += 8)
        int8_rows_block<8, 1, G>(x + m * k_len, w + p * k_len, scale + p * groups, zn, bn, y + m * n_len + p, n_len,
                                 k_len, gs, groups);
    }
  }
#else
  const int64_t m8 = 0;
#endif
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* wn = w + n * k_len;
    const float* sn = scale + n * groups;
    const float* zn = offset != nullptr ? offset + n * groups : nullptr;
    const float b = bias != nullptr ? bias[n] : 0.f;
    int64_t m = m8;
    for (; m + 4 <= m_len; m += 4)
      int8_rows_block<4, 1, G>(x + m * k_len, wn, sn, zn, bias != nullptr ? bias + n : nullptr, y + m * n_len + n,
                               n_len, k_len, gs, groups);
    for (; m < m_len; ++m) {
      // Four chains over the row (a group of 32 is only two blocks of 16): one chain would
      // wait on each multiply-add.
      const float* xm = x + m * k_len;
      F16 acc[4] = {zero16(), zero16(), zero16(), zero16()};
      int64_t k = 0;
      for (; k + 4 * kLanes <= k_len; k += 4 * kLanes) {
        for (int64_t j = 0; j < 4; ++j) {
          const int64_t kj = k + j * kLanes, g = group_of(kj);
          const F16 wk = affine16(load_i8(wn + kj), sn[g], zn != nullptr ? zn[g] : 0.f);
          acc[j] = fma16(load_f32(xm + kj), wk, acc[j]);
        }
      }
      for (; k < k_len; k += kLanes) {
        const int64_t g = group_of(k);
        acc[0] = fma16(load_f32(xm + k), affine16(load_i8(wn + k), sn[g], zn != nullptr ? zn[g] : 0.f), acc[0]);
      }
      y[m * n_len + n] = sum16(add16(add16(acc[0], acc[1]), add16(acc[2], acc[3]))) + b;
    }
  }
}

void int8_linear_rows(const float* x, const int8_t* w, const float* scale, const float* offset,
                      const float* bias, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                      int64_t n_len, int64_t k_len, int64_t group) {
  if (group == 32)
    return int8_linear_rows_g<32>(x, w, scale, offset, bias, y, m_len, n_begin, n_end, n_len, k_len, group);
  if (group == 64)
    return int8_linear_rows_g<64>(x, w, scale, offset, bias, y, m_len, n_begin, n_end, n_len, k_len, group);
  int8_linear_rows_g<0>(x, w, scale, offset, bias, y, m_len, n_begin, n_end, n_len, k_len, group);
}

}  // namespace

extern "C" int plimsoll_int8_linear_f32(const float* x, const int8_t* w, const float* scale, const float* offset,
                                        const float* bias, float* y, int64_t m_len, int64_t n_len, int64_t k_len,
                                        int64_t group, int64_t num_threads) {
  if (m_len <= 0 || n_len <= 0 || k_len <= 0 || group <= 0 || k_len % group != 0 || group % kLanes != 0) return 1;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, n_len * k_len / 262144));
  const int64_t chunk = (n_len + workers - 1) / workers;
  pool::parallel(workers, [=](int64_t i) {
    int8_linear_rows(x, w, scale, offset, bias, y, m_len, std::min(n_len, i * chunk),
                     std::min(n_len, (i + 1) * chunk), n_len, k_len, group);
  });
  return 0;
}

namespace {

// y[m, n0..n0+NB) for MB rows of x: NB rows of W against MB rows of x, 16 inputs at a time, so
// each load of W serves MB rows and each load of x serves NB (register blocking).
// With `ahead` (not null), the line of the next W block that matches each line read is
// prefetched: the block after this one, read while this one's rows of x are worked through.
template <int64_t MB, int64_t NB>
inline void f32_rows_block(const float* xm, const float* wn, float* ym, int64_t n_len, int64_t k_len,
                           const float* ahead = nullptr) {
  F16 acc[NB][MB];
  for (int64_t j = 0; j < NB; ++j)
    for (int64_t i = 0; i < MB; ++i) acc[j][i] = zero16();
  int64_t k = 0;
  for (; k + kLanes <= k_len; k += kLanes) {
#if defined(__AVX2__) || defined(__AVX512F__)
    if (ahead != nullptr) {
      for (int64_t j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * k_len + k), _MM_HINT_T1);
    }
#endif
    F16 wk[NB];
    for (int64_t j = 0; j < NB; ++j) wk[j] = load_f32(wn + j * k_len + k);
    for (int64_t i = 0; i < MB; ++i) {
      const F16 xv = load_f32(xm + i * k_len + k);
      for (int64_t j = 0; j < NB; ++j) acc[j][i] = fma16(xv, wk[j], acc[j][i]);
    }
  }
  for (int64_t j = 0; j < NB; ++j)
    for (int64_t i = 0; i < MB; ++i) {
      float v = sum16(acc[j][i]);
      for (int64_t t = k; t < k_len; ++t) v += xm[i * k_len + t] * wn[j * k_len + t];
      ym[i * n_len + j] = v;
    }
}

#if defined(__AVX512F__)
constexpr int64_t kBlockM = 4, kBlockN = 4;  // 16 accumulators of 32 registers
#else
constexpr int64_t kBlockM = 2, kBlockN = 2;  // AVX2: a 16-float vector is two of its 16 registers
#endif

// y[:, n_begin..n_end) = x @ W[n_begin..n_end).T for a decode batch of more than a few rows: each
// block of W rows is read from memory once and kept in L1 while every row of x meets it.
// NB rows of W from row n against every row of x: whole blocks of kBlockM rows, then one at a time.
constexpr int64_t kAheadBlocks = 3;
// The first block of rows of x prefetches the next NB rows of W (`ahead`, null for the last).
template <int64_t NB>
void blocked_column(const float* x, const float* w, float* y, int64_t m_len, int64_t n, int64_t n_len,
                    int64_t k_len, const float* ahead) {
  int64_t m = 0;
  for (; m + kBlockM <= m_len; m += kBlockM, ahead = nullptr)
    f32_rows_block<kBlockM, NB>(x + m * k_len, w + n * k_len, y + m * n_len + n, n_len, k_len, ahead);
  for (; m < m_len; ++m, ahead = nullptr)
    f32_rows_block<1, NB>(x + m * k_len, w + n * k_len, y + m * n_len + n, n_len, k_len, ahead);
}

void blocked_rows(const float* x, const float* w, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                  int64_t n_len, int64_t k_len) {
  int64_t n = n_begin;
  for (; n + kBlockN <= n_end; n += kBlockN) {
    const float* ahead = n + (kAheadBlocks + 1) * kBlockN <= n_end ? w + (n + kAheadBlocks * kBlockN) * k_len : nullptr;
    blocked_column<kBlockN>(x, w, y, m_len, n, n_len, k_len, ahead);
  }
  for (; n < n_end; ++n) blocked_column<1>(x, w, y, m_len, n, n_len, k_len, nullptr);
}

}  // namespace

// plimsoll_packed_linear_f32: y (=, or += with accumulate) x @ W.T + bias for float32 x [M, K]
// and W [N, K] packed once into column panels (plimsoll_pack_f32): panel p holds W's rows
// p*C .. p*C+C-1 as K rows of C floats (C = kPanelCols; the last panel zero-padded), so one
// step of k reads C consecutive weights, each x[m, k] is broadcast once for them, and a block
// of up to kPanelRows rows of x keeps its C outputs a row in registers for the whole of K:
// outer products, no horizontal sums, every multiply-add useful. A panel (K * C * 4 bytes,
// 110-295 KB for SmolLM2) is read from memory by the first block of rows and from L2 by the
// others. Packed with `parts` > 1, W's rows are that many equal parts each packed on its own
// (gate_up: gate's panels, then up's), so a column range of one part is whole panels.
// Figures against the plain-row kernel (blocked_rows) and oneDNN: docs/runtime.md
// ("Weights in column panels").
namespace {

#if defined(__AVX512F__)
constexpr int64_t kPanelCols = 48;  // three vectors: 8 rows x 3 = 24 accumulators of 32 registers
constexpr int64_t kPanelRows = 8;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kPanelCols = 16;  // one F16, two registers: 6 rows x 2 = 12 accumulators of 16
constexpr int64_t kPanelRows = 6;
#else
constexpr int64_t kPanelCols = 16;
constexpr int64_t kPanelRows = 4;
#endif
constexpr int64_t kPanelVecs = kPanelCols / kLanes;

inline int64_t panels_of(int64_t n_len) { return (n_len + kPanelCols - 1) / kPanelCols; }

// MR rows of x (row stride ldx) against one panel: y[r, 0..cols) for r < MR (row stride ldy).
template <int64_t MR, bool Accumulate>
inline void panel_block(const float* x, int64_t ldx, const float* panel, const float* bias, float* y, int64_t ldy,
                        int64_t cols, int64_t k_len) {
  // Few rows make few chains of multiply-adds, each waiting on its last: S sets of accumulators
  // take every S-th k (one row: 4 sets, 12 chains), summed once at the end.
  constexpr int64_t S = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  F16 acc[S][MR][kPanelVecs];
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = 0; r < MR; ++r)
      for (int64_t v = 0; v < kPanelVecs; ++v) acc[s][r][v] = zero16();
  auto step = [&](int64_t s, int64_t k) {
    const float* pk = panel + k * kPanelCols;
    F16 w[kPanelVecs];
    for (int64_t v = 0; v < kPanelVecs; ++v) w[v] = load_f32(pk + v * kLanes);
    for (int64_t r = 0; r < MR; ++r) {
      const F16 b = set16(x[r * ldx + k]);
      for (int64_t v = 0; v < kPanelVecs; ++v) acc[s][r][v] = fma16(b, w[v], acc[s][r][v]);
    }
  };
  int64_t k = 0;
  for (; k + S <= k_len; k += S)
    for (int64_t s = 0; s < S; ++s) step(s, k + s);
  for (; k < k_len; ++k) step(0, k);
  for (int64_t s = 1; s < S; ++s)
    for (int64_t r = 0; r < MR; ++r)
      for (int64_t v = 0; v < kPanelVecs; ++v) acc[0][r][v] = add16(acc[0][r][v], acc[s][r][v]);
  for (int64_t r = 0; r < MR; ++r) {
    float* yr = y + r * ldy;
    if (cols == kPanelCols) {
      for (int64_t v = 0; v < kPanelVecs; ++v) {
        F16 out = acc[0][r][v];
        if (bias != nullptr) out = add16(out, load_f32(bias + v * kLanes));
        if constexpr (Accumulate) out = add16(load_f32(yr + v * kLanes), out);
        store16(yr + v * kLanes, out);
      }
    } else {
      alignas(64) float t[kPanelCols];
      for (int64_t v = 0; v < kPanelVecs; ++v) store16(t + v * kLanes, acc[0][r][v]);
      for (int64_t c = 0; c < cols; ++c) {
        const float out = bias != nullptr ? t[c] + bias[c] : t[c];
        yr[c] = Accumulate ? yr[c] + out : out;
      }
    }
  }
}

template <bool Accumulate, int64_t MR = kPanelRows>
inline void panel_block_of(int64_t rows, const float* x, int64_t ldx, const float* panel, const float* bias, float* y,
                           int64_t ldy, int64_t cols, int64_t k_len) {
  if (rows == MR) {
    panel_block<MR, Accumulate>(x, ldx, panel, bias, y, ldy, cols, k_len);
  } else if constexpr (MR > 1) {
    panel_block_of<Accumulate, MR - 1>(rows, x, ldx, panel, bias, y, ldy, cols, k_len);
  }
}

// Panels [p0, p1) of one packed part (n_len columns) for all m_len rows, in blocks of rows as even
// as kPanelRows allows (12 rows: 6 + 6, not 8 + 4).
template <bool Accumulate>
void packed_panels(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t ldy,
                   int64_t m_len, int64_t n_len, int64_t k_len, int64_t p0, int64_t p1) {
  const int64_t blocks = (m_len + kPanelRows - 1) / kPanelRows;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kPanelCols, cols = std::min(kPanelCols, n_len - n0);
    const float* panel = packed + p * k_len * kPanelCols;
    const float* b = bias != nullptr ? bias + n0 : nullptr;
    for (int64_t blk = 0, m = 0; blk < blocks; ++blk) {
      const int64_t rows = (m_len - m + (blocks - blk) - 1) / (blocks - blk);
      panel_block_of<Accumulate>(rows, x + m * ldx, ldx, panel, b, y + m * ldy + n0, ldy, cols, k_len);
      m += rows;
    }
  }
}

// Threads for a packed matmul: one per 256 KB of W (streaming it is the work at a few rows) or per
// ~1 MFLOP, at most num_threads.
int64_t packed_workers(int64_t m_len, int64_t n_len, int64_t k_len, int64_t num_threads) {
  const int64_t work = std::max(n_len * k_len / 65536, m_len * n_len * k_len / (1 << 19));
  return std::max<int64_t>(1, std::min(num_threads, work));
}

// The panels of `parts` equal parts dealt out in contiguous runs (each thread streams its own).
template <bool Accumulate>
void packed_linear(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t ldy,
                   int64_t m_len, int64_t n_len, int64_t k_len, int64_t parts, int64_t num_threads) {
  const int64_t part_n = n_len / parts, part_panels = panels_of(part_n), total = parts * part_panels;
  const int64_t workers = std::min(total, packed_workers(m_len, n_len, k_len, num_threads));
  const int64_t chunk = (total + workers - 1) / workers;
  pool::parallel(workers, [=](int64_t t) {
    for (int64_t u = t * chunk, end = std::min(total, (t + 1) * chunk); u < end;) {
      const int64_t part = u / part_panels, p0 = u % part_panels;
      const int64_t p1 = std::min(part_panels, p0 + (end - u));
      const float* part_packed = packed + part * part_panels * k_len * kPanelCols;
      const float* part_bias = bias != nullptr ? bias + part * part_n : nullptr;
      packed_panels<Accumulate>(x, ldx, part_packed, part_bias, y + part * part_n, ldy, m_len, part_n, k_len, p0, p1);
      u += p1 - p0;
    }
  });
}

}  // namespace

// plimsoll_fma_peak: GFLOP/s of float32 multiply-adds over `num_threads` tasks of the pool, each
// `iters` rounds of independent vector chains (enough of them to hide an FMA's latency; no memory
// traffic): the most any float32 matmul can reach here (bench/hostprobe.py's ceiling).
extern "C" double plimsoll_fma_peak(int64_t iters, int64_t num_threads) {
#if defined(__AVX512F__)
  constexpr int kChains = 12;
#else
  constexpr int kChains = 6;  // two registers a chain with AVX2: 12 of 16
#endif
  std::atomic<int64_t> nonzero{0};
  const auto start = std::chrono::steady_clock::now();
  pool::parallel(num_threads, [&](int64_t t) {
    F16 acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = set16(0.001f * static_cast<float>(c + t));
    const F16 a = set16(0.9999f), b = set16(1e-4f);
    for (int64_t i = 0; i < iters; ++i)
      for (int c = 0; c < kChains; ++c) acc[c] = fma16(acc[c], a, b);
    float total = 0.f;
    for (int c = 0; c < kChains; ++c) total += sum16(acc[c]);
    if (total != 0.f) nonzero.fetch_add(1);  // the sums are used: the loop cannot be dropped
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return nonzero.load() > 0 ? 2.0 * kLanes * kChains * static_cast<double>(iters * num_threads) / seconds / 1e9 : 0.0;
}

// Floats a weight of n_len x k_len packed in `parts` parts takes (0: parts does not divide n_len).
extern "C" int64_t plimsoll_packed_f32_floats(int64_t n_len, int64_t k_len, int64_t parts) {
  if (n_len <= 0 || k_len <= 0 || parts <= 0 || n_len % parts != 0) return 0;
  return parts * panels_of(n_len / parts) * k_len * kPanelCols;
}

extern "C" int64_t plimsoll_packed_f32_panel_cols() { return kPanelCols; }

// out (plimsoll_packed_f32_floats(n_len, k_len, parts) floats) = W [n_len, k_len] in panels.
extern "C" int plimsoll_pack_f32(const float* w, float* out, int64_t n_len, int64_t k_len, int64_t parts,
                                 int64_t num_threads) {
  if (plimsoll_packed_f32_floats(n_len, k_len, parts) == 0) return 1;
  const int64_t part_n = n_len / parts, part_panels = panels_of(part_n), total = parts * part_panels;
  const int64_t workers = std::max<int64_t>(1, std::min(num_threads, total));
  pool::parallel(workers, [=](int64_t t) {
    for (int64_t u = t; u < total; u += workers) {
      const int64_t part = u / part_panels, p = u % part_panels;
      float* panel = out + u * k_len * kPanelCols;
      for (int64_t j = 0; j < kPanelCols; ++j) {
        const int64_t n = p * kPanelCols + j;  // row of the part
        const float* row = n < part_n ? w + (part * part_n + n) * k_len : nullptr;
        for (int64_t k = 0; k < k_len; ++k) panel[k * kPanelCols + j] = row != nullptr ? row[k] : 0.f;
      }
    }
  });
  return 0;
}

// x [m_len rows, row stride ldx], y [m_len rows, row stride ldy]; bias [n_len] or null.
extern "C" int plimsoll_packed_linear_f32(const float* x, int64_t ldx, const float* packed, const float* bias, float* y,
                                          int64_t ldy, int64_t m_len, int64_t n_len, int64_t k_len, int64_t parts,
                                          int64_t accumulate, int64_t num_threads) {
  if (m_len <= 0 || plimsoll_packed_f32_floats(n_len, k_len, parts) == 0 || ldx < k_len || ldy < n_len) return 1;
  if (accumulate != 0)
    packed_linear<true>(x, ldx, packed, bias, y, ldy, m_len, n_len, k_len, parts, num_threads);
  else
    packed_linear<false>(x, ldx, packed, bias, y, ldy, m_len, n_len, k_len, parts, num_threads);
  return 0;
}

// plimsoll_fused_decode_f32: every decoder layer of a decode step for a few sequences, one
// call per step. Per layer: RMSNorm -> qkv matmul -> RoPE on q and k -> k and v stored in
// their slots of the paged cache -> paged decode attention -> o_proj added to the residual
// -> RMSNorm -> gate_up matmul with SiLU(gate) * up -> down added to the residual.
// What it is: the plain Llama/SmolLM2 layer (no biases, no q/k norm, SiLU MLP) in float32,
// with a float32 cache, for rows that are one decode token each (models/fused_decode.py
// decides); the matmuls split by output rows over the pool as small_batch_linear does,
// the norms, RoPE and stores run on the calling thread (microseconds at these sizes).
// What it is not: prefill, LoRA, int8 weights or KV, biases, tensor parallelism.
//
// layers [L, 8] int64: addresses of input_layernorm.weight [hidden], qkv_proj.weight
// [(H + 2 Hkv) D, hidden], o_proj.weight [hidden, H D], post_attention_layernorm.weight,
// gate_up_proj.weight [2 I, hidden], down_proj.weight [hidden, I], k_cache, v_cache.
// x [M, hidden] (in: embeddings, out: the last layer's output), cos/sin [M, D] (the
// attention scaling already in), slots [M] int64 (-1: do not store), block_tables
// [M, max_blocks] int32, context_lens [M] int32 (the new token included).
namespace {

int64_t split_for(int64_t n_len, int64_t k_len, int64_t num_threads) {
  return std::max<int64_t>(1, std::min<int64_t>(num_threads, n_len * k_len / 65536));
}

template <typename O>
void rms_norm(const float* x, const float* weight, O* out, int64_t m_len, int64_t dim, float eps) {
  for (int64_t m = 0; m < m_len; ++m) {
    const float* xm = x + m * dim;
    // Two vector accumulators (the adds' latency, not their rate, bounds one), then the tail.
    F16 acc0 = zero16(), acc1 = zero16();
    int64_t d = 0;
    for (; d + 2 * kLanes <= dim; d += 2 * kLanes) {
      const F16 a = load_f32(xm + d), b = load_f32(xm + d + kLanes);
      acc0 = fma16(a, a, acc0);
      acc1 = fma16(b, b, acc1);
    }
    for (; d + kLanes <= dim; d += kLanes) {
      const F16 a = load_f32(xm + d);
      acc0 = fma16(a, a, acc0);
    }
    float sq = sum16(add16(acc0, acc1));
    for (; d < dim; ++d) sq += xm[d] * xm[d];
    const float inv = 1.f / std::sqrt(sq / static_cast<float>(dim) + eps);
    O* om = out + m * dim;
    const F16 vinv = set16(inv);
    d = 0;
    for (; d + kLanes <= dim; d += kLanes)
      store_row(om + d, fma16(fma16(load_f32(xm + d), vinv, zero16()), load_f32(weight + d), zero16()));
    for (; d < dim; ++d) put(om + d, xm[d] * inv * weight[d]);
  }
}

// x * cos + rotate_half(x) * sin for one head of D values (models/llama.apply_rope).
template <typename I, typename O>
void rope(const I* x, const float* cos, const float* sin, O* out, int64_t d_len) {
  const int64_t half = d_len / 2;
  auto at = [x](int64_t d) { return static_cast<float>(x[d]); };
  for (int64_t d = 0; d < half; ++d) put(out + d, at(d) * cos[d] - at(d + half) * sin[d]);
  for (int64_t d = half; d < d_len; ++d) put(out + d, at(d) * cos[d] + at(d - half) * sin[d]);
}

// Rows [m0, m1) of a qkv projection's output (row stride qkv_stride: q heads, k heads, v heads):
// RoPE on q into q_out [M, H, D], and, for rows whose slot is >= 0, RoPE'd k and plain v into
// that slot of the caches ([slots, Hkv, D]). The caller checks slots against the cache's size.
// T: the projection's output and the cache, float32 or bfloat16 (q_out stays float32).
template <typename T>
void rope_store_rows(const T* qkv, int64_t qkv_stride, float* q_out, T* k_cache, T* v_cache,
                     const float* cos, const float* sin, const int64_t* slots, int64_t m0, int64_t m1,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  for (int64_t m = m0; m < m1; ++m) {
    const T* row = qkv + m * qkv_stride;
    const float* c = cos + m * head_dim;
    const float* s = sin + m * head_dim;
    for (int64_t hh = 0; hh < num_heads; ++hh)
      rope(row + hh * head_dim, c, s, q_out + (m * num_heads + hh) * head_dim, head_dim);
    if (slots[m] < 0) continue;
    T* k_dst = k_cache + slots[m] * kv_size;
    for (int64_t hh = 0; hh < num_kv_heads; ++hh)
      rope(row + q_size + hh * head_dim, c, s, k_dst + hh * head_dim, head_dim);
    std::memcpy(v_cache + slots[m] * kv_size, row + q_size + kv_size, sizeof(T) * kv_size);
  }
}

// act[m, i] = SiLU(gate[m, i]) * up[m, i] for rows [m0, m1) and columns [i0, i1), where row m of
// gate_up holds `inter` gate values then `inter` up values (models/llama.MLP). SiLU(g) =
// g / (1 + exp(-g)) with exp_vec on whole vectors (its argument capped at 88, where exp is
// still finite; SiLU there is -0 to float32 either way).
template <typename T>
void silu_mul(const T* gate_up, T* act, int64_t m0, int64_t m1, int64_t i0, int64_t i1, int64_t inter) {
  for (int64_t m = m0; m < m1; ++m) {
    const T* g = gate_up + m * 2 * inter;
    const T* u = g + inter;
    T* o = act + m * inter;
    int64_t i = i0;
    if constexpr (std::is_same_v<T, float>) {
#if defined(__AVX512F__)
      for (; i + 16 <= i1; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = exp_vec(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(88.f)));
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= i1; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp_vec(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(88.f)));
        const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
      }
#endif
    } else {
#if defined(__AVX512F__)
      // bfloat16 in and out: widened to float32 lanes, rounded back once.
      for (; i + kLanes <= i1; i += kLanes) {
        const __m512 gv = load_row(g + i).v;
        const __m512 e = exp_vec(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(88.f)));
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        store_row(o + i, F16{_mm512_mul_ps(silu, load_row(u + i).v)});
      }
#endif
    }
    for (; i < i1; ++i) {
      const float gi = static_cast<float>(g[i]);
      put(o + i, gi / (1.f + std::exp(-gi)) * static_cast<float>(u[i]));
    }
  }
}

// Rows [m0, m1): x[m] += delta[m] (delta null: nothing added), then h[m] = RMSNorm(x[m]) * weight.
// T: delta's and h's type, float32 or bfloat16 (the float32 residual x of a bfloat16 model's glue).
template <typename T>
void add_rms_norm_rows(float* x, const T* delta, const float* weight, T* h, int64_t m0, int64_t m1,
                       int64_t dim, float eps) {
  for (int64_t m = m0; m < m1; ++m) {
    float* xm = x + m * dim;
    if (delta != nullptr) {
      const T* dm = delta + m * dim;
      int64_t d = 0;
      for (; d + kLanes <= dim; d += kLanes) store16(xm + d, add16(load_f32(xm + d), load_row(dm + d)));
      for (; d < dim; ++d) xm[d] += static_cast<float>(dm[d]);
    }
    rms_norm(xm, weight, h + m * dim, 1, dim, eps);
  }
}

// Splits rows [0, m_len) over the pool in runs of at least `min_rows`.
template <typename F>
void over_rows(int64_t m_len, int64_t min_rows, int64_t num_threads, const F& f) {
  const int64_t workers = std::max<int64_t>(1, std::min(num_threads, m_len / std::max<int64_t>(1, min_rows)));
  const int64_t chunk = (m_len + workers - 1) / workers;
  pool::parallel(workers, [&](int64_t w) { f(std::min(m_len, w * chunk), std::min(m_len, (w + 1) * chunk)); });
}

// Time per part of the fused step, summed over calls while on (benchmarks/step_profile.py):
// norms + RoPE + KV store, qkv, attention, o_proj, gate_up + SiLU, down; nanoseconds.
constexpr int FUSED_PARTS = 6;
std::atomic<bool> g_fused_timing{false};
double g_fused_ns[FUSED_PARTS] = {};

struct PartClock {
  bool on = g_fused_timing.load(std::memory_order_relaxed);
  std::chrono::steady_clock::time_point last = on ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  void lap(int part) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    g_fused_ns[part] += std::chrono::duration<double, std::nano>(now - last).count();
    last = now;
  }
};

}  // namespace

// on >= 0: switch the timing on (1) or off (0) and zero the sums; out (FUSED_PARTS doubles, or
// null): the sums so far in nanoseconds. Timing is for one caller at a time (a benchmark).
extern "C" void plimsoll_fused_decode_timing(int64_t on, double* out) {
  if (out != nullptr) std::memcpy(out, g_fused_ns, sizeof g_fused_ns);
  if (on >= 0) {
    std::fill(g_fused_ns, g_fused_ns + FUSED_PARTS, 0.0);
    g_fused_timing.store(on != 0);
  }
}

namespace {

// A projection's weight as the fused step reads it: float32 rows, or int8 rows in groups of
// `group` inputs with a float32 scale and offset (null: symmetric) per group (models/quant.py).
struct F32Proj {
  const float* w;
};
struct Int8Proj {
  const int8_t* q;
  const float* scale;
  const float* offset;
  int64_t group;
};
// float32 W in column panels (plimsoll_pack_f32; gate_up in two parts, gate's then up's).
struct PackedProj {
  const float* panels;
};

// One row: one row of W at a time (matmul_rows); more: register blocks of both (blocked_rows),
// which stream W 1.5-2x faster from 2 rows on (SmolLM2's projections and head, 2-4 rows: 23-28
// GB/s against matmul_rows' 15-17; at one row the two are even).
constexpr int64_t kSmallRows = kSmallLinearRows;

inline void proj_rows(const F32Proj& p, const float* x, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                      int64_t n_len, int64_t k_len) {
  if (m_len <= kSmallRows)
    matmul_rows<false>(x, p.w, nullptr, y, m_len, n_begin, n_end, n_len, k_len);
  else
    blocked_rows(x, p.w, y, m_len, n_begin, n_end, n_len, k_len);
}
inline void proj_rows(const Int8Proj& p, const float* x, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                      int64_t n_len, int64_t k_len) {
  int8_linear_rows(x, p.q, p.scale, p.offset, nullptr, y, m_len, n_begin, n_end, n_len, k_len, p.group);
}
// Columns [n_begin, n_end) of a packed part whose last column is n_end or past it; n_begin on a panel edge.
template <bool Accumulate = false>
inline void packed_rows(const PackedProj& p, const float* x, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                        int64_t ldy, int64_t k_len) {
  packed_panels<Accumulate>(x, k_len, p.panels, nullptr, y, ldy, m_len, n_end, k_len, n_begin / kPanelCols,
                            panels_of(n_end));
}

// y = x @ W.T, or y += x @ W.T (Accumulate; all but float32's few rows go through `tmp` [M, N] first),
// over the pool.
template <bool Accumulate, typename P>
void project_rows(const P& p, const float* x, float* y, float* tmp, int64_t m_len, int64_t n_len, int64_t k_len,
                  int64_t num_threads);

template <bool Accumulate, typename P>
void project(const P& p, const float* x, float* y, float* tmp, int64_t m_len, int64_t n_len, int64_t k_len,
             int64_t num_threads) {
  if constexpr (std::is_same_v<P, PackedProj>) {  // panels write (or add) their outputs in place
    packed_linear<Accumulate>(x, k_len, p.panels, nullptr, y, n_len, m_len, n_len, k_len, 1, num_threads);
  } else {
    project_rows<Accumulate>(p, x, y, tmp, m_len, n_len, k_len, num_threads);
  }
}

// project() for plain float32 or int8 rows: output columns split over the pool.
template <bool Accumulate, typename P>
void project_rows(const P& p, const float* x, float* y, float* tmp, int64_t m_len, int64_t n_len, int64_t k_len,
                  int64_t num_threads) {
  const int64_t workers = split_for(n_len, k_len, num_threads);
  const int64_t chunk = (n_len + workers - 1) / workers;
  pool::parallel(workers, [=, &p](int64_t i) {
    const int64_t n0 = std::min(n_len, i * chunk), n1 = std::min(n_len, (i + 1) * chunk);
    if constexpr (std::is_same_v<P, F32Proj>) {
      if (m_len <= kSmallRows) {
        matmul_rows<Accumulate>(x, p.w, nullptr, y, m_len, n0, n1, n_len, k_len);
        return;
      }
    }
    if constexpr (Accumulate) {
      proj_rows(p, x, tmp, m_len, n0, n1, n_len, k_len);
      for (int64_t m = 0; m < m_len; ++m)
        for (int64_t n = n0; n < n1; ++n) y[m * n_len + n] += tmp[m * n_len + n];
    } else {
      proj_rows(p, x, y, m_len, n0, n1, n_len, k_len);
    }
  });
}

template <typename P>
struct FusedLayer {
  const float* in_norm;
  const float* post_norm;
  float* k_cache;
  float* v_cache;
  P qkv, o, gate_up, down;
};

template <typename P>
int fused_decode(float* x, const std::vector<FusedLayer<P>>& layers, const float* cos, const float* sin,
                 const int64_t* slots, const int32_t* block_tables, const int32_t* context_lens, int64_t m_len,
                 int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter,
                 int64_t block_size, int64_t max_blocks, int64_t num_slots, float eps, float scale,
                 int64_t num_threads) {
  if (m_len <= 0 || layers.empty() || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim % 2 != 0 ||
      block_size <= 0)
    return 1;
  for (int64_t m = 0; m < m_len; ++m) {
    if (context_lens[m] <= 0 || context_lens[m] > max_blocks * block_size) return 2;
    if (slots[m] >= num_slots) return 3;
  }
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t qkv_size = q_size + 2 * kv_size;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(m_len * (2 * hidden + qkv_size + 2 * q_size + 3 * inter)));
  float* h = scratch.data();        // [M, hidden]  normed input of a block
  float* qkv = h + m_len * hidden;  // [M, qkv_size]
  float* q = qkv + m_len * qkv_size;  // [M, H, D]  after RoPE
  float* attn = q + m_len * q_size;   // [M, H, D]
  float* gate_up = attn + m_len * q_size;  // [M, 2 I]
  float* act = gate_up + m_len * 2 * inter;  // [M, I]
  float* tmp = act + m_len * inter;  // [M, hidden]  an int8 projection's output before it is added
  const int64_t attn_workers = std::max<int64_t>(1, std::min(num_threads, m_len));
  const int64_t mlp_workers = split_for(2 * inter, hidden, num_threads);
  int64_t mlp_chunk = (inter + mlp_workers - 1) / mlp_workers;
  if constexpr (std::is_same_v<P, PackedProj>) mlp_chunk = panels_of(mlp_chunk) * kPanelCols;  // whole panels

  for (const FusedLayer<P>& layer : layers) {
    const float* in_norm = layer.in_norm;
    const float* post_norm = layer.post_norm;
    float* k_cache = layer.k_cache;
    float* v_cache = layer.v_cache;

    PartClock clock;
    rms_norm(x, in_norm, h, m_len, hidden, eps);
    clock.lap(0);
    project<false>(layer.qkv, h, qkv, tmp, m_len, qkv_size, hidden, num_threads);
    clock.lap(1);
    // Every row's KV is stored before any row attends (a sequence may read a block
    // another one fills in this step), as the module path does.
    rope_store_rows(qkv, qkv_size, q, k_cache, v_cache, cos, sin, slots, 0, m_len, num_heads, num_kv_heads,
                    head_dim);
    clock.lap(0);
    const Args<float> a{q, k_cache, v_cache, block_tables, context_lens, attn,
                        num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale};
    pool::parallel(attn_workers, [&a, m_len, attn_workers](int64_t w) {
      thread_local std::vector<float> scores;
      for (int64_t b = w; b < m_len; b += attn_workers) attend(a, b, scores);
    });
    clock.lap(2);
    project<true>(layer.o, attn, x, tmp, m_len, hidden, q_size, num_threads);
    clock.lap(3);
    rms_norm(x, post_norm, h, m_len, hidden, eps);
    clock.lap(0);
    // gate rows [i0, i1) and the same up rows in one task, then SiLU(gate) * up on them.
    const P& w_gate_up = layer.gate_up;
    pool::parallel(mlp_workers, [=, &w_gate_up](int64_t t) {
      const int64_t i0 = std::min(inter, t * mlp_chunk), i1 = std::min(inter, (t + 1) * mlp_chunk);
      if (i0 >= i1) return;
      if constexpr (std::is_same_v<P, PackedProj>) {
        const PackedProj up{w_gate_up.panels + panels_of(inter) * hidden * kPanelCols};
        packed_rows(w_gate_up, h, gate_up, m_len, i0, i1, 2 * inter, hidden);
        packed_rows(up, h, gate_up + inter, m_len, i0, i1, 2 * inter, hidden);
      } else {
        proj_rows(w_gate_up, h, gate_up, m_len, i0, i1, 2 * inter, hidden);
        proj_rows(w_gate_up, h, gate_up, m_len, inter + i0, inter + i1, 2 * inter, hidden);
      }
      silu_mul(gate_up, act, 0, m_len, i0, i1, inter);
    });
    clock.lap(4);
    project<true>(layer.down, act, x, tmp, m_len, hidden, inter, num_threads);
    clock.lap(5);
  }
  return 0;
}

// layers [L, 8] of addresses (see above) as FusedLayer records over float projections P.
template <typename P>
std::vector<FusedLayer<P>> float_layers(const int64_t* layers, int64_t num_layers) {
  std::vector<FusedLayer<P>> parsed(static_cast<size_t>(std::max<int64_t>(0, num_layers)));
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* p = layers + l * 8;
    auto f = [p](int i) { return reinterpret_cast<const float*>(p[i]); };
    parsed[l] = {f(0), f(3), reinterpret_cast<float*>(p[6]), reinterpret_cast<float*>(p[7]),
                 {f(1)}, {f(2)}, {f(4)}, {f(5)}};
  }
  return parsed;
}

}  // namespace

// layers [L, 8]: see above.
extern "C" int plimsoll_fused_decode_f32(float* x, const int64_t* layers, const float* cos, const float* sin,
                                         const int64_t* slots, const int32_t* block_tables,
                                         const int32_t* context_lens, int64_t m_len, int64_t num_layers,
                                         int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                         int64_t inter, int64_t block_size, int64_t max_blocks, int64_t num_slots,
                                         float eps, float scale, int64_t num_threads) {
  return fused_decode(x, float_layers<F32Proj>(layers, num_layers), cos, sin, slots, block_tables, context_lens, m_len,
                      hidden, num_heads, num_kv_heads, head_dim, inter, block_size, max_blocks, num_slots, eps, scale,
                      num_threads);
}

// plimsoll_fused_decode_packed_f32: the same step over projections packed in column panels
// (plimsoll_pack_f32; gate_up in two parts): layers [L, 8] as above with the panels' addresses
// in place of the weights'.
extern "C" int plimsoll_fused_decode_packed_f32(float* x, const int64_t* layers, const float* cos, const float* sin,
                                                const int64_t* slots, const int32_t* block_tables,
                                                const int32_t* context_lens, int64_t m_len, int64_t num_layers,
                                                int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
                                                int64_t head_dim, int64_t inter, int64_t block_size,
                                                int64_t max_blocks, int64_t num_slots, float eps, float scale,
                                                int64_t num_threads) {
  return fused_decode(x, float_layers<PackedProj>(layers, num_layers), cos, sin, slots, block_tables, context_lens,
                      m_len, hidden, num_heads, num_kv_heads, head_dim, inter, block_size, max_blocks, num_slots, eps,
                      scale, num_threads);
}

// plimsoll_fused_decode_int8: the same step with int8 projections (--quantization int8).
// layers [L, 20] int64: input_layernorm.weight, post_attention_layernorm.weight, k_cache,
// v_cache, then for qkv_proj, o_proj, gate_up_proj and down_proj in turn: qweight [N, K] int8,
// scales [N, K / G] float32, offsets [N, K / G] float32 (0: none), G (a multiple of 16).
extern "C" int plimsoll_fused_decode_int8(float* x, const int64_t* layers, const float* cos, const float* sin,
                                          const int64_t* slots, const int32_t* block_tables,
                                          const int32_t* context_lens, int64_t m_len, int64_t num_layers,
                                          int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                          int64_t inter, int64_t block_size, int64_t max_blocks, int64_t num_slots,
                                          float eps, float scale, int64_t num_threads) {
  const int64_t q_size = num_heads * head_dim;
  const int64_t k_lens[4] = {hidden, q_size, hidden, inter};  // inputs of qkv, o, gate_up, down
  std::vector<FusedLayer<Int8Proj>> parsed(static_cast<size_t>(std::max<int64_t>(0, num_layers)));
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* p = layers + l * 20;
    Int8Proj proj[4];
    for (int i = 0; i < 4; ++i) {
      const int64_t* e = p + 4 + 4 * i;
      const int64_t group = e[3];
      if (group <= 0 || group % kLanes != 0 || k_lens[i] % group != 0) return 4;
      proj[i] = {reinterpret_cast<const int8_t*>(e[0]), reinterpret_cast<const float*>(e[1]),
                 reinterpret_cast<const float*>(e[2]), group};
    }
    parsed[l] = {reinterpret_cast<const float*>(p[0]), reinterpret_cast<const float*>(p[1]),
                 reinterpret_cast<float*>(p[2]), reinterpret_cast<float*>(p[3]), proj[0], proj[1], proj[2], proj[3]};
  }
  return fused_decode(x, parsed, cos, sin, slots, block_tables, context_lens, m_len, hidden, num_heads, num_kv_heads,
                      head_dim, inter, block_size, max_blocks, num_slots, eps, scale, num_threads);
}

// The glue of a step run layer by layer with oneDNN's matmuls (models/fused_decode.py's
// GluedLayers, for steps the fused step does not take): each call is every op of a Llama layer
// between two projections, over all the step's rows. x, h [M, dim]; qkv [M, (H + 2 Hkv) D];
// q_out [M, H, D]; gate_up [M, 2 I]; act [M, I]; slots [M] int64 (-1: do not store).
namespace {

template <typename T>
int add_rms_norm_glue(float* x, const T* delta, const float* weight, T* h, int64_t m_len, int64_t dim, float eps,
                      int64_t num_threads) {
  if (m_len <= 0 || dim <= 0) return 1;
  over_rows(m_len, 16, num_threads,
            [=](int64_t m0, int64_t m1) { add_rms_norm_rows(x, delta, weight, h, m0, m1, dim, eps); });
  return 0;
}

template <typename T>
int rope_store_glue(const T* qkv, float* q_out, T* k_cache, T* v_cache, const float* cos, const float* sin,
                    const int64_t* slots, int64_t m_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t num_slots, int64_t num_threads) {
  if (m_len <= 0 || num_heads <= 0 || num_kv_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0) return 1;
  for (int64_t m = 0; m < m_len; ++m) {
    if (slots[m] >= num_slots) return 3;
  }
  const int64_t stride = (num_heads + 2 * num_kv_heads) * head_dim;
  over_rows(m_len, 32, num_threads, [=](int64_t m0, int64_t m1) {
    rope_store_rows(qkv, stride, q_out, k_cache, v_cache, cos, sin, slots, m0, m1, num_heads, num_kv_heads,
                    head_dim);
  });
  return 0;
}

template <typename T>
int silu_mul_glue(const T* gate_up, T* act, int64_t m_len, int64_t inter, int64_t num_threads) {
  if (m_len <= 0 || inter <= 0) return 1;
  over_rows(m_len, std::max<int64_t>(1, 16384 / inter), num_threads,
            [=](int64_t m0, int64_t m1) { silu_mul(gate_up, act, m0, m1, 0, inter, inter); });
  return 0;
}

const Bf16* as_bf16(const uint16_t* p) { return reinterpret_cast<const Bf16*>(p); }
Bf16* as_bf16(uint16_t* p) { return reinterpret_cast<Bf16*>(p); }

}  // namespace

extern "C" int plimsoll_add_rms_norm_f32(float* x, const float* delta, const float* weight, float* h, int64_t m_len,
                                         int64_t dim, float eps, int64_t num_threads) {
  return add_rms_norm_glue(x, delta, weight, h, m_len, dim, eps, num_threads);
}

extern "C" int plimsoll_rope_store_f32(const float* qkv, float* q_out, float* k_cache, float* v_cache,
                                       const float* cos, const float* sin, const int64_t* slots, int64_t m_len,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                                       int64_t num_threads) {
  return rope_store_glue(qkv, q_out, k_cache, v_cache, cos, sin, slots, m_len, num_heads, num_kv_heads, head_dim,
                         num_slots, num_threads);
}

extern "C" int plimsoll_silu_mul_f32(const float* gate_up, float* act, int64_t m_len, int64_t inter,
                                     int64_t num_threads) {
  return silu_mul_glue(gate_up, act, m_len, inter, num_threads);
}

// The same glue for a bfloat16 model (oneDNN's bf16 matmuls between, AMX where the CPU has it):
// the residual x, the norm weights, cos/sin and q_out stay float32; delta, h, qkv, the caches,
// gate_up and act are bfloat16, each value rounded to the nearest even once where it is stored.
extern "C" int plimsoll_add_rms_norm_bf16(float* x, const uint16_t* delta, const float* weight, uint16_t* h,
                                          int64_t m_len, int64_t dim, float eps, int64_t num_threads) {
  return add_rms_norm_glue(x, as_bf16(delta), weight, as_bf16(h), m_len, dim, eps, num_threads);
}

extern "C" int plimsoll_rope_store_bf16(const uint16_t* qkv, float* q_out, uint16_t* k_cache, uint16_t* v_cache,
                                        const float* cos, const float* sin, const int64_t* slots, int64_t m_len,
                                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                                        int64_t num_threads) {
  return rope_store_glue(as_bf16(qkv), q_out, as_bf16(k_cache), as_bf16(v_cache), cos, sin, slots, m_len, num_heads,
                         num_kv_heads, head_dim, num_slots, num_threads);
}

extern "C" int plimsoll_silu_mul_bf16(const uint16_t* gate_up, uint16_t* act, int64_t m_len, int64_t inter,
                                      int64_t num_threads) {
  return silu_mul_glue(as_bf16(gate_up), as_bf16(act), m_len, inter, num_threads);
}

// float32 [n] to bfloat16 (rounded to the nearest even): attention's output into o_proj's input.
extern "C" int plimsoll_to_bf16(const float* x, uint16_t* y, int64_t n, int64_t num_threads) {
  if (n < 0) return 1;
  Bf16* out = as_bf16(y);
  over_rows(n / kLanes, 1024, num_threads, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) store_row(out + b * kLanes, load_f32(x + b * kLanes));
  });
  for (int64_t i = n / kLanes * kLanes; i < n; ++i) put(out + i, x[i]);
  return 0;
}
