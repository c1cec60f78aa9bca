// CUDA-core window_scores kernel: any dtype, any head_dim >= 1, any strides.
// The fallback for what the tensor-core kernel does not cover (fp32, other head
// dims, strides or pointers that are not 16-byte multiples).
//
// One CTA = one (batch row, KV head, tile of kTileKeys keys); thread x owns keys
// x + c * kThreads (c < kKeysPerThread) and sweeps every query row of the group,
// kRowBlock rows at a time, so each key's sums stay in that thread's registers and
// need no reduction across threads (a sum over a head's rows, or their max with
// kProbsMax). Head dims are staged in chunks of kDimChunk
// as fp32 in shared memory (K chunk transposed to [dim][key], padded against bank
// conflicts); the K tile is re-read (from L1/L2) once per row block.
#pragma once

#include "cuda/simt.cuh"
#include "cuda/window_scores_common.cuh"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace window_scores_impl {

struct SimtShape {
  static constexpr int kThreads = 128;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kKeysPerThread = 2;
  static constexpr int kTileKeys = kThreads * kKeysPerThread;
  static constexpr int kRowBlock = 16;
  static constexpr int kDimChunk = 32;
};

// ptxas for sm_100 / sm_103 sizes this kernel for the 6 CTAs per SM its shared memory
// allows (80 registers) and spills; asking for 4 leaves it the registers it needs (~115, no
// spill). The other archs keep their own choice (sm_90a: 80 registers, no spill).
// (An explicit minimum of 1 is not the same as none: it changes ptxas's choice, so the other
// archs get the plain bound.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000 && __CUDA_ARCH__ < 1200
#define KVPRUNE_SIMT_LAUNCH_BOUNDS __launch_bounds__(SimtShape::kThreads, 4)
#else
#define KVPRUNE_SIMT_LAUNCH_BOUNDS __launch_bounds__(SimtShape::kThreads)
#endif

// T: the query type; KT: K's storage (T, or fp8).
template <typename T, Pass kPass, typename KT>
__global__ void KVPRUNE_SIMT_LAUNCH_BOUNDS
    window_scores_simt_kernel(const KernelArgs a) {
  constexpr int kThreads = SimtShape::kThreads;
  constexpr int kKeys = SimtShape::kKeysPerThread;
  constexpr int kTileKeys = SimtShape::kTileKeys;
  constexpr int kRowBlock = SimtShape::kRowBlock;
  constexpr int kDimChunk = SimtShape::kDimChunk;
  constexpr bool kProbs = kPass != Pass::kStats;
  constexpr int kQueryMax = kPass == Pass::kProbsMax ? 1 : 0;
  KVPRUNE_SHARED(float, k_chunk, [kDimChunk][kTileKeys + 1]);  // [dim][key]
  KVPRUNE_SHARED_ALIGNED(16, float, q_chunk, [kDimChunk][kRowBlock]);  // [dim][row]
  KVPRUNE_SHARED(float2, warp_states, [SimtShape::kWarps][kRowBlock]);  // [warp][row] (kStats)

  const int tile = blockIdx.x % a.num_chunks;
  const int bh = blockIdx.x / a.num_chunks;  // batch * kv_heads + kv head
  const int b = bh / a.kv_heads;
  const int kv_head = bh % a.kv_heads;
  const int n = window_scores_row_length(a.seq_lens, b, a.length);
  const float scale_log2 = window_scores_scale_log2(a, kv_head);
  const int tile_key0 = tile * kTileKeys;
  // Keys of the tile that exist (stats) or are scored (probs: below out_length).
  const int stored_keys = min((kProbs ? a.out_length : a.length) - tile_key0, kTileKeys);
  const int valid_keys = min(n - tile_key0, kTileKeys);          // keys of the tile below n
  const auto col = [](int c) { return static_cast<int>(threadIdx.x) + c * kThreads; };  // tile-relative key
  float* out = nullptr;  // this tile's scores [stored_keys]
  if constexpr (kProbs) out = a.out + static_cast<int64_t>(bh) * a.out_length + tile_key0;
  if (valid_keys <= 0) {  // every key of the tile is past the row's end
    if constexpr (kProbs) {
#pragma unroll
      for (int c = 0; c < kKeys; ++c) {
        if (col(c) < stored_keys) window_scores_store(out, col(c), 0.f, a.fold, kQueryMax);
      }
    }
    return;
  }
  const int64_t rows_total = static_cast<int64_t>(a.batch) * a.q_heads * a.window;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;

  float group_acc[kKeys] = {};
  for (int head = 0; head < a.group; ++head) {
    const int64_t q_head = static_cast<int64_t>(b) * a.q_heads + kv_head * a.group + head;
    const T* q_rows = static_cast<const T*>(a.q) + b * a.q_batch_stride +
                      static_cast<int64_t>(kv_head * a.group + head) * a.q_head_stride;
    float head_sum[kKeys] = {};
    for (int i0 = 0; i0 < a.window; i0 += kRowBlock) {
      float acc[kRowBlock][kKeys] = {};
      for (int d0 = 0; d0 < a.head_dim; d0 += kDimChunk) {
        __syncthreads();  // the previous chunk (and warp_states) are no longer read
        for (int e = threadIdx.x; e < kDimChunk * kRowBlock; e += kThreads) {
          const int r = e / kDimChunk, d = d0 + e % kDimChunk;
          const bool ok = i0 + r < a.window && d < a.head_dim;
          q_chunk[e % kDimChunk][r] =
              ok ? window_scores_to_float(q_rows[(i0 + r) * a.q_token_stride + d]) : 0.f;
        }
        for (int e = threadIdx.x; e < kDimChunk * kTileKeys; e += kThreads) {
          const int key = e / kDimChunk, d = d0 + e % kDimChunk;
          const bool ok = key < valid_keys && d < a.head_dim;
          k_chunk[e % kDimChunk][key] =
              ok ? window_scores_to_float(window_scores_key<KT>(a, b, kv_head, tile_key0 + key)[d]) : 0.f;
        }
        __syncthreads();
#pragma unroll 4
        for (int d = 0; d < kDimChunk; ++d) {
          float kv[kKeys];
#pragma unroll
          for (int c = 0; c < kKeys; ++c) kv[c] = k_chunk[d][col(c)];
#pragma unroll
          for (int r = 0; r < kRowBlock; ++r) {
            const float qv = q_chunk[d][r];
#pragma unroll
            for (int c = 0; c < kKeys; ++c) acc[r][c] = fmaf(qv, kv[c], acc[r][c]);
          }
        }
      }

#pragma unroll
      for (int r = 0; r < kRowBlock; ++r) {
        const int i = i0 + r;
        if (i >= a.window) break;
        const int last = window_scores_last_key(n, a.window, i) - tile_key0;  // tile-relative
        if constexpr (kProbs) {
          if (last < 0) continue;
          const float lse2 = __ldg(a.lse + q_head * a.window + i) * kLog2e;
#pragma unroll
          for (int c = 0; c < kKeys; ++c) {
            const float p = window_scores_exp2(fmaf(acc[r][c], scale_log2, -lse2));
            const float v = col(c) <= last ? p : 0.f;
            head_sum[c] = kQueryMax ? fmaxf(head_sum[c], v) : head_sum[c] + v;
          }
        } else {
          float x[kKeys];
          float m = -INFINITY;
#pragma unroll
          for (int c = 0; c < kKeys; ++c) {
            x[c] = col(c) <= last ? acc[r][c] * scale_log2 : -INFINITY;
            m = fmaxf(m, x[c]);
          }
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
          const float m_ref = m == -INFINITY ? 0.f : m;
          float l = 0.f;
#pragma unroll
          for (int c = 0; c < kKeys; ++c) l += window_scores_exp2(x[c] - m_ref);
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
          if (lane == 0) warp_states[warp][r] = make_float2(m, l);
        }
      }
      if constexpr (kPass == Pass::kStats) {
        __syncthreads();
        const int i = i0 + threadIdx.x;
        if (threadIdx.x < kRowBlock && i < a.window) {
          float2 state = warp_states[0][threadIdx.x];
          for (int w = 1; w < SimtShape::kWarps; ++w) state = window_scores_merge(state, warp_states[w][threadIdx.x]);
          a.stats[tile * rows_total + q_head * a.window + i] = state;
        }
      }
    }
    if constexpr (kProbs) {
#pragma unroll
      for (int c = 0; c < kKeys; ++c) {
        if (kQueryMax && col(c) < min(valid_keys, stored_keys))
          head_sum[c] = window_scores_weigh_key(a, head_sum[c], q_head, tile_key0 + col(c));
        group_acc[c] = a.reduce_max ? fmaxf(group_acc[c], head_sum[c]) : group_acc[c] + head_sum[c];
      }
    }
  }

  if constexpr (kProbs) {
#pragma unroll
    for (int c = 0; c < kKeys; ++c) {
      if (col(c) < stored_keys)
        window_scores_store(out, col(c), group_acc[c] * a.out_scale, a.fold, kQueryMax);
    }
  }
}

}  // namespace window_scores_impl
KVPRUNE_CUDA_NAMESPACE_END
