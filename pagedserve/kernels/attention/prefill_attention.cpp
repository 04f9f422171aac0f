// Prefill attention for the CPU: one chunk of a sequence's queries attends over its K/V read in place from the
// paged cache (no gather into a contiguous copy, no K/V repeated per query head), flash-style: key tiles of
// kKeys keys, an online softmax per query row, fp32 accumulation. A work item is one KV head and a block of
// the chunk's queries with that head's query group stacked as rows (row r = token r / group, head r % group),
// so each K/V tile is read once for the whole group. Causal within the chunk; window > 0 keeps the last
// `window` keys of each query; soft_cap > 0 applies cap * tanh(s / cap).
// Where the compiler targets AMX-BF16 (and the kernel may use it), bf16 caches run Q·K and P·V on AMX tiles;
// otherwise (fp32, or a CPU without AMX) the same loops run in fp32 vector code. An fp8 cache is widened as its
// tiles are packed (to bf16 for AMX: every fp8 value is a bf16 one), k_scale folded into the scale and v_scale
// into the output.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "../native/cpu_common.h"
#include "../native/fp8.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDSERVE_PREFILL_AMX 1
#endif

namespace {

using pagedserve::Elem;
using pagedserve::fast_exp;
using pagedserve::kIsFp8;

// A cache element's value in fp32 (an fp8 one before its scale).
template <typename C>
inline float load_elem(C v) {
  if constexpr (kIsFp8<C>) {
    return pagedserve::fp8_to_float(v);
  } else {
    return Elem<C>::load(v);
  }
}

constexpr int64_t kKeys = 128;  // keys per tile: 4 AMX K-steps of 32 (fewer rescales of the output rows)
constexpr int64_t kRows = 16;  // query rows per score block: one AMX tile's rows

struct Problem {
  const void* query;
  const void* key_cache;
  const void* value_cache;
  void* out;
  const int32_t* table;
  int64_t q_len, seq_len, num_q_heads, num_kv_heads, head_dim, block_size, query_stride, out_stride;
  float scale;
  int64_t window;
  float soft_cap;
  int64_t group, query_block;
  float out_scale;  // times each output row: an fp8 cache's v_scale, else 1
};

// KV head `head`, chunk tokens first..first+count-1 (positions pos0..), keys key_begin..key_end-1.
struct Item {
  int64_t head, first, count, rows, padded, pos0, key_begin, key_end;
};

// Storage on 64-byte boundaries: an AMX tile row or a 512-bit vector that straddles two cache lines costs two
// accesses, and malloc's 16-byte alignment made the tile loads and stores of every buffer below straddle.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using Buffer = std::vector<T, CacheLineAllocator<T>>;

// Per thread: stacked queries, the packed K/V tile, one block's scores/probabilities, the running state.
struct Workspace {
  Buffer<float> qf, kt, vf, scores, probs, o, m, l;
  Buffer<uint16_t> qb, pb;
  Buffer<uint32_t> kp, vp;
  Buffer<uint16_t> widened;  // an fp8 tile's two K and two V rows in bf16 (AMX packing)
  std::vector<int64_t> row_pos;  // position of each stacked row's query (no division per row and tile)
};

inline int64_t first_visible(const Problem& pb, int64_t pos) {
  return pb.window > 0 ? std::max<int64_t>(0, pos - pb.window + 1) : 0;
}

// Work items in an order where contiguous ranges hold similar causal work: query blocks zig-zag (first, last,
// second, second last...), KV heads innermost.
Item make_item(const Problem& pb, int64_t index) {
  const int64_t blocks = (pb.q_len + pb.query_block - 1) / pb.query_block;
  const int64_t j = index / pb.num_kv_heads;
  const int64_t block = j % 2 == 0 ? j / 2 : blocks - 1 - j / 2;
  Item it;
  it.head = index % pb.num_kv_heads;
  it.first = block * pb.query_block;
  it.count = std::min(pb.query_block, pb.q_len - it.first);
  it.rows = it.count * pb.group;
  it.padded = (it.rows + kRows - 1) / kRows * kRows;
  it.pos0 = pb.seq_len - pb.q_len + it.first;
  it.key_begin = first_visible(pb, it.pos0);
  it.key_end = it.pos0 + it.count;
  return it;
}

template <typename T>
inline const T* cache_row(const void* cache, const Problem& pb, int64_t pos, int64_t head) {
  const int64_t slot = static_cast<int64_t>(pb.table[pos / pb.block_size]) * pb.block_size + pos % pb.block_size;
  return static_cast<const T*>(cache) + (slot * pb.num_kv_heads + head) * pb.head_dim;
}

// K and V rows of 16 consecutive positions from pos0 (a multiple of 16): one table lookup and one division
// when a cache block holds whole groups of 16, else per position (an int64 division and a table read each).
// Positions past the context are not looked up (their rows are never read).
template <typename C>
inline void cache_rows16(const Problem& pb, int64_t pos0, int64_t head, const C* keys[16], const C* values[16]) {
  const int64_t stride = pb.num_kv_heads * pb.head_dim;
  if (pb.block_size % 16 == 0 && pos0 < pb.seq_len) {
    const int64_t slot = static_cast<int64_t>(pb.table[pos0 / pb.block_size]) * pb.block_size + pos0 % pb.block_size;
    const int64_t first = slot * stride + head * pb.head_dim;
    for (int e = 0; e < 16; ++e) {
      keys[e] = static_cast<const C*>(pb.key_cache) + first + e * stride;
      values[e] = static_cast<const C*>(pb.value_cache) + first + e * stride;
    }
    return;
  }
  for (int e = 0; e < 16; ++e) {
    const bool inside = pos0 + e < pb.seq_len;
    keys[e] = inside ? cache_row<C>(pb.key_cache, pb, pos0 + e, head) : nullptr;
    values[e] = inside ? cache_row<C>(pb.value_cache, pb, pos0 + e, head) : nullptr;
  }
}

template <typename T>
inline const T* query_row(const Problem& pb, const Item& it, int64_t r) {
  const int64_t token = it.first + r / pb.group, q_head = it.head * pb.group + r % pb.group;
  return static_cast<const T*>(pb.query) + token * pb.query_stride + q_head * pb.head_dim;
}

// Scores of rows r0..r0+16 against keys k0..k0+kKeys (raw dot products in s): scaled, capped, masked, folded
// into the running max m, sum l and output rows o (rescaled); p gets the tile's probabilities (P: float or
// bf16 bits). Returns false when no row of the block sees any key of the tile (p untouched).
template <typename P>
bool softmax_block(const Problem& pb, const Item& it, int64_t r0, int64_t k0, float* s, P* p, Workspace& ws) {
  const int64_t d = pb.head_dim;
  bool any = false;
  for (int64_t rr = 0; rr < kRows; ++rr) {
    const int64_t r = r0 + rr;
    float* srow = s + rr * kKeys;
    P* prow = p + rr * kKeys;
    const int64_t pos = ws.row_pos[r];
    const int64_t lo = r < it.rows ? std::max<int64_t>(first_visible(pb, pos) - k0, 0) : kKeys;
    const int64_t hi = r < it.rows ? std::min<int64_t>(pos + 1 - k0, kKeys) : 0;
    if (lo >= hi) {
      std::memset(prow, 0, kKeys * sizeof(P));
      continue;
    }
    any = true;
    float top = -INFINITY;
    if (pb.soft_cap > 0.f) {
      for (int64_t j = lo; j < hi; ++j) {
        srow[j] = pb.soft_cap * std::tanh(srow[j] * pb.scale / pb.soft_cap);
        top = srow[j] > top ? srow[j] : top;
      }
    } else {
#pragma omp simd reduction(max : top)
      for (int64_t j = 0; j < kKeys; ++j) {
        srow[j] *= pb.scale;
        top = j >= lo && j < hi && srow[j] > top ? srow[j] : top;
      }
    }
    const float m_new = std::max(ws.m[r], top);
    const float alpha = ws.m[r] == -INFINITY ? 0.f : fast_exp(ws.m[r] - m_new);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < kKeys; ++j) {
      const float e = j >= lo && j < hi ? fast_exp(srow[j] - m_new) : 0.f;
      prow[j] = Elem<P>::store(e);
      sum += e;
    }
    ws.l[r] = ws.l[r] * alpha + sum;
    ws.m[r] = m_new;
    if (alpha != 1.f) {
      float* orow = ws.o.data() + r * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) orow[c] *= alpha;
    }
  }
  return any;
}

// True when the rows r0..r0+16 (tokens in order) may see a key of the tile at k0 (causal bound only).
inline bool block_reaches(const Problem& pb, const Item& it, int64_t r0, int64_t k0) {
  const int64_t last = std::min(r0 + kRows, it.rows) - 1;
  return last >= r0 && it.pos0 + last / pb.group >= k0;
}

template <typename T>
void store_output(const Problem& pb, const Item& it, const Workspace& ws) {
  const int64_t d = pb.head_dim;
  for (int64_t r = 0; r < it.rows; ++r) {
    const int64_t token = it.first + r / pb.group, q_head = it.head * pb.group + r % pb.group;
    T* dst = static_cast<T*>(pb.out) + token * pb.out_stride + q_head * d;
    const float* src = ws.o.data() + r * d;
    const float inv = pb.out_scale / ws.l[r];  // 1 / l without an fp8 cache
    for (int64_t c = 0; c < d; ++c) dst[c] = Elem<T>::store(src[c] * inv);
  }
}

void reset_state(const Problem& pb, const Item& it, Workspace& ws) {
  const int64_t head_dim = pb.head_dim;
  ws.row_pos.resize(it.padded);
  for (int64_t r = 0; r < it.padded; ++r) ws.row_pos[r] = it.pos0 + r / pb.group;
  ws.o.assign(it.padded * head_dim, 0.f);
  ws.m.assign(it.padded, -INFINITY);
  ws.l.assign(it.padded, 0.f);
}

// The fp32 path: K packed transposed ([D][kKeys], so a row's scores are one vector loop over keys), V as rows.
template <typename C>
void pack_tile_f32(const Problem& pb, const Item& it, int64_t k0, Workspace& ws) {
  const int64_t d = pb.head_dim;
  for (int64_t j = 0; j < kKeys; ++j) {
    const int64_t pos = k0 + j;
    float* vrow = ws.vf.data() + j * d;
    if (pos < it.key_begin || pos >= it.key_end) {
      for (int64_t c = 0; c < d; ++c) ws.kt[c * kKeys + j] = 0.f;
      std::memset(vrow, 0, d * sizeof(float));
      continue;
    }
    const C* krow = cache_row<C>(pb.key_cache, pb, pos, it.head);
    const C* vsrc = cache_row<C>(pb.value_cache, pb, pos, it.head);
    for (int64_t c = 0; c < d; ++c) ws.kt[c * kKeys + j] = load_elem(krow[c]);
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) vrow[c] = load_elem(vsrc[c]);
  }
}

template <typename T, typename C>
void run_item_f32(const Problem& pb, const Item& it, Workspace& ws) {
  const int64_t d = pb.head_dim;
  reset_state(pb, it, ws);
  ws.qf.assign(it.padded * d, 0.f);
  ws.kt.resize(d * kKeys);
  ws.vf.resize(kKeys * d);
  ws.scores.resize(kRows * kKeys);
  ws.probs.resize(kRows * kKeys);
  for (int64_t r = 0; r < it.rows; ++r) {
    const T* src = query_row<T>(pb, it, r);
    for (int64_t c = 0; c < d; ++c) ws.qf[r * d + c] = Elem<T>::load(src[c]);
  }
  for (int64_t k0 = it.key_begin / kKeys * kKeys; k0 < it.key_end; k0 += kKeys) {
    pack_tile_f32<C>(pb, it, k0, ws);
    for (int64_t r0 = 0; r0 < it.padded; r0 += kRows) {
      if (!block_reaches(pb, it, r0, k0)) continue;
      float* s = ws.scores.data();
      std::memset(s, 0, kRows * kKeys * sizeof(float));
      for (int64_t rr = 0; rr < kRows; ++rr) {
        const float* q = ws.qf.data() + (r0 + rr) * d;
        float* srow = s + rr * kKeys;
        for (int64_t c = 0; c < d; ++c) {
          const float qc = q[c];
          const float* kc = ws.kt.data() + c * kKeys;
#pragma omp simd
          for (int64_t j = 0; j < kKeys; ++j) srow[j] += qc * kc[j];
        }
      }
      if (!softmax_block(pb, it, r0, k0, s, ws.probs.data(), ws)) continue;
      for (int64_t rr = 0; rr < kRows; ++rr) {
        float* orow = ws.o.data() + (r0 + rr) * d;
        const float* prow = ws.probs.data() + rr * kKeys;
        for (int64_t j = 0; j < kKeys; ++j) {
          const float pj = prow[j];
          const float* vrow = ws.vf.data() + j * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) orow[c] += pj * vrow[c];
        }
      }
    }
  }
  store_output<T>(pb, it, ws);
}

#ifdef PAGEDSERVE_PREFILL_AMX
// Eight tiles of 16 rows x 64 bytes: 0-3 accumulators, 4 the A operand, 5-7 the B operand.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Linux hands out the AMX register state only on request (once per process).
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

// 2^t on the lanes of `keep` (0 elsewhere): 2^round(t) * 2^f, f in [-0.5, 0.5], a degree-3 minimax fit (relative
// error below 7.5e-5, a fiftieth of the bf16 rounding the probabilities then take: outputs as close to the fp32
// oracle as with degree 5); scalef takes any exponent, so no clamp.
inline __m512 exp2_16(__mmask16 keep, __m512 t) {
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(5.5176053e-2f);  // fitted for relative error on [-0.5, 0.5]
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2426115f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69326019f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992806f));
  return _mm512_maskz_scalef_ps(keep, p, whole);
}

// Lanes 16i..16i+15 of a row that fall in [lo, hi) (all of them for a row that sees the whole tile, the common
// case past the first tiles: no scalar work competing with the vector ports).
inline __mmask16 lane_mask(int64_t i, int64_t lo, int64_t hi) {
  if (lo == 0 && hi == kKeys) return 0xffff;
  const int64_t a = std::clamp<int64_t>(lo - 16 * i, 0, 16), b = std::clamp<int64_t>(hi - 16 * i, 0, 16);
  return static_cast<__mmask16>(((1u << b) - 1u) & ~((1u << a) - 1u));
}

// 16 vectors in, one out whose lane L reduces (by `op`: add or max) the lanes of v[(L % 4) * 4 + L / 4]: a row's
// vector stored at v[(r % 4) * 4 + r / 4] gives lane r its total, 16 rows' horizontal reductions in 15 steps.
template <typename Op>
inline __m512 reduce16(const __m512* v, Op op) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {
    w[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    x[i] = op(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    y[i] = op(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return op(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline int lane_slot(int64_t rr) { return static_cast<int>((rr % 4) * 4 + rr / 4); }

// softmax_block for bf16 probabilities without a soft cap, in AVX-512: the maximum over the raw dot products
// (the scale is positive), then exp(scale * s - m) as 2^(s * scale * log2 e - m * log2 e), one FMA per lane.
// Two passes over the block's rows (maxima, then exponentials), each row's maximum and sum left in a vector and
// the 16 rows' vectors reduced together (reduce16) rather than one horizontal reduction per row.
bool softmax_block_avx512(const Problem& pb, const Item& it, int64_t r0, int64_t k0, Workspace& ws) {
  constexpr int64_t kVecs = kKeys / 16;
  constexpr float kLog2e = 1.44269504088896341f;
  int64_t lo[kRows], hi[kRows];
  alignas(64) float row_max[kRows], row_sum[kRows];
  __m512 lanes[kRows];
  bool any = false;
  for (int64_t rr = 0; rr < kRows; ++rr) {
    const int64_t r = r0 + rr, pos = ws.row_pos[r];
    lo[rr] = r < it.rows ? std::max<int64_t>(first_visible(pb, pos) - k0, 0) : kKeys;
    hi[rr] = r < it.rows ? std::min<int64_t>(pos + 1 - k0, kKeys) : 0;
    __m512 top = _mm512_set1_ps(-INFINITY);
    if (lo[rr] < hi[rr]) {
      any = true;
      const float* srow = ws.scores.data() + rr * kKeys;
      for (int64_t i = 0; i < kVecs; ++i) {
        top = _mm512_mask_max_ps(top, lane_mask(i, lo[rr], hi[rr]), top, _mm512_loadu_ps(srow + 16 * i));
      }
    }
    lanes[lane_slot(rr)] = top;
  }
  if (!any) return false;
  _mm512_store_ps(row_max, reduce16(lanes, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }));
  float alpha[kRows];
  for (int64_t rr = 0; rr < kRows; ++rr) {
    uint16_t* prow = ws.pb.data() + rr * kKeys;
    if (lo[rr] >= hi[rr]) {
      std::memset(prow, 0, kKeys * sizeof(uint16_t));
      lanes[lane_slot(rr)] = _mm512_setzero_ps();
      continue;
    }
    const int64_t r = r0 + rr;
    const float m_old = ws.m[r], m_new = std::max(m_old, row_max[rr] * pb.scale);
    // Past the first tiles the maximum seldom moves: no scalar exp then.
    alpha[rr] = m_new == m_old ? 1.f : (m_old == -INFINITY ? 0.f : fast_exp(m_old - m_new));
    ws.m[r] = m_new;
    const float* srow = ws.scores.data() + rr * kKeys;
    const __m512 mul = _mm512_set1_ps(pb.scale * kLog2e), shift = _mm512_set1_ps(-m_new * kLog2e);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < kVecs; i += 2) {
      const __m512 e0 = exp2_16(lane_mask(i, lo[rr], hi[rr]),
                                _mm512_fmadd_ps(_mm512_loadu_ps(srow + 16 * i), mul, shift));
      const __m512 e1 = exp2_16(lane_mask(i + 1, lo[rr], hi[rr]),
                                _mm512_fmadd_ps(_mm512_loadu_ps(srow + 16 * i + 16), mul, shift));
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      _mm512_storeu_si512(prow + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    lanes[lane_slot(rr)] = sum;
  }
  _mm512_store_ps(row_sum, reduce16(lanes, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
  for (int64_t rr = 0; rr < kRows; ++rr) {
    if (lo[rr] >= hi[rr]) continue;
    const int64_t r = r0 + rr;
    ws.l[r] = ws.l[r] * alpha[rr] + row_sum[rr];
    if (alpha[rr] != 1.f) {
      float* orow = ws.o.data() + r * pb.head_dim;
      const __m512 a = _mm512_set1_ps(alpha[rr]);
      for (int64_t c = 0; c < pb.head_dim; c += 16) {
        _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(orow + c), a));
      }
    }
  }
  return true;
}

// K as AMX's B operand of S = Q K^T: element (dim pair c, key j) = K[j][2c..2c+1] as one uint32, [D/2][kKeys].
// V as the B operand of O = P V: element (key pair j, dim c) = (V[2j][c], V[2j+1][c]), [kKeys/2][D].
// A cache row as bf16: a bf16 cache's in place, an fp8 one's widened into `buf` (exactly: fp8 values are bf16 ones).
template <typename C>
const uint16_t* bf16_row(const C* row, int64_t d, uint16_t* buf) {
  if constexpr (kIsFp8<C>) {
    const __m512 unit = _mm512_set1_ps(C::kHalfUnit);
    for (int64_t c = 0; c < d; c += 16) {
      const __m512 x = _mm512_mul_ps(pagedserve::fp8x16_load(row + c, 0xffff), unit);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf + c), (__m256i)_mm512_cvtneps_pbh(x));
    }
    return buf;
  } else {
    return row;
  }
}

// Transposes a 16 x 16 block of 32-bit elements held as 16 row vectors (columns become rows).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + 4 + i], 0x88);
      t[h + 4 + i] = _mm512_shuffle_i32x4(r[h + i], r[h + 4 + i], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
  }
}

// Keys k0..k0+kKeys of KV head it.head into ws.kp / ws.vp. K goes 16 keys at a time through 16 x 16 transposes
// of dim pairs rather than a scalar store per pair and key; the next tile's rows are prefetched line by line while
// this one's are packed.
template <typename C>
void pack_tile_amx(const Problem& pb, const Item& it, int64_t k0, Workspace& ws) {
  const int64_t d = pb.head_dim, pairs = d / 2;
  static const uint16_t zeros[512] = {};
  if constexpr (kIsFp8<C>) ws.widened.resize(18 * d);  // 16 K rows, then two V rows
  for (int64_t j0 = 0; j0 < kKeys; j0 += 16) {
    const C *kp[16], *vp[16], *kn[16], *vn[16];
    cache_rows16(pb, k0 + j0, it.head, kp, vp);
    const bool next = k0 + j0 + kKeys < it.key_end;
    if (next) cache_rows16(pb, k0 + j0 + kKeys, it.head, kn, vn);
    const uint16_t* krows[16];
    for (int64_t e = 0; e < 16; ++e) {
      const int64_t pos = k0 + j0 + e;
      const bool valid = pos >= it.key_begin && pos < it.key_end;
      krows[e] = valid ? bf16_row(kp[e], d, ws.widened.data() + e * d) : zeros;
      if (next && pos + kKeys < it.key_end) {
        for (int64_t line = 0; line < pb.head_dim * static_cast<int64_t>(sizeof(C)); line += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(kn[e]) + line);
          __builtin_prefetch(reinterpret_cast<const char*>(vn[e]) + line);
        }
      }
    }
    for (int64_t c0 = 0; c0 < pairs; c0 += 16) {
      __m512i r[16];
      for (int e = 0; e < 16; ++e) r[e] = _mm512_loadu_si512(krows[e] + 2 * c0);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(ws.kp.data() + (c0 + i) * kKeys + j0, r[i]);
    }
    for (int64_t j = j0; j < j0 + 16; j += 2) {
      const uint16_t* vrows[2];
      for (int64_t e = 0; e < 2; ++e) {
        const int64_t pos = k0 + j + e;
        const bool valid = pos >= it.key_begin && pos < it.key_end;
        uint16_t* buf = ws.widened.data() + (16 + e) * d;
        vrows[e] = valid ? bf16_row(vp[j - j0 + e], d, buf) : zeros;
      }
      uint32_t* vrow = ws.vp.data() + (j / 2) * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) {
        vrow[c] = static_cast<uint32_t>(vrows[0][c]) | static_cast<uint32_t>(vrows[1][c]) << 16;
      }
    }
  }
}

// S (16 rows x kKeys, fp32) = Q rows r0.. times the packed K tile, 64 keys (four accumulators) at a time.
void scores_amx(const Problem& pb, int64_t r0, Workspace& ws) {
  const int64_t d = pb.head_dim;
  for (int64_t k = 0; k < kKeys; k += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < d / 32; ++c) {
      _tile_loadd(4, ws.qb.data() + r0 * d + c * 32, d * 2);
      const uint32_t* b = ws.kp.data() + c * 16 * kKeys + k;
      // B rotates over three tiles: a load need not wait for the product just issued to release its tile.
      _tile_loadd(5, b, kKeys * 4);
      _tile_loadd(6, b + 16, kKeys * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(7, b + 32, kKeys * 4);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, b + 48, kKeys * 4);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    }
    float* s = ws.scores.data() + k;
    _tile_stored(0, s, kKeys * 4);
    _tile_stored(1, s + 16, kKeys * 4);
    _tile_stored(2, s + 32, kKeys * 4);
    _tile_stored(3, s + 48, kKeys * 4);
  }
}

// O rows r0.. += P (16 x kKeys, bf16) times the packed V tile, 64 output columns at a time.
void accumulate_amx(const Problem& pb, int64_t r0, Workspace& ws) {
  const int64_t d = pb.head_dim;
  for (int64_t half = 0; half < d; half += 64) {
    float* o = ws.o.data() + r0 * d + half;
    _tile_loadd(0, o, d * 4);
    _tile_loadd(1, o + 16, d * 4);
    _tile_loadd(2, o + 32, d * 4);
    _tile_loadd(3, o + 48, d * 4);
    for (int64_t kc = 0; kc < kKeys / 32; ++kc) {
      _tile_loadd(4, ws.pb.data() + kc * 32, kKeys * 2);
      const uint32_t* b = ws.vp.data() + kc * 16 * d + half;
      _tile_loadd(5, b, d * 4);
      _tile_loadd(6, b + 16, d * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(7, b + 32, d * 4);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, b + 48, d * 4);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, o, d * 4);
    _tile_stored(1, o + 16, d * 4);
    _tile_stored(2, o + 32, d * 4);
    _tile_stored(3, o + 48, d * 4);
  }
}

template <typename C>
void run_item_amx(const Problem& pb, const Item& it, Workspace& ws) {
  const int64_t d = pb.head_dim;
  reset_state(pb, it, ws);
  ws.qb.assign(it.padded * d, 0);
  ws.kp.resize(d / 2 * kKeys);
  ws.vp.resize(kKeys / 2 * d);
  ws.scores.resize(kRows * kKeys);
  ws.pb.resize(kRows * kKeys);
  for (int64_t r = 0; r < it.rows; ++r) {
    std::memcpy(ws.qb.data() + r * d, query_row<uint16_t>(pb, it, r), d * sizeof(uint16_t));
  }
  for (int64_t k0 = it.key_begin / kKeys * kKeys; k0 < it.key_end; k0 += kKeys) {
    pack_tile_amx<C>(pb, it, k0, ws);
    for (int64_t r0 = 0; r0 < it.padded; r0 += kRows) {
      if (!block_reaches(pb, it, r0, k0)) continue;
      scores_amx(pb, r0, ws);
      const bool any = pb.soft_cap > 0.f ? softmax_block(pb, it, r0, k0, ws.scores.data(), ws.pb.data(), ws)
                                          : softmax_block_avx512(pb, it, r0, k0, ws);
      if (any) accumulate_amx(pb, r0, ws);
    }
  }
  store_output<uint16_t>(pb, it, ws);
}
#endif

template <typename T, typename C>
void run_items(const Problem& pb, int64_t begin, int64_t end, bool amx) {
  thread_local Workspace ws;
#ifdef PAGEDSERVE_PREFILL_AMX
  if constexpr (sizeof(T) == 2) {
    if (amx) {
      TileConfig config;
      _tile_loadconfig(&config);
      for (int64_t i = begin; i < end; ++i) run_item_amx<C>(pb, make_item(pb, i), ws);
      _tile_release();
      return;
    }
  }
#endif
  (void)amx;
  for (int64_t i = begin; i < end; ++i) run_item_f32<T, C>(pb, make_item(pb, i), ws);
}

}  // namespace

extern "C" {

// 1 where bf16 prefill attention can run on AMX tiles (built for them, and the OS grants them), else 0.
int pagedserve_prefill_attention_amx() {
#ifdef PAGEDSERVE_PREFILL_AMX
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// One chunk of q_len queries whose last sits at seq_len - 1, work items begin..end-1 of
// num_kv_heads * ceil(q_len / query_block). Strides in elements; caches contiguous
// [num_blocks, block_size, num_kv_heads, head_dim] of the query's dtype or fp8 (cache_dtype, fp8.h: read as
// stored * k_scale and stored * v_scale). Returns 0, 1 for an unsupported dtype, 2 when AMX was asked for and is
// not available or head_dim is not a multiple of 64.
int pagedserve_prefill_attention(void* out, const void* query, const void* key_cache, const void* value_cache,
                                 const int32_t* table, int64_t q_len, int64_t seq_len, int64_t num_q_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t query_stride,
                                 int64_t out_stride, float scale, int64_t window, float soft_cap,
                                 int64_t query_block, int64_t begin, int64_t end, int use_amx, int dtype,
                                 int cache_dtype, float k_scale, float v_scale) {
  if (use_amx && (pagedserve_prefill_attention_amx() == 0 || head_dim % 64 != 0 || head_dim > 512 || dtype != pagedserve::kBFloat16)) {
    return 2;
  }
  const bool fp8 = cache_dtype == pagedserve::kCacheE4M3 || cache_dtype == pagedserve::kCacheE5M2;
  const Problem pb{query,    key_cache, value_cache, out,        table,      q_len,    seq_len,
                   num_q_heads, num_kv_heads, head_dim, block_size, query_stride, out_stride,
                   fp8 ? scale * k_scale : scale, window, soft_cap, num_q_heads / num_kv_heads, query_block,
                   fp8 ? v_scale : 1.f};
  int bad = 0;
  const int status = pagedserve::with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int cache_status = pagedserve::with_cache_dtype(cache_dtype, [&](auto cache_tag) {
      using C = decltype(cache_tag);
      if constexpr (kIsFp8<C> || std::is_same_v<C, T>) {
        run_items<T, C>(pb, begin, end, use_amx != 0);
      } else {
        bad = 1;
      }
    });
    bad |= cache_status;
  });
  return status | bad;
}

}  // extern "C"
