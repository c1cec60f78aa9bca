// The small kernels between and after the window_scores score passes:
//  * lse combine: per-chunk softmax states of pass 1 -> lse of every query row;
//  * lse weighting: the caller's lse with the query weights folded in;
//  * split reduce: per-split scores (query heads split across CTAs) -> scores.
#pragma once

#include "cuda/simt.cuh"
#include "cuda/window_scores_common.cuh"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace window_scores_impl {

// Natural-log lse of a row from its base-2 lse2, with query weight w folded in (null: none).
__device__ __forceinline__ float window_scores_weighted_lse(float lse2, const float* w) {
  return (w == nullptr ? lse2 : weighted_lse2(lse2, __ldg(w))) * kLn2;
}

// lse[r] = ln(sum over the row's visible keys of exp(logit)) - ln(query_weight[r]) for
// every query row r of [batch, q_heads, window]; -inf for a row that sees no key. Only
// chunks holding a valid key were written by pass 1, and only those are read.
// stats: [num_chunks, rows_total] (m, l) in log2 units; seq_lens: [batch] or null;
// query_weight: [rows_total] or null (weight 1); lse: out [batch, q_heads, window] = [rows_total].
__global__ void window_scores_lse_combine_kernel(const float2* stats, const int32_t* seq_lens,
                                                 const float* query_weight, float* lse,
                                                 int64_t rows_total, int64_t rows_per_batch,
                                                 int length, int keys_per_chunk) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows_total;
       r += stride) {
    const int n = window_scores_row_length(seq_lens, static_cast<int>(r / rows_per_batch), length);
    const int chunks = (n + keys_per_chunk - 1) / keys_per_chunk;
    float2 state = make_float2(-INFINITY, 0.f);
    for (int c = 0; c < chunks; ++c) state = window_scores_merge(state, stats[c * rows_total + r]);
    lse[r] = state.x == -INFINITY
                 ? -INFINITY
                 : window_scores_weighted_lse(state.x + log2f(state.y),
                                              query_weight == nullptr ? nullptr : query_weight + r);
  }
}

// weighted[r] = lse[r] - ln(query_weight[r]) for every query row r (+inf where the weight
// counts as 0). lse, query_weight, weighted: [rows_total] = [batch, q_heads, window].
__global__ void window_scores_lse_weight_kernel(const float* lse, const float* query_weight,
                                                float* weighted, int64_t rows_total) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows_total;
       r += stride)
    weighted[r] = window_scores_weighted_lse(__ldg(lse + r) * kLog2e, query_weight + r);
}

// scores[e] = out_scale * (sum or max over s of partial[s, e]), stored or folded
// into scores (window_scores_store). partial: [splits, count]; scores: [count]
// (= [batch, kv_heads, out_length]).
__global__ void window_scores_split_reduce_kernel(const float* partial, float* scores,
                                                  int64_t count, int splits, int reduce_max,
                                                  float out_scale, int fold, int query_max) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += stride) {
    float v = partial[e];
    for (int s = 1; s < splits; ++s) {
      const float p = partial[s * count + e];
      v = reduce_max ? fmaxf(v, p) : v + p;
    }
    window_scores_store(scores, e, v * out_scale, fold, query_max);
  }
}

}  // namespace window_scores_impl
KVPRUNE_CUDA_NAMESPACE_END
