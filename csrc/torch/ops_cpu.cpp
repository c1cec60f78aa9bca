// CPU backend: the core's CPU kernels on ATen's intra-op thread pool.
#include "torch/aten_executor.h"
#include "torch/checks.h"
#include "torch/decode_ops.h"
#include "torch/emulation.h"
#include "torch/ops.h"

namespace kvprune::torch_ext {
namespace {

class CpuBackend final : public Backend {
 public:
  CpuBackend() : exec_(aten_executor()) {}

  size_t window_scores_workspace(const WindowScoresParams& p) const override {
    return window_scores_workspace_bytes_cpu(p, exec_);
  }
  Status window_scores(const WindowScoresParams& p, void* ws, size_t ws_bytes) const override {
    return window_scores_cpu(p, ws, ws_bytes, exec_);
  }
  Status pool_scores(const PoolScoresParams& p) const override { return pool_scores_cpu(p, exec_); }
  size_t select_keep_workspace(const SelectKeepParams& p) const override {
    return select_keep_workspace_bytes_cpu(p, exec_);
  }
  Status select_keep(const SelectKeepParams& p, void* ws, size_t ws_bytes) const override {
    return select_keep_cpu(p, ws, ws_bytes, exec_);
  }
  Status streaming_keep(const StreamingKeepParams& p) const override {
    return streaming_keep_cpu(p, exec_);
  }
  Status gather_kv(const GatherKvParams& p) const override {
    check_keep_indices(p);
    return gather_kv_cpu(p, exec_);
  }
  Status compact_kv(const CompactKvParams& p) const override { return compact_kv_cpu(p, exec_); }
  size_t snapkv_workspace(const SnapKvParams& p) const override {
    return snapkv_workspace_bytes_cpu(p, exec_);
  }
  Status snapkv(const SnapKvParams& p, void* ws, size_t ws_bytes) const override {
    return snapkv_cpu(p, ws, ws_bytes, exec_);
  }
  Status streaming_append(const StreamingAppendParams& p) const override {
    return streaming_append_cpu(p, exec_);
  }
  Status rerotate_keys(const RerotateKeysParams& p) const override {
    return rerotate_keys_cpu(p, exec_);
  }
  size_t decode_scores_workspace(const DecodeScoresParams& p) const override {
    return decode_scores_workspace_bytes_cpu(p, exec_);
  }
  Status decode_scores(const DecodeScoresParams& p, void* ws, size_t ws_bytes) const override {
    return decode_scores_cpu(p, ws, ws_bytes, exec_);
  }
  Status h2o_evict(const H2oEvictParams& p) const override { return h2o_evict_cpu(p, exec_); }

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
