// Shared by the native CPU kernels: the dtype codes, bf16 <-> fp32 conversion, an exp the compiler can
// vectorise, and the dispatch from a dtype code to the kernel's template.
#pragma once

#include <cstdint>

namespace pagedserve {

// The `dtype` argument of the entry points (pagedserve/kernels/native/__init__.py: _DTYPE_CODES).
enum DType : int { kFloat32 = 0, kBFloat16 = 1 };

inline float bf16_to_float(uint16_t bits) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(bits) << 16);
}

inline uint16_t float_to_bf16(float value) {
  uint32_t bits = __builtin_bit_cast(uint32_t, value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays a quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);                    // round to nearest even, as torch does
  return static_cast<uint16_t>(bits >> 16);
}

// Storage type <-> float, and the rounding a value of that type went through (bf16 is held as uint16_t).
template <typename T> struct Elem;
template <> struct Elem<float> {
  static float load(float v) { return v; }
  static float store(float v) { return v; }
  static float round(float v) { return v; }
};
template <> struct Elem<uint16_t> {
  static float load(uint16_t v) { return bf16_to_float(v); }
  static uint16_t store(float v) { return float_to_bf16(v); }
  static float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

// Runs kernel(T{}) with T the storage type of `dtype`; returns the entry points' status: 0, or 1 for a
// dtype the kernels do not serve.
template <typename Kernel>
int with_dtype(int dtype, Kernel&& kernel) {
  switch (dtype) {
    case kFloat32:
      kernel(float{});
      return 0;
    case kBFloat16:
      kernel(uint16_t{});
      return 0;
    default:
      return 1;
  }
}

// exp(x) as straight-line code the compiler vectorises (libm's expf is a scalar call per element):
// 2^t = 2^round(t) * 2^f with f in [-0.5, 0.5] and a degree-7 polynomial, relative error below 1e-7.
// x is clamped to [-87, 88], where fp32 exp neither overflows nor goes denormal.
inline float fast_exp(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float t = x * 1.44269504088896341f;
  // Round to nearest by adding and removing 1.5 * 2^23 (exact for |t| < 2^22): floorf only vectorises
  // without trapping math, which the build keeps.
  const float whole = (t + 12582912.f) - 12582912.f;
  const float f = (t - whole) * 0.693147180559945309f;  // back to base e: e^f = 2^(t - whole)
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  // __builtin_bit_cast, not memcpy: the vectoriser sees through it (GCC 11+, Clang 9+).
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(whole) + 127) << 23);
}

}  // namespace pagedserve
