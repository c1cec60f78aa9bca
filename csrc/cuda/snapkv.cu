// snapkv_cuda: the three CUDA stage entry points chained on one stream
// (core/snapkv_chain.h).
#include "cuda/simt.cuh"
#include "core/snapkv_chain.h"
#include "kvprune/emu.h"
#include "kvprune/kvprune.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace {

// This build's CUDA stage entry points (the emulated ones in the emulator build).
struct CudaStages {
  cudaStream_t stream;
  size_t score_scratch(const WindowScoresParams& p) const {
    return window_scores_workspace_bytes_cuda(p);
  }
  size_t select_scratch(const SelectKeepParams& p) const {
    return select_keep_workspace_bytes_cuda(p);
  }
  Status scores(const WindowScoresParams& p, void* ws, size_t bytes) const {
    return window_scores_cuda(p, ws, bytes, stream);
  }
  Status select(const SelectKeepParams& p, void* ws, size_t bytes) const {
    return select_keep_cuda(p, ws, bytes, stream);
  }
  Status gather(const GatherKvParams& p) const { return gather_kv_cuda(p, stream); }
};

}  // namespace

size_t snapkv_workspace_bytes_cuda(const SnapKvParams& p) {
  return snapkv_chain::workspace_bytes(p, CudaStages{nullptr});
}

Status snapkv_cuda(const SnapKvParams& p, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream) {
  return snapkv_chain::run(p, workspace, workspace_bytes, CudaStages{stream});
}

KVPRUNE_CUDA_NAMESPACE_END
