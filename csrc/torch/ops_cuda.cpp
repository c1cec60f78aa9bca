// CUDA backend: the core's CUDA kernels on PyTorch's current stream of the
// tensors' device (the op bodies set the device with a DeviceGuard).
#include <c10/cuda/CUDAStream.h>

#include "torch/decode_ops.h"
#include "torch/ops.h"

namespace kvprune::torch_ext {
namespace {

class CudaBackend final : public Backend {
 public:
  size_t window_scores_workspace(const WindowScoresParams& p) const override {
    return window_scores_workspace_bytes_cuda(p);
  }
  Status window_scores(const WindowScoresParams& p, void* ws, size_t ws_bytes) const override {
    return window_scores_cuda(p, ws, ws_bytes, stream());
  }
  Status pool_scores(const PoolScoresParams& p) const override { return pool_scores_cuda(p, stream()); }
  size_t select_keep_workspace(const SelectKeepParams& p) const override {
    return select_keep_workspace_bytes_cuda(p);
  }
  Status select_keep(const SelectKeepParams& p, void* ws, size_t ws_bytes) const override {
    return select_keep_cuda(p, ws, ws_bytes, stream());
  }
  Status streaming_keep(const StreamingKeepParams& p) const override {
    return streaming_keep_cuda(p, stream());
  }
  Status gather_kv(const GatherKvParams& p) const override { return gather_kv_cuda(p, stream()); }
  Status compact_kv(const CompactKvParams& p) const override { return compact_kv_cuda(p, stream()); }
  size_t snapkv_workspace(const SnapKvParams& p) const override {
    return snapkv_workspace_bytes_cuda(p);
  }
  Status snapkv(const SnapKvParams& p, void* ws, size_t ws_bytes) const override {
    return snapkv_cuda(p, ws, ws_bytes, stream());
  }
  Status streaming_append(const StreamingAppendParams& p) const override {
    return streaming_append_cuda(p, stream());
  }
  Status rerotate_keys(const RerotateKeysParams& p) const override {
    return rerotate_keys_cuda(p, stream());
  }
  size_t decode_scores_workspace(const DecodeScoresParams& p) const override {
    return decode_scores_workspace_bytes_cuda(p);
  }
  Status decode_scores(const DecodeScoresParams& p, void* ws, size_t ws_bytes) const override {
    return decode_scores_cuda(p, ws, ws_bytes, stream());
  }
  Status h2o_evict(const H2oEvictParams& p) const override { return h2o_evict_cuda(p, stream()); }

 private:
  // Looked up at each call, after the op body's DeviceGuard selected the tensors' device.
  static cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
};

struct CudaBackends {
  static const Backend& get() {
    static const CudaBackend backend;
    return backend;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(kvprune, CUDA, m) {
  OpsFor<CudaBackends>::register_all(m);
  DecodeOpsFor<CudaBackends>::register_all(m);
}

}  // namespace kvprune::torch_ext
