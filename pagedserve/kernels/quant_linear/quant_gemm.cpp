// Weight-only quantized GEMM for few activation rows (decode): out[m, n] = sum_g scale[n, g] * sum_{k in g}
// q[n, k] * x[m, k] + offset[n, g] * sum_{k in g} x[m, k], the integers times the scales in fp32, so the result
// is the dequantized weight's product up to fp32 rounding. Each weight byte is read once per call.
// Weights are packed by pagedserve/kernels/quant_linear/native_gemm.py in tiles of kTile output rows, k-major inside a
// tile: int8: q[tile][k][kTile]; int4: q[tile][k / 2][kTile], k even in the low nibble. Scales and offsets are
// [tile][group][kTile], fp32, fp16 (when exact) or int8 steps times an fp16 per super-block of groups
// [tile][group / per_super][kTile] (GGUF K-quants' d * sc). One vector lane per output row: no horizontal sums.
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "../native/cpu_common.h"

namespace {

constexpr int kTile = 16;
constexpr int kMaxRows = 8;  // activation rows per pass over a weight tile (the tile stays in L1 between passes)

typedef float VecF __attribute__((vector_size(kTile * sizeof(float))));
typedef int8_t VecI8 __attribute__((vector_size(kTile)));
typedef uint8_t VecU8 __attribute__((vector_size(kTile)));
typedef uint16_t VecU16 __attribute__((vector_size(kTile * sizeof(uint16_t))));
typedef uint32_t VecU32 __attribute__((vector_size(kTile * sizeof(uint32_t))));
typedef int32_t VecI32 __attribute__((vector_size(kTile * sizeof(int32_t))));

// Bytes -> floats through 32-bit integers (GCC 12 scalarises a direct byte -> float conversion, and a signed
// byte -> int one): signed bytes are flipped to q + 128 and widened unsigned.
inline VecF to_float(VecU8 v) { return __builtin_convertvector(__builtin_convertvector(v, VecI32), VecF); }
inline VecF to_float(VecI8 v) {
  const VecI32 biased = __builtin_convertvector(__builtin_bit_cast(VecU8, v) ^ 0x80, VecI32);
  return __builtin_convertvector(biased - 128, VecF);
}

template <typename V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// IEEE half -> float, exact for every finite half (subnormals too): shift the exponent and mantissa into
// float position, then scale by 2^112 to rebias the exponent.
inline VecF half_to_float(const uint16_t* p) {
  const VecU32 h = __builtin_convertvector(load<VecU16>(p), VecU32);
  const VecU32 magnitude = (h & 0x7fffu) << 13;
  const VecF scaled = __builtin_bit_cast(VecF, magnitude) * 0x1p112f;
  return __builtin_bit_cast(VecF, __builtin_bit_cast(VecU32, scaled) | ((h & 0x8000u) << 16));
}

// How scales and offsets are stored (the kind argument).
enum ParamsKind : int64_t { kFloat32 = 0, kFloat16 = 1, kStepsTimesHalf = 2 };

// Independent sums per activation row: an FMA chain waits on its own previous result, so few rows need
// several chains to keep both FMA ports busy (each int4 byte feeds two chains already).
constexpr int chains(int rows, int bits) { return rows >= 8 / (bits == 4 ? 2 : 1) ? 1 : 8 / (bits == 4 ? 2 : 1) / rows; }

// The group's integer dot products for ROWS activation rows, one lane per output row of the tile.
template <int ROWS, int BITS>
inline void group_dot(const uint8_t* q, const float* x, int64_t k_stride, int64_t begin, int64_t size,
                      VecF (&part)[ROWS]) {
  constexpr int kChains = chains(ROWS, BITS);
  constexpr int kStep = BITS == 8 ? kChains : 2 * kChains;  // k values per unrolled step
  VecF sums[ROWS][BITS == 8 ? kChains : 2 * kChains] = {};
  const int64_t end = begin + size, unrolled = begin + size / kStep * kStep;
  int64_t k = begin;
  for (; k < unrolled; k += kStep) {
    for (int c = 0; c < kChains; ++c) {
      if constexpr (BITS == 8) {
        const VecF w = to_float(load<VecI8>(q + (k + c) * kTile));
        for (int r = 0; r < ROWS; ++r) sums[r][c] += w * x[r * k_stride + k + c];
      } else {
        const int64_t kc = k + 2 * c;
        const VecU8 bytes = load<VecU8>(q + (kc / 2) * kTile);
        const VecF low = to_float(VecU8(bytes & 15)), high = to_float(VecU8(bytes >> 4));
        for (int r = 0; r < ROWS; ++r) {
          sums[r][2 * c] += low * x[r * k_stride + kc];
          sums[r][2 * c + 1] += high * x[r * k_stride + kc + 1];
        }
      }
    }
  }
  for (; k < end; k += BITS == 8 ? 1 : 2) {
    if constexpr (BITS == 8) {
      const VecF w = to_float(load<VecI8>(q + k * kTile));
      for (int r = 0; r < ROWS; ++r) sums[r][0] += w * x[r * k_stride + k];
    } else {
      const VecU8 bytes = load<VecU8>(q + (k / 2) * kTile);
      const VecF low = to_float(VecU8(bytes & 15)), high = to_float(VecU8(bytes >> 4));
      for (int r = 0; r < ROWS; ++r) sums[r][0] += low * x[r * k_stride + k] + high * x[r * k_stride + k + 1];
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    part[r] = sums[r][0];
    for (int c = 1; c < (BITS == 8 ? kChains : 2 * kChains); ++c) part[r] += sums[r][c];
  }
}

#if defined(__AVX512BF16__)
// bf16 activations and enough rows to be compute-bound: the integers are exact in bf16 (|q| <= 128 needs 8
// significant bits), so one vdpbf16ps per row adds two exact products per lane in fp32, where the fp32 path
// needs two FMAs. Pairs (k, k + 1) of a row share a 32-bit lane, k in the low half, as the x pair does.
constexpr int kMinDotRows = 4;

template <int BITS>
inline __m512bh weight_pairs(const uint8_t* q, int64_t k) {
  VecF even, odd;
  if constexpr (BITS == 8) {
    even = to_float(load<VecI8>(q + k * kTile));
    odd = to_float(load<VecI8>(q + (k + 1) * kTile));
  } else {
    const VecU8 bytes = load<VecU8>(q + (k / 2) * kTile);
    even = to_float(VecU8(bytes & 15));
    odd = to_float(VecU8(bytes >> 4));
  }
  const VecU32 pairs = (__builtin_bit_cast(VecU32, odd) & 0xffff0000u) | (__builtin_bit_cast(VecU32, even) >> 16);
  return __builtin_bit_cast(__m512bh, pairs);
}

template <int ROWS, int BITS>
inline void group_dot_bf16(const uint8_t* q, const uint16_t* x, int64_t k_stride, int64_t begin, int64_t size,
                           VecF (&part)[ROWS]) {
  __m512 sums[ROWS];
  for (int r = 0; r < ROWS; ++r) sums[r] = _mm512_setzero_ps();
  for (int64_t k = begin; k < begin + size; k += 2) {
    const __m512bh w = weight_pairs<BITS>(q, k);
    for (int r = 0; r < ROWS; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * k_stride + k, sizeof(pair));
      sums[r] = _mm512_dpbf16_ps(sums[r], w, __builtin_bit_cast(__m512bh, _mm512_set1_epi32(pair)));
    }
  }
  for (int r = 0; r < ROWS; ++r) part[r] = __builtin_bit_cast(VecF, sums[r]);
}
#endif

struct Problem {
  const float* x;     // [M, K] fp32
  const uint16_t* xb;  // [M, K] bf16 when the activations are bf16, else null
  const float* xsum;  // [M, G] each group's sum of x
  const uint8_t* q;
  const void* scales;
  const void* offsets;  // or null
  int64_t kind;         // ParamsKind of scales and offsets
  const uint16_t* scale_super;   // kStepsTimesHalf: fp16 [tile][group / per_super][kTile]
  const uint16_t* offset_super;  // likewise for the offsets
  int64_t per_super;
  int64_t n, k, group_size, groups, tile_bytes;
};

// A group's scales (or offsets) for the tile's rows. kStepsTimesHalf: the fp16 times the int8 step is exact in fp32
// (11 by 8 significant bits), the same value an fp32 store would hold.
inline VecF load_params(const Problem& p, const void* base, const uint16_t* super, int64_t tile, int64_t g) {
  const int64_t index = tile * p.groups + g;
  if (p.kind == kStepsTimesHalf) {
    const int64_t supers = p.groups / p.per_super;
    return half_to_float(super + (tile * supers + g / p.per_super) * kTile) *
           to_float(load<VecI8>(static_cast<const int8_t*>(base) + index * kTile));
  }
  return p.kind == kFloat16 ? half_to_float(static_cast<const uint16_t*>(base) + index * kTile)
                            : load<VecF>(static_cast<const float*>(base) + index * kTile);
}

// ROWS activation rows against one weight tile; writes the tile's valid output rows.
template <typename T, int ROWS, int BITS>
void tile_rows(const Problem& p, int64_t tile, int64_t row0, T* out) {
  VecF acc[ROWS] = {};
  VecF part[ROWS];
  const uint8_t* q = p.q + tile * p.tile_bytes;
  const float* x = p.x + row0 * p.k;
  for (int64_t g = 0; g < p.groups; ++g) {
#if defined(__AVX512BF16__)
    if (ROWS >= kMinDotRows && p.xb != nullptr && p.group_size % 2 == 0) {
      group_dot_bf16<ROWS, BITS>(q, p.xb + row0 * p.k, p.k, g * p.group_size, p.group_size, part);
    } else {
      group_dot<ROWS, BITS>(q, x, p.k, g * p.group_size, p.group_size, part);
    }
#else
    group_dot<ROWS, BITS>(q, x, p.k, g * p.group_size, p.group_size, part);
#endif
    const VecF scale = load_params(p, p.scales, p.scale_super, tile, g);
    for (int r = 0; r < ROWS; ++r) acc[r] += part[r] * scale;
    if (p.offsets != nullptr) {
      const VecF offset = load_params(p, p.offsets, p.offset_super, tile, g);
      for (int r = 0; r < ROWS; ++r) acc[r] += offset * p.xsum[(row0 + r) * p.groups + g];
    }
  }
  const int64_t valid = p.n - tile * kTile < kTile ? p.n - tile * kTile : kTile;
  for (int r = 0; r < ROWS; ++r) {
    T* dst = out + (row0 + r) * p.n + tile * kTile;
    for (int64_t j = 0; j < valid; ++j) dst[j] = pagedserve::Elem<T>::store(acc[r][j]);
  }
}

template <typename T, int BITS>
void tile_all_rows(const Problem& p, int64_t tile, int64_t m, T* out) {
  int64_t row = 0;
  for (; row + kMaxRows <= m; row += kMaxRows) tile_rows<T, kMaxRows, BITS>(p, tile, row, out);
  switch (m - row) {
    case 7: tile_rows<T, 7, BITS>(p, tile, row, out); break;
    case 6: tile_rows<T, 6, BITS>(p, tile, row, out); break;
    case 5: tile_rows<T, 5, BITS>(p, tile, row, out); break;
    case 4: tile_rows<T, 4, BITS>(p, tile, row, out); break;
    case 3: tile_rows<T, 3, BITS>(p, tile, row, out); break;
    case 2: tile_rows<T, 2, BITS>(p, tile, row, out); break;
    case 1: tile_rows<T, 1, BITS>(p, tile, row, out); break;
    default: break;
  }
}

template <typename T>
void run(const T* x_in, T* out, Problem p, int64_t m, int bits, int64_t tile_begin, int64_t tile_end) {
  std::vector<float> x(m * p.k), xsum(m * p.groups, 0.f);
  for (int64_t i = 0; i < m * p.k; ++i) x[i] = pagedserve::Elem<T>::load(x_in[i]);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < p.k; ++i) xsum[r * p.groups + i / p.group_size] += x[r * p.k + i];
  }
  p.x = x.data();
  if constexpr (sizeof(T) == sizeof(uint16_t)) p.xb = x_in;
  p.xsum = xsum.data();
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    if (bits == 8) {
      tile_all_rows<T, 8>(p, tile, m, out);
    } else {
      tile_all_rows<T, 4>(p, tile, m, out);
    }
  }
}

}  // namespace

// x [M, K] and out [M, N] in `dtype`; q, scales and offsets (may be null) packed as described above, `kind` a
// ParamsKind (kStepsTimesHalf: scale_super / offset_super and per_super too); computes the output rows of tiles
// [tile_begin, tile_end). Status 2: bits not 4 or 8; 3: K not whole (even) groups; 4: groups not whole
// super-blocks, or an unknown kind.
extern "C" int pagedserve_quant_gemm(const void* x, void* out, const void* q, const void* scales,
                                     const void* offsets, const void* scale_super, const void* offset_super,
                                     int64_t m, int64_t n, int64_t k, int64_t group_size, int64_t bits, int64_t kind,
                                     int64_t per_super, int64_t tile_begin, int64_t tile_end, int dtype) {
  if (bits != 4 && bits != 8) return 2;
  if (group_size < 1 || k % group_size != 0 || (bits == 4 && group_size % 2 != 0)) return 3;
  if (kind < kFloat32 || kind > kStepsTimesHalf ||
      (kind == kStepsTimesHalf && (per_super < 1 || (k / group_size) % per_super != 0))) {
    return 4;
  }
  Problem p{nullptr, nullptr, nullptr, static_cast<const uint8_t*>(q), scales, offsets, kind,
            static_cast<const uint16_t*>(scale_super), static_cast<const uint16_t*>(offset_super), per_super,
            n, k, group_size, k / group_size, kTile * k * bits / 8};
  return pagedserve::with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    run<T>(static_cast<const T*>(x), static_cast<T*>(out), p, m, static_cast<int>(bits), tile_begin, tile_end);
  });
}
