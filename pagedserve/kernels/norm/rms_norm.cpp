// Fused RMSNorm (with the residual add) for the CPU path: one pass over memory where torch runs several ops
// with temporaries. bf16 results round where torch's bf16 ops round (after the residual add, the normalised
// value before the weight), so they match the reference to the last bit in most elements.
#include <cmath>
#include <cstdint>
#include <vector>

#include "../native/cpu_common.h"
#include "../native/parallel.h"

// Full-width AVX-512 vectors where the CPU has them: these loops are compute-bound (exp, bf16 rounding).
#pragma GCC target("prefer-vector-width=512")

namespace {

using pagedserve::Elem;

// Rows go to torch's OpenMP team (the library links torch's libgomp) from this many elements: below it,
// waking a thread costs more than the rows.
constexpr int64_t kParallelElements = 1 << 16;

template <typename T>
void rms_norm(T* out, T* summed, const T* x, const T* residual, const T* weight, int64_t rows, int64_t hidden,
              float eps) {
  pagedserve::parallel_rows(rows, rows * hidden, kParallelElements, [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      if (residual != nullptr) {
        const T* rr = residual + r * hidden;
        T* sr = summed + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) h[i] = Elem<T>::round(Elem<T>::load(xr[i]) + Elem<T>::load(rr[i]));
        for (int64_t i = 0; i < hidden; ++i) sr[i] = Elem<T>::store(h[i]);
      } else {
        for (int64_t i = 0; i < hidden; ++i) h[i] = Elem<T>::load(xr[i]);
      }
      double square_sum = 0.0;  // fp64 accumulators: the lane order does not show at fp32 precision
#pragma omp simd reduction(+ : square_sum)
      for (int64_t i = 0; i < hidden; ++i) square_sum += static_cast<double>(h[i]) * h[i];
      const float inv = 1.f / std::sqrt(static_cast<float>(square_sum / hidden) + eps);
      T* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        o[i] = Elem<T>::store(Elem<T>::load(weight[i]) * Elem<T>::round(h[i] * inv));
      }
    }
  });
}

}  // namespace

extern "C" {

// summed and residual are both null, or both [rows, hidden] like x.
int pagedserve_rms_norm(void* out, void* summed, const void* x, const void* residual, const void* weight,
                        int64_t rows, int64_t hidden, float eps, int dtype) {
  return pagedserve::with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    rms_norm(static_cast<T*>(out), static_cast<T*>(summed), static_cast<const T*>(x),
             static_cast<const T*>(residual), static_cast<const T*>(weight), rows, hidden, eps);
  });
}

}  // extern "C"
