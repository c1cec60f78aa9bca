// Inner kernels of the CPU window_scores op. The driver (window_scores.cpp) owns
// the loops over heads and key chunks and calls one of four compiled variants of
// these kernels (AVX-512 with and without BF16, AVX2, baseline) chosen at run time.
//
// Layouts used by every kernel (Mp = query rows padded to a multiple of 16):
//   q_packed [D][Mp]     fp32, row r = (query head in group) * W + window index,
//                        pre-multiplied by scale * log2(e) so logits are base-2
//   k_chunk  [keys][D]   fp32 K rows of one chunk (a copy, or fp32 K in place, strided)
//   tile     [keys][Mp]  fp32 base-2 logits, one key per Mp-long line
// bf16 Q and K on an AVX512-BF16 host (logits_bf16) use instead
//   q_pairs  [D/2][Mp]   uint32 bf16 pairs (element 2e in the low half), unscaled
//   k_chunk  [keys][D]   bf16 K rows (a copy, or K in place, strided)
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

// Memory traffic the logits kernel spreads evenly over its register blocks, so it
// runs under the arithmetic instead of before or after it.
struct BackgroundWork {
  KeyPrefetch next_keys;              // K rows of the chunk after this one
  const float* prefetch = nullptr;    // [prefetch_floats] pulled into L2 (read soon after)
  int64_t prefetch_floats = 0;
  const float* copy_from = nullptr;   // [copy_floats], a multiple of kRowAlign, in cache...
  float* copy_to = nullptr;           // ...stored here past the caches
  int64_t copy_floats = 0;
};

struct WindowScoresKernels {
  const char* name;  // the instruction set: "avx512bf16", "avx512", "avx2" or "baseline"
  // k_chunk[j][:] = fp32(k[j * token_stride + :]) for j < num_keys, zero rows up to padded_keys.
  void (*pack_keys)(const void* k, int64_t token_stride, DType dtype, int64_t head_dim,
                    int64_t num_keys, int64_t padded_keys, float* k_chunk);
  // tile[j][r] = sum_d q_packed[d][r] * k_chunk[j * k_stride + d] for j < num_keys (a
  // multiple of kKeyBlock), doing `background` on the way. k_chunk is a pack_keys
  // copy or, for fp32 K, the K rows themselves.
  void (*logits)(const float* q_packed, int64_t mp, int64_t head_dim, const float* k_chunk,
                 int64_t k_stride, int64_t num_keys, float* tile, const BackgroundWork& background);
  // The same from bf16 pairs (null where the CPU has no bf16 dot product):
  // tile[j][r] = factor * sum_e q_pairs[e][r] . k_chunk[j * k_stride + 2e, +1] (D = 2 * pairs),
  // each product exact, summed in fp32 (vdpbf16ps; bf16 denormals count as 0).
  void (*logits_bf16)(const uint32_t* q_pairs, int64_t mp, int64_t pairs,
                      const uint16_t* k_chunk, int64_t k_stride, int64_t num_keys, float factor,
                      float* tile, const BackgroundWork& background);
  // In place, per row r: chunk_max[r] = max_j tile[j][r] (-inf if all masked), then
  // tile[j][r] = 2^(tile[j][r] - chunk_max[r]) (0 for masked) and
  // chunk_sum[r] = sum_j tile[j][r].
  void (*softmax_stats)(float* tile, int64_t mp, int64_t num_keys, float* chunk_max,
                        float* chunk_sum);
  // Rows [row_begin, row_end) (multiples of kRowAlign) of the exact softmax
  // normalisation: with M[r] = max_c chunk_max[c][r] and
  // total[r] = sum_c chunk_weight[c][r] * 2^(chunk_max[c][r] - M[r]), overwrites
  // chunk_weight[c][r] with 2^(chunk_max[c][r] - M[r]) / total[r], or 0 where
  // r >= live_rows, the chunk is fully masked or the row sees no key.
  void (*chunk_weights)(const float* chunk_max, float* chunk_weight, int64_t chunks, int64_t mp,
                        int64_t row_begin, int64_t row_end, int64_t live_rows);
  // copy_to[i] = copy_from[i] for i < copy_floats, past the caches (the whole
  // copy part of a BackgroundWork at once; prefetch and next_keys are ignored).
  void (*stream_copy)(const BackgroundWork& work);
  // tile[j][r] = 2^(tile[j][r] - lse2[r]) (lse2 in base 2; +inf gives 0).
  void (*exp_minus)(float* tile, int64_t mp, int64_t num_keys, const float* lse2);
  // out[j] = reduce over query heads h of sum_{i<window} tile[j][h*window+i] * weight[h*window+i]
  // (mean divides the total by `group`); weight is 0 on padding rows.
  void (*reduce_columns)(const float* tile, int64_t mp, int64_t num_keys, const float* weight,
                         int64_t group, int64_t window, GqaReduce reduce, float* out);
  // tile [num_keys][block_rows] holds probabilities of packed rows [row0, row0 + block_rows);
  // for each query head h and key j < num_keys: head_max[h * kChunkKeys + j] = max of
  // itself and tile[j][r - row0] over the rows r < live_rows of head h (r / window == h).
  void (*column_max)(const float* tile, int64_t block_rows, int64_t num_keys, int64_t row0,
                     int64_t live_rows, int64_t window, float* head_max);
};

// The variant for the best instruction set this CPU supports.
const WindowScoresKernels& best_window_scores_kernels();

// Individual variants (defined in window_scores_<isa>.cpp).
const WindowScoresKernels& window_scores_kernels_avx512bf16();
const WindowScoresKernels& window_scores_kernels_avx512();
const WindowScoresKernels& window_scores_kernels_avx2();
const WindowScoresKernels& window_scores_kernels_baseline();

}  // namespace kvprune::cpu
