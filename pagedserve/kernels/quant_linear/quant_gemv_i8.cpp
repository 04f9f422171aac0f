// One activation row against quant_gemm.cpp's tiles (int8 [tile][K][kTile]: GGUF Q8_0, int8 per channel; int4
// words: Q4_0, Q4_1, Q4_K, Q3_K; 5- and 6-bit codes: Q5_0, Q5_1, Q5_K, Q6_K) with AVX-512 VNNI integer dot
// products, exactly: each group's activations are written as integers X = x / 2^lo (lo: the group's lowest set bit,
// so X is exact) in balanced base-256 digits, one int8 row per digit, and each digit's dot product with the weight
// is an exact int32 sum (vpdpbusd on unsigned codes: int8 flipped to q + 128, narrow codes as they are, q - bias;
// the bias times the digits' sum starts each sum). The digits' sums are then joined in fp32 (a few roundings per group,
// where the fp32 path rounds once per k), times 2^lo and the group's scale. fp32 activations only against 5- and
// 6-bit codes (see kMaxLimbs); a call whose activations need more than kMaxLimbs digits in some group (a spread of
// exponents the digits cannot hold), or a CPU without VNNI and VBMI, returns 1 and quant_gemm.cpp runs its own path.
#include <cmath>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDSERVE_GEMV_I8 1
#endif

#include "../native/cpu_common.h"

#if defined(PAGEDSERVE_GEMV_I8)
namespace {

constexpr int kTile = 16;
// Digits per group: each costs one vpdpbusd per 4 k, where the fp32 path spends three instructions per k on 16 rows
// of int8 (more on 5- and 6-bit codes). bf16 activations need 2 or 3 (8 significant bits over a group's spread of
// exponents); fp32 ones need 5 or 6, which gained nothing measurable against int8 tiles or int4 words, so fp32
// activations take this path against 5- and 6-bit codes only.
constexpr int kMaxLimbs = 6;

// The activation row as digits: limb-major int8 [limbs][K], per group the int32 that starts each limb's sum
// (the weights' bias times its digits' sum: the codes are the values minus the bias) and 2^lo.
struct Digits {
  int limbs = 0;
  std::vector<int8_t> d;
  std::vector<int32_t> start;  // [groups][limbs]
  std::vector<float> unit;     // [groups]
};

// x's value as +-m 2^e with m an integer below 2^24 (0 for zeros); false for a NaN or an infinity.
inline bool integer_form(float x, int64_t& m, int& e) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const uint32_t field = (bits >> 23) & 255u, fraction = bits & 0x7fffffu;
  if (field == 255u) return false;
  m = field == 0 ? fraction : (fraction | 0x800000u);
  e = (field == 0 ? 1 : static_cast<int>(field)) - 150;
  if (bits >> 31) m = -m;
  return true;
}

// Digits of every group of x (fp32 values; bf16 ones are exact in fp32); false when some group needs more than
// kMaxLimbs digits (x / 2^lo below 2^46) or holds a NaN or an infinity.
bool make_digits(const float* x, int64_t k, int64_t group_size, int64_t bias, Digits& out) {
  const int64_t groups = k / group_size;
  std::vector<int64_t> m(k);
  std::vector<int> e(k), lows(groups, 0);
  int limbs = 1;
  for (int64_t g = 0; g < groups; ++g) {
    int hi = INT32_MIN, lo = INT32_MAX;
    for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) {
      if (!integer_form(x[i], m[i], e[i])) return false;
      if (m[i] == 0) continue;
      const uint64_t magnitude = static_cast<uint64_t>(m[i] < 0 ? -m[i] : m[i]);
      const int low = e[i] + __builtin_ctzll(magnitude), top = e[i] + 64 - __builtin_clzll(magnitude);
      lo = low < lo ? low : lo;
      hi = top > hi ? top : hi;  // |x| < 2^top
    }
    if (hi == INT32_MIN) continue;  // all zeros
    // |X| < 2^(hi - lo) <= 2^(8 L - 2), within what L balanced digits hold (127 (256^L - 1) / 255).
    const int need = (hi - lo + 2 + 7) / 8;
    if (need > kMaxLimbs) return false;
    limbs = need > limbs ? need : limbs;
    lows[g] = lo;
  }
  out.limbs = limbs;
  out.d.assign(limbs * k, 0);
  out.start.assign(groups * limbs, 0);
  out.unit.resize(groups);
  for (int64_t g = 0; g < groups; ++g) {
    out.unit[g] = std::ldexp(1.f, lows[g]);  // lo >= -149: a power of two fp32 holds
    for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) {
      // x / 2^lo, exact: m's bits below 2^(lo - e) are zeros where e < lo
      const int shift = e[i] - lows[g];
      int64_t value = m[i] == 0 ? 0 : shift >= 0 ? m[i] * (int64_t{1} << shift) : m[i] / (int64_t{1} << -shift);
      for (int j = 0; j < limbs; ++j) {
        const int8_t digit = static_cast<int8_t>(static_cast<uint8_t>(value & 0xff));
        out.d[j * k + i] = digit;
        out.start[g * limbs + j] += static_cast<int32_t>(bias) * digit;
        value = (value - digit) >> 8;
      }
      if (value != 0) return false;
    }
  }
  return true;
}

// IEEE half -> float for 16 lanes (exact, subnormals included).
inline __m512 halves(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

struct Weights {
  const uint8_t* q;
  const void* scales;
  const void* offsets;
  const uint16_t* scale_super;
  const uint16_t* offset_super;
  int64_t kind, per_super, n, k, group_size, groups;
};

// A group's scales (or offsets) for the tile's rows, as quant_gemm.cpp's load_params (kinds: 0 fp32, 1 fp16,
// 2 int8 steps times an fp16 per super-block).
inline __m512 params(const Weights& w, const void* base, const uint16_t* super, int64_t tile, int64_t g) {
  const int64_t index = (tile * w.groups + g) * kTile;
  if (w.kind == 2) {
    const __m512 steps = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + index))));
    return _mm512_mul_ps(halves(super + (tile * (w.groups / w.per_super) + g / w.per_super) * kTile), steps);
  }
  if (w.kind == 1) return halves(static_cast<const uint16_t*>(base) + index);
  return _mm512_loadu_ps(static_cast<const float*>(base) + index);
}

inline __m512i digit4(const int8_t* d) {
  int32_t four;
  std::memcpy(&four, d, sizeof(four));
  return _mm512_set1_epi32(four);
}

// vpmultishiftqb controls for 5- and 6-bit codes (HB high bits; quant_gemm.cpp's narrow chunks): per quad of k
// (A: k0..k0+3, B: k0+4..k0+7 of word J), the bit offsets of each byte's low nibble in the int4 word (nibbles in
// kNibbleK order) and of its high bits, placed at bit 4, in the chunk's high word; each 64-bit lane holds two rows.
struct NarrowControls {
  __m512i low[2], high[4][2], keep_high, select_low;
};

inline uint64_t pattern(const int (&offsets)[4]) {
  uint64_t bytes = 0;
  for (int t = 0; t < 4; ++t) {
    bytes |= static_cast<uint64_t>(offsets[t] & 63) << (8 * t);
    bytes |= static_cast<uint64_t>((offsets[t] + 32) & 63) << (8 * (t + 4));
  }
  return bytes;
}

template <int HB>
NarrowControls narrow_controls() {
  NarrowControls c;
  c.low[0] = _mm512_set1_epi64(static_cast<int64_t>(pattern({0, 16, 4, 20})));
  c.low[1] = _mm512_set1_epi64(static_cast<int64_t>(pattern({8, 24, 12, 28})));
  for (int j = 0; j < 4 / HB; ++j) {
    for (int half = 0; half < 2; ++half) {
      int offsets[4];
      for (int t = 0; t < 4; ++t) {
        const int kk = 4 * half + t;  // k0 + kk, high bits at quant_gemm.cpp's high_pos
        offsets[t] = (kk % 2) * 16 + (4 * j + kk / 2) * HB - 4;
      }
      c.high[j][half] = _mm512_set1_epi64(static_cast<int64_t>(pattern(offsets)));
    }
  }
  c.keep_high = _mm512_set1_epi8(static_cast<char>(((1 << HB) - 1) << 4));
  c.select_low = _mm512_set1_epi8(0x0f);
  return c;
}

template <int HB>
inline __m512i narrow_quad(const NarrowControls& c, __m512i words, __m512i high, int j, int half) {
  const __m512i low = _mm512_multishift_epi64_epi8(c.low[half], words);
  const __m512i up = _mm512_and_si512(_mm512_multishift_epi64_epi8(c.high[j][half], high), c.keep_high);
  return _mm512_ternarylogic_epi32(up, low, c.select_low, 0xd8);  // select_low ? low : up
}

// One group's digit sums over int8 tiles: the bytes [4 k][16 rows] transposed to [16 rows][4 k] (row r's four k in
// its 32-bit lane, as vpdpbusd pairs them) and flipped to q + 128 (unsigned).
template <int L>
inline void group_sums8(const uint8_t* q, const int8_t* d, int64_t k, int64_t begin, int64_t end,
                        __m512i (&sums)[L][2]) {
  alignas(64) static const uint8_t kTranspose[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
      6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
      12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
  const __m512i transpose = _mm512_load_si512(kTranspose), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  auto quad = [&](int64_t i) {
    return _mm512_xor_si512(_mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(q + i * kTile)), flip);
  };
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m512i w0 = quad(i), w1 = quad(i + 4);
    for (int j = 0; j < L; ++j) {
      sums[j][0] = _mm512_dpbusd_epi32(sums[j][0], w0, digit4(d + j * k + i));
      sums[j][1] = _mm512_dpbusd_epi32(sums[j][1], w1, digit4(d + j * k + i + 4));
    }
  }
  if (i < end) {  // a last quad (groups of 4 mod 8)
    const __m512i w0 = quad(i);
    for (int j = 0; j < L; ++j) sums[j][0] = _mm512_dpbusd_epi32(sums[j][0], w0, digit4(d + j * k + i));
  }
}

// One group's digit sums over 5- or 6-bit codes (unsigned already): each int4 word's two quads, unpacked in
// registers.
template <int HB, int L>
inline void group_sums_narrow(const uint8_t* q, const int8_t* d, int64_t k, int64_t begin, int64_t end,
                              const NarrowControls& c, __m512i (&sums)[L][2]) {
  constexpr int kWords = 4 / HB, kChunkK = 32 / HB, kChunkBytes = (kWords + 1) * kTile * 4;
  for (int64_t k0 = begin; k0 < end; k0 += kChunkK) {
    const uint8_t* chunk = q + k0 / kChunkK * kChunkBytes;
    const __m512i high = _mm512_loadu_si512(chunk + kWords * kTile * 4);
    for (int jw = 0; jw < kWords; ++jw) {
      const __m512i words = _mm512_loadu_si512(chunk + jw * kTile * 4);
      for (int half = 0; half < 2; ++half) {
        const __m512i codes = narrow_quad<HB>(c, words, high, jw, half);
        const int64_t i = k0 + 8 * jw + 4 * half;
        for (int j = 0; j < L; ++j) sums[j][half] = _mm512_dpbusd_epi32(sums[j][half], codes, digit4(d + j * k + i));
      }
    }
  }
}

// One group's digit sums over 4-bit codes: each int4 word's two quads, its low nibbles picked out in registers.
template <int L>
inline void group_sums4(const uint8_t* q, const int8_t* d, int64_t k, int64_t begin, int64_t end,
                        const NarrowControls& c, __m512i (&sums)[L][2]) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  for (int64_t k0 = begin; k0 < end; k0 += 8) {
    const __m512i words = _mm512_loadu_si512(q + k0 / 8 * kTile * 4);
    for (int half = 0; half < 2; ++half) {
      const __m512i codes = _mm512_and_si512(_mm512_multishift_epi64_epi8(c.low[half], words), nibble);
      for (int j = 0; j < L; ++j) {
        sums[j][half] = _mm512_dpbusd_epi32(sums[j][half], codes, digit4(d + j * k + k0 + 4 * half));
      }
    }
  }
}

// One tile's 16 outputs: per group, L exact int32 digit sums per row (two chains each), joined in fp32.
template <typename T, int BITS, int L>
void tile_gemv(const Weights& w, const Digits& dg, const NarrowControls& c, const float* xsum, int64_t tile,
               T* out) {
  const int64_t tile_bytes = w.k * kTile * BITS / 8, group_bytes = tile_bytes / w.groups;
  const uint8_t* q = w.q + tile * tile_bytes;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    for (int64_t b = 0; b < group_bytes; b += 64) __builtin_prefetch(q + tile_bytes + g * group_bytes + b, 0, 2);
    __m512i sums[L][2];
    for (int j = 0; j < L; ++j) {
      sums[j][0] = _mm512_set1_epi32(dg.start[g * L + j]);
      sums[j][1] = _mm512_setzero_si512();
    }
    const int64_t begin = g * w.group_size, end = begin + w.group_size;
    if constexpr (BITS == 8) {
      group_sums8<L>(q, dg.d.data(), w.k, begin, end, sums);
    } else if constexpr (BITS == 4) {
      group_sums4<L>(q, dg.d.data(), w.k, begin, end, c, sums);
    } else {
      group_sums_narrow<BITS - 4, L>(q, dg.d.data(), w.k, begin, end, c, sums);
    }
    __m512 part = _mm512_cvtepi32_ps(_mm512_add_epi32(sums[0][0], sums[0][1]));
    for (int j = 1; j < L; ++j) {
      const __m512 limb = _mm512_cvtepi32_ps(_mm512_add_epi32(sums[j][0], sums[j][1]));
      part = _mm512_fmadd_ps(limb, _mm512_set1_ps(std::ldexp(1.f, 8 * j)), part);
    }
    part = _mm512_mul_ps(part, _mm512_set1_ps(dg.unit[g]));
    acc = _mm512_fmadd_ps(part, params(w, w.scales, w.scale_super, tile, g), acc);
    if (w.offsets != nullptr) {
      acc = _mm512_fmadd_ps(params(w, w.offsets, w.offset_super, tile, g), _mm512_set1_ps(xsum[g]), acc);
    }
  }
  alignas(64) float lanes[kTile];
  _mm512_store_ps(lanes, acc);
  const int64_t valid = w.n - tile * kTile < kTile ? w.n - tile * kTile : kTile;
  for (int64_t r = 0; r < valid; ++r) out[tile * kTile + r] = pagedserve::Elem<T>::store(lanes[r]);
}

template <typename T, int BITS>
void tiles(const Weights& w, const Digits& dg, const float* xsum, int64_t tile_begin, int64_t tile_end, T* out) {
  const NarrowControls c = narrow_controls<BITS == 6 ? 2 : 1>();
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    switch (dg.limbs) {
      case 1: tile_gemv<T, BITS, 1>(w, dg, c, xsum, tile, out); break;
      case 2: tile_gemv<T, BITS, 2>(w, dg, c, xsum, tile, out); break;
      case 3: tile_gemv<T, BITS, 3>(w, dg, c, xsum, tile, out); break;
      case 4: tile_gemv<T, BITS, 4>(w, dg, c, xsum, tile, out); break;
      case 5: tile_gemv<T, BITS, 5>(w, dg, c, xsum, tile, out); break;
      default: tile_gemv<T, BITS, 6>(w, dg, c, xsum, tile, out); break;
    }
  }
}

template <typename T>
int run(const T* x_in, T* out, const Weights& w, int bits, int64_t bias, int64_t tile_begin, int64_t tile_end) {
  std::vector<float> x(w.k), xsum(w.groups, 0.f);
  for (int64_t i = 0; i < w.k; ++i) {
    x[i] = pagedserve::Elem<T>::load(x_in[i]);
    xsum[i / w.group_size] += x[i];
  }
  Digits dg;
  // int8 tiles are flipped to q + 128: their values are the codes minus 128
  if (!make_digits(x.data(), w.k, w.group_size, bits == 8 ? -128 : bias, dg)) return 1;
  switch (bits) {
    case 8: tiles<T, 8>(w, dg, xsum.data(), tile_begin, tile_end, out); break;
    case 6: tiles<T, 6>(w, dg, xsum.data(), tile_begin, tile_end, out); break;
    case 4: tiles<T, 4>(w, dg, xsum.data(), tile_begin, tile_end, out); break;
    default: tiles<T, 5>(w, dg, xsum.data(), tile_begin, tile_end, out); break;
  }
  return 0;
}

}  // namespace
#endif

// One row x [K] against int8 tiles or 4-, 5- or 6-bit codes (quant_gemm.cpp's arguments); 0 when done, 1 when this
// path does not serve the call (no VNNI/VBMI build, fp32 activations against int8 or 4-bit codes, groups too large
// for int32 sums, activations whose digits do not fit), and the caller then computes it.
extern "C" int pagedserve_quant_gemv_i8(const void* x, void* out, const void* q, const void* scales,
                                        const void* offsets, const void* scale_super, const void* offset_super,
                                        int64_t n, int64_t k, int64_t group_size, int64_t bits, int64_t kind,
                                        int64_t per_super, int64_t bias, int64_t tile_begin, int64_t tile_end,
                                        int dtype) {
#if defined(PAGEDSERVE_GEMV_I8)
  // int32 sums: |(q + 128) d| <= 255 * 128 per k, and the start at most 128 * 128 per k.
  const int64_t chunk = bits == 8 ? 4 : bits == 4 ? 8 : bits == 5 ? 32 : 16;
  // fp32 activations (5-6 digits) only against 5- and 6-bit codes: their fp32 path costs two lookups and an add per k
  if ((dtype != pagedserve::kBFloat16 && (bits == 4 || bits == 8)) || bits < 4 || bits > 8 || bits == 7 ||
      group_size % chunk != 0 || group_size > 16384 || kind < 0 || kind > 2) {
    return 1;
  }
  const Weights w{static_cast<const uint8_t*>(q), scales, offsets, static_cast<const uint16_t*>(scale_super),
                  static_cast<const uint16_t*>(offset_super), kind, per_super, n, k, group_size, k / group_size};
  int status = 1;
  pagedserve::with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    status = run<T>(static_cast<const T*>(x), static_cast<T*>(out), w, static_cast<int>(bits), bias, tile_begin,
                    tile_end);
  });
  return status;
#else
  (void)x, (void)out, (void)q, (void)scales, (void)offsets, (void)scale_super, (void)offset_super, (void)n, (void)k;
  (void)group_size, (void)bits, (void)kind, (void)per_super, (void)bias, (void)tile_begin, (void)tile_end, (void)dtype;
  return 1;
#endif
}

// *built = 1 where this build has the integer-dot path (AVX-512 VNNI and VBMI), else 0.
extern "C" int pagedserve_quant_gemv_i8_built(int* built) {
#if defined(PAGEDSERVE_GEMV_I8)
  *built = 1;
#else
  *built = 0;
#endif
  return 0;
}
