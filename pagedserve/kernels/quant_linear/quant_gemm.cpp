// Weight-only quantized GEMM for few activation rows (decode): out[m, n] = sum_g scale[n, g] * sum_{k in g}
// q[n, k] * x[m, k] + offset[n, g] * sum_{k in g} x[m, k], the integers times the scales in fp32, so the result
// is the dequantized weight's product up to fp32 rounding. Each weight byte is read once per call.
// Weights are packed by pagedserve/kernels/quant_linear/native_gemm.py in tiles of kTile output rows, k-major inside a
// tile, as codes q - bias of `bits` bits: 8: q[tile][k][kTile] (bias 0); 4: one 32-bit word per output row and 8 k,
// q[tile][k / 8][kTile], nibble i of the word holding k0 + kNibbleK[i] (so a 16-bit shift and a table lookup give
// bf16 pairs (k, k + 1), and a 32-bit shift and a lookup give fp32 values, the lookups exact integers); 5 and 6
// (GGUF's Q5_*, Q6_K): chunks of 32 (5) or 16 (6) k, each its low nibbles as 4 (or 2) int4 words and one word
// per row of the high bits (HighPos says where). Scales and offsets are
// [tile][group][kTile], fp32, fp16 (when exact) or int8 steps times an fp16 per super-block of groups
// [tile][group / per_super][kTile] (GGUF K-quants' d * sc). One vector lane per output row: no horizontal sums.
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
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

// int4: the k (from the word's first) of each nibble of a row's 32-bit word, nibble 0 the lowest.
constexpr int kNibbleK[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// Bytes -> floats through 32-bit integers (GCC 12 scalarises a direct byte -> float conversion, and a signed
// byte -> int one): signed bytes are flipped to q + 128 and widened unsigned.
inline VecF to_float(VecU8 v) { return __builtin_convertvector(__builtin_convertvector(v, VecI32), VecF); }
inline VecF to_float(VecI8 v) {
#if defined(__AVX512F__)
  return __builtin_bit_cast(VecF, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(__builtin_bit_cast(__m128i, v))));
#else
  const VecI32 biased = __builtin_convertvector(__builtin_bit_cast(VecU8, v) ^ 0x80, VecI32);
  return __builtin_convertvector(biased - 128, VecF);
#endif
}

// The values of the codes, code + bias, for the lookups: fp32 for the fp32 path, bf16 for the bf16 dot products
// (exact: |value| <= 128). Entry i is code i & (2^bits - 1), so 4-bit codes read the same value at i and i + 16.
struct Tables {
  alignas(64) float f[64];  // [48, 64): 16 * (i & (2^(bits - 4) - 1)), the high bits' part of 5- and 6-bit codes
  alignas(64) uint16_t b[64];
};

// Nibble i of each lane's word as a float (exact), through the fp32 table.
template <int I>
inline VecF nibble_float(VecU32 words, const float* table) {
#if defined(__AVX512F__)
  const __m512i index = __builtin_bit_cast(__m512i, I == 0 ? words : VecU32(words >> (4 * I)));
  return __builtin_bit_cast(VecF, _mm512_permutexvar_ps(index, _mm512_load_ps(table)));  // index's low 4 bits
#else
  return __builtin_convertvector(__builtin_bit_cast(VecI32, (words >> (4 * I)) & 15u), VecF) + table[0];
#endif
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
// several chains to keep both FMA ports busy.
constexpr int chains(int rows) { return rows >= 8 ? 1 : 8 / rows; }
constexpr int chains4(int rows) { return rows >= 4 ? 1 : 4 / rows; }  // int4: 8 (fp32) or 4 (bf16) per word

// int8: the group's integer dot products for ROWS activation rows, one lane per output row of the tile.
template <int ROWS>
inline void group_dot8(const uint8_t* q, const float* x, int64_t k_stride, int64_t begin, int64_t size,
                       VecF (&part)[ROWS]) {
  constexpr int kChains = chains(ROWS);
  VecF sums[ROWS][kChains] = {};
  const int64_t end = begin + size, unrolled = begin + size / kChains * kChains;
  int64_t k = begin;
  for (; k < unrolled; k += kChains) {
    for (int c = 0; c < kChains; ++c) {
      const VecF w = to_float(load<VecI8>(q + (k + c) * kTile));
      for (int r = 0; r < ROWS; ++r) sums[r][c] += w * x[r * k_stride + k + c];
    }
  }
  for (; k < end; ++k) {
    const VecF w = to_float(load<VecI8>(q + k * kTile));
    for (int r = 0; r < ROWS; ++r) sums[r][0] += w * x[r * k_stride + k];
  }
  for (int r = 0; r < ROWS; ++r) {
    part[r] = sums[r][0];
    for (int c = 1; c < kChains; ++c) part[r] += sums[r][c];
  }
}

// int4, fp32 activations: each word's 8 nibbles as floats, one FMA per nibble and row.
template <int I, int ROWS, int C>
inline void nibble_fma(VecU32 words, const float* table, const float* x, int64_t k_stride, int64_t k0,
                       VecF (&sums)[ROWS][C]) {
  const VecF w = nibble_float<I>(words, table);
  for (int r = 0; r < ROWS; ++r) sums[r][I % C] += w * x[r * k_stride + k0 + kNibbleK[I]];
}

template <int ROWS, int C, size_t... I>
inline void nibble_fmas(VecU32 words, const float* table, const float* x, int64_t k_stride, int64_t k0,
                        VecF (&sums)[ROWS][C], std::index_sequence<I...>) {
  (nibble_fma<I>(words, table, x, k_stride, k0, sums), ...);
}

template <int ROWS>
inline void group_dot4(const uint8_t* q, const float* table, const float* x, int64_t k_stride, int64_t begin,
                       int64_t size, VecF (&part)[ROWS]) {
  constexpr int kChains = chains4(ROWS) * 2;
  VecF sums[ROWS][kChains] = {};
  for (int64_t k0 = begin; k0 < begin + size; k0 += 8) {
    nibble_fmas(load<VecU32>(q + k0 / 2 * kTile), table, x, k_stride, k0, sums, std::make_index_sequence<8>());
  }
  for (int r = 0; r < ROWS; ++r) {
    part[r] = sums[r][0];
    for (int c = 1; c < kChains; ++c) part[r] += sums[r][c];
  }
}

// 5- and 6-bit codes (HB = 1 or 2 high bits): a chunk of 32 / HB k holds 4 / HB int4 words of the low nibbles, then
// one word per row of the high bits: those of word j's pair i (k 8j + 2i, 8j + 2i + 1) at bit (4j + i) * HB of the
// word's low (even k) and high (odd k) 16-bit halves.
template <int HB> constexpr int chunk_words() { return 4 / HB; }
template <int HB> constexpr int chunk_k() { return 32 / HB; }
template <int HB> constexpr int chunk_bytes() { return (4 / HB + 1) * kTile * 4; }
constexpr int high_pos(int hb, int j, int i) { return (4 * j + i) * hb; }

// Nibble I of word J as fp32 values: the low nibble's value (its table: code + bias) plus 16 times the high bits.
template <int HB, int J, int I>
inline VecF narrow_float(VecU32 words, VecU32 high, const float* table) {
  constexpr int kPos = (kNibbleK[I] % 2 ? 16 : 0) + high_pos(HB, J, I % 4);
#if defined(__AVX512F__)
  // Two 16-entry lookups (vpermps reads an index's low 4 bits): the high bits' table repeats every 2^HB entries.
  const __m512i up = __builtin_bit_cast(__m512i, kPos == 0 ? high : VecU32(high >> kPos));
  const __m512 sixteens = _mm512_load_ps(table + 64 - 16);
  return nibble_float<I>(words, table) + __builtin_bit_cast(VecF, _mm512_permutexvar_ps(up, sixteens));
#else
  const VecU32 code = ((words >> (4 * I)) & 15u) | (((high >> kPos) & ((1u << HB) - 1)) << 4);
  return __builtin_convertvector(__builtin_bit_cast(VecI32, code), VecF) + table[0];
#endif
}

template <int HB, int J, int I, int ROWS, int C>
inline void narrow_fma(VecU32 words, VecU32 high, const float* table, const float* x, int64_t k_stride, int64_t k0,
                       VecF (&sums)[ROWS][C]) {
  const VecF w = narrow_float<HB, J, I>(words, high, table);
  for (int r = 0; r < ROWS; ++r) sums[r][I % C] += w * x[r * k_stride + k0 + 8 * J + kNibbleK[I]];
}

template <int HB, int J, int ROWS, int C, size_t... I>
inline void narrow_word(const uint8_t* chunk, VecU32 high, const float* table, const float* x, int64_t k_stride,
                        int64_t k0, VecF (&sums)[ROWS][C], std::index_sequence<I...>) {
  const VecU32 words = load<VecU32>(chunk + J * kTile * 4);
  (narrow_fma<HB, J, I>(words, high, table, x, k_stride, k0, sums), ...);
}

template <int HB, int ROWS, int C, size_t... J>
inline void narrow_chunk(const uint8_t* chunk, const float* table, const float* x, int64_t k_stride, int64_t k0,
                         VecF (&sums)[ROWS][C], std::index_sequence<J...>) {
  const VecU32 high = load<VecU32>(chunk + chunk_words<HB>() * kTile * 4);
  (narrow_word<HB, J>(chunk, high, table, x, k_stride, k0, sums, std::make_index_sequence<8>()), ...);
}

template <int HB, int ROWS>
inline void group_dot_narrow(const uint8_t* q, const float* table, const float* x, int64_t k_stride, int64_t begin,
                             int64_t size, VecF (&part)[ROWS]) {
  constexpr int kChains = chains4(ROWS) * 2;
  VecF sums[ROWS][kChains] = {};
  for (int64_t k0 = begin; k0 < begin + size; k0 += chunk_k<HB>()) {
    narrow_chunk<HB>(q + k0 / chunk_k<HB>() * chunk_bytes<HB>(), table, x, k_stride, k0, sums,
                     std::make_index_sequence<chunk_words<HB>()>());
  }
  for (int r = 0; r < ROWS; ++r) {
    part[r] = sums[r][0];
    for (int c = 1; c < kChains; ++c) part[r] += sums[r][c];
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 activations: the integers are exact in bf16 (|q| <= 128 needs 8 significant bits), so one vdpbf16ps
// per row adds two exact products per lane in fp32, where the fp32 path needs two FMAs. Pairs (k, k + 1) of a
// row share a 32-bit lane, k in the low half, as the x pair does. int8 only pays for it from 4 rows on (its
// weight is converted through fp32); int4 looks its pairs up in a table, cheap at any number of rows.
constexpr int kMinDotRows = 4;

inline __m512bh weight_pairs(const uint8_t* q, int64_t k) {
  const VecF even = to_float(load<VecI8>(q + k * kTile)), odd = to_float(load<VecI8>(q + (k + 1) * kTile));
  const VecU32 pairs = (__builtin_bit_cast(VecU32, odd) & 0xffff0000u) | (__builtin_bit_cast(VecU32, even) >> 16);
  return __builtin_bit_cast(__m512bh, pairs);
}

inline __m512 dot_pair(__m512 sum, __m512bh w, const uint16_t* x) {
  uint32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return _mm512_dpbf16_ps(sum, w, __builtin_bit_cast(__m512bh, _mm512_set1_epi32(static_cast<int>(pair))));
}

template <int ROWS>
inline void group_dot8_bf16(const uint8_t* q, const uint16_t* x, int64_t k_stride, int64_t begin, int64_t size,
                            VecF (&part)[ROWS]) {
  __m512 sums[ROWS];
  for (int r = 0; r < ROWS; ++r) sums[r] = _mm512_setzero_ps();
  for (int64_t k = begin; k < begin + size; k += 2) {
    const __m512bh w = weight_pairs(q, k);
    for (int r = 0; r < ROWS; ++r) sums[r] = dot_pair(sums[r], w, x + r * k_stride + k);
  }
  for (int r = 0; r < ROWS; ++r) part[r] = __builtin_bit_cast(VecF, sums[r]);
}

// Pair I of each word: its 16-bit halves' nibble I, i.e. (k0 + 2I, k0 + 2I + 1) as bf16.
template <int I, int ROWS, int C>
inline void nibble_dot(__m512i words, __m512i table, const uint16_t* x, int64_t k_stride, int64_t k0,
                       __m512 (&sums)[ROWS][C]) {
  const __m512i index = I == 0 ? words : _mm512_srli_epi16(words, 4 * I);
  const __m512bh w = __builtin_bit_cast(__m512bh, _mm512_permutexvar_epi16(index, table));
  for (int r = 0; r < ROWS; ++r) sums[r][I % C] = dot_pair(sums[r][I % C], w, x + r * k_stride + k0 + 2 * I);
}

// The table holds each 4-bit code's value twice (Tables): vpermw reads an index's low 5 bits, so the nibble above
// a looked-up one never matters.
template <int ROWS>
inline void group_dot4_bf16(const uint8_t* q, const uint16_t* bf16_table, const uint16_t* x, int64_t k_stride,
                            int64_t begin, int64_t size, VecF (&part)[ROWS]) {
  constexpr int kChains = chains4(ROWS);
  const __m512i table = _mm512_load_si512(bf16_table);
  __m512 sums[ROWS][kChains];
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < kChains; ++c) sums[r][c] = _mm512_setzero_ps();
  }
  for (int64_t k0 = begin; k0 < begin + size; k0 += 8) {
    const __m512i words = _mm512_loadu_si512(q + k0 / 2 * kTile);
    nibble_dot<0>(words, table, x, k_stride, k0, sums);
    nibble_dot<1>(words, table, x, k_stride, k0, sums);
    nibble_dot<2>(words, table, x, k_stride, k0, sums);
    nibble_dot<3>(words, table, x, k_stride, k0, sums);
  }
  for (int r = 0; r < ROWS; ++r) {
    part[r] = __builtin_bit_cast(VecF, sums[r][0]);
    for (int c = 1; c < kChains; ++c) part[r] += __builtin_bit_cast(VecF, sums[r][c]);
  }
}

// 5- and 6-bit codes: pair I of word J's 16-bit halves, the low nibble with the high bits selected in above it,
// looked up in the 32 (5 bits, vpermw) or 64 (6 bits, vpermt2w) bf16 values.
template <int HB, int J, int I, int ROWS, int C>
inline void narrow_dot(__m512i words, __m512i high, __m512i t0, __m512i t1, const uint16_t* x, int64_t k_stride,
                       int64_t k0, __m512 (&sums)[ROWS][C]) {
  constexpr int kPos = high_pos(HB, J, I);
  const __m512i low = I == 0 ? words : _mm512_srli_epi16(words, 4 * I);
  __m512i up;
  if constexpr (kPos >= 4) {
    up = kPos == 4 ? high : _mm512_srli_epi16(high, kPos - 4);
  } else {
    up = _mm512_slli_epi16(high, 4 - kPos);
  }
  const __m512i index = _mm512_ternarylogic_epi32(low, up, _mm512_set1_epi16(((1 << HB) - 1) << 4), 0xd8);  // c ? b : a
  const __m512i w = HB == 1 ? _mm512_permutexvar_epi16(index, t0) : _mm512_permutex2var_epi16(t0, index, t1);
  for (int r = 0; r < ROWS; ++r) {
    sums[r][I % C] = dot_pair(sums[r][I % C], __builtin_bit_cast(__m512bh, w), x + r * k_stride + k0 + 8 * J + 2 * I);
  }
}

template <int HB, int J, int ROWS, int C, size_t... I>
inline void narrow_word_bf16(const uint8_t* chunk, __m512i high, __m512i t0, __m512i t1, const uint16_t* x,
                             int64_t k_stride, int64_t k0, __m512 (&sums)[ROWS][C], std::index_sequence<I...>) {
  const __m512i words = _mm512_loadu_si512(chunk + J * kTile * 4);
  (narrow_dot<HB, J, I>(words, high, t0, t1, x, k_stride, k0, sums), ...);
}

template <int HB, int ROWS, int C, size_t... J>
inline void narrow_chunk_bf16(const uint8_t* chunk, __m512i t0, __m512i t1, const uint16_t* x, int64_t k_stride,
                              int64_t k0, __m512 (&sums)[ROWS][C], std::index_sequence<J...>) {
  const __m512i high = _mm512_loadu_si512(chunk + chunk_words<HB>() * kTile * 4);
  (narrow_word_bf16<HB, J>(chunk, high, t0, t1, x, k_stride, k0, sums, std::make_index_sequence<4>()), ...);
}

template <int HB, int ROWS>
inline void group_dot_narrow_bf16(const uint8_t* q, const uint16_t* bf16_table, const uint16_t* x, int64_t k_stride,
                                  int64_t begin, int64_t size, VecF (&part)[ROWS]) {
  constexpr int kChains = chains4(ROWS);
  const __m512i t0 = _mm512_load_si512(bf16_table), t1 = _mm512_load_si512(bf16_table + 32);
  __m512 sums[ROWS][kChains];
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < kChains; ++c) sums[r][c] = _mm512_setzero_ps();
  }
  for (int64_t k0 = begin; k0 < begin + size; k0 += chunk_k<HB>()) {
    narrow_chunk_bf16<HB>(q + k0 / chunk_k<HB>() * chunk_bytes<HB>(), t0, t1, x, k_stride, k0, sums,
                          std::make_index_sequence<chunk_words<HB>()>());
  }
  for (int r = 0; r < ROWS; ++r) {
    part[r] = __builtin_bit_cast(VecF, sums[r][0]);
    for (int c = 1; c < kChains; ++c) part[r] += __builtin_bit_cast(VecF, sums[r][c]);
  }
}
#endif

// The group's dot products, by the fastest exact path the weight's bits and the activations' type allow.
template <int ROWS, int BITS>
inline void group_dot(const uint8_t* q, const Tables& t, const float* x, const uint16_t* xb, int64_t k_stride,
                      int64_t begin, int64_t size, VecF (&part)[ROWS]) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (xb != nullptr && (BITS != 8 || (ROWS >= kMinDotRows && size % 2 == 0))) {
    if constexpr (BITS == 4) {
      group_dot4_bf16<ROWS>(q, t.b, xb, k_stride, begin, size, part);
    } else if constexpr (BITS == 8) {
      group_dot8_bf16<ROWS>(q, xb, k_stride, begin, size, part);
    } else {
      group_dot_narrow_bf16<BITS - 4, ROWS>(q, t.b, xb, k_stride, begin, size, part);
    }
    return;
  }
#endif
  if constexpr (BITS == 4) {
    group_dot4<ROWS>(q, t.f, x, k_stride, begin, size, part);
  } else if constexpr (BITS == 8) {
    group_dot8<ROWS>(q, x, k_stride, begin, size, part);
  } else {
    group_dot_narrow<BITS - 4, ROWS>(q, t.f, x, k_stride, begin, size, part);
  }
}

struct Problem {
  const float* x;     // [M, K] fp32
  const uint16_t* xb;  // [M, K] bf16 when the activations are bf16, else null
  const float* xsum;  // [M, G] each group's sum of x
  const uint8_t* q;
  const Tables* tables;  // the codes' values (4-, 5- and 6-bit codes)
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
void tile_rows(const Problem& p, const uint8_t* q, int64_t tile, int64_t row0, T* out) {
  VecF acc[ROWS] = {};
  VecF part[ROWS];
  const float* x = p.x + row0 * p.k;
  const int64_t group_bytes = p.tile_bytes / p.groups;
  for (int64_t g = 0; g < p.groups; ++g) {
    // The next tile's group, a tile ahead of the reads: at decode the weight streams from memory once per call.
    for (int64_t b = 0; b < group_bytes; b += 64) __builtin_prefetch(q + p.tile_bytes + g * group_bytes + b, 0, 2);
    group_dot<ROWS, BITS>(q, *p.tables, x, p.xb == nullptr ? nullptr : p.xb + row0 * p.k, p.k, g * p.group_size,
                          p.group_size, part);
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
void tile_all_rows(const Problem& p, const uint8_t* q, int64_t tile, int64_t m, T* out) {
  int64_t row = 0;
  for (; row + kMaxRows <= m; row += kMaxRows) tile_rows<T, kMaxRows, BITS>(p, q, tile, row, out);
  switch (m - row) {
    case 7: tile_rows<T, 7, BITS>(p, q, tile, row, out); break;
    case 6: tile_rows<T, 6, BITS>(p, q, tile, row, out); break;
    case 5: tile_rows<T, 5, BITS>(p, q, tile, row, out); break;
    case 4: tile_rows<T, 4, BITS>(p, q, tile, row, out); break;
    case 3: tile_rows<T, 3, BITS>(p, q, tile, row, out); break;
    case 2: tile_rows<T, 2, BITS>(p, q, tile, row, out); break;
    case 1: tile_rows<T, 1, BITS>(p, q, tile, row, out); break;
    default: break;
  }
}

// A tile of 5- or 6-bit codes as int8 values [K][kTile], for the passes of many activation rows: unpacking once
// per tile costs less than once per pass of kMaxRows rows.
template <int HB, size_t... I>
inline void narrow_word_to_int8(const uint8_t* chunk, int J, VecU32 high, int64_t bias, int8_t* dst,
                                std::index_sequence<I...>) {
  const VecU32 words = load<VecU32>(chunk + J * kTile * 4);
  auto one = [&](auto i) {
    constexpr int kI = decltype(i)::value;
    const int pos = (kNibbleK[kI] % 2 ? 16 : 0) + high_pos(HB, J, kI % 4);
    const VecU32 code = ((words >> (4 * kI)) & 15u) | (((high >> pos) & ((1u << HB) - 1)) << 4);
    const VecI8 value = __builtin_convertvector(__builtin_bit_cast(VecI32, code) + static_cast<int32_t>(bias), VecI8);
    std::memcpy(dst + (8 * J + kNibbleK[kI]) * kTile, &value, sizeof(value));
  };
  (one(std::integral_constant<size_t, I>()), ...);
}

template <int HB>
void narrow_tile_to_int8(const uint8_t* q, int64_t k, int64_t bias, int8_t* dst) {
  for (int64_t k0 = 0; k0 < k; k0 += chunk_k<HB>()) {
    const uint8_t* chunk = q + k0 / chunk_k<HB>() * chunk_bytes<HB>();
    const VecU32 high = load<VecU32>(chunk + chunk_words<HB>() * kTile * 4);
    for (int j = 0; j < chunk_words<HB>(); ++j) {
      narrow_word_to_int8<HB>(chunk, j, high, bias, dst + k0 * kTile, std::make_index_sequence<8>());
    }
  }
}

template <typename T, int BITS>
void tile_codes(const Problem& p, int64_t tile, int64_t m, int64_t bias, std::vector<int8_t>& scratch, T* out) {
  const uint8_t* q = p.q + tile * p.tile_bytes;
  if constexpr (BITS == 5 || BITS == 6) {
    if (m > kMaxRows) {
      scratch.resize(p.k * kTile);
      narrow_tile_to_int8<BITS - 4>(q, p.k, bias, scratch.data());
      tile_all_rows<T, 8>(p, reinterpret_cast<const uint8_t*>(scratch.data()), tile, m, out);
      return;
    }
  }
  tile_all_rows<T, BITS>(p, q, tile, m, out);
}

template <typename T>
void run(const T* x_in, T* out, Problem p, int64_t m, int bits, int64_t bias, int64_t tile_begin, int64_t tile_end) {
  Tables tables;
  const int mask = (1 << (bits < 6 ? bits : 6)) - 1;
  for (int i = 0; i < 64; ++i) {
    tables.f[i] = static_cast<float>((i & mask) + bias);
    tables.b[i] = pagedserve::float_to_bf16(tables.f[i]);
  }
  for (int i = 0; i < 16 && bits > 4 && bits < 8; ++i) tables.f[48 + i] = static_cast<float>(16 * (i & (mask >> 4)));
  p.tables = &tables;
  std::vector<float> x(m * p.k), xsum(m * p.groups, 0.f);
  for (int64_t i = 0; i < m * p.k; ++i) x[i] = pagedserve::Elem<T>::load(x_in[i]);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < p.k; ++i) xsum[r * p.groups + i / p.group_size] += x[r * p.k + i];
  }
  p.x = x.data();
  if constexpr (sizeof(T) == sizeof(uint16_t)) p.xb = x_in;
  p.xsum = xsum.data();
  std::vector<int8_t> scratch;
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    switch (bits) {
      case 8: tile_codes<T, 8>(p, tile, m, bias, scratch, out); break;
      case 6: tile_codes<T, 6>(p, tile, m, bias, scratch, out); break;
      case 5: tile_codes<T, 5>(p, tile, m, bias, scratch, out); break;
      default: tile_codes<T, 4>(p, tile, m, bias, scratch, out); break;
    }
  }
}

bool int8_dots = true;  // one row of 5-, 6- or 8-bit codes through quant_gemv_i8.cpp (pagedserve_quant_gemm_int8_dots)

}  // namespace

extern "C" int pagedserve_quant_gemv_i8(const void* x, void* out, const void* q, const void* scales,
                                        const void* offsets, const void* scale_super, const void* offset_super,
                                        int64_t n, int64_t k, int64_t group_size, int64_t bits, int64_t kind,
                                        int64_t per_super, int64_t bias, int64_t tile_begin, int64_t tile_end,
                                        int dtype);

// Whether one activation row against 5-, 6- or 8-bit codes takes the exact integer-dot path (on: 1; off: 0, for A/B).
extern "C" int pagedserve_quant_gemm_int8_dots(int on) {
  int8_dots = on != 0;
  return 0;
}

// x [M, K] and out [M, N] in `dtype`; q, scales and offsets (may be null) packed as described above, the codes of
// `bits` bits with values code + `bias` (bits 8: bias 0), `kind` a ParamsKind (kStepsTimesHalf: scale_super /
// offset_super and per_super too); computes the output rows of tiles [tile_begin, tile_end). Status 2: bits not 4,
// 5, 6 or 8, or a bias that leaves the int8 range; 3: K not whole groups (groups of whole words or chunks: 8 k for
// 4 bits, 32 for 5, 16 for 6); 4: groups not whole super-blocks, or an unknown kind.
extern "C" int pagedserve_quant_gemm(const void* x, void* out, const void* q, const void* scales,
                                     const void* offsets, const void* scale_super, const void* offset_super,
                                     int64_t m, int64_t n, int64_t k, int64_t group_size, int64_t bits, int64_t kind,
                                     int64_t per_super, int64_t bias, int64_t tile_begin, int64_t tile_end,
                                     int dtype) {
  if ((bits < 4 || bits > 6) && bits != 8) return 2;
  if (bias < -128 || bias + (1 << (bits < 6 ? bits : 6)) > 128 || (bits == 8 && bias != 0)) return 2;
  const int64_t chunk = bits == 8 ? 1 : bits == 4 ? 8 : bits == 5 ? 32 : 16;
  if (group_size < 1 || k % group_size != 0 || group_size % chunk != 0) return 3;
  if (kind < kFloat32 || kind > kStepsTimesHalf ||
      (kind == kStepsTimesHalf && (per_super < 1 || (k / group_size) % per_super != 0))) {
    return 4;
  }
  if (m == 1 && int8_dots &&
      pagedserve_quant_gemv_i8(x, out, q, scales, offsets, scale_super, offset_super, n, k, group_size, bits, kind,
                               per_super, bias, tile_begin, tile_end, dtype) == 0) {
    return 0;
  }
  Problem p{nullptr, nullptr, nullptr, static_cast<const uint8_t*>(q), nullptr, scales, offsets, kind,
            static_cast<const uint16_t*>(scale_super), static_cast<const uint16_t*>(offset_super), per_super,
            n, k, group_size, k / group_size, kTile * k * bits / 8};
  return pagedserve::with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    run<T>(static_cast<const T*>(x), static_cast<T*>(out), p, m, static_cast<int>(bits), bias, tile_begin,
           tile_end);
  });
}
