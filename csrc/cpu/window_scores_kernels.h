// Inner kernels of the CPU window_scores op. The driver (window_scores.cpp) owns
// the loops over heads and key chunks and calls one of three compiled variants of
// these kernels (AVX-512, AVX2, baseline) chosen at run time.
//
// Layouts used by every kernel (Mp = query rows padded to a multiple of 16):
//   q_packed [D][Mp]     fp32, row r = (query head in group) * W + window index,
//                        pre-multiplied by scale * log2(e) so logits are base-2
//   k_chunk  [keys][D]   fp32 copy of one chunk of K rows
//   tile     [keys][Mp]  fp32 base-2 logits, one key per Mp-long line
#pragma once

#include <cstdint>

#include "kvprune/params.h"

namespace kvprune::cpu {

// Keys per register block of the logits kernel: `logits` takes a multiple of this.
constexpr int64_t kKeyBlock = 6;
// Keys per chunk: the unit of parallel work and of the fp32 K copy.
constexpr int64_t kChunkKeys = 32 * kKeyBlock;
// Query rows are padded to a multiple of this.
constexpr int64_t kRowAlign = 16;

// K rows to prefetch while a chunk computes: rows [0, rows) at base + r * stride_bytes.
struct KeyPrefetch {
  const char* base = nullptr;
  int64_t stride_bytes = 0;
  int64_t rows = 0;
  int64_t row_bytes = 0;
};

struct WindowScoresKernels {
  // k_chunk[j][:] = fp32(k[j * token_stride + :]) for j < num_keys, zero rows up to padded_keys.
  void (*pack_keys)(const void* k, int64_t token_stride, DType dtype, int64_t head_dim,
                    int64_t num_keys, int64_t padded_keys, float* k_chunk);
  // tile[j][r] = sum_d q_packed[d][r] * k_chunk[j][d] for j < num_keys (a multiple of
  // kKeyBlock), prefetching `next` on the way.
  void (*logits)(const float* q_packed, int64_t mp, int64_t head_dim, const float* k_chunk,
                 int64_t num_keys, float* tile, const KeyPrefetch& next);
  // Per row r: chunk_max[r] = max_j tile[j][r] (-inf if all masked); then
  // exps[j][r] = 2^(tile[j][r] - chunk_max[r]) (0 for masked, stored past the
  // caches) and chunk_sum[r] = sum_j exps[j][r].
  void (*softmax_stats)(const float* tile, int64_t mp, int64_t num_keys, float* exps,
                        float* chunk_max, float* chunk_sum);
  // tile[j][r] = 2^(tile[j][r] - lse2[r]) (lse2 in base 2; +inf gives 0).
  void (*exp_minus)(float* tile, int64_t mp, int64_t num_keys, const float* lse2);
  // out[j] = reduce over query heads h of sum_{i<window} tile[j][h*window+i] * weight[h*window+i]
  // (mean divides the total by `group`); weight is 0 on padding rows.
  void (*reduce_columns)(const float* tile, int64_t mp, int64_t num_keys, const float* weight,
                         int64_t group, int64_t window, GqaReduce reduce, float* out);
};

// The variant for the best instruction set this CPU supports.
const WindowScoresKernels& best_window_scores_kernels();

// Individual variants (defined in window_scores_<isa>.cpp).
const WindowScoresKernels& window_scores_kernels_avx512();
const WindowScoresKernels& window_scores_kernels_avx2();
const WindowScoresKernels& window_scores_kernels_baseline();

}  // namespace kvprune::cpu
