// Decode-time PagedAttention for the CPU: one query token per sequence attends over its K/V read in place
// from the paged cache, so nothing is gathered into a padded copy first (the torch path's biggest cost).
// A sliding window (window > 0) reads only the last `window` keys; soft_cap > 0 applies cap * tanh(s / cap).
// Math is fp32 whatever the cache dtype; -march=native -fopenmp-simd turn the head_dim loops into vector code.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../native/cpu_common.h"

namespace {

using pagedserve::bf16_to_float;
using pagedserve::fast_exp;
using pagedserve::float_to_bf16;

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n);

template <>
inline void load_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <>
inline void load_row<uint16_t>(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n, float scale);

template <>
inline void store_row<float>(const float* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
}

template <>
inline void store_row<uint16_t>(const float* src, uint16_t* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i] * scale);
}

// The cache is far larger than any CPU cache and a sequence's blocks lie anywhere in it: while reading
// slot j of a block, ask for slot j of the next block (one row ahead, spread over the block rather than
// all at once), so DRAM-resident blocks arrive before they are read (docs/benchmarks.md: row-ahead prefetch).
template <typename T>
inline void prefetch_row(const T* row, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < elements * static_cast<int64_t>(sizeof(T)); offset += 64) {
    __builtin_prefetch(bytes + offset, 0, 3);
  }
}

// HEAD_DIM > 0 fixes the row length at compile time (vectorised loops); 0 means `head_dim` at run time.
// Softmax numerators of one head's scores in place (capped first when soft_cap > 0); returns their sum.
inline float exponentiate(float* scores, int64_t span, float max_score, float soft_cap) {
  float total = 0.f;
  if (soft_cap > 0.f) {
    // tanh is increasing, so the capped maximum is the cap of the maximum.
    const float m = soft_cap * std::tanh(max_score / soft_cap);
    for (int64_t pos = 0; pos < span; ++pos) {
      scores[pos] = fast_exp(soft_cap * std::tanh(scores[pos] / soft_cap) - m);
      total += scores[pos];
    }
    return total;
  }
#pragma omp simd reduction(+ : total)
  for (int64_t pos = 0; pos < span; ++pos) {
    scores[pos] = fast_exp(scores[pos] - max_score);
    total += scores[pos];
  }
  return total;
}

// Each cache slot holds all KV heads back to back, so one pass over a sequence's blocks reads its context
// sequentially, once for K and once for V, serving every query head. Keys before `begin` (outside the
// window) are skipped; scores are stored relative to it.
template <typename T, int HEAD_DIM>
void decode_attention(T* out, const T* query, const T* key_cache, const T* value_cache,
                      const int32_t* block_tables, const int64_t* seq_lens, int64_t num_seqs,
                      int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim_rt, int64_t block_size,
                      int64_t block_table_stride, int64_t query_stride, int64_t out_stride, float scale,
                      int64_t window, float soft_cap) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_rt;
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;  // elements between consecutive slots of a block
  std::vector<float> q(num_q_heads * head_dim), row(slot_stride), acc(num_q_heads * head_dim), scores;
  std::vector<float> row_max(num_q_heads), row_sum(num_q_heads);

  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t length = seq_lens[s];
    const int64_t begin = window > 0 && length > window ? length - window : 0;
    const int64_t span = length - begin;
    const int32_t* table = block_tables + s * block_table_stride;
    if (static_cast<int64_t>(scores.size()) < num_q_heads * span) scores.resize(num_q_heads * span);
    load_row(query + s * query_stride, q.data(), num_q_heads * head_dim);
    for (int64_t i = 0; i < num_q_heads * head_dim; ++i) q[i] *= scale;
    std::fill(row_max.begin(), row_max.end(), -INFINITY);

    // Scores of every query head against every key; blocks outer, slots inner (no division per slot).
    for (int64_t first = begin / block_size * block_size; first < length; first += block_size) {
      const T* block = key_cache + static_cast<int64_t>(table[first / block_size]) * block_size * slot_stride;
      const int64_t count = std::min(block_size, length - first);
      // The same slot of the next block (K, or the first V block after the last K block), a row ahead.
      const T* ahead = first + block_size < length
                           ? key_cache + static_cast<int64_t>(table[first / block_size + 1]) * block_size * slot_stride
                           : value_cache + static_cast<int64_t>(table[begin / block_size]) * block_size * slot_stride;
      for (int64_t j = std::max<int64_t>(begin - first, 0); j < count; ++j) {
        prefetch_row(ahead + j * slot_stride, slot_stride);
        load_row(block + j * slot_stride, row.data(), slot_stride);
        for (int64_t h = 0, qh = 0; h < num_kv_heads; ++h) {
          const float* kv = row.data() + h * head_dim;
          for (int64_t g = 0; g < group; ++g, ++qh) {
            const float* qv = q.data() + qh * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qv[d] * kv[d];
            scores[qh * span + first + j - begin] = dot;
            row_max[qh] = dot > row_max[qh] ? dot : row_max[qh];
          }
        }
      }
    }
    for (int64_t qh = 0; qh < num_q_heads; ++qh) {
      row_sum[qh] = exponentiate(scores.data() + qh * span, span, row_max[qh], soft_cap);
    }
    // Weighted sum of the values, same order.
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t first = begin / block_size * block_size; first < length; first += block_size) {
      const T* block =
          value_cache + static_cast<int64_t>(table[first / block_size]) * block_size * slot_stride;
      const int64_t count = std::min(block_size, length - first);
      const T* ahead =
          first + block_size < length
              ? value_cache + static_cast<int64_t>(table[first / block_size + 1]) * block_size * slot_stride
              : (s + 1 < num_seqs ? key_cache + static_cast<int64_t>(block_tables[(s + 1) * block_table_stride]) *
                                                    block_size * slot_stride
                                  : block);
      for (int64_t j = std::max<int64_t>(begin - first, 0); j < count; ++j) {
        prefetch_row(ahead + j * slot_stride, slot_stride);
        load_row(block + j * slot_stride, row.data(), slot_stride);
        for (int64_t h = 0, qh = 0; h < num_kv_heads; ++h) {
          const float* vv = row.data() + h * head_dim;
          for (int64_t g = 0; g < group; ++g, ++qh) {
            const float p = scores[qh * span + first + j - begin];
            float* aq = acc.data() + qh * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) aq[d] += p * vv[d];
          }
        }
      }
    }
    for (int64_t qh = 0; qh < num_q_heads; ++qh) {
      store_row(acc.data() + qh * head_dim, out + s * out_stride + qh * head_dim, head_dim, 1.f / row_sum[qh]);
    }
  }
}

template <typename T>
void dispatch_head_dim(T* out, const T* query, const T* key_cache, const T* value_cache,
                       const int32_t* block_tables, const int64_t* seq_lens, int64_t num_seqs,
                       int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                       int64_t block_table_stride, int64_t query_stride, int64_t out_stride, float scale,
                       int64_t window, float soft_cap) {
#define PAGEDSERVE_CASE(D)                                                                                 \
  case D:                                                                                                  \
    return decode_attention<T, D>(out, query, key_cache, value_cache, block_tables, seq_lens, num_seqs,    \
                                  num_q_heads, num_kv_heads, head_dim, block_size, block_table_stride,    \
                                  query_stride, out_stride, scale, window, soft_cap);
  switch (head_dim) {
    PAGEDSERVE_CASE(64)
    PAGEDSERVE_CASE(128)
    PAGEDSERVE_CASE(32)
    PAGEDSERVE_CASE(96)
    default:
      return decode_attention<T, 0>(out, query, key_cache, value_cache, block_tables, seq_lens, num_seqs,
                                    num_q_heads, num_kv_heads, head_dim, block_size, block_table_stride,
                                    query_stride, out_stride, scale, window, soft_cap);
  }
#undef PAGEDSERVE_CASE
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 for an unsupported dtype. Strides are in elements; caches are contiguous
// [num_blocks, block_size, num_kv_heads, head_dim]; query/out rows are [num_q_heads, head_dim] contiguous.
// window <= 0: no sliding window; soft_cap <= 0: no soft-capping.
int pagedserve_decode_attention(void* out, const void* query, const void* key_cache, const void* value_cache,
                                const int32_t* block_tables, const int64_t* seq_lens, int64_t num_seqs,
                                int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, int64_t block_table_stride, int64_t query_stride,
                                int64_t out_stride, float scale, int64_t window, float soft_cap, int dtype) {
  return pagedserve::with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_head_dim(static_cast<T*>(out), static_cast<const T*>(query), static_cast<const T*>(key_cache),
                      static_cast<const T*>(value_cache), block_tables, seq_lens, num_seqs, num_q_heads,
                      num_kv_heads, head_dim, block_size, block_table_stride, query_stride, out_stride, scale,
                      window, soft_cap);
  });
}

}  // extern "C"
