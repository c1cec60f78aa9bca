// CPU backend: the core's CPU kernels on ATen's intra-op thread pool.
#include "torch/aten_executor.h"
#include "torch/checks.h"
#include "torch/decode_ops.h"
#include "torch/emulation.h"
#include "torch/ops.h"

namespace kvprune::torch_ext {
namespace {

// What a CPU kernel needs checked before it reads host memory: the gather trusts keep_idx.
template <typename Params>
void check_before_cpu(const Params&) {}
void check_before_cpu(const GatherKvParams& p) { check_keep_indices(p); }

class CpuBackend final : public Backend {
 public:
  CpuBackend() : exec_(aten_executor()) {}

#define KVPRUNE_OP(name, Params)                                                     \
  Status name(const Params& p) const override {                                      \
    check_before_cpu(p);                                                             \
    return name##_cpu(p, exec_);                                                     \
  }
#define KVPRUNE_OP_WS(name, Params)                                                  \
  size_t name##_workspace(const Params& p) const override {                          \
    return name##_workspace_bytes_cpu(p, exec_);                                     \
  }                                                                                  \
  Status name(const Params& p, void* ws, size_t ws_bytes) const override {           \
    return name##_cpu(p, ws, ws_bytes, exec_);                                       \
  }
#include "kvprune/entry_points.def"
#undef KVPRUNE_OP
#undef KVPRUNE_OP_WS

 private:
  CpuExecutor exec_;
};

// CPU tensors run the CPU kernels, or the CUDA kernels under the emulator inside
// kp.testing.emulate_cuda() (torch/emulation.h).
struct HostBackends {
  static const Backend& get() {
    static const CpuBackend cpu;
    return cuda_emulation_enabled() ? emulated_cuda_backend() : cpu;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(kvprune, CPU, m) {
  OpsFor<HostBackends>::register_all(m);
  DecodeOpsFor<HostBackends>::register_all(m);
}

}  // namespace kvprune::torch_ext
