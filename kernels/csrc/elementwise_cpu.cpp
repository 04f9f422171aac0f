// Fused element-wise kernels for the CPU path: RMSNorm (with the residual add), SiLU-and-mul and the
// neox rotary embedding, each one pass over memory where torch runs five to ten ops with temporaries.
//
// bf16 results round where torch's bf16 ops round (after the residual add, the normalised value before
// the weight, each product of the rotation, SiLU before the multiply), so they match the reference to the
// last bit in most elements and to one bf16 ulp elsewhere. Compiled with paged_attention_cpu.cpp.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace {

enum DType : int { kFloat32 = 0, kBFloat16 = 1 };

using pagedserve::bf16_to_float;
using pagedserve::fast_exp;
using pagedserve::float_to_bf16;

// Storage type <-> float, and the rounding a value of that type went through.
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

template <typename T>
void rms_norm(T* out, T* summed, const T* x, const T* residual, const T* weight, int64_t rows, int64_t hidden,
              float eps) {
  std::vector<float> h(hidden);
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * hidden;
    if (residual != nullptr) {
      const T* rr = residual + r * hidden;
      T* sr = summed + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) h[i] = Elem<T>::round(Elem<T>::load(xr[i]) + Elem<T>::load(rr[i]));
      for (int64_t i = 0; i < hidden; ++i) sr[i] = Elem<T>::store(h[i]);
    } else {
      for (int64_t i = 0; i < hidden; ++i) h[i] = Elem<T>::load(xr[i]);
    }
    double square_sum = 0.0;  // fp64 accumulators: the lane order does not show at fp32 precision
#pragma omp simd reduction(+ : square_sum)
    for (int64_t i = 0; i < hidden; ++i) square_sum += static_cast<double>(h[i]) * h[i];
    const float inv = 1.f / std::sqrt(static_cast<float>(square_sum / hidden) + eps);
    T* o = out + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) {
      o[i] = Elem<T>::store(Elem<T>::load(weight[i]) * Elem<T>::round(h[i] * inv));
    }
  }
}

template <typename T>
void silu_and_mul(T* out, const T* x, int64_t rows, int64_t inter) {
  // Row-sized fp32 buffers and one simple loop per stage: each stage vectorises on its own.
  std::vector<float> gate(inter), up(inter);
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * 2 * inter;
    for (int64_t i = 0; i < inter; ++i) gate[i] = Elem<T>::load(row[i]);
    for (int64_t i = 0; i < inter; ++i) up[i] = Elem<T>::load(row[inter + i]);
    for (int64_t i = 0; i < inter; ++i) gate[i] = Elem<T>::round(gate[i] / (1.f + fast_exp(-gate[i])));
    T* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i) o[i] = Elem<T>::store(gate[i] * up[i]);
  }
}

// One head's rotation: out = [x1 cos - x2 sin, x2 cos + x1 sin], each product rounded like torch's ops.
template <typename T>
inline void rotate(T* out, const T* in, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = Elem<T>::load(in[i]);
    const float x2 = Elem<T>::load(in[half + i]);
    out[i] = Elem<T>::store(Elem<T>::round(x1 * cos[i]) - Elem<T>::round(x2 * sin[i]));
    out[half + i] = Elem<T>::store(Elem<T>::round(x2 * cos[i]) + Elem<T>::round(x1 * sin[i]));
  }
}

template <typename T>
void rotary(T* q_out, T* k_out, const T* q, const T* k, const int64_t* positions, const float* cos_sin,
            int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t q_stride,
            int64_t k_stride) {
  const int64_t half = head_dim / 2;
  std::vector<float> cos(half), sin(half);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = cos_sin + positions[t] * head_dim;
    for (int64_t i = 0; i < half; ++i) {  // the table is cast to the activation dtype first, as in torch
      cos[i] = Elem<T>::round(row[i]);
      sin[i] = Elem<T>::round(row[half + i]);
    }
    for (int64_t h = 0; h < q_heads; ++h) {
      rotate(q_out + (t * q_heads + h) * head_dim, q + t * q_stride + h * head_dim, cos.data(), sin.data(), half);
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      rotate(k_out + (t * kv_heads + h) * head_dim, k + t * k_stride + h * head_dim, cos.data(), sin.data(),
             half);
    }
  }
}

// Rotary embedding of q into q_out, and of k straight into its KV-cache slot with v beside it (the
// cache is [num_blocks * block_size slots, kv_heads, head_dim]); a slot of -1 writes nothing.
template <typename T>
void rotary_and_cache(T* q_out, const T* q, const T* k, const T* v, const int64_t* positions, const float* cos_sin,
                      const int64_t* slots, T* key_cache, T* value_cache, int64_t tokens, int64_t q_heads,
                      int64_t kv_heads, int64_t head_dim, int64_t q_stride, int64_t k_stride, int64_t v_stride) {
  const int64_t half = head_dim / 2;
  const int64_t slot_size = kv_heads * head_dim;
  std::vector<float> cos(half), sin(half);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = cos_sin + positions[t] * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      cos[i] = Elem<T>::round(row[i]);
      sin[i] = Elem<T>::round(row[half + i]);
    }
    for (int64_t h = 0; h < q_heads; ++h) {
      rotate(q_out + (t * q_heads + h) * head_dim, q + t * q_stride + h * head_dim, cos.data(), sin.data(), half);
    }
    if (slots[t] < 0) continue;
    T* k_slot = key_cache + slots[t] * slot_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      rotate(k_slot + h * head_dim, k + t * k_stride + h * head_dim, cos.data(), sin.data(), half);
    }
    std::memcpy(value_cache + slots[t] * slot_size, v + t * v_stride, slot_size * sizeof(T));
  }
}

}  // namespace

extern "C" {

int pagedserve_rotary_and_cache(void* q_out, const void* q, const void* k, const void* v, const int64_t* positions,
                                const float* cos_sin, const int64_t* slots, void* key_cache, void* value_cache,
                                int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                int64_t q_stride, int64_t k_stride, int64_t v_stride, int dtype) {
  if (dtype == kFloat32) {
    rotary_and_cache(static_cast<float*>(q_out), static_cast<const float*>(q), static_cast<const float*>(k),
                     static_cast<const float*>(v), positions, cos_sin, slots, static_cast<float*>(key_cache),
                     static_cast<float*>(value_cache), tokens, q_heads, kv_heads, head_dim, q_stride, k_stride,
                     v_stride);
  } else if (dtype == kBFloat16) {
    rotary_and_cache(static_cast<uint16_t*>(q_out), static_cast<const uint16_t*>(q),
                     static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), positions, cos_sin, slots,
                     static_cast<uint16_t*>(key_cache), static_cast<uint16_t*>(value_cache), tokens, q_heads,
                     kv_heads, head_dim, q_stride, k_stride, v_stride);
  } else {
    return 1;
  }
  return 0;
}

int pagedserve_rms_norm(void* out, void* summed, const void* x, const void* residual, const void* weight,
                        int64_t rows, int64_t hidden, float eps, int dtype) {
  if (dtype == kFloat32) {
    rms_norm(static_cast<float*>(out), static_cast<float*>(summed), static_cast<const float*>(x),
             static_cast<const float*>(residual), static_cast<const float*>(weight), rows, hidden, eps);
  } else if (dtype == kBFloat16) {
    rms_norm(static_cast<uint16_t*>(out), static_cast<uint16_t*>(summed), static_cast<const uint16_t*>(x),
             static_cast<const uint16_t*>(residual), static_cast<const uint16_t*>(weight), rows, hidden, eps);
  } else {
    return 1;
  }
  return 0;
}

// bf16 -> fp32 widening of n contiguous values (the logits), exact.
int pagedserve_bf16_to_float(const void* src, float* dst, int64_t n) {
  const uint16_t* in = static_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(in[i]);
  return 0;
}

int pagedserve_silu_and_mul(void* out, const void* x, int64_t rows, int64_t inter, int dtype) {
  if (dtype == kFloat32) {
    silu_and_mul(static_cast<float*>(out), static_cast<const float*>(x), rows, inter);
  } else if (dtype == kBFloat16) {
    silu_and_mul(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x), rows, inter);
  } else {
    return 1;
  }
  return 0;
}

int pagedserve_rotary(void* q_out, void* k_out, const void* q, const void* k, const int64_t* positions,
                      const float* cos_sin, int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                      int64_t q_stride, int64_t k_stride, int dtype) {
  if (dtype == kFloat32) {
    rotary(static_cast<float*>(q_out), static_cast<float*>(k_out), static_cast<const float*>(q),
           static_cast<const float*>(k), positions, cos_sin, tokens, q_heads, kv_heads, head_dim, q_stride,
           k_stride);
  } else if (dtype == kBFloat16) {
    rotary(static_cast<uint16_t*>(q_out), static_cast<uint16_t*>(k_out), static_cast<const uint16_t*>(q),
           static_cast<const uint16_t*>(k), positions, cos_sin, tokens, q_heads, kv_heads, head_dim, q_stride,
           k_stride);
  } else {
    return 1;
  }
  return 0;
}

}  // extern "C"
