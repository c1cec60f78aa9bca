// Device pieces shared by the window_scores kernels (launchers: window_scores.cu).
//
// Softmax statistics are kept in log2 units: a row's partial state is
// (m, l) = (max_j x_j, sum_j exp2(x_j - m)) with x_j = q.k_j * scale * log2(e).
// An empty state is (-inf, 0).
#pragma once

#include "cuda/simt.cuh"


#include <cstdint>

#include "kvprune/fp8.h"
#include "kvprune/params.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace window_scores_impl {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Pass 1 (no lse given) gathers per-row softmax statistics; pass 2 accumulates
// the GQA-reduced probabilities into the scores, summing (kProbs) or taking the
// maximum (kProbsMax, qreduce = max) over each head's window queries.
enum class Pass : int { kStats = 0, kProbs = 1, kProbsMax = 2 };

// Everything a window_scores kernel needs. Sizes follow WindowScoresParams.
struct KernelArgs {
  const void* q;  // [batch, q_heads, window, head_dim], last dim contiguous
  int64_t q_batch_stride;
  int64_t q_head_stride;
  int64_t q_token_stride;
  const void* k;  // [batch, kv_heads, length, head_dim], last dim contiguous (dense or paged)
  int64_t k_batch_stride;
  int64_t k_head_stride;
  int64_t k_token_stride;
  const float* k_scale;     // [1 or kv_heads] fp32 dequantisation scale of K, or null
  int k_scale_per_head;     // 1: k_scale[kv_head], 0: k_scale[0]
  const int32_t* k_blocks;  // paged K: [batch, k_table_stride] block table (params.h BlockTable), or null
  int64_t k_table_stride;
  int64_t k_block_stride;
  int k_block_size;
  const float* lse;         // [batch, q_heads, window] natural-log LSE (probs passes)
  const int32_t* seq_lens;  // [batch] or null
  float2* stats;            // out: [num_chunks, batch*q_heads*window] (m, l) (Pass::kStats)
  float* out;               // out: [splits, batch, kv_heads, out_length] scores (probs passes)
  const float* key_weight;  // [batch, q_heads, out_length] (kProbsMax), or null
  int length;               // N (the launcher guarantees length + key tile < 2^31)
  int out_length;           // keys per score row of out (probs passes): N, or M when folding
  int fold;                 // 1: fold into out (max for kProbsMax, else add), 0: store
  int batch;
  int q_heads;
  int kv_heads;
  int group;  // q_heads / kv_heads
  int window;
  int head_dim;
  int reduce_max;    // 1: max over the heads of a group, 0: sum
  float scale_log2;  // scale * log2(e)
  float out_scale;   // 1/group for a finished mean, else 1
  int heads_per_cta;     // query heads of a group handled by one CTA (tensor-core path)
  int tiles_per_chunk;   // key tiles handled by one CTA
  int num_chunks;        // CTAs along the keys of one (batch, kv head)
};

// Key `key` of (batch row b, kv_head): head_dim elements, dense or through the block table.
// params.h's token_offset, with the 32-bit block index arithmetic of the key loop (a 64-bit
// division per key fragment would cost the tensor-core kernel dearly).
template <typename T>
__device__ __forceinline__ const T* window_scores_key(const KernelArgs& a, int b, int kv_head, int key) {
  const T* k = static_cast<const T*>(a.k) + kv_head * a.k_head_stride;
  if (a.k_blocks == nullptr) return k + b * a.k_batch_stride + static_cast<int64_t>(key) * a.k_token_stride;
  const int64_t block = __ldg(a.k_blocks + b * a.k_table_stride + key / a.k_block_size);
  return k + block * a.k_block_stride + (key % a.k_block_size) * a.k_token_stride;
}

// scale * log2(e) of kv_head's logits: the softmax scale times K's dequantisation scale.
__device__ __forceinline__ float window_scores_scale_log2(const KernelArgs& a, int kv_head) {
  if (a.k_scale == nullptr) return a.scale_log2;
  return a.scale_log2 * __ldg(a.k_scale + (a.k_scale_per_head ? kv_head : 0));
}

// A finished query head's maximum of key `key` times its key weight (kProbsMax; none: 1).
// q_head: b * q_heads + query head; key < a.out_length.
__device__ __forceinline__ float window_scores_weigh_key(const KernelArgs& a, float head_max,
                                                         int64_t q_head, int key) {
  if (a.key_weight == nullptr) return head_max;
  return head_max * applied_key_weight(__ldg(a.key_weight + q_head * a.out_length + key));
}

// Valid length of batch row b: seq_lens[b] clamped to [0, length], or length.
// seq_lens: [batch] int32 or null.
__device__ __forceinline__ int window_scores_row_length(const int32_t* seq_lens, int b, int length) {
  if (seq_lens == nullptr) return length;
  const int n = __ldg(seq_lens + b);
  return n < 0 ? 0 : (n > length ? length : n);
}

// Last key position that window query i of a row of length n sees, or -1 when it
// sees none (padded query i >= window, or position n - window + i < 0).
__device__ __forceinline__ int window_scores_last_key(int n, int window, int i) {
  const int position = n - window + i;
  return (i < window && position >= 0) ? position : -1;
}

__device__ __forceinline__ float window_scores_exp2(float x) { return simt::fast_exp2(x); }

// Combines two softmax states (m, l); either may be empty (-inf, 0).
__device__ __forceinline__ float2 window_scores_merge(float2 a, float2 b) {
  if (b.x == -INFINITY) return a;
  if (a.x == -INFINITY) return b;
  const float m = fmaxf(a.x, b.x);
  return make_float2(m, a.y * window_scores_exp2(a.x - m) + b.y * window_scores_exp2(b.x - m));
}

// out[i] = v, or v folded into it: max(out[i], v) when query_max, else out[i] + v.
// out: a score row [out_length] (or all scores).
__device__ __forceinline__ void window_scores_store(float* out, int64_t i, float v, int fold,
                                                    int query_max) {
  if (fold) v = query_max ? fmaxf(out[i], v) : out[i] + v;
  out[i] = v;
}

__device__ __forceinline__ float window_scores_to_float(float x) { return x; }
__device__ __forceinline__ float window_scores_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float window_scores_to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float window_scores_to_float(Fp8E4M3 x) { return fp8_to_float(x); }
__device__ __forceinline__ float window_scores_to_float(Fp8E5M2 x) { return fp8_to_float(x); }

// 8 consecutive key elements (this lane's part of a 16-byte mma fragment) as 8 values of
// the query type T packed in a uint4: one 16-byte load when K is T, else one 8-byte load
// of fp8 bytes converted exactly. src: 16-byte (T) or 8-byte (fp8) aligned.
template <typename T, typename KT>
__device__ __forceinline__ uint4 window_scores_key_fragment(const KT* src) {
  if constexpr (sizeof(KT) == sizeof(T)) {
    return __ldg(reinterpret_cast<const uint4*>(src));
  } else {
    const uint2 bytes = __ldg(reinterpret_cast<const uint2*>(src));
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w = i < 2 ? bytes.x : bytes.y;
      const int shift = (i & 1) * 16;
      const T lo = T(fp8_to_float(KT{static_cast<uint8_t>(w >> shift)}));
      const T hi = T(fp8_to_float(KT{static_cast<uint8_t>(w >> (shift + 8))}));
      words[i] = static_cast<uint32_t>(reinterpret_cast<const uint16_t&>(lo)) |
                 (static_cast<uint32_t>(reinterpret_cast<const uint16_t&>(hi)) << 16);
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
  }
}

}  // namespace window_scores_impl
KVPRUNE_CUDA_NAMESPACE_END
