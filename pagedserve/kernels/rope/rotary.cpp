// Neox rotary embedding for the CPU path, alone or with the rotated key and the value written straight
// into their KV-cache slots. bf16 results round where torch's bf16 ops round (each product of the
// rotation), so they match the reference to the last bit in most elements and to one bf16 ulp elsewhere.
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../native/cpu_common.h"
#include "../native/fp8.h"
#include "../native/parallel.h"

// Full-width AVX-512 vectors where the CPU has them: these loops are compute-bound (exp, bf16 rounding).
#pragma GCC target("prefer-vector-width=512")

namespace {

using pagedserve::Elem;

// Tokens go to torch's OpenMP team (the library links torch's libgomp) from this many head rows: below it,
// waking a thread costs more than the rotation.
constexpr int64_t kParallelHeads = 1 << 10;

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

// The position's cos/sin row, cast to the activation dtype first, as in torch.
template <typename T>
inline void load_cos_sin(const float* row, float* cos, float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    cos[i] = Elem<T>::round(row[i]);
    sin[i] = Elem<T>::round(row[half + i]);
  }
}

template <typename T>
void rotary(T* q_out, T* k_out, const T* q, const T* k, const int64_t* positions, const float* cos_sin,
            int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t q_stride,
            int64_t k_stride) {
  const int64_t half = head_dim / 2;
  const int64_t heads = tokens * (q_heads + kv_heads);
  pagedserve::parallel_rows(tokens, heads, kParallelHeads, [&](int64_t begin, int64_t end) {
    std::vector<float> cos(half), sin(half);
    for (int64_t t = begin; t < end; ++t) {
      load_cos_sin<T>(cos_sin + positions[t] * head_dim, cos.data(), sin.data(), half);
      for (int64_t h = 0; h < q_heads; ++h) {
        rotate(q_out + (t * q_heads + h) * head_dim, q + t * q_stride + h * head_dim, cos.data(), sin.data(), half);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate(k_out + (t * kv_heads + h) * head_dim, k + t * k_stride + h * head_dim, cos.data(), sin.data(),
               half);
      }
    }
  });
}

// One head row into the cache: as is where the cache has the activations' type, else quantized (fp8).
template <typename T, typename C>
inline void store_row(C* dst, const T* src, int64_t n, float scale) {
  if constexpr (pagedserve::kIsFp8<C>) {
    for (int64_t i = 0; i < n; ++i) dst[i] = pagedserve::fp8_store<C>(Elem<T>::load(src[i]), scale);
  } else {
    std::memcpy(dst, src, n * sizeof(T));
  }
}

// Rotary embedding of q into q_out, and of k straight into its KV-cache slot with v beside it (the
// cache is [num_blocks * block_size slots, kv_heads, head_dim]); a slot of -1 writes nothing. An fp8 cache
// (C) gets the rotated key as rounded in T, then quantized, exactly as the unfused rotary + cache write.
template <typename T, typename C>
void rotary_and_cache(T* q_out, const T* q, const T* k, const T* v, const int64_t* positions, const float* cos_sin,
                      const int64_t* slots, C* key_cache, C* value_cache, int64_t tokens, int64_t q_heads,
                      int64_t kv_heads, int64_t head_dim, int64_t q_stride, int64_t k_stride, int64_t v_stride,
                      float k_scale, float v_scale) {
  const int64_t half = head_dim / 2;
  const int64_t slot_size = kv_heads * head_dim;
  const int64_t heads = tokens * (q_heads + kv_heads);
  pagedserve::parallel_rows(tokens, heads, kParallelHeads, [&](int64_t begin, int64_t end) {
    std::vector<float> cos(half), sin(half);
    std::vector<T> k_row(pagedserve::kIsFp8<C> ? head_dim : 0);
    for (int64_t t = begin; t < end; ++t) {
      load_cos_sin<T>(cos_sin + positions[t] * head_dim, cos.data(), sin.data(), half);
      for (int64_t h = 0; h < q_heads; ++h) {
        rotate(q_out + (t * q_heads + h) * head_dim, q + t * q_stride + h * head_dim, cos.data(), sin.data(), half);
      }
      if (slots[t] < 0) continue;
      C* k_slot = key_cache + slots[t] * slot_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const T* k_head = k + t * k_stride + h * head_dim;
        if constexpr (pagedserve::kIsFp8<C>) {
          rotate(k_row.data(), k_head, cos.data(), sin.data(), half);
          store_row(k_slot + h * head_dim, k_row.data(), head_dim, k_scale);
        } else {
          rotate(k_slot + h * head_dim, k_head, cos.data(), sin.data(), half);
        }
      }
      store_row(value_cache + slots[t] * slot_size, v + t * v_stride, slot_size, v_scale);
    }
  });
}

}  // namespace

extern "C" {

int pagedserve_rotary(void* q_out, void* k_out, const void* q, const void* k, const int64_t* positions,
                      const float* cos_sin, int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                      int64_t q_stride, int64_t k_stride, int dtype) {
  return pagedserve::with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    rotary(static_cast<T*>(q_out), static_cast<T*>(k_out), static_cast<const T*>(q), static_cast<const T*>(k),
           positions, cos_sin, tokens, q_heads, kv_heads, head_dim, q_stride, k_stride);
  });
}

// cache_dtype (fp8.h CacheDType): the query's dtype code, or an fp8 format (k_scale / v_scale then divide).
// Returns 0, or 1 for an unsupported dtype or a cache of the other 16/32-bit type.
int pagedserve_rotary_and_cache(void* q_out, const void* q, const void* k, const void* v, const int64_t* positions,
                                const float* cos_sin, const int64_t* slots, void* key_cache, void* value_cache,
                                int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                int64_t q_stride, int64_t k_stride, int64_t v_stride, int dtype, int cache_dtype,
                                float k_scale, float v_scale) {
  int bad = 0;
  const int outer = pagedserve::with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int cache_status = pagedserve::with_cache_dtype(cache_dtype, [&](auto cache_tag) {
      using C = decltype(cache_tag);
      if constexpr (pagedserve::kIsFp8<C> || std::is_same_v<C, T>) {
        rotary_and_cache(static_cast<T*>(q_out), static_cast<const T*>(q), static_cast<const T*>(k),
                         static_cast<const T*>(v), positions, cos_sin, slots, static_cast<C*>(key_cache),
                         static_cast<C*>(value_cache), tokens, q_heads, kv_heads, head_dim, q_stride, k_stride,
                         v_stride, k_scale, v_scale);
      } else {
        bad = 1;
      }
    });
    bad |= cache_status;
  });
  return outer | bad;
}

}  // extern "C"
