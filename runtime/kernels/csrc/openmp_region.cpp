// The kernels' parallel region on the OpenMP runtime torch has loaded.
//
// What it is: libplimsoll_openmp.so, built with -fopenmp on its own so that it, not the
// kernels, depends on libgomp.so.1: cpu_library.py loads it only where torch's OpenMP runtime
// is GNU libgomp loaded as libgomp.so.1 (the dynamic linker then binds this library to that
// very copy) and hands plimsoll_openmp_region to the kernels (plimsoll_set_openmp_region), so
// their work and oneDNN's matmuls share one team of threads. Elsewhere it is never loaded and
// the kernels use their own pool (pool.cpp).
// What it is not: part of the kernels' C interface (plimsoll_kernels.h); one function, the
// pool's OpenMPRegion.
#include <omp.h>

#include <algorithm>
#include <cstdint>

using TaskFn = void (*)(const void* ctx, int64_t task);

// Runs call(ctx, 0) .. call(ctx, n - 1) as one parallel region and returns 1; 0 (nothing run)
// when called inside a parallel region already.
extern "C" __attribute__((visibility("default"))) int plimsoll_openmp_region(int64_t n, TaskFn call,
                                                                              const void* ctx) {
  if (omp_in_parallel()) return 0;
  // A team smaller than n (OMP_THREAD_LIMIT, a busy runtime) takes the tasks in turn.
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(n, 1024)))
  {
    const int64_t team = omp_get_num_threads();
    for (int64_t t = omp_get_thread_num(); t < n; t += team) call(ctx, t);
  }
  return 1;
}
