// CUDA backend of the decode ops: the core's CUDA kernels on PyTorch's current
// stream (the op bodies set the device with a DeviceGuard).
#include <c10/cuda/CUDAStream.h>

#include "torch/decode_ops.h"

namespace kvprune::torch_ext {
namespace {

class CudaDecodeBackend final : public DecodeBackend {
 public:
  Status streaming_append(const StreamingAppendParams& p) const override {
    return streaming_append_cuda(p, stream());
  }
  Status rerotate_keys(const RerotateKeysParams& p) const override { return rerotate_keys_cuda(p, stream()); }
  size_t decode_scores_workspace(const DecodeScoresParams& p) const override {
    return decode_scores_workspace_bytes_cuda(p);
  }
  Status decode_scores(const DecodeScoresParams& p, void* ws, size_t ws_bytes) const override {
    return decode_scores_cuda(p, ws, ws_bytes, stream());
  }
  Status h2o_evict(const H2oEvictParams& p) const override { return h2o_evict_cuda(p, stream()); }
  Status gather_kv(const GatherKvParams& p) const override { return gather_kv_cuda(p, stream()); }

 private:
  // Looked up at each call, after the op body's DeviceGuard selected the tensors' device.
  static cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
};

struct CudaBackends {
  static const DecodeBackend& get() {
    static const CudaDecodeBackend backend;
    return backend;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(kvprune, CUDA, m) { DecodeOpsFor<CudaBackends>::register_all(m); }

}  // namespace kvprune::torch_ext
