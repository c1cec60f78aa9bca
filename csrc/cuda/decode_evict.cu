// CUDA h2o_evict: one CTA per (batch, KV head) row. For each of the `num` tokens
// beyond capacity, a block-wide argmin over the slots picks the victim (holes
// below the fill frontier first by slot, then lowest score, then lowest position,
// then lowest slot); thread 0 frees it before the next round. Same rule as the CPU.
#include <cstdint>

#include "cuda/simt.cuh"
#include "core/validate_decode.h"
#include "cuda/common.cuh"
#include "kvprune/kvprune.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace {

constexpr int kBlock = 256;
constexpr int kMaxNum = 64;  // tokens per call handled by the shared chosen list

// 64-bit order key: holes (bit 63 = 0) by slot; occupied slots (bit 63 = 1) by
// order-preserving score bits, then position (< 2^31). Ties broken by slot.
__device__ __forceinline__ uint64_t candidate_key(bool hole, float score, int64_t pos, int64_t slot) {
  if (hole) return static_cast<uint64_t>(slot);
  // -0.0 and +0.0 tie (as in the CPU's float compare), so the position decides.
  uint32_t bits = __float_as_uint(score == 0.f ? 0.f : score);
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (uint64_t{1} << 63) | (static_cast<uint64_t>(bits) << 31) | static_cast<uint64_t>(pos);
}

struct Best {
  uint64_t key;
  int32_t slot;  // -1: none
};

__device__ __forceinline__ Best better(Best a, Best b) {
  if (a.slot < 0) return b;
  if (b.slot < 0) return a;
  if (a.key != b.key) return a.key < b.key ? a : b;
  return a.slot < b.slot ? a : b;
}

__global__ __launch_bounds__(kBlock) void evict_kernel(H2oEvictParams p) {
  KVPRUNE_SHARED(Best, warp_best, [kBlock / 32]);
  KVPRUNE_SHARED(int32_t, chosen, [kMaxNum]);
  const int64_t row = blockIdx.x;
  const int64_t n = cuda_detail::valid_length(p.seq_lens, row / p.heads, INT64_MAX);
  float* scores = p.h2o_scores + row * p.capacity;
  int32_t* slot_pos = p.slot_pos + row * p.capacity;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int evicted = 0;
  for (int64_t t = 0; t < p.num; ++t) {
    const int64_t pos = n + t;
    if (pos < p.capacity) {
      if (threadIdx.x == 0) p.next_slot[row * p.num + t] = static_cast<int32_t>(pos);
      continue;
    }
    Best best{0, -1};
    for (int64_t s = threadIdx.x; s < p.capacity; s += kBlock) {
      const int64_t sp = slot_pos[s];
      const bool hole = sp < 0;
      if (hole ? s >= n : (sp < p.n_sink || sp >= n - p.recent)) continue;
      // Slots [n, n + t) went to the in-order tokens of this call (CPU: next[u] == s);
      // only reachable with an occupied slot past the fill frontier (inconsistent cache),
      // where it would otherwise be handed out twice.
      if (s >= n && s < n + t) continue;
      bool taken = false;
      for (int u = 0; u < evicted; ++u) taken |= chosen[u] == s;
      if (!taken) best = better(best, Best{candidate_key(hole, scores[s], sp, s), static_cast<int32_t>(s)});
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      Best other{__shfl_xor_sync(0xffffffffu, best.key, offset),
                 __shfl_xor_sync(0xffffffffu, best.slot, offset)};
      best = better(best, other);
    }
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      Best all = warp_best[0];
      for (int w = 1; w < kBlock / 32; ++w) all = better(all, warp_best[w]);
      chosen[evicted] = all.slot;
      if (all.slot >= 0) {
        slot_pos[all.slot] = -1;
        scores[all.slot] = 0.f;
      }
    }
    __syncthreads();  // chosen[] and the freed slot are visible to the next round
    ++evicted;
  }
  if (threadIdx.x == 0 && evicted > 0) {
    // Evicted slots in ascending order, -1 (none found) last.
    for (int i = 1; i < evicted; ++i) {
      const int32_t v = chosen[i];
      int j = i - 1;
      while (j >= 0 && static_cast<uint32_t>(chosen[j]) > static_cast<uint32_t>(v)) {
        chosen[j + 1] = chosen[j];
        --j;
      }
      chosen[j + 1] = v;
    }
    for (int i = 0; i < evicted; ++i) p.next_slot[row * p.num + (p.num - evicted) + i] = chosen[i];
  }
}

}  // namespace

Status h2o_evict_cuda(const H2oEvictParams& p, cudaStream_t stream) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (p.num > kMaxNum) return Status::kInvalidArgument;
  const int64_t rows = p.batch * p.heads;
  if (rows == 0) return Status::kOk;
  if (rows > cuda_detail::kMaxGridBlocks) return Status::kInvalidArgument;
  simt::launch<evict_kernel>(static_cast<unsigned>(rows), kBlock, 0, stream, p);
  return cuda_detail::launch_status();
}

KVPRUNE_CUDA_NAMESPACE_END
