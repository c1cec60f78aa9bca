// CUDA streaming_keep (StreamingLLM): per (batch, head) row keep [0, n_sink) and
// the last budget - n_sink positions; rows with n <= budget keep 0..n-1 and pad
// with -1. One thread per output index, no inputs besides seq_lens.
#include <cstdint>

#include "cuda/simt.cuh"
#include "core/validate.h"
#include "cuda/common.cuh"
#include "kvprune/kvprune.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace {

using cuda_detail::ceil_div;

// ---- launch heuristics ----------------------------------------------------------
constexpr int kBlock = 256;  // threads per CTA, one output index each

struct StreamingArgs {
  const int32_t* seq_lens;  // [batch] or null
  int32_t* keep_idx;        // out: [rows, budget]
  int64_t heads;
  int64_t length;
  int64_t budget;
  int64_t n_sink;
  uint32_t tiles_per_row;
};

__global__ __launch_bounds__(kBlock) void streaming_keep_kernel(StreamingArgs a) {
  const int64_t row = blockIdx.x / a.tiles_per_row;
  const int64_t t = static_cast<int64_t>(blockIdx.x % a.tiles_per_row) * kBlock + threadIdx.x;
  if (t >= a.budget) return;
  const int64_t n = cuda_detail::valid_length(a.seq_lens, row / a.heads, a.length);
  int64_t position;
  if (n <= a.budget) {
    position = t < n ? t : -1;
  } else {
    position = t < a.n_sink ? t : n - a.budget + t;  // recent part: [n - (budget - n_sink), n)
  }
  a.keep_idx[row * a.budget + t] = static_cast<int32_t>(position);
}

}  // namespace

Status streaming_keep_cuda(const StreamingKeepParams& p, cudaStream_t stream) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (p.length > INT32_MAX) return Status::kInvalidArgument;  // positions are int32
  const int64_t rows = p.batch * p.heads;
  if (rows == 0) return Status::kOk;
  const int64_t tiles_per_row = ceil_div<int64_t>(p.budget, kBlock);
  if (rows * tiles_per_row > cuda_detail::kMaxGridBlocks) return Status::kInvalidArgument;

  const StreamingArgs args{p.seq_lens, p.keep_idx, p.heads, p.length,
                           p.budget,   p.n_sink,   static_cast<uint32_t>(tiles_per_row)};
  simt::launch<streaming_keep_kernel>(static_cast<unsigned>(rows * tiles_per_row), kBlock, 0, stream,
                                      args);
  return cuda_detail::launch_status();
}

KVPRUNE_CUDA_NAMESPACE_END
