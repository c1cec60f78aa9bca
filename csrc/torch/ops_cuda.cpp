// CUDA backend: the core's CUDA kernels on PyTorch's current stream of the
// tensors' device (the op bodies set the device with a DeviceGuard).
#include <c10/cuda/CUDAStream.h>

#include "torch/decode_ops.h"
#include "torch/ops.h"

namespace kvprune::torch_ext {
namespace {

class CudaBackend final : public Backend {
 public:
#define KVPRUNE_OP(name, Params)                                                     \
  Status name(const Params& p) const override { return name##_cuda(p, stream()); }
#define KVPRUNE_OP_WS(name, Params)                                                  \
  size_t name##_workspace(const Params& p) const override {                          \
    return name##_workspace_bytes_cuda(p);                                           \
  }                                                                                  \
  Status name(const Params& p, void* ws, size_t ws_bytes) const override {           \
    return name##_cuda(p, ws, ws_bytes, stream());                                   \
  }
#include "kvprune/entry_points.def"
#undef KVPRUNE_OP
#undef KVPRUNE_OP_WS

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
