// The emulated CUDA backend (torch/emulation.h): the core's CUDA entry points as
// compiled for the SIMT emulator, run on the host on the tensors' CPU memory.
#include <c10/util/Exception.h>

#include "torch/emulation.h"

namespace kvprune::torch_ext {
namespace {

thread_local bool t_enabled = false;

// A kCudaError from the emulator carries its report: raise it here, where the op's
// name is known, instead of a bare status.
Status reported(Status status, const char* op) {
  if (status == Status::kCudaError)
    TORCH_CHECK(false, "kvprune.", op, " (emulated CUDA) failed: ", emu::last_error());
  return status;
}

class EmulatedCudaBackend final : public Backend {
 public:
  size_t window_scores_workspace(const WindowScoresParams& p) const override {
    return emu::window_scores_workspace_bytes_cuda(p);
  }
  Status window_scores(const WindowScoresParams& p, void* ws, size_t ws_bytes) const override {
    return reported(emu::window_scores_cuda(p, ws, ws_bytes, nullptr), "window_scores");
  }
  Status pool_scores(const PoolScoresParams& p) const override {
    return reported(emu::pool_scores_cuda(p, nullptr), "pool_scores");
  }
  size_t select_keep_workspace(const SelectKeepParams& p) const override {
    return emu::select_keep_workspace_bytes_cuda(p);
  }
  Status select_keep(const SelectKeepParams& p, void* ws, size_t ws_bytes) const override {
    return reported(emu::select_keep_cuda(p, ws, ws_bytes, nullptr), "select_keep");
  }
  Status streaming_keep(const StreamingKeepParams& p) const override {
    return reported(emu::streaming_keep_cuda(p, nullptr), "streaming");
  }
  Status gather_kv(const GatherKvParams& p) const override {
    return reported(emu::gather_kv_cuda(p, nullptr), "gather_kv");
  }
  Status compact_kv(const CompactKvParams& p) const override {
    return reported(emu::compact_kv_cuda(p, nullptr), "paged.compact");
  }
  size_t snapkv_workspace(const SnapKvParams& p) const override {
    return emu::snapkv_workspace_bytes_cuda(p);
  }
  Status snapkv(const SnapKvParams& p, void* ws, size_t ws_bytes) const override {
    return reported(emu::snapkv_cuda(p, ws, ws_bytes, nullptr), "snapkv");
  }
  Status streaming_append(const StreamingAppendParams& p) const override {
    return reported(emu::streaming_append_cuda(p, nullptr), "streaming_append");
  }
  Status rerotate_keys(const RerotateKeysParams& p) const override {
    return reported(emu::rerotate_keys_cuda(p, nullptr), "rerotate_keys");
  }
  size_t decode_scores_workspace(const DecodeScoresParams& p) const override {
    return emu::decode_scores_workspace_bytes_cuda(p);
  }
  Status decode_scores(const DecodeScoresParams& p, void* ws, size_t ws_bytes) const override {
    return reported(emu::decode_scores_cuda(p, ws, ws_bytes, nullptr), "decode_scores");
  }
  Status h2o_evict(const H2oEvictParams& p) const override {
    return reported(emu::h2o_evict_cuda(p, nullptr), "h2o_evict");
  }
};

}  // namespace

bool cuda_emulation_enabled() { return t_enabled; }

void set_cuda_emulation(bool enabled, const emu::Options& options) {
  TORCH_CHECK(!enabled || emu::compiled(),
              "this build of kvprune_cuda has no CUDA emulator (it needs CUDA's headers at build "
              "time; see kp.build_info()['cuda_emulator'])");
  TORCH_CHECK_VALUE(options.sm_count >= 1, "sm_count must be >= 1, got ", options.sm_count);
  TORCH_CHECK_VALUE(options.host_threads >= 0, "host_threads must be >= 0, got ",
                    options.host_threads);
  emu::set_options(options);
  t_enabled = enabled;
}

const Backend& emulated_cuda_backend() {
  static const EmulatedCudaBackend backend;
  return backend;
}

}  // namespace kvprune::torch_ext
