// Decode-time PagedAttention for the CPU: one query token per sequence attends over its K/V read in place
// from the paged cache, so nothing is gathered into a padded copy first (the torch path's biggest cost).
// A sliding window (window > 0) reads only the last `window` keys; soft_cap > 0 applies cap * tanh(s / cap).
//
// One pass over the context in tiles of 16 keys with an online softmax: each K and V row (all KV heads of a
// slot, back to back) is read once and serves every query head of its GQA group. With AVX-512 the 16 scores
// of a tile fill one register (Q·K by vdpbf16ps on a bf16 cache where the CPU has AVX512_BF16: bf16 products
// are exact in fp32), P·V accumulates in fp32 registers; elsewhere portable loops the compiler vectorises.
// Threads of torch's OpenMP team share the keys: whole sequences where there are enough of them, else exact
// shares of all keys end to end (flash-decoding), each cut sequence's pieces (max, sum, unnormalised output)
// merged by log-sum-exp afterwards.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDSERVE_ATTN_AVX512 1
constexpr bool kHaveAvx512 = true;
#else
constexpr bool kHaveAvx512 = false;
#endif
#if defined(PAGEDSERVE_ATTN_AVX512)
#include <immintrin.h>
#endif

#include "../native/cpu_common.h"
#include "../native/fp8.h"

namespace {

using pagedserve::Elem;
using pagedserve::fast_exp;
using pagedserve::Fp8E4M3;
using pagedserve::Fp8E5M2;
using pagedserve::kIsFp8;

// An fp8 cache element as the kernel reads it: its value / C::kHalfUnit (what the fp16 conversion of its bits
// gives), the power of two folded into the scales (Problem).
template <typename C>
inline float fp8_raw(C v) { return pagedserve::fp8_to_float(v) * (1.f / C::kHalfUnit); }

constexpr int kTile = 16;  // keys per tile: one score per lane of a 512-bit register

struct Problem {
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int64_t* seq_lens;
  int64_t num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, table_stride, query_stride, out_stride;
  float scale, soft_cap;
  int64_t window;
  float out_scale;  // times each output row: an fp8 cache's v_scale (and its power of two), else 1
};

// Row pointers of up to kTile consecutive keys (each row: every KV head of one cache slot).
template <typename T>
struct Tile {
  const T* keys[kTile];
  const T* values[kTile];
  int count;
};

// A query's running softmax over the keys seen so far: max and sum of exp(score - max) per query head,
// and the unnormalised weighted sum of values, [num_q_heads, head_dim] fp32.
struct State {
  std::vector<float> max, sum, acc;
  void reset(int64_t heads, int64_t dim) {
    max.assign(heads, -INFINITY);
    sum.assign(heads, 0.f);
    acc.assign(heads * dim, 0.f);
  }
};

// Keys [pos, min(end, next multiple of kTile)): tiles line up with cache blocks of 16 or more slots.
template <typename T>
int64_t fill_tile(const Problem& p, const int32_t* table, int64_t pos, int64_t end, Tile<T>& tile) {
  const int64_t stop = std::min(end, (pos / kTile + 1) * kTile);
  const int64_t slot_stride = p.num_kv_heads * p.head_dim;
  int64_t block = pos / p.block_size, offset = pos % p.block_size;
  tile.count = static_cast<int>(stop - pos);
  for (int j = 0; j < tile.count; ++j) {
    const int64_t row = (static_cast<int64_t>(table[block]) * p.block_size + offset) * slot_stride;
    tile.keys[j] = static_cast<const T*>(p.key_cache) + row;
    tile.values[j] = static_cast<const T*>(p.value_cache) + row;
    if (++offset == p.block_size) offset = 0, ++block;
  }
  // Past the count, rows repeat the first (whose lanes are masked): full-width loops need no branches.
  for (int j = tile.count; j < kTile; ++j) tile.keys[j] = tile.keys[0], tile.values[j] = tile.values[0];
  return stop;
}

constexpr int kAhead = 2;  // tiles between the one computed and the one prefetched

// Software prefetch of a tile's K and V rows (a block anywhere in the cache, which the hardware prefetcher
// cannot guess), issued a few lines at a time between the computations of a tile `kAhead` earlier: a burst
// of a whole tile's lines would stall on the core's few line-fill buffers.
template <typename T>
struct Prefetcher {
  Tile<T> tile;
  // The tile's K rows, then its V rows, as byte ranges (rows next to each other in the cache merged): a cursor
  // walks them a line at a time, with no per-line row lookups.
  const char* begins[2 * kTile];
  const char* ends[2 * kTile];
  const char* cur = nullptr;
  int segment = 0, segments = 0;
  int per_head = 0;  // lines to ask for at each of the 2 * num_q_heads calls a tile makes

  void add_rows(const T* const* rows, int count, int64_t row_bytes) {
    for (int j = 0; j < count; ++j) {
      const char* begin = reinterpret_cast<const char*>(rows[j]);
      if (segments > 0 && ends[segments - 1] == begin) {
        ends[segments - 1] = begin + row_bytes;
      } else {
        begins[segments] = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{63});
        ends[segments++] = begin + row_bytes;
      }
    }
  }

  void start(const Problem& p, bool active) {
    const int64_t row_bytes = p.num_kv_heads * p.head_dim * static_cast<int64_t>(sizeof(T));
    segments = segment = 0;
    if (active) add_rows(tile.keys, tile.count, row_bytes), add_rows(tile.values, tile.count, row_bytes);
    int64_t lines = 0;
    for (int i = 0; i < segments; ++i) lines += (ends[i] - begins[i] + 63) / 64;
    cur = segments > 0 ? begins[0] : nullptr;
    per_head = static_cast<int>((lines + 2 * p.num_q_heads - 1) / (2 * p.num_q_heads));
  }

  void issue(int lines) {
    for (int n = 0; n < lines && segment < segments; ++n) {
      __builtin_prefetch(cur, 0, 2);  // to L2 (T1): beat T0 here
      cur += 64;
      if (cur >= ends[segment] && ++segment < segments) cur = begins[segment];
    }
  }
};

// Portable tile operations: plain loops the compiler vectorises for whatever -march=native offers.
struct PortableOps {
  struct Query {
    std::vector<float> q;  // [num_q_heads, head_dim] fp32
    std::vector<float> row;  // one cache row converted to fp32
  };

  template <typename T>
  static void prepare(const Problem& p, const T* query, Query& out) {
    out.q.resize(p.num_q_heads * p.head_dim);
    out.row.resize(p.num_kv_heads * p.head_dim);
    for (int64_t i = 0; i < p.num_q_heads * p.head_dim; ++i) out.q[i] = Elem<T>::load(query[i]);
  }

  template <typename C>
  static void load_row(const C* src, float* dst, int64_t n) {
    if constexpr (kIsFp8<C>) {
      int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, pagedserve::fp8x8_load(src + i));
#endif
      for (; i < n; ++i) dst[i] = fp8_raw(src[i]);
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = Elem<C>::load(src[i]);
    }
  }

  // scores[qh * kTile + j] = scale * q[qh] · k[j]; lanes past the tile's count are left alone.
  template <typename T, int HEAD_DIM>
  static void scores(const Problem& p, Query& q, const Tile<T>& tile, float* scores, Prefetcher<T>& ahead) {
    const int64_t dim = HEAD_DIM > 0 ? HEAD_DIM : p.head_dim, group = p.num_q_heads / p.num_kv_heads;
    const int lines = ahead.per_head * static_cast<int>(p.num_q_heads) / kTile + 1;
    for (int j = 0; j < tile.count; ++j) {
      ahead.issue(lines);
      load_row(tile.keys[j], q.row.data(), p.num_kv_heads * dim);
      for (int64_t h = 0, qh = 0; h < p.num_kv_heads; ++h) {
        for (int64_t g = 0; g < group; ++g, ++qh) {
          const float* kv = q.row.data() + h * dim;
          const float* qv = q.q.data() + qh * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qv[d] * kv[d];
          scores[qh * kTile + j] = dot * p.scale;
        }
      }
    }
  }

  static void softmax(const Problem& p, int count, float* scores, State& state);

  // acc[qh] += sum_j weights[qh * kTile + j] * v[j].
  template <typename T, int HEAD_DIM>
  static void values(const Problem& p, Query& q, const Tile<T>& tile, const float* weights, float* acc,
                     Prefetcher<T>& ahead) {
    const int64_t dim = HEAD_DIM > 0 ? HEAD_DIM : p.head_dim, group = p.num_q_heads / p.num_kv_heads;
    const int lines = ahead.per_head * static_cast<int>(p.num_q_heads) / kTile + 1;
    for (int j = 0; j < tile.count; ++j) {
      ahead.issue(lines);
      load_row(tile.values[j], q.row.data(), p.num_kv_heads * dim);
      for (int64_t h = 0, qh = 0; h < p.num_kv_heads; ++h) {
        for (int64_t g = 0; g < group; ++g, ++qh) {
          const float* vv = q.row.data() + h * dim;
          const float w = weights[qh * kTile + j];
          float* aq = acc + qh * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) aq[d] += w * vv[d];
        }
      }
    }
  }
};

#if defined(PAGEDSERVE_ATTN_AVX512)
// 16 vectors in, one out whose lane L is the sum of the lanes of v[(L % 4) * 4 + L / 4] (a 4x4 transpose of
// the order; callers store key j's partial sums at v[(j % 4) * 4 + j / 4] so that lane j is key j's score).
inline __m512 reduce16(__m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __mmask16 mask16(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1); }

// 16 elements (fewer under `mask`) of a row as fp32.
inline __m512 load16(const float* src, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, src); }
inline __m512 load16(const uint16_t* src, __mmask16 mask) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// fp8 as the value / C::kHalfUnit (fp8.h).
inline __m512 load16(const Fp8E4M3* src, __mmask16 mask) { return pagedserve::fp8x16_load(src, mask); }
inline __m512 load16(const Fp8E5M2* src, __mmask16 mask) { return pagedserve::fp8x16_load(src, mask); }

// fast_exp (cpu_common.h) on 16 lanes: the same clamp, rounding and polynomial.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, whole), _mm512_set1_ps(0.693147180559945309f));
  __m512 poly = _mm512_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) {
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(c));
  }
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(whole), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(poly, _mm512_castsi512_ps(bits));
}

struct Avx512Ops {
  struct Query {
    std::vector<float> q;        // [num_q_heads, padded] fp32, zero past head_dim
    std::vector<uint16_t> qbf;   // the same in bf16 (a bf16 query as given), for vdpbf16ps
    std::vector<float> vrows;    // a tile's values (or fp8 keys) of one KV head in fp32, [kTile, padded]
    std::vector<float> parts;    // fp8 keys: a query group's 16-lane partial dot products, [group, kTile, 16]
    int64_t padded = 0;          // head_dim rounded up to 32
  };

  template <typename T>
  static void prepare(const Problem& p, const T* query, Query& out) {
    out.padded = (p.head_dim + 31) / 32 * 32;
    out.q.assign(p.num_q_heads * out.padded, 0.f);
    out.qbf.assign(p.num_q_heads * out.padded, 0);
    out.vrows.resize(kTile * out.padded);
    for (int64_t qh = 0; qh < p.num_q_heads; ++qh) {
      for (int64_t d = 0; d < p.head_dim; ++d) out.q[qh * out.padded + d] = Elem<T>::load(query[qh * p.head_dim + d]);
      if constexpr (sizeof(T) == 2) std::memcpy(&out.qbf[qh * out.padded], query + qh * p.head_dim, p.head_dim * 2);
    }
  }

  // One query head against one key row's head: 16 partial sums whose total is the dot product.
  template <typename T>
  static __m512 partial_dot(const Query& q, int64_t qh, const T* key, int64_t dim) {
    __m512 acc = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if constexpr (sizeof(T) == 2) {
      const uint16_t* qv = q.qbf.data() + qh * q.padded;
      for (int64_t d = 0; d < dim; d += 32) {
        const __mmask32 mask = dim - d >= 32 ? 0xffffffffu : (1u << (dim - d)) - 1;
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(mask, key + d),
                               (__m512bh)_mm512_loadu_si512(qv + d));
      }
      return acc;
    }
#endif
    const float* qv = q.q.data() + qh * q.padded;
    for (int64_t d = 0; d < dim; d += 16) {
      acc = _mm512_fmadd_ps(load16(key + d, mask16(dim - d)), _mm512_loadu_ps(qv + d), acc);
    }
    return acc;
  }

  // A tile's rows of KV head h widened to fp32 in q.vrows (one conversion for the whole query group).
  template <typename T>
  static void widen(Query& q, const T* const* src, int64_t offset, int64_t dim, const float** rows) {
    for (int j = 0; j < kTile; ++j) {
      float* dst = q.vrows.data() + j * q.padded;
      for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(dst + d, load16(src[j] + offset + d, mask16(dim - d)));
      rows[j] = dst;
    }
  }

  // Scores on an fp8 cache of a compiled head size: each key row is widened in registers and serves its whole
  // query group (the partial sums go through a small buffer to reduce16), nothing staged in memory.
  template <typename C, int HEAD_DIM>
  static void fp8_scores(const Problem& p, Query& q, const Tile<C>& tile, float* scores, Prefetcher<C>& ahead) {
    constexpr int kChunks = HEAD_DIM / 16 + (HEAD_DIM % 16 != 0);
    const int64_t group = p.num_q_heads / p.num_kv_heads;
    q.parts.resize(group * kTile * 16);
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      ahead.issue(static_cast<int>(ahead.per_head * group));
      for (int j = 0; j < kTile; ++j) {
        __m512 x[kChunks];
#pragma GCC unroll 16
        for (int c = 0; c < kChunks; ++c) x[c] = load16(tile.keys[j] + h * HEAD_DIM + 16 * c, mask16(HEAD_DIM - 16 * c));
        for (int64_t g = 0; g < group; ++g) {
          const float* qv = q.q.data() + (h * group + g) * q.padded;
          __m512 acc = _mm512_mul_ps(x[0], _mm512_loadu_ps(qv));
#pragma GCC unroll 16
          for (int c = 1; c < kChunks; ++c) acc = _mm512_fmadd_ps(x[c], _mm512_loadu_ps(qv + 16 * c), acc);
          _mm512_storeu_ps(q.parts.data() + (g * kTile + (j % 4) * 4 + j / 4) * 16, acc);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        __m512 parts[kTile];
#pragma GCC unroll 16
        for (int i = 0; i < kTile; ++i) parts[i] = _mm512_loadu_ps(q.parts.data() + (g * kTile + i) * 16);
        _mm512_storeu_ps(scores + (h * group + g) * kTile, _mm512_mul_ps(reduce16(parts), _mm512_set1_ps(p.scale)));
      }
    }
  }

  // acc rows of N query heads (from qh) += their weights times a tile's values of KV head h, columns
  // [16 * c0, 16 * (c0 + K)): each value vector is loaded (and widened) once for the N heads, and the N * K
  // sums stay in registers across the tile's keys (the same fma order as one head at a time).
  template <int N, int K, typename C, int HEAD_DIM>
  static void values_chunks(const Tile<C>& tile, const float* weights, float* acc, int64_t h, int64_t qh, int c0) {
    __m512 sum[N][K];
#pragma GCC unroll 4
    for (int i = 0; i < N; ++i) {
#pragma GCC unroll 4
      for (int c = 0; c < K; ++c) sum[i][c] = _mm512_loadu_ps(acc + (qh + i) * HEAD_DIM + 16 * (c0 + c));
    }
#pragma GCC unroll 16
    for (int j = 0; j < kTile; ++j) {
      __m512 x[K];
#pragma GCC unroll 4
      for (int c = 0; c < K; ++c) x[c] = load16(tile.values[j] + h * HEAD_DIM + 16 * (c0 + c), 0xffff);
#pragma GCC unroll 4
      for (int i = 0; i < N; ++i) {
        const __m512 w = _mm512_set1_ps(weights[(qh + i) * kTile + j]);
#pragma GCC unroll 4
        for (int c = 0; c < K; ++c) sum[i][c] = _mm512_fmadd_ps(w, x[c], sum[i][c]);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < N; ++i) {
#pragma GCC unroll 4
      for (int c = 0; c < K; ++c) _mm512_storeu_ps(acc + (qh + i) * HEAD_DIM + 16 * (c0 + c), sum[i][c]);
    }
  }

  // P·V for a head size that is a multiple of 16: up to 4 query heads of a group times up to 4 chunks a pass.
  template <typename C, int HEAD_DIM>
  static void group_values(const Problem& p, const Tile<C>& tile, const float* weights, float* acc,
                           Prefetcher<C>& ahead) {
    constexpr int kChunks = HEAD_DIM / 16;  // in passes of the largest divisor of kChunks up to 4
    constexpr int kPass = kChunks % 4 == 0 ? 4 : kChunks % 3 == 0 ? 3 : kChunks % 2 == 0 ? 2 : 1;
    const int64_t group = p.num_q_heads / p.num_kv_heads;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      ahead.issue(static_cast<int>(ahead.per_head * group));
      for (int c = 0; c < kChunks; c += kPass) {
        for (int64_t g = 0; g < group; g += 4) {
          const int64_t qh = h * group + g;
          switch (std::min<int64_t>(4, group - g)) {
            case 1: values_chunks<1, kPass, C, HEAD_DIM>(tile, weights, acc, h, qh, c); break;
            case 2: values_chunks<2, kPass, C, HEAD_DIM>(tile, weights, acc, h, qh, c); break;
            case 3: values_chunks<3, kPass, C, HEAD_DIM>(tile, weights, acc, h, qh, c); break;
            default: values_chunks<4, kPass, C, HEAD_DIM>(tile, weights, acc, h, qh, c); break;
          }
        }
      }
    }
  }

  template <typename T, int HEAD_DIM>
  static void scores(const Problem& p, Query& q, const Tile<T>& tile, float* scores, Prefetcher<T>& ahead) {
    const int64_t dim = HEAD_DIM > 0 ? HEAD_DIM : p.head_dim, group = p.num_q_heads / p.num_kv_heads;
    const __m512 scale = _mm512_set1_ps(p.scale);
    if constexpr (kIsFp8<T> && HEAD_DIM > 0) {
      return fp8_scores<T, HEAD_DIM>(p, q, tile, scores, ahead);
    } else if constexpr (kIsFp8<T>) {  // fp8 keys widened once per KV head; fp32 products with the fp32 query
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        const float* rows[kTile];
        widen(q, tile.keys, h * dim, dim, rows);
        for (int64_t qh = h * group; qh < (h + 1) * group; ++qh) {
          ahead.issue(ahead.per_head);
          __m512 parts[kTile];
#pragma GCC unroll 16
          for (int j = 0; j < kTile; ++j) parts[(j % 4) * 4 + j / 4] = partial_dot(q, qh, rows[j], dim);
          _mm512_storeu_ps(scores + qh * kTile, _mm512_mul_ps(reduce16(parts), scale));
        }
      }
      return;
    }
    for (int64_t qh = 0; qh < p.num_q_heads; ++qh) {
      ahead.issue(ahead.per_head);
      const int64_t head_offset = qh / group * dim;
      __m512 parts[kTile];  // unrolled, so the partial sums stay in registers
#pragma GCC unroll 16
      for (int j = 0; j < kTile; ++j) parts[(j % 4) * 4 + j / 4] = partial_dot(q, qh, tile.keys[j] + head_offset, dim);
      _mm512_storeu_ps(scores + qh * kTile, _mm512_mul_ps(reduce16(parts), scale));
    }
  }

  // The online softmax step of PortableOps::softmax below, 16 lanes at once.
  static void softmax(const Problem& p, int count, float* scores, State& state) {
    const __mmask16 valid = mask16(count);
    for (int64_t qh = 0; qh < p.num_q_heads; ++qh) {
      float* s = scores + qh * kTile;
      if (p.soft_cap > 0.f) {
        for (int j = 0; j < count; ++j) s[j] = p.soft_cap * std::tanh(s[j] / p.soft_cap);
      }
      const __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, _mm512_loadu_ps(s));
      const float tile_max = _mm512_reduce_max_ps(x);
      float& m = state.max[qh];
      if (tile_max > m) {
        const float alpha = fast_exp(m - tile_max);  // m = -inf: the state is still empty
        state.sum[qh] *= alpha;
        float* acc = state.acc.data() + qh * p.head_dim;
        for (int64_t d = 0; d < p.head_dim; d += 16) {
          const __mmask16 mask = mask16(p.head_dim - d);
          _mm512_mask_storeu_ps(acc + d, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, acc + d),
                                                             _mm512_set1_ps(alpha)));
        }
        m = tile_max;
      }
      const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(x, _mm512_set1_ps(m))));
      _mm512_storeu_ps(s, e);
      state.sum[qh] += _mm512_reduce_add_ps(e);
    }
  }

  template <typename T, int HEAD_DIM>
  static void values(const Problem& p, Query& q, const Tile<T>& tile, const float* weights, float* acc,
                     Prefetcher<T>& ahead) {
    if constexpr (HEAD_DIM > 0 && HEAD_DIM % 16 == 0) {
      return group_values<T, HEAD_DIM>(p, tile, weights, acc, ahead);
    }
    const int64_t dim = HEAD_DIM > 0 ? HEAD_DIM : p.head_dim, group = p.num_q_heads / p.num_kv_heads;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      // A bf16 or fp8 head is widened once into vrows and serves the whole group; fp32 rows are read in place.
      const float* rows[kTile];
      if constexpr (std::is_same_v<T, float>) {
        for (int j = 0; j < kTile; ++j) rows[j] = tile.values[j] + h * dim;
      } else {
        widen(q, tile.values, h * dim, dim, rows);
      }
      for (int64_t qh = h * group; qh < (h + 1) * group; ++qh) {
        ahead.issue(ahead.per_head);
        __m512 w[kTile];  // zero past the tile's count
#pragma GCC unroll 16
        for (int j = 0; j < kTile; ++j) w[j] = _mm512_set1_ps(weights[qh * kTile + j]);
        float* aq = acc + qh * dim;
        for (int64_t d = 0; d < dim; d += 16) {
          const __mmask16 mask = mask16(dim - d);
          __m512 sum = _mm512_maskz_loadu_ps(mask, aq + d);
#pragma GCC unroll 16
          for (int j = 0; j < kTile; ++j) sum = _mm512_fmadd_ps(w[j], _mm512_maskz_loadu_ps(mask, rows[j] + d), sum);
          _mm512_mask_storeu_ps(aq + d, mask, sum);
        }
      }
    }
  }
};
#endif

// Online softmax over one tile's scores: rescales the state to the new maximum and turns the scores into
// weights exp(score - max) in place (zero past the tile's count).
void PortableOps::softmax(const Problem& p, int count, float* scores, State& state) {
  for (int64_t qh = 0; qh < p.num_q_heads; ++qh) {
    float* s = scores + qh * kTile;
    if (p.soft_cap > 0.f) {
      for (int j = 0; j < count; ++j) s[j] = p.soft_cap * std::tanh(s[j] / p.soft_cap);
    }
    float tile_max = -INFINITY;
#pragma omp simd reduction(max : tile_max)
    for (int j = 0; j < count; ++j) tile_max = std::max(tile_max, s[j]);
    float& m = state.max[qh];
    if (tile_max > m) {
      const float alpha = fast_exp(m - tile_max);  // m = -inf: the state is still empty
      state.sum[qh] *= alpha;
      float* acc = state.acc.data() + qh * p.head_dim;
#pragma omp simd
      for (int64_t d = 0; d < p.head_dim; ++d) acc[d] *= alpha;
      m = tile_max;
    }
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int j = 0; j < kTile; ++j) {
      // Lanes past the count hold stale (maybe NaN) scores: select before exp, zero after.
      s[j] = fast_exp(j < count ? s[j] - m : -87.f) * static_cast<float>(j < count);
      total += s[j];
    }
    state.sum[qh] += total;
  }
}

// Attention of sequence s's query (T) over its keys [first, last) in a cache of C into `state` (reset first).
template <typename T, typename C, int HEAD_DIM, typename Ops>
void attend(const Problem& p, int64_t s, int64_t first, int64_t last, typename Ops::Query& q, State& state) {
  Ops::prepare(p, static_cast<const T*>(p.query) + s * p.query_stride, q);
  state.reset(p.num_q_heads, p.head_dim);
  const int32_t* table = p.block_tables + s * p.table_stride;
  float scores[64 * kTile];
  std::vector<float> heap;
  float* weights = scores;
  if (p.num_q_heads > 64) heap.resize(p.num_q_heads * kTile), weights = heap.data();
  Tile<C> tile;
  Prefetcher<C> ahead;
  int64_t ahead_pos = first;
  for (int i = 0; i < kAhead && ahead_pos < last; ++i) ahead_pos = fill_tile(p, table, ahead_pos, last, ahead.tile);
  for (int64_t pos = first; pos < last;) {
    pos = fill_tile(p, table, pos, last, tile);
    const bool active = ahead_pos < last;
    if (active) ahead_pos = fill_tile(p, table, ahead_pos, last, ahead.tile);
    ahead.start(p, active);
    Ops::template scores<C, HEAD_DIM>(p, q, tile, weights, ahead);
    Ops::softmax(p, tile.count, weights, state);
    Ops::template values<C, HEAD_DIM>(p, q, tile, weights, state.acc.data(), ahead);
  }
}

// Output rows acc / sum (times out_scale) in the query's dtype.
template <typename T>
void write_out(const Problem& p, const State& state, T* out) {
  for (int64_t qh = 0; qh < p.num_q_heads; ++qh) {
    const float inv = p.out_scale / state.sum[qh];
    for (int64_t d = 0; d < p.head_dim; ++d) {
      out[qh * p.head_dim + d] = Elem<T>::store(state.acc[qh * p.head_dim + d] * inv);
    }
  }
}

// A piece of a cut sequence: [max, sum] per query head, then acc, as fp32.
int64_t piece_size(const Problem& p) { return p.num_q_heads * (p.head_dim + 2); }

void write_piece(const Problem& p, const State& state, float* piece) {
  std::copy(state.max.begin(), state.max.end(), piece);
  std::copy(state.sum.begin(), state.sum.end(), piece + p.num_q_heads);
  std::copy(state.acc.begin(), state.acc.end(), piece + 2 * p.num_q_heads);
}

// Below this many keys a part, waking another thread costs more than it saves.
constexpr int64_t kMinKeysPerPart = 512;

// How the keys are shared among parts: all sequences' keys end to end (each sequence's window only).
struct Split {
  int64_t parts = 1, total = 0;
  bool cut = false;  // parts cut sequences at exact key shares (flash-decoding), else whole sequences

  Split(const Problem& p, int64_t max_parts) {
    for (int64_t s = 0; s < p.num_seqs; ++s) total += span(p, s);
    parts = std::max<int64_t>(1, std::min(max_parts, total / kMinKeysPerPart));
    cut = parts > 1 && p.num_seqs < 2 * parts;  // too few sequences to share them out whole
  }
  static int64_t span(const Problem& p, int64_t s) {
    return p.window > 0 ? std::min(p.seq_lens[s], p.window) : p.seq_lens[s];
  }
  // The keys [begin, end) of sequence s (starting at `offset` end to end) that part `part` computes.
  std::pair<int64_t, int64_t> share(int64_t part, int64_t offset, int64_t span) const {
    if (cut) {
      return {std::max(total * part / parts, offset), std::min(total * (part + 1) / parts, offset + span)};
    }
    const int64_t owner = std::min(parts - 1, (2 * offset + span) * parts / std::max<int64_t>(2 * total, 1));
    return owner == part ? std::make_pair(offset, offset + span) : std::make_pair(offset, offset);
  }
};

// Part `part` of the split: sequences wholly in its share are written to `out`; a cut one goes to piece slot
// 2 * part (the share's first sequence, begun by an earlier part) or 2 * part + 1 (its last, ended by a later
// part), its sequence number in piece_seqs (-1: slot unused).
template <typename T, typename C, int HEAD_DIM, typename Ops>
void decode_part(const Problem& p, const Split& split, int64_t part, T* out, float* pieces, int64_t* piece_seqs) {
  if (split.cut) piece_seqs[2 * part] = piece_seqs[2 * part + 1] = -1;
  typename Ops::Query q;
  State state;
  for (int64_t s = 0, offset = 0; s < p.num_seqs; offset += Split::span(p, s), ++s) {
    const int64_t span = Split::span(p, s);
    const auto [begin, end] = split.share(part, offset, span);
    if (begin >= end) continue;
    const int64_t skipped = p.seq_lens[s] - span;  // keys before the window
    attend<T, C, HEAD_DIM, Ops>(p, s, skipped + begin - offset, skipped + end - offset, q, state);
    if (begin == offset && end == offset + span) {
      write_out(p, state, out + s * p.out_stride);
    } else {
      const int64_t slot = 2 * part + (begin > offset ? 0 : 1);
      write_piece(p, state, pieces + slot * piece_size(p));
      piece_seqs[slot] = s;
    }
  }
}

template <typename T, typename C, int HEAD_DIM, typename Ops>
void decode_parts(const Problem& p, const Split& split, T* out, float* pieces, int64_t* piece_seqs) {
#pragma omp parallel for schedule(static, 1) num_threads(static_cast<int>(split.parts)) if (split.parts > 1)
  for (int64_t part = 0; part < split.parts; ++part) {
    decode_part<T, C, HEAD_DIM, Ops>(p, split, part, out, pieces, piece_seqs);
  }
}

template <typename T, typename C, typename Ops>
void dispatch_head_dim(const Problem& p, const Split& split, T* out, float* pieces, int64_t* piece_seqs) {
  switch (p.head_dim) {
    case 64: return decode_parts<T, C, 64, Ops>(p, split, out, pieces, piece_seqs);
    case 128: return decode_parts<T, C, 128, Ops>(p, split, out, pieces, piece_seqs);
    case 32: return decode_parts<T, C, 32, Ops>(p, split, out, pieces, piece_seqs);
    case 96: return decode_parts<T, C, 96, Ops>(p, split, out, pieces, piece_seqs);
    default: return decode_parts<T, C, 0, Ops>(p, split, out, pieces, piece_seqs);
  }
}

// Combines the pieces of each cut sequence by their maxima (log-sum-exp) and writes its output row.
template <typename T>
void merge_pieces(T* out, const float* pieces, const int64_t* piece_seqs, int64_t num_pieces, int64_t heads,
                  int64_t dim, int64_t out_stride, float out_scale) {
  const int64_t size = heads * (dim + 2);
  std::vector<float> acc(dim);
  for (int64_t i = 0; i < num_pieces; ++i) {
    const int64_t s = piece_seqs[i];
    if (s < 0 || (i > 0 && std::find(piece_seqs, piece_seqs + i, s) != piece_seqs + i)) continue;
    for (int64_t qh = 0; qh < heads; ++qh) {
      float m = -INFINITY, sum = 0.f;
      for (int64_t k = i; k < num_pieces; ++k) {
        if (piece_seqs[k] == s) m = std::max(m, pieces[k * size + qh]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k = i; k < num_pieces; ++k) {
        if (piece_seqs[k] != s) continue;
        const float* piece = pieces + k * size;
        const float weight = fast_exp(piece[qh] - m);
        sum += piece[heads + qh] * weight;
        for (int64_t d = 0; d < dim; ++d) acc[d] += piece[2 * heads + qh * dim + d] * weight;
      }
      const float inv = out_scale / sum;  // 1 / sum without an fp8 cache, as write_out
      for (int64_t d = 0; d < dim; ++d) out[s * out_stride + qh * dim + d] = Elem<T>::store(acc[d] * inv);
    }
  }
}

// The fp8 caches' parameters: the scales of the contract, and the power of two of the kernel's fp16 reading.
template <typename C>
void fold_scales(Problem& p, float k_scale, float v_scale) {
  if constexpr (kIsFp8<C>) {
    p.scale *= k_scale * C::kHalfUnit;  // scores: q · (stored * k_scale), soft cap after
    p.out_scale = v_scale * C::kHalfUnit;
  }
}

template <typename T, typename C>
void decode(Problem& p, int64_t max_parts, int portable, float k_scale, float v_scale, T* rows) {
  fold_scales<C>(p, k_scale, v_scale);
  const Split split(p, max_parts);
  std::vector<float> pieces(split.cut ? 2 * split.parts * piece_size(p) : 0);
  std::vector<int64_t> piece_seqs(split.cut ? 2 * split.parts : 0);
#if defined(PAGEDSERVE_ATTN_AVX512)
  if (!portable) dispatch_head_dim<T, C, Avx512Ops>(p, split, rows, pieces.data(), piece_seqs.data());
#endif
  if (portable || !kHaveAvx512) dispatch_head_dim<T, C, PortableOps>(p, split, rows, pieces.data(), piece_seqs.data());
  merge_pieces(rows, pieces.data(), piece_seqs.data(), static_cast<int64_t>(piece_seqs.size()), p.num_q_heads,
               p.head_dim, p.out_stride, p.out_scale);
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 for an unsupported dtype (or cache dtype). Strides are in elements; caches are
// contiguous [num_blocks, block_size, num_kv_heads, head_dim]; query/out rows are [num_q_heads, head_dim]
// contiguous. window <= 0: no sliding window; soft_cap <= 0: no soft-capping. Up to max_parts threads of the
// OpenMP team share the keys (Split); portable != 0 uses the portable loops even where AVX-512 was compiled in.
// cache_dtype (fp8.h): the query's dtype code, or an fp8 format read as stored * k_scale (keys) and
// stored * v_scale (values).
int pagedserve_decode_attention(void* out, const void* query, const void* key_cache, const void* value_cache,
                                const int32_t* block_tables, const int64_t* seq_lens, int64_t num_seqs,
                                int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, int64_t block_table_stride, int64_t query_stride,
                                int64_t out_stride, float scale, int64_t window, float soft_cap, int dtype,
                                int64_t max_parts, int portable, int cache_dtype, float k_scale, float v_scale) {
  Problem problem{query, key_cache, value_cache, block_tables, seq_lens, num_seqs, num_q_heads,
                  num_kv_heads, head_dim, block_size, block_table_stride, query_stride, out_stride,
                  scale, soft_cap, window, 1.f};
  int bad = 0;
  const int status = pagedserve::with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int cache_status = pagedserve::with_cache_dtype(cache_dtype, [&](auto cache_tag) {
      using C = decltype(cache_tag);
      if constexpr (kIsFp8<C> || std::is_same_v<C, T>) {
        decode<T, C>(problem, max_parts, portable, k_scale, v_scale, static_cast<T*>(out));
      } else {
        bad = 1;
      }
    });
    bad |= cache_status;
  });
  return status | bad;
}

}  // extern "C"
