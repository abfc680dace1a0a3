// The worker pool every kernel splits its work over (defined in pool.cpp).
//
// What it is: `pool::parallel(n, f)`, which runs f(0) .. f(n - 1), each once, the caller
// running some of them, and returns when all are done; how the tasks reach other threads
// (torch's own OpenMP team, the pool's helpers, or threads started for the call) is the
// process's parallel mode (plimsoll_parallel_mode).
// What it is not: a general task scheduler (no nesting, no work stealing).
#pragma once

#include <cstdint>

namespace plimsoll::pool {

using TaskFn = void (*)(const void* ctx, int64_t task);

// Runs call(ctx, 0) .. call(ctx, n - 1) for n >= 2, each once; returns when all are done.
void run(int64_t n, TaskFn call, const void* ctx);

template <typename F>
void parallel(int64_t n, const F& f) {
  if (n <= 1) {
    if (n == 1) f(0);
    return;
  }
  run(n, [](const void* ctx, int64_t task) { (*static_cast<const F*>(ctx))(task); }, &f);
}

}  // namespace plimsoll::pool
