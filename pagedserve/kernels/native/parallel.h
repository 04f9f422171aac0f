// Rows of a native kernel split over torch's OpenMP team (the library links the libgomp torch loaded, so this
// is the team torch.set_num_threads sizes). Below `min_work`, or with one thread, the rows run on the caller
// with no parallel region at all: entering even a one-thread region costs a few microseconds, as much as a
// decode step's norm of one row.
#pragma once

#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace pagedserve {

// fn(begin, end) over contiguous ranges of [0, rows), one per thread; `work` is what the threshold compares.
template <typename Fn>
void parallel_rows(int64_t rows, int64_t work, int64_t min_work, Fn&& fn) {
#ifdef _OPENMP
  if (work >= min_work && rows > 1 && omp_get_max_threads() > 1 && !omp_in_parallel()) {
#pragma omp parallel
    {
      const int64_t team = omp_get_num_threads(), self = omp_get_thread_num();
      const int64_t begin = rows * self / team, end = rows * (self + 1) / team;
      if (end > begin) fn(begin, end);
    }
    return;
  }
#endif
  fn(int64_t{0}, rows);
}

}  // namespace pagedserve
