// Pooled score of one position, read straight from global memory (DESIGN §1,
// stage 3): the rule of pool_scores on the GPU (select_keep pools through
// pool_scores too), the same as cpu/pooling.h:
//   max: max of row[i], i in [j-r-shift, j+r-shift] ∩ [0, prefix)   (padding never wins)
//   avg: sum of row[i] over the same i, / kernel_size
// with r = kernel_size / 2, 0 <= shift <= r. Neighbouring threads read neighbouring
// addresses, so every tap is a coalesced load that mostly hits L1; no shared memory,
// so any kernel_size works. The avg sum is accumulated in double, like the reference.
#pragma once

#include <cstdint>

#include "cuda/simt.cuh"
#include "kvprune/params.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace cuda_detail {

struct PooledRow {
  const float* __restrict__ scores;  // [>= prefix] one score row
  int64_t prefix;                    // pooling covers [0, prefix)
  int64_t kernel_size;               // odd, >= 1
  PoolMode mode;
  int64_t shift;                     // in [0, kernel_size / 2]

  // Pooled score at position j, 0 <= j < prefix.
  __device__ __forceinline__ float at(int64_t j) const {
    const int64_t radius = kernel_size / 2;
    if (radius == 0) return __ldg(scores + j);
    const int64_t first = j - radius - shift, last = j + radius - shift;  // last >= j
    const int64_t lo = first > 0 ? first : 0;
    const int64_t hi = last < prefix - 1 ? last : prefix - 1;
    if (mode == PoolMode::kMax) {
      float best = __ldg(scores + lo);
      for (int64_t i = lo + 1; i <= hi; ++i) best = fmaxf(best, __ldg(scores + i));
      return best;
    }
    double sum = 0.0;
    for (int64_t i = lo; i <= hi; ++i) sum += __ldg(scores + i);
    return static_cast<float>(sum / static_cast<double>(kernel_size));
  }
};

}  // namespace cuda_detail
KVPRUNE_CUDA_NAMESPACE_END
