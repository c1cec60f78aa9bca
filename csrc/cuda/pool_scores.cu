// CUDA pool_scores (DESIGN §1, stage 3): per (batch, head) row, pool the prefix
// [0, n - window), copy the window [n - window, n) and zero [n, length).
//
// One CTA covers kTile consecutive positions of one row; thread t handles
// positions t, t + kBlock, ... so every load and store of a warp is coalesced.
#include <cstdint>

#include "cuda/simt.cuh"
#include "core/validate.h"
#include "cuda/common.cuh"
#include "cuda/pooled_load.cuh"
#include "kvprune/kvprune.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace {

using cuda_detail::ceil_div;

// ---- launch heuristics ----------------------------------------------------------
constexpr int kBlock = 256;        // threads per CTA
constexpr int kItemsPerThread = 4;  // positions per thread
constexpr int64_t kTile = kBlock * kItemsPerThread;

struct PoolArgs {
  const float* scores_in;   // [rows, length]
  float* scores_out;        // out: [rows, length]
  const int32_t* seq_lens;  // [batch] or null
  int64_t heads;
  int64_t length;
  int64_t window;
  int64_t kernel_size;
  PoolMode mode;
  int64_t shift;
  uint32_t tiles_per_row;
};

__global__ __launch_bounds__(kBlock) void pool_scores_kernel(PoolArgs a) {
  const int64_t row = blockIdx.x / a.tiles_per_row;
  const int64_t tile = blockIdx.x % a.tiles_per_row;
  const int64_t n = cuda_detail::valid_length(a.seq_lens, row / a.heads, a.length);
  const int64_t prefix = n - a.window > 0 ? n - a.window : 0;
  const float* in = a.scores_in + row * a.length;
  float* out = a.scores_out + row * a.length;
  const cuda_detail::PooledRow pooled{in, prefix, a.kernel_size, a.mode, a.shift};
#pragma unroll
  for (int i = 0; i < kItemsPerThread; ++i) {
    const int64_t j = tile * kTile + i * kBlock + threadIdx.x;
    if (j >= a.length) break;
    out[j] = j < prefix ? pooled.at(j) : (j < n ? __ldg(in + j) : 0.f);
  }
}

}  // namespace

Status pool_scores_cuda(const PoolScoresParams& p, cudaStream_t stream) {
  if (auto s = validate(p); s != Status::kOk) return s;
  const int64_t rows = p.batch * p.heads;
  if (rows == 0 || p.length == 0) return Status::kOk;
  const int64_t tiles_per_row = ceil_div(p.length, kTile);
  if (rows * tiles_per_row > cuda_detail::kMaxGridBlocks) return Status::kInvalidArgument;

  const PoolArgs args{p.scores_in, p.scores_out,  p.seq_lens, p.heads,
                      p.length,    p.window,      p.kernel_size, p.mode,
                      p.shift,     static_cast<uint32_t>(tiles_per_row)};
  simt::launch<pool_scores_kernel>(static_cast<unsigned>(rows * tiles_per_row), kBlock, 0, stream, args);
  return cuda_detail::launch_status();
}

KVPRUNE_CUDA_NAMESPACE_END
