// Sampling over fp32 logits rows for the CPU path: an inverse-CDF draw and the row's log-sum-exp in three
// passes over one row (max; exp and block sums; search), where torch makes five full-size temporaries;
// greedy rows' argmax (torch's index reduction is scalar); and the exact bf16 -> fp32 widening of the logits.
//
// Semantics follow pagedserve/kernels/sampling/reference.py: probs = exp((x - max) / T), tokens below min_p * max
// prob (the max prob is 1 here) are dropped, the token is the first whose running sum exceeds u * total,
// and the returned normaliser is max / T + log(total). -inf logits (top-k/top-p masks) get probability 0.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../native/cpu_common.h"
#include "../native/parallel.h"

// Full-width AVX-512 vectors where the CPU has them: these loops are compute-bound (exp, bf16 rounding).
#pragma GCC target("prefer-vector-width=512")

namespace {

// The row's largest value (NaN entries skipped, as a comparison does); a plain `m = x > m ? x : m` loop stays
// scalar (one dependent compare per entry), the simd max reduction runs on full vectors.
float row_max_of(const float* row, int64_t vocab) {
  float row_max = -INFINITY;
#pragma omp simd reduction(max : row_max)
  for (int64_t i = 0; i < vocab; ++i) row_max = row[i] > row_max ? row[i] : row_max;
  return row_max;
}

// The first index from `start` whose value `hit` accepts, or -1: a simd test per 64-value block, then the block
// in order (an early-exit loop stays scalar, one dependent compare per entry).
template <typename Hit>
int64_t first_index(const float* row, int64_t vocab, Hit hit) {
  constexpr int64_t kBlock = 64;
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t stop = start + kBlock < vocab ? start + kBlock : vocab;
    int found = 0;
#pragma omp simd reduction(| : found)
    for (int64_t i = start; i < stop; ++i) found |= hit(row[i]) ? 1 : 0;
    if (!found) continue;
    for (int64_t i = start; i < stop; ++i) {
      if (hit(row[i])) return i;
    }
  }
  return -1;
}

constexpr int64_t kChunk = 256;  // running sums are kept per chunk so the search skips whole chunks
// Rows go to torch's OpenMP team (native/parallel.h) from this many values: a 49k-token vocabulary's row is
// enough for the draw; the widening, a plain copy, needs a few rows of it.
constexpr int64_t kParallelElements = 1 << 16;

// Unnormalised probs of one row into `probs`, chunk sums into `sums`; returns the row max.
float row_probs(const float* logits, int64_t vocab, float inv_temp, float min_p, float* probs, double* sums) {
  const float row_max = row_max_of(logits, vocab);
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = logits[i];
    const float p = pagedserve::fast_exp((x - row_max) * inv_temp);
    probs[i] = (x == -INFINITY || p < min_p) ? 0.f : p;
  }
  for (int64_t c = 0; c * kChunk < vocab; ++c) {
    const int64_t end = (c + 1) * kChunk < vocab ? (c + 1) * kChunk : vocab;
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (int64_t i = c * kChunk; i < end; ++i) total += probs[i];
    sums[c] = total;  // may differ from the search's in-order sum by rounding; search() tolerates that
  }
  return row_max;
}

// First token whose running sum exceeds target, searching chunk sums first; never a zero-probability token.
int64_t search(const float* probs, const double* sums, int64_t vocab, double target) {
  const int64_t num_chunks = (vocab + kChunk - 1) / kChunk;
  int64_t last_nonzero = -1;
  double running = 0.0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (sums[c] <= 0.0) continue;
    if (running + sums[c] <= target && c + 1 < num_chunks) {
      running += sums[c];
      for (int64_t i = c * kChunk; i < (c + 1) * kChunk; ++i) last_nonzero = probs[i] > 0.f ? i : last_nonzero;
      continue;
    }
    const int64_t end = (c + 1) * kChunk < vocab ? (c + 1) * kChunk : vocab;
    for (int64_t i = c * kChunk; i < end; ++i) {
      if (probs[i] <= 0.f) continue;
      running += probs[i];
      last_nonzero = i;
      if (running > target) return i;
    }
  }
  return last_nonzero;  // rounding left the target at the very top: the last token with any mass
}

}  // namespace

extern "C" {

// logits [rows, vocab] fp32 contiguous; per row inv_temp, min_p, a uniform in [0, 1); writes the token and
// max / T + log(total). Returns 0, or 2 where a row has no finite logit.
int pagedserve_sample(const float* logits, const float* inv_temps, const float* min_ps, const double* uniforms,
                      int64_t* tokens, float* lse, int64_t rows, int64_t vocab) {
  std::atomic<int> status{0};
  pagedserve::parallel_rows(rows, rows * vocab, kParallelElements, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(vocab);
    std::vector<double> sums((vocab + kChunk - 1) / kChunk);
    for (int64_t r = begin; r < end; ++r) {
      const float row_max = row_probs(logits + r * vocab, vocab, inv_temps[r], min_ps[r], probs.data(),
                                      sums.data());
      double total = 0.0;
      for (double s : sums) total += s;
      if (!(row_max > -INFINITY) || total <= 0.0) {
        tokens[r] = 0;
        lse[r] = NAN;
        status = 2;
        continue;
      }
      tokens[r] = search(probs.data(), sums.data(), vocab, uniforms[r] * total);
      lse[r] = static_cast<float>(row_max * inv_temps[r] + std::log(total));
    }
  });
  return status;
}

// The log-sum-exp of each fp32 row (for greedy rows' logprobs), one exp pass per row.
int pagedserve_logsumexp(const float* logits, float* lse, int64_t rows, int64_t vocab) {
  pagedserve::parallel_rows(rows, rows * vocab, kParallelElements, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(vocab);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = logits + r * vocab;
      const float row_max = row_max_of(row, vocab);
      if (!(row_max > -INFINITY)) {
        lse[r] = row_max;
        continue;
      }
      for (int64_t i = 0; i < vocab; ++i) {
        probs[i] = row[i] == -INFINITY ? 0.f : pagedserve::fast_exp(row[i] - row_max);
      }
      double total = 0.0;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < vocab; ++i) total += probs[i];
      lse[r] = static_cast<float>(row_max + std::log(total));
    }
  });
  return 0;
}

// Greedy rows: the index of each fp32 row's largest value, its first occurrence; a row holding NaN gets its
// first NaN (torch.argmax's answer, which treats NaN as the largest).
int pagedserve_argmax(const float* logits, int64_t* tokens, int64_t rows, int64_t vocab) {
  pagedserve::parallel_rows(rows, rows * vocab, kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = logits + r * vocab;
      float row_max = -INFINITY;
      int has_nan = 0;
#pragma omp simd reduction(max : row_max) reduction(| : has_nan)
      for (int64_t i = 0; i < vocab; ++i) {
        row_max = row[i] > row_max ? row[i] : row_max;
        has_nan |= row[i] != row[i] ? 1 : 0;
      }
      const int64_t index = has_nan ? first_index(row, vocab, [](float x) { return x != x; })
                                    : first_index(row, vocab, [row_max](float x) { return x == row_max; });
      tokens[r] = index < 0 ? 0 : index;
    }
  });
  return 0;
}

// bf16 -> fp32 widening of n contiguous values (the logits), exact.
int pagedserve_bf16_to_float(const void* src, float* dst, int64_t n) {
  const uint16_t* in = static_cast<const uint16_t*>(src);
  pagedserve::parallel_rows(n, n, kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = pagedserve::bf16_to_float(in[i]);
  });
  return 0;
}

}  // extern "C"
