// CPU backend of the decode ops: the core's CPU kernels on ATen's thread pool.
#include "torch/aten_executor.h"
#include "torch/checks.h"
#include "torch/emulation.h"
#include "torch/decode_ops.h"

namespace kvprune::torch_ext {
namespace {

class CpuDecodeBackend final : public DecodeBackend {
 public:
  CpuDecodeBackend() : exec_(aten_executor()) {}
  Status streaming_append(const StreamingAppendParams& p) const override {
    return streaming_append_cpu(p, exec_);
  }
  Status rerotate_keys(const RerotateKeysParams& p) const override { return rerotate_keys_cpu(p, exec_); }
  size_t decode_scores_workspace(const DecodeScoresParams& p) const override {
    return decode_scores_workspace_bytes_cpu(p, exec_);
  }
  Status decode_scores(const DecodeScoresParams& p, void* ws, size_t ws_bytes) const override {
    return decode_scores_cpu(p, ws, ws_bytes, exec_);
  }
  Status h2o_evict(const H2oEvictParams& p) const override { return h2o_evict_cpu(p, exec_); }
  Status gather_kv(const GatherKvParams& p) const override {
    check_keep_indices(p);
    return gather_kv_cpu(p, exec_);
  }

 private:
  CpuExecutor exec_;
};

// CPU tensors run the CPU kernels, or the CUDA kernels under the emulator inside
// kp.testing.emulate_cuda() (torch/emulation.h).
struct HostBackends {
  static const DecodeBackend& get() {
    static const CpuDecodeBackend cpu;
    return cuda_emulation_enabled() ? emulated_cuda_decode_backend() : cpu;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(kvprune, CPU, m) { DecodeOpsFor<HostBackends>::register_all(m); }

}  // namespace kvprune::torch_ext
