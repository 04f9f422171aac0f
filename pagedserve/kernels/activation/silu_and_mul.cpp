// Fused SiLU-and-mul for the CPU path: one pass over memory where torch runs several ops with temporaries.
// bf16 results round where torch's bf16 ops round (SiLU before the multiply).
#include <cstdint>
#include <vector>

#include "../native/cpu_common.h"
#include "../native/parallel.h"

// Full-width AVX-512 vectors where the CPU has them: these loops are compute-bound (exp, bf16 rounding).
#pragma GCC target("prefer-vector-width=512")

namespace {

using pagedserve::Elem;
using pagedserve::fast_exp;

// Rows go to torch's OpenMP team (the library links torch's libgomp) from this many elements: below it,
// waking a thread costs more than the rows.
constexpr int64_t kParallelElements = 1 << 16;

template <typename T>
void silu_and_mul(T* out, const T* x, int64_t rows, int64_t inter) {
  // Row-sized fp32 buffers and one simple loop per stage: each stage vectorises on its own.
  pagedserve::parallel_rows(rows, rows * inter, kParallelElements, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(inter), up(inter);
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * 2 * inter;
      for (int64_t i = 0; i < inter; ++i) gate[i] = Elem<T>::load(row[i]);
      for (int64_t i = 0; i < inter; ++i) up[i] = Elem<T>::load(row[inter + i]);
      for (int64_t i = 0; i < inter; ++i) gate[i] = Elem<T>::round(gate[i] / (1.f + fast_exp(-gate[i])));
      T* o = out + r * inter;
      for (int64_t i = 0; i < inter; ++i) o[i] = Elem<T>::store(gate[i] * up[i]);
    }
  });
}

}  // namespace

extern "C" {

// x is [rows, 2 * inter] rows of [gate | up]; out is [rows, inter].
int pagedserve_silu_and_mul(void* out, const void* x, int64_t rows, int64_t inter, int dtype) {
  return pagedserve::with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul(static_cast<T*>(out), static_cast<const T*>(x), rows, inter);
  });
}

}  // extern "C"
