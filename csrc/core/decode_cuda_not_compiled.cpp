// CUDA entry points of the decode ops in a build without nvcc: kNotCompiled.
#include "kvprune/kvprune.h"

namespace kvprune {

Status streaming_append_cuda(const StreamingAppendParams&, cudaStream_t) { return Status::kNotCompiled; }
Status rerotate_keys_cuda(const RerotateKeysParams&, cudaStream_t) { return Status::kNotCompiled; }
size_t decode_scores_workspace_bytes_cuda(const DecodeScoresParams&) { return 0; }
Status decode_scores_cuda(const DecodeScoresParams&, void*, size_t, cudaStream_t) {
  return Status::kNotCompiled;
}
Status h2o_evict_cuda(const H2oEvictParams&, cudaStream_t) { return Status::kNotCompiled; }

}  // namespace kvprune
