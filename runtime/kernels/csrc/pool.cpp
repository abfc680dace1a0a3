// The worker pool every kernel splits its work over, and the C calls that steer it.
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "plimsoll_kernels.h"
#include "pool.h"

// The worker pool every kernel splits its work over.
//
// What it is: threads created once per process (grown to the most any call asked for),
// each with its own mailbox. A call posts one task per helper it needs, runs task 0
// itself, then runs any task no helper has taken yet (so a host too busy to wake a helper
// costs no more than running serially) and waits for the ones taken. A helper spins on
// its mailbox for SPIN_US after its last task, yielding its core after the first
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
namespace plimsoll::pool {
namespace {

constexpr int64_t SPIN_US = 200;
constexpr int64_t PAUSE_US = 20;
constexpr int64_t MAX_HELPERS = 255;
constexpr uint64_t CLAIMED = uint64_t{1} << 63;  // set in `posted` by whoever runs the task

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
      const auto until = start + std::chrono::microseconds(SPIN_US);
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
// How run() splits a call: THREADS starts and joins threads for the call (as before the pool,
// for A/B timing), POOL posts to the helpers above, OPENMP runs it as a parallel region of the
// OpenMP runtime torch itself uses, through the region function of libplimsoll_openmp.so
// (openmp_region.cpp, loaded by cpu_library.py only where that runtime is libgomp.so.1, so it
// binds to torch's copy; this library itself is built without -fopenmp and so needs no OpenMP
// runtime). OpenMP is the default where the region is set: oneDNN's matmuls run on the same
// team, whose workers spin for a while after each region, so the next kernel's work starts on
// them at once. With a pool of its own beside them, a helper and an OpenMP worker fought for
// the second core after every matmul, and the caller often ran the whole call alone (decode
// attention, 64 sequences: 1.0 ms a layer alone, 1.8 right after a matmul).
enum Mode : int64_t { THREADS = 0, POOL = 1, OPENMP = 2 };
// Runs the tasks as one OpenMP parallel region; 0 (nothing run) inside a parallel region already.
using OpenMPRegion = int (*)(int64_t n, TaskFn call, const void* ctx);
std::atomic<OpenMPRegion> g_openmp{nullptr};
std::atomic<int64_t> g_mode{POOL};

int64_t default_mode() { return g_openmp.load() != nullptr ? OPENMP : POOL; }

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

}  // namespace

void run(int64_t n, TaskFn call, const void* ctx) {
  const int64_t mode = g_mode.load(std::memory_order_relaxed);
  if (mode == OPENMP) {
    // A team smaller than n (OMP_THREAD_LIMIT, a busy runtime) takes the tasks in turn.
    const OpenMPRegion region = g_openmp.load(std::memory_order_relaxed);
    if (region != nullptr && region(n, call, ctx) != 0) return;
  }
  Pool* p = get();
  std::unique_lock<std::mutex> owner(p->busy, std::try_to_lock);
  if (!owner.owns_lock() || n - 1 > MAX_HELPERS || mode == THREADS) {
    std::vector<std::thread> threads;  // another call holds the pool: threads of our own
    for (int64_t t = 1; t < n; ++t) threads.emplace_back([call, ctx, t] { call(ctx, t); });
    call(ctx, 0);
    for (auto& th : threads) th.join();
    return;
  }
  p->grow(n - 1);
  const uint64_t gen = ++p->generation;
  for (int64_t t = 1; t < n; ++t) {
    Mailbox* box = p->boxes[t - 1];
    box->fn = call;
    box->ctx = ctx;
    box->task = t;
    box->posted.store(gen);
    if (box->sleeping.load()) {
      std::lock_guard<std::mutex> lock(box->m);
      box->cv.notify_one();
    }
  }
  call(ctx, 0);
  for (int64_t t = 1; t < n; ++t) {
    Mailbox* box = p->boxes[t - 1];
    uint64_t expected = gen;
    // A helper that has not woken yet (a busy host) does not hold the call up: its task runs here.
    if (box->posted.compare_exchange_strong(expected, gen | CLAIMED, std::memory_order_acq_rel)) {
      call(ctx, t);
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

}  // namespace plimsoll::pool

// What the loader checks before it binds anything: the hash of the sources and flags this library
// was built from (setup.py passes cpu_variants.build_hash; cpu_library.py refuses a library built
// from other sources than the header it reads) and the instruction-set variant it was built for.
#ifndef PLIMSOLL_BUILD_HASH
#define PLIMSOLL_BUILD_HASH "unknown"
#endif
#ifndef PLIMSOLL_VARIANT
#define PLIMSOLL_VARIANT "unknown"
#endif
extern "C" const char* plimsoll_kernels_build_hash() { return PLIMSOLL_BUILD_HASH; }
extern "C" const char* plimsoll_kernels_variant() { return PLIMSOLL_VARIANT; }

// The pool's helper count (threads started so far) and a no-op call that runs `n` empty
// tasks over it: cpu_kernels.py's tests and benchmarks read the overhead of a call with them.
extern "C" int64_t plimsoll_pool_threads() {
  plimsoll::pool::Pool* p = plimsoll::pool::get();
  std::lock_guard<std::mutex> lock(p->busy);
  return static_cast<int64_t>(p->boxes.size());
}

// on: the default mode (OpenMP where its region is set, else the pool); off: threads per call.
extern "C" void plimsoll_pool_enable(int64_t on) {
  plimsoll::pool::g_mode.store(on != 0 ? plimsoll::pool::default_mode() : plimsoll::pool::THREADS);
}

// Sets how calls split their work (0 threads per call, 1 the pool, 2 OpenMP) and returns the
// mode before, or -1 (nothing changed) for a mode this process cannot run (OpenMP without its region).
extern "C" int64_t plimsoll_parallel_mode(int64_t mode) {
  using namespace plimsoll::pool;
  const bool ok = mode == THREADS || mode == POOL || (mode == OPENMP && g_openmp.load() != nullptr);
  return ok ? g_mode.exchange(mode) : -1;
}

extern "C" int64_t plimsoll_parallel_mode_get() { return plimsoll::pool::g_mode.load(); }

// `region`: libplimsoll_openmp.so's plimsoll_openmp_region (null: none). Setting one makes OpenMP
// the mode; clearing it leaves OpenMP for the pool.
extern "C" void plimsoll_set_openmp_region(void* region) {
  using namespace plimsoll::pool;
  g_openmp.store(reinterpret_cast<OpenMPRegion>(region));
  if (region != nullptr) {
    g_mode.store(OPENMP);
  } else {
    int64_t openmp = OPENMP;
    g_mode.compare_exchange_strong(openmp, POOL);
  }
}

extern "C" int64_t plimsoll_pool_noop(int64_t n, int64_t use_pool) {
  std::atomic<int64_t> ran{0};
  auto f = [&ran](int64_t) { ran.fetch_add(1); };
  if (use_pool) {
    plimsoll::pool::parallel(n, f);
  } else {
    std::vector<std::thread> threads;
    for (int64_t t = 1; t < n; ++t) threads.emplace_back(f, t);
    f(0);
    for (auto& th : threads) th.join();
  }
  return ran.load();
}
