// Multi-LoRA shrink and expand-add for the CPU: every row of a call in one pass, each row reading its own
// adapter slot (-1: the base model, skipped; expand never writes it), fp32 sums whatever the storage dtype.
// Both are rows x W[slot].T for a per-slot weight W [M, L] (shrink: A [R, K], dots over K; expand: B [N, R],
// vectorised over N); a run of up to four consecutive rows of one slot shares each weight load.
#include <cstdint>
#include <vector>

#include "../native/cpu_common.h"

namespace {

using pagedserve::Elem;

constexpr int kTile = 4;

inline int64_t slot_at(const void* slots, int slot_bytes, int64_t t) {
  return slot_bytes == 4 ? static_cast<const int32_t*>(slots)[t] : static_cast<const int64_t*>(slots)[t];
}

// out[j][m] = in[j] . w[m] for ROWS (1..kTile) rows of one slot; fp32 sums.
template <typename T, int ROWS>
void tile_rows(T* const* out, const T* const* in, const T* w, int64_t w_row, int64_t m_count, int64_t len) {
  for (int64_t m = 0; m < m_count; ++m) {
    const T* wm = w + m * w_row;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    const T* i0 = in[0];
    const T* i1 = in[ROWS > 1 ? 1 : 0];
    const T* i2 = in[ROWS > 2 ? 2 : 0];
    const T* i3 = in[ROWS > 3 ? 3 : 0];
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t k = 0; k < len; ++k) {  // rows past ROWS are compiled out
      const float wk = Elem<T>::load(wm[k]);
      s0 += Elem<T>::load(i0[k]) * wk;
      if constexpr (ROWS > 1) s1 += Elem<T>::load(i1[k]) * wk;
      if constexpr (ROWS > 2) s2 += Elem<T>::load(i2[k]) * wk;
      if constexpr (ROWS > 3) s3 += Elem<T>::load(i3[k]) * wk;
    }
    const float sums[kTile] = {s0, s1, s2, s3};
    for (int j = 0; j < ROWS; ++j) out[j][m] = Elem<T>::store(sums[j]);
  }
}

template <typename T>
void tile(T* const* out, const T* const* in, int rows, const T* w, int64_t w_row, int64_t m_count,
          int64_t len) {
  switch (rows) {
    case 1: return tile_rows<T, 1>(out, in, w, w_row, m_count, len);
    case 2: return tile_rows<T, 2>(out, in, w, w_row, m_count, len);
    case 3: return tile_rows<T, 3>(out, in, w, w_row, m_count, len);
    default: return tile_rows<T, 4>(out, in, w, w_row, m_count, len);
  }
}

// out[j][n] += in[j] . w[n] for the `rows` rows of one slot, vectorised over n: each block of kBlockN
// weight rows (contiguous, [kBlockN, len]) is turned into [len, kBlockN] fp32 first, a slice of kChunk at a time.
constexpr int64_t kBlockN = 16;
constexpr int64_t kChunk = 64;

template <typename T>
void expand_tile(T* const* out, const T* const* in, int rows, const T* w, int64_t w_row, int64_t n_count,
                 int64_t len) {
  float block[kChunk][kBlockN];
  for (int64_t n0 = 0; n0 < n_count; n0 += kBlockN) {
    const int64_t width = n_count - n0 < kBlockN ? n_count - n0 : kBlockN;
    float acc[kTile][kBlockN] = {};
    for (int64_t r0 = 0; r0 < len; r0 += kChunk) {
      const int64_t depth = len - r0 < kChunk ? len - r0 : kChunk;
      for (int64_t i = 0; i < kBlockN; ++i) {
        const T* wi = w + (n0 + (i < width ? i : 0)) * w_row + r0;
        for (int64_t r = 0; r < depth; ++r) block[r][i] = Elem<T>::load(wi[r]);
      }
      for (int j = 0; j < rows; ++j) {
        const T* x = in[j] + r0;
        for (int64_t r = 0; r < depth; ++r) {
          const float xr = Elem<T>::load(x[r]);
#pragma omp simd
          for (int64_t i = 0; i < kBlockN; ++i) acc[j][i] += xr * block[r][i];
        }
      }
    }
    for (int j = 0; j < rows; ++j) {
      T* o = out[j] + n0;
      for (int64_t i = 0; i < width; ++i) o[i] = Elem<T>::store(Elem<T>::load(o[i]) + acc[j][i]);
    }
  }
}

// As expand_tile for weights stored n-contiguous (w[n, r] at r * w_rank): no transposition needed.
constexpr int64_t kWideN = 64;

template <typename T>
void expand_tile_by_rank(T* const* out, const T* const* in, int rows, const T* w, int64_t w_rank,
                         int64_t n_count, int64_t len) {
  for (int64_t n0 = 0; n0 < n_count; n0 += kWideN) {
    const int64_t width = n_count - n0 < kWideN ? n_count - n0 : kWideN;
    float acc[kTile][kWideN] = {};
    for (int64_t r = 0; r < len; ++r) {
      const T* wr = w + r * w_rank + n0;
      for (int j = 0; j < rows; ++j) {
        const float xr = Elem<T>::load(in[j][r]);
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) acc[j][i] += xr * Elem<T>::load(wr[i]);
      }
    }
    for (int j = 0; j < rows; ++j) {
      T* o = out[j] + n0;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) o[i] = Elem<T>::store(Elem<T>::load(o[i]) + acc[j][i]);
    }
  }
}

// Calls run(first_row, rows, slot) for each run of up to kTile consecutive rows of one slot, and base(t) for
// each row of slot -1. Returns 2, before any call, where a row's slot is not below num_slots.
template <typename Run, typename Base>
int for_each_run(const void* slots, int slot_bytes, int64_t num_rows, int64_t num_slots, Run run, Base base) {
  for (int64_t t = 0; t < num_rows; ++t) {
    if (slot_at(slots, slot_bytes, t) >= num_slots) return 2;
  }
  int64_t t = 0;
  while (t < num_rows) {
    const int64_t slot = slot_at(slots, slot_bytes, t);
    if (slot < 0) {
      base(t++);
      continue;
    }
    const int64_t first = t;
    while (t - first < kTile && t < num_rows && slot_at(slots, slot_bytes, t) == slot) ++t;
    run(first, static_cast<int>(t - first), slot);
  }
  return 0;
}

// rows x W[slot].T over the runs of one slot; -1 rows are zeroed (shrink) or skipped (expand).
template <typename T, bool ADD>
int rows_times_weights(T* out, int64_t out_stride, const T* in, int64_t in_stride, const T* w,
                       int64_t w_slot, int64_t w_row, int64_t w_col, int64_t num_slots, const void* slots, int slot_bytes,
                       int64_t num_rows, int64_t m_count, int64_t len) {
  auto run = [&](int64_t first, int rows, int64_t slot) {
    T* outs[kTile];
    const T* ins[kTile];
    for (int j = 0; j < rows; ++j) {
      outs[j] = out + (first + j) * out_stride;
      ins[j] = in + (first + j) * in_stride;
    }
    if (ADD && w_row == 1) {
      expand_tile_by_rank<T>(outs, ins, rows, w + slot * w_slot, w_col, m_count, len);
    } else if (ADD) {
      expand_tile<T>(outs, ins, rows, w + slot * w_slot, w_row, m_count, len);
    } else {
      tile<T>(outs, ins, rows, w + slot * w_slot, w_row, m_count, len);
    }
  };
  auto base = [&](int64_t t) {
    if (!ADD) {
      for (int64_t m = 0; m < m_count; ++m) out[t * out_stride + m] = Elem<T>::store(0.f);
    }
  };
  return for_each_run(slots, slot_bytes, num_rows, num_slots, run, base);
}

// out[t, part_cols[p]:part_cols[p + 1]] += (x[t] @ A[slot].T)[p * rank:(p + 1) * rank] @ B_p[slot].T for every
// part p of a fused projection, per run of rows of one slot: the shrink's rows stay in a local buffer (rounded
// to T, as the two-call path stores them) and feed each part's expand; -1 rows are not touched.
template <typename T>
int shrink_expand(T* out, int64_t out_stride, const T* x, int64_t x_stride, const T* a, int64_t a_slot,
                  int64_t a_row, const T* b, int64_t b_slot, int64_t b_rank, const int64_t* part_cols,
                  int64_t num_parts, int64_t num_slots, const void* slots, int slot_bytes, int64_t num_rows,
                  int64_t k, int64_t rank) {
  const int64_t width = num_parts * rank;
  std::vector<T> buffer(kTile * width);
  auto run = [&](int64_t first, int rows, int64_t slot) {
    T* ys[kTile];
    const T* ins[kTile];
    for (int j = 0; j < rows; ++j) {
      ins[j] = x + (first + j) * x_stride;
      ys[j] = buffer.data() + j * width;
    }
    tile<T>(ys, ins, rows, a + slot * a_slot, a_row, width, k);
    for (int64_t p = 0; p < num_parts; ++p) {
      T* part_outs[kTile];
      const T* part_ys[kTile];
      for (int j = 0; j < rows; ++j) {
        part_outs[j] = out + (first + j) * out_stride + part_cols[p];
        part_ys[j] = ys[j] + p * rank;
      }
      expand_tile_by_rank<T>(part_outs, part_ys, rows, b + slot * b_slot + part_cols[p], b_rank,
                             part_cols[p + 1] - part_cols[p], rank);
    }
  };
  return for_each_run(slots, slot_bytes, num_rows, num_slots, run, [](int64_t) {});
}

}  // namespace

// y[t] = x[t] @ A[slots[t]].T for y [T, R] (row stride y_stride), x [T, K] (row stride x_stride), A with
// strides (a_slot, a_row, 1); rows with slot -1 get zeros. Status 0, 1 (dtype), 2 (slot out of range).
extern "C" int pagedserve_lora_shrink(void* y, const void* x, const void* a, const void* slots, int slot_bytes,
                                      int64_t num_rows, int64_t k, int64_t rank, int64_t num_slots,
                                      int64_t x_stride, int64_t y_stride, int64_t a_slot, int64_t a_row,
                                      int dtype) {
  int status = 0;
  const int bad_dtype = pagedserve::with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    status = rows_times_weights<T, false>(static_cast<T*>(y), y_stride, static_cast<const T*>(x), x_stride,
                                          static_cast<const T*>(a), a_slot, a_row, 1, num_slots, slots, slot_bytes,
                                          num_rows, rank, k);
  });
  return bad_dtype ? bad_dtype : status;
}

// out[t, :N] += y[t] @ B[slots[t]].T for out (its first column already offset, row stride out_stride),
// y [T, R] (row stride y_stride), B with strides (b_slot, b_row, b_rank), one of b_row and b_rank 1 (the
// n-contiguous layout, b_row 1, is the faster); rows with slot -1 are not touched.
extern "C" int pagedserve_lora_expand_add(void* out, const void* y, const void* b, const void* slots,
                                          int slot_bytes, int64_t num_rows, int64_t n, int64_t rank,
                                          int64_t num_slots, int64_t out_stride, int64_t y_stride,
                                          int64_t b_slot, int64_t b_row, int64_t b_rank, int dtype) {
  int status = 0;
  const int bad_dtype = pagedserve::with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    status = rows_times_weights<T, true>(static_cast<T*>(out), out_stride, static_cast<const T*>(y), y_stride,
                                         static_cast<const T*>(b), b_slot, b_row, b_rank, num_slots, slots, slot_bytes,
                                         num_rows, n, rank);
  });
  return bad_dtype ? bad_dtype : status;
}

// One call for a whole (fused) projection: out[t, cols_p] += (x[t] @ A[slot].T)[part p's rank slice] @
// B_p[slot].T, A [S, parts * rank, K] with strides (a_slot, a_row, 1), every part's B in one n-contiguous
// storage [S, rank, N] with strides (b_slot, b_rank, 1), part p owning columns part_cols[p]..part_cols[p + 1]
// of both out and B; rows with slot -1 are not touched.
extern "C" int pagedserve_lora_shrink_expand_add(void* out, const void* x, const void* a, const void* b,
                                                 const void* slots, int slot_bytes, int64_t num_rows, int64_t k,
                                                 int64_t rank, int64_t num_slots, int64_t out_stride,
                                                 int64_t x_stride, int64_t a_slot, int64_t a_row, int64_t b_slot,
                                                 int64_t b_rank, const int64_t* part_cols, int64_t num_parts,
                                                 int dtype) {
  int status = 0;
  const int bad_dtype = pagedserve::with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    status = shrink_expand<T>(static_cast<T*>(out), out_stride, static_cast<const T*>(x), x_stride,
                              static_cast<const T*>(a), a_slot, a_row, static_cast<const T*>(b), b_slot, b_rank,
                              part_cols, num_parts, num_slots, slots, slot_bytes, num_rows, k, rank);
  });
  return bad_dtype ? bad_dtype : status;
}
