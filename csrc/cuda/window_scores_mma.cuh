// Tensor-core window_scores kernel: fp16/bf16, head_dim 64, 128 or 256.
//
// One CTA = one (batch row, KV head, chunk of consecutive key tiles, split of the
// group's query heads; one split unless the rows overflow shared memory). The CTA
// stages its query rows in shared memory once; then every warp loads the K
// fragments of its own kWarpKeys keys into registers and sweeps all query rows
// with mma.sync m16n8k16 (fp32 accumulate). K is read from memory once per split
// (exactly once unless key weights, one query head per CTA, or shared memory split
// the group).
//
// Rows: each query head's W queries are padded to 16 * ceil(W / 16) rows, so an
// m16 tile never straddles two heads; padded rows see no key. Rows are ordered
// head-major, so a head's per-key sum is complete after its last m16 tile.
//
// Dimension order: within each 32-dim chunk c, lane (g = lane / 4, t = lane % 4)
// holds dims 32c + 8t .. 8t + 7 of its row as one 16-byte vector; the first half
// feeds k-step 2c, the second half k-step 2c + 1. Q and K use the same
// permutation of the reduction dimension, so every dot product is unchanged and
// every fragment is a single 16-byte load.
#pragma once

#include "cuda/simt.cuh"
#include "cuda/window_scores_common.cuh"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace window_scores_impl {

template <int kHeadDim>
struct MmaShape {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKeyTiles = kHeadDim == 256 ? 2 : 4;  // n8 tiles per warp
  static constexpr int kWarpKeys = 8 * kKeyTiles;
  static constexpr int kTileKeys = kWarps * kWarpKeys;  // keys per CTA iteration
  static constexpr int kDimChunks = kHeadDim / 32;
  // Shared-memory bytes per staged query row (Q fragments, last visible key, lse
  // or per-warp softmax states).
  static constexpr int64_t row_bytes(Pass pass) {
    return 2 * kHeadDim + 4 + (pass == Pass::kStats ? 8 * kWarps : 4);
  }
};

// Logits of one m16 tile against the warp's keys. acc[nt][0..1]: row g, keys
// nt*8 + 2t + {0,1}; acc[nt][2..3]: row g + 8, same keys.
// q_tile: this m16 tile's fragments [kDimChunks][2][32] in shared memory.
// k_frag: the warp's K fragments [kDimChunks][kKeyTiles] (this lane's part).
template <typename T, int kDimChunks, int kKeyTiles>
__device__ __forceinline__ void window_scores_logits(const uint4* q_tile,
                                                     const uint4 (&k_frag)[kDimChunks][kKeyTiles],
                                                     float (&acc)[kKeyTiles][4]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int nt = 0; nt < kKeyTiles; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
  for (int c = 0; c < kDimChunks; ++c) {
    const uint4 row_lo = q_tile[c * 64 + lane];       // row g
    const uint4 row_hi = q_tile[c * 64 + 32 + lane];  // row g + 8
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
      const uint4 kv = k_frag[c][nt];
      simt::mma_m16n8k16<T>(acc[nt], row_lo.x, row_hi.x, row_lo.y, row_hi.y, kv.x, kv.y);
      simt::mma_m16n8k16<T>(acc[nt], row_lo.z, row_hi.z, row_lo.w, row_hi.w, kv.z, kv.w);
    }
  }
}

// Sum (or max, if use_max) of v over the 8 lanes that share this lane's key columns (same t).
__device__ __forceinline__ float window_scores_column_reduce(float v, int use_max) {
#pragma unroll
  for (int mask = 4; mask <= 16; mask <<= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, v, mask);
    v = use_max ? fmaxf(v, other) : v + other;
  }
  return v;
}

// Column sums (or maxima) of a lane's per-key partials over the 8 lanes of its key
// columns, returning the one of key column (g/2)*8 + 2t + g%2 that lane (g, t) owns
// (0 for lanes with g >= 2 * kKeyTiles).
template <int kKeyTiles>
__device__ __forceinline__ float window_scores_own_column(const float (&partial)[kKeyTiles][2],
                                                          int use_max) {
  const int g = (threadIdx.x & 31) >> 2;
  float own = 0.f;
#pragma unroll
  for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float v = window_scores_column_reduce(partial[nt][e], use_max);
      if (nt * 2 + e == g) own = v;
    }
  }
  return own;
}

// T: the query type (fp16/bf16); KT: K's storage, T or fp8 (converted exactly to T).
template <typename T, int kHeadDim, Pass kPass, typename KT>
__global__ void __launch_bounds__(MmaShape<kHeadDim>::kThreads, 2)
    window_scores_mma_kernel(const KernelArgs a) {
  using Shape = MmaShape<kHeadDim>;
  constexpr int kKeyTiles = Shape::kKeyTiles;
  constexpr int kDimChunks = Shape::kDimChunks;
  constexpr int kWarpKeys = Shape::kWarpKeys;
  constexpr int kTileKeys = Shape::kTileKeys;
  constexpr bool kProbs = kPass != Pass::kStats;
  constexpr int kQueryMax = kPass == Pass::kProbsMax ? 1 : 0;
  uint4* const window_scores_smem = simt::dynamic_shared<uint4>();

  const int chunk = blockIdx.x % a.num_chunks;
  const int bh = blockIdx.x / a.num_chunks;  // batch * kv_heads + kv head
  const int b = bh / a.kv_heads;
  const int kv_head = bh % a.kv_heads;
  const int n = window_scores_row_length(a.seq_lens, b, a.length);
  // Keys this pass covers: all N for the stats, the score row's out_length for the probs.
  const int key_limit = kProbs ? a.out_length : a.length;
  const int first_key = chunk * a.tiles_per_chunk * kTileKeys;  // this CTA's keys
  const int end_key = min(first_key + a.tiles_per_chunk * kTileKeys, key_limit);
  // This (split, batch, kv head)'s scores [out_length], recomputed at each store rather
  // than held in registers through the key loop.
  const auto out = [&a]() {
    const int64_t row = blockIdx.y * static_cast<int64_t>(a.batch) * a.kv_heads + blockIdx.x / a.num_chunks;
    return a.out + row * a.out_length;
  };
  if (first_key >= n) {  // the chunk holds no valid key
    if constexpr (kProbs) {
      for (int key = first_key + threadIdx.x; key < end_key; key += Shape::kThreads)
        window_scores_store(out(), key, 0.f, a.fold, kQueryMax);
    }
    return;
  }

  const int head0 = blockIdx.y * a.heads_per_cta;  // first query head of the group in this CTA
  const int rows_per_head = 16 * ((a.window + 15) / 16);
  const int rows = min(a.heads_per_cta, a.group - head0) * rows_per_head;
  const int64_t q_head0 = static_cast<int64_t>(b) * a.q_heads + kv_head * a.group + head0;

  // Shared memory: Q fragments [rows/16][kDimChunks][2][32] uint4, then the last
  // visible key per row [rows] int, then lse*log2(e) per row [rows] (kProbs) or
  // per-warp softmax states [kWarps][rows] (kStats).
  uint4* q_frag = window_scores_smem;
  int* row_last_key = reinterpret_cast<int*>(q_frag + rows / 16 * kDimChunks * 64);
  float* row_lse2 = reinterpret_cast<float*>(row_last_key + rows);
  float2* warp_states = reinterpret_cast<float2*>(row_last_key + rows);

  const T* q_rows = static_cast<const T*>(a.q) + b * a.q_batch_stride +
                    static_cast<int64_t>(kv_head * a.group + head0) * a.q_head_stride;
  for (int s = threadIdx.x; s < rows / 16 * kDimChunks * 64; s += Shape::kThreads) {
    const int lane = s & 31;
    const int row = (s >> 6) / kDimChunks * 16 + (lane >> 2) + 8 * ((s >> 5) & 1);
    const int dim = (s >> 6) % kDimChunks * 32 + (lane & 3) * 8;
    const int i = row % rows_per_head;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (i < a.window) {
      const T* src = q_rows + (row / rows_per_head) * a.q_head_stride + i * a.q_token_stride + dim;
      v = __ldg(reinterpret_cast<const uint4*>(src));
    }
    q_frag[s] = v;
  }
  for (int row = threadIdx.x; row < rows; row += Shape::kThreads) {
    const int i = row % rows_per_head;
    const int last_key = window_scores_last_key(n, a.window, i);
    row_last_key[row] = last_key;
    if constexpr (kProbs) {
      const int64_t q_row = (q_head0 + row / rows_per_head) * a.window + i;
      row_lse2[row] = last_key >= 0 ? __ldg(a.lse + q_row) * kLog2e : 0.f;
    } else {
      for (int w = 0; w < Shape::kWarps; ++w) warp_states[w * rows + row] = make_float2(-INFINITY, 0.f);
    }
  }
  __syncthreads();
  // The logits' scale: times K's dequantisation scale where K is fp8 (elsewhere the kernel
  // parameter itself, which takes no register).
  const float scale_log2 = sizeof(KT) == 1 ? window_scores_scale_log2(a, kv_head) : a.scale_log2;

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;

  for (int tile_key0 = first_key; tile_key0 < end_key; tile_key0 += kTileKeys) {
    const int warp_key0 = tile_key0 + warp * kWarpKeys;
    if (warp_key0 >= n) {  // every key of this warp is past the row's end
      if constexpr (kProbs) {
        if (lane < kWarpKeys && warp_key0 + lane < key_limit)
          window_scores_store(out(), warp_key0 + lane, 0.f, a.fold, kQueryMax);
      }
      continue;
    }

    // K fragments of keys warp_key0 + nt*8 + g; keys past the row's end are zero.
    uint4 k_frag[kDimChunks][kKeyTiles];
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
      const int key = warp_key0 + nt * 8 + g;
      const KT* src = key < n ? window_scores_key<KT>(a, b, kv_head, key) + t * 8 : nullptr;
#pragma unroll
      for (int c = 0; c < kDimChunks; ++c) {
        k_frag[c][nt] = key < n ? window_scores_key_fragment<T>(src + c * 32)
                                : make_uint4(0u, 0u, 0u, 0u);
      }
    }

    // head_sum: this lane's part of the per-key sum (or max over rows, kQueryMax) of
    // the current head (when heads finish one by one) or of all heads so far (plain
    // sum). Heads finish one by one for a max over heads or over queries: lane (g, t)
    // owns key column (g/2)*8 + 2t + g%2 and keeps the finished heads' GQA
    // reduction in own.
    const int per_head = kQueryMax | a.reduce_max;
    float head_sum[kKeyTiles][2] = {};
    float own = 0.f;
    int tiles_left_in_head = rows_per_head / 16;
#pragma unroll 1
    for (int mt = 0; mt < rows / 16; ++mt) {
      float acc[kKeyTiles][4];
      window_scores_logits<T>(q_frag + mt * kDimChunks * 64, k_frag, acc);

      // This lane's rows are row0 and row0 + 8; its key column nt*8 + 2t + e is
      // visible to a row iff nt*8 + e <= that row's limit.
      const int row0 = mt * 16 + g;
      const int limit0 = row_last_key[row0] - warp_key0 - 2 * t;
      const int limit1 = row_last_key[row0 + 8] - warp_key0 - 2 * t;

      if constexpr (kProbs) {
        const float lse0 = row_lse2[row0];
        const float lse1 = row_lse2[row0 + 8];
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = nt * 8 + e;
            const float p0 = window_scores_exp2(fmaf(acc[nt][e], scale_log2, -lse0));
            const float p1 = window_scores_exp2(fmaf(acc[nt][2 + e], scale_log2, -lse1));
            const float v0 = col <= limit0 ? p0 : 0.f;
            const float v1 = col <= limit1 ? p1 : 0.f;
            head_sum[nt][e] = kQueryMax ? fmaxf(head_sum[nt][e], fmaxf(v0, v1)) : head_sum[nt][e] + (v0 + v1);
          }
        }
        if (per_head && --tiles_left_in_head == 0) {  // the head is complete
          tiles_left_in_head = rows_per_head / 16;
          const float head = window_scores_own_column<kKeyTiles>(head_sum, kQueryMax);
          own = a.reduce_max ? fmaxf(own, head) : own + head;
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt) head_sum[nt][0] = head_sum[nt][1] = 0.f;
        }
      } else {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int limit = half == 0 ? limit0 : limit1;
          float m = -INFINITY;  // masked logits (log2 units) replace acc in place
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = acc[nt][2 * half + e];
              x = nt * 8 + e <= limit ? x * scale_log2 : -INFINITY;
              m = fmaxf(m, x);
            }
          }
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
          const float m_ref = m == -INFINITY ? 0.f : m;
          float l = 0.f;
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt) {
            l += window_scores_exp2(acc[nt][2 * half] - m_ref) +
                 window_scores_exp2(acc[nt][2 * half + 1] - m_ref);
          }
          l += __shfl_xor_sync(0xffffffffu, l, 1);
          l += __shfl_xor_sync(0xffffffffu, l, 2);
          if (t == 0) {  // only this lane ever touches rows row0 + 8*half of this warp
            float2& state = warp_states[warp * rows + row0 + 8 * half];
            state = window_scores_merge(state, make_float2(m, l));
          }
        }
      }
    }

    if constexpr (kProbs) {
      float value = per_head ? own : window_scores_own_column<kKeyTiles>(head_sum, 0);
      const int key = warp_key0 + (g >> 1) * 8 + 2 * t + (g & 1);  // the lane's key column
      // Key weights: the plan gives each CTA one query head (head0), so they apply here.
      if (kQueryMax && g < 2 * kKeyTiles && key < n && key < key_limit)
        value = window_scores_weigh_key(a, value, q_head0, key);
      if (g < 2 * kKeyTiles && key < key_limit)
        window_scores_store(out(), key, value * a.out_scale, a.fold, kQueryMax);
    }
  }

  if constexpr (kPass == Pass::kStats) {
    __syncthreads();
    const int64_t rows_total = static_cast<int64_t>(a.batch) * a.q_heads * a.window;
    for (int row = threadIdx.x; row < rows; row += Shape::kThreads) {
      const int i = row % rows_per_head;
      if (i >= a.window) continue;
      float2 state = warp_states[row];
      for (int w = 1; w < Shape::kWarps; ++w) state = window_scores_merge(state, warp_states[w * rows + row]);
      const int64_t q_row = (q_head0 + row / rows_per_head) * a.window + i;
      a.stats[chunk * rows_total + q_row] = state;
    }
  }
}

}  // namespace window_scores_impl
KVPRUNE_CUDA_NAMESPACE_END
