// Definitions of the window_scores inner kernels (see window_scores_kernels.h),
// compiled once per instruction set. The including .cpp defines
//   KVPRUNE_ISA_NAMESPACE  a namespace unique to its instruction set
//   KVPRUNE_LANES          floats per vector register (16, 8 or 4)
//   KVPRUNE_ROW_VECS       row vectors per register block (MR)
// and then instantiates `kernels()` under that namespace.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu/half.h"
#include "cpu/simd.h"
#include "cpu/window_scores_kernels.h"

namespace kvprune::cpu::KVPRUNE_ISA_NAMESPACE {
namespace {

constexpr int kLanes = KVPRUNE_LANES;
using V = simd::Vec<kLanes>;

void convert_row(const void* src, DType dtype, int64_t count, float* dst) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  const uint16_t* bits = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  if (dtype == DType::kBFloat16) {
    for (; i < count; ++i) {
      const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
      std::memcpy(dst + i, &wide, 4);
    }
    return;
  }
#if defined(__F16C__)
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i))));
#endif
  for (; i < count; ++i) dst[i] = fp16_to_float(bits[i]);
}

void pack_keys(const void* k, int64_t token_stride, DType dtype, int64_t head_dim,
               int64_t num_keys, int64_t padded_keys, float* k_chunk) {
  const char* base = static_cast<const char*>(k);
  const int64_t row_bytes = token_stride * dtype_size(dtype);
  for (int64_t j = 0; j < num_keys; ++j)
    convert_row(base + j * row_bytes, dtype, head_dim, k_chunk + j * head_dim);
  std::memset(k_chunk + num_keys * head_dim, 0, (padded_keys - num_keys) * head_dim * sizeof(float));
}

// One MR x NR register block: rows [row0, row0 + kRowVecs*kLanes), keys [key0, key0+6).
template <int kRowVecs>
inline void logits_block(const float* q_packed, int64_t mp, int64_t head_dim,
                         const float* k_chunk, int64_t key0, int64_t row0, float* tile) {
  V acc[kRowVecs][kKeyBlock] = {};
  const float* k_rows = k_chunk + key0 * head_dim;
  for (int64_t d = 0; d < head_dim; ++d) {
    V q[kRowVecs];
#pragma GCC unroll 8
    for (int m = 0; m < kRowVecs; ++m) q[m] = simd::load<kLanes>(q_packed + d * mp + row0 + m * kLanes);
#pragma GCC unroll 8
    for (int n = 0; n < kKeyBlock; ++n) {
      const float k_value = k_rows[n * head_dim + d];
#pragma GCC unroll 8
      for (int m = 0; m < kRowVecs; ++m) acc[m][n] += q[m] * k_value;
    }
  }
#pragma GCC unroll 8
  for (int n = 0; n < kKeyBlock; ++n)
#pragma GCC unroll 8
    for (int m = 0; m < kRowVecs; ++m)
      simd::store<kLanes>(tile + (key0 + n) * mp + row0 + m * kLanes, acc[m][n]);
}

// Hints the cache to fetch rows [first, last) of `next` (the K rows of the next
// chunk) while this chunk computes, so the next pack_keys does not wait on memory.
inline void prefetch_rows(const KeyPrefetch& next, int64_t first, int64_t last) {
  for (int64_t r = first; r < std::min(last, next.rows); ++r)
    for (int64_t byte = 0; byte < next.row_bytes; byte += 64)
      __builtin_prefetch(next.base + r * next.stride_bytes + byte, 0, 2);
}

template <int kRowVecs>
void logits_rows(const float* q_packed, int64_t mp, int64_t head_dim, const float* k_chunk,
                 int64_t num_keys, int64_t row0, float* tile, const KeyPrefetch* next) {
  for (int64_t key0 = 0; key0 < num_keys; key0 += kKeyBlock) {
    if (next != nullptr) prefetch_rows(*next, key0, key0 + kKeyBlock);
    logits_block<kRowVecs>(q_packed, mp, head_dim, k_chunk, key0, row0, tile);
  }
  if (next != nullptr) prefetch_rows(*next, num_keys, next->rows);
}

void logits(const float* q_packed, int64_t mp, int64_t head_dim, const float* k_chunk,
            int64_t num_keys, float* tile, const KeyPrefetch& next) {
  constexpr int kBlock = KVPRUNE_ROW_VECS;
  const int64_t row_vecs = mp / kLanes;
  int64_t v = 0;
  for (; v + kBlock <= row_vecs; v += kBlock)  // the first pass over the keys prefetches
    logits_rows<kBlock>(q_packed, mp, head_dim, k_chunk, num_keys, v * kLanes, tile, v == 0 ? &next : nullptr);
  for (; v < row_vecs; ++v)  // leftover row vectors, one at a time
    logits_rows<1>(q_packed, mp, head_dim, k_chunk, num_keys, v * kLanes, tile, v == 0 ? &next : nullptr);
}

void softmax_stats(const float* tile, int64_t mp, int64_t num_keys, float* exps,
                   float* chunk_max, float* chunk_sum) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < mp; r += kLanes) {
    V row_max = simd::splat<kLanes>(neg_inf);
    for (int64_t j = 0; j < num_keys; ++j)
      row_max = simd::vmax<kLanes>(row_max, simd::load<kLanes>(tile + j * mp + r));
    // A fully masked row keeps max -inf but subtracts 0, so its exps are 0 not NaN.
    const V finite_max = row_max == simd::splat<kLanes>(neg_inf) ? V{} : row_max;
    V row_sum = V{};
    for (int64_t j = 0; j < num_keys; ++j) {
      const V e = simd::exp2<kLanes>(simd::load<kLanes>(tile + j * mp + r) - finite_max);
      simd::stream_store<kLanes>(exps + j * mp + r, e);  // read again only after all chunks
      row_sum += e;
    }
    simd::store<kLanes>(chunk_max + r, row_max);
    simd::store<kLanes>(chunk_sum + r, row_sum);
  }
  simd::stream_fence();
}

void exp_minus(float* tile, int64_t mp, int64_t num_keys, const float* lse2) {
  for (int64_t j = 0; j < num_keys; ++j)
    for (int64_t r = 0; r < mp; r += kLanes) {
      float* line = tile + j * mp + r;
      simd::store<kLanes>(line, simd::exp2<kLanes>(simd::load<kLanes>(line) - simd::load<kLanes>(lse2 + r)));
    }
}

void reduce_columns(const float* tile, int64_t mp, int64_t num_keys, const float* weight,
                    int64_t group, int64_t window, GqaReduce reduce, float* out) {
  if (reduce != GqaReduce::kMax) {
    const float divisor = reduce == GqaReduce::kMean ? static_cast<float>(group) : 1.f;
    for (int64_t j = 0; j < num_keys; ++j) {
      V total = V{};
      for (int64_t r = 0; r < mp; r += kLanes)
        total += simd::load<kLanes>(tile + j * mp + r) * simd::load<kLanes>(weight + r);
      out[j] = simd::horizontal_sum<kLanes>(total) / divisor;
    }
    return;
  }
  for (int64_t j = 0; j < num_keys; ++j) {
    const float* line = tile + j * mp;
    float best = 0.f;  // sums of probabilities are >= 0
    for (int64_t h = 0; h < group; ++h) {
      float head_sum = 0.f;
      for (int64_t i = h * window; i < (h + 1) * window; ++i) head_sum += line[i] * weight[i];
      best = head_sum > best ? head_sum : best;
    }
    out[j] = best;
  }
}

}  // namespace

const WindowScoresKernels& kernels() {
  static const WindowScoresKernels table{pack_keys, logits, softmax_stats, exp_minus, reduce_columns};
  return table;
}

}  // namespace kvprune::cpu::KVPRUNE_ISA_NAMESPACE
