// The 8-bit float KV cache's element types for the native CPU kernels (kernels/kv8.py has the rules): the
// write rounds like torch's cast (x / scale, saturated, round to nearest even, subnormals included), and the
// read is a shift/or (no table). Reads ignore fp8 NaN encodings (a NaN only comes from a NaN written).
#pragma once

#include <cstdint>

namespace pagedserve {

// The `cache_dtype` argument of the fp8-aware entry points: the query's DType codes, then the fp8 formats
// (kernels/attention/cpu.py: CACHE_CODES).
enum CacheDType : int { kCacheFloat32 = 0, kCacheBFloat16 = 1, kCacheE4M3 = 2, kCacheE5M2 = 3 };

struct Fp8E4M3 {
  uint8_t bits;
  static constexpr float kMax = 448.f;
  // As fp16 bits (sign, then the 7 low bits below fp16's sign): the fp16 number is the value times 2^-8.
  static constexpr float kHalfUnit = 256.f;
};
struct Fp8E5M2 {
  uint8_t bits;
  static constexpr float kMax = 57344.f;
  static constexpr float kHalfUnit = 1.f;  // the byte is the high half of the fp16 number
};

// The exact value of a stored byte (contract's trick: the fp32 bits, then a power of two for the bias).
inline float fp8_to_float(Fp8E4M3 v) {
  const uint32_t b = v.bits;
  return __builtin_bit_cast(float, (b & 0x80u) << 24 | (b & 0x7fu) << 20) * 0x1p120f;
}
inline float fp8_to_float(Fp8E5M2 v) {
  const uint32_t b = v.bits;
  if ((b & 0x7cu) == 0x7cu) {  // exponent all ones: inf / NaN, which the power of two would not keep
    return __builtin_bit_cast(float, (b & 0x80u) << 24 | 0x7f800000u | (b & 0x3u) << 21);
  }
  return __builtin_bit_cast(float, (b & 0x80u) << 24 | (b & 0x7fu) << 21) * 0x1p112f;
}

// torch's fp32 -> fp8 cast (c10's Float8 conversions): normals round their mantissa to nearest even by integer
// adds; below the smallest normal an fp32 add of a power of two rounds at the subnormal step.
inline uint8_t fp8_from_float(float x, Fp8E4M3) {
  uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint32_t result;
  if (bits >= 1087u << 20) {  // 480 and above, inf, NaN: NaN (callers saturate finite values first)
    result = 0x7f;
  } else if (bits < 121u << 23) {  // below 2^-6
    result = __builtin_bit_cast(uint32_t, __builtin_bit_cast(float, bits) + 0x1p14f) - (141u << 23);
  } else {
    const uint32_t odd = (bits >> 20) & 1u;
    result = (bits + ((7u - 127u) << 23) + 0x7ffffu + odd) >> 20;
  }
  return static_cast<uint8_t>(result | sign >> 24);
}

inline uint8_t fp8_from_float(float x, Fp8E5M2) {
  uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint32_t result;
  if (bits >= 143u << 23) {  // 65536 and above: inf, NaN stays NaN
    result = bits > 0x7f800000u ? 0x7f : 0x7c;
  } else if (bits < 113u << 23) {  // below 2^-14
    result = __builtin_bit_cast(uint32_t, __builtin_bit_cast(float, bits) + 0x1p7f) - (134u << 23);
  } else {
    const uint32_t odd = (bits >> 21) & 1u;
    result = (bits + ((15u - 127u) << 23) + 0xfffffu + odd) >> 21;
  }
  return static_cast<uint8_t>(result | sign >> 24);
}

// The cache write rule: x / scale (fp32, as torch divides), saturated to the finite range, then the cast.
template <typename F>
inline F fp8_store(float x, float scale) {
  float y = x / scale;
  y = y > F::kMax ? F::kMax : (y < -F::kMax ? -F::kMax : y);  // NaN passes, as torch's clamp
  return F{fp8_from_float(y, F{})};
}

// Runs kernel(C{}) with C the cache element type of a code from CacheDType; fp32 / bf16 give float / uint16_t.
template <typename Kernel>
int with_cache_dtype(int code, Kernel&& kernel) {
  switch (code) {
    case kCacheFloat32: kernel(float{}); return 0;
    case kCacheBFloat16: kernel(uint16_t{}); return 0;
    case kCacheE4M3: kernel(Fp8E4M3{}); return 0;
    case kCacheE5M2: kernel(Fp8E5M2{}); return 0;
    default: return 1;
  }
}

template <typename C>
constexpr bool kIsFp8 = sizeof(C) == 1;

}  // namespace pagedserve

// Vector reads: fp8 bytes become fp16 bits by shifts, then the hardware's exact fp16 conversion (subnormals
// included, no assists): the value / C::kHalfUnit. An e4m3 byte is sign-extended, so the shift puts its sign in
// bit 15 (and a copy in bit 14, cleared).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
namespace pagedserve {
inline __m512 fp8x16_load(const Fp8E4M3* src, __mmask16 mask) {
  const __m256i wide = _mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(mask, src));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(static_cast<int16_t>(0xbfff))));
}
inline __m512 fp8x16_load(const Fp8E5M2* src, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mask, src)), 8));
}
}  // namespace pagedserve
#endif
#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
namespace pagedserve {
inline __m256 fp8x8_load(const Fp8E4M3* src) {
  const __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(static_cast<int16_t>(0xbfff))));
}
inline __m256 fp8x8_load(const Fp8E5M2* src) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))), 8));
}
}  // namespace pagedserve
#endif
