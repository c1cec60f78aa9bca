// CUDA entry points of a build without nvcc: every call reports kNotCompiled.
#include "kvprune/kvprune.h"

namespace kvprune {

size_t window_scores_workspace_bytes_cuda(const WindowScoresParams&) { return 0; }
Status window_scores_cuda(const WindowScoresParams&, void*, size_t, cudaStream_t) {
  return Status::kNotCompiled;
}
Status pool_scores_cuda(const PoolScoresParams&, cudaStream_t) { return Status::kNotCompiled; }
size_t select_keep_workspace_bytes_cuda(const SelectKeepParams&) { return 0; }
Status select_keep_cuda(const SelectKeepParams&, void*, size_t, cudaStream_t) {
  return Status::kNotCompiled;
}
Status streaming_keep_cuda(const StreamingKeepParams&, cudaStream_t) { return Status::kNotCompiled; }
Status gather_kv_cuda(const GatherKvParams&, cudaStream_t) { return Status::kNotCompiled; }

}  // namespace kvprune
