// Runs a callback over contiguous ranges of [0, count) on the OpenMP team torch's own ops run on (the library
// links the libgomp torch loaded, so this is the same pool of threads, sized by torch.set_num_threads): no
// second pool of threads competing with torch's for the cores. Built without OpenMP, it is one call.
#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#endif

extern "C" {

typedef void (*pagedserve_range_fn)(int64_t begin, int64_t end);

// 1 when the library was built with OpenMP (the ranges then run on several threads), else 0.
int pagedserve_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

// fn(begin, end) over `workers` contiguous ranges of [0, count), range i on the team's thread i.
int pagedserve_parallel_ranges(pagedserve_range_fn fn, int64_t count, int64_t workers) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1) num_threads(static_cast<int>(workers))
#endif
  for (int64_t i = 0; i < workers; ++i) {
    const int64_t begin = count * i / workers, end = count * (i + 1) / workers;
    if (end > begin) fn(begin, end);
  }
  return 0;
}

}  // extern "C"
