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
#define KVPRUNE_OP(name, Params)                                                     \
  Status name(const Params& p) const override {                                      \
    return reported(emu::name##_cuda(p, nullptr), #name);                            \
  }
#define KVPRUNE_OP_WS(name, Params)                                                  \
  size_t name##_workspace(const Params& p) const override {                          \
    return emu::name##_workspace_bytes_cuda(p);                                      \
  }                                                                                  \
  Status name(const Params& p, void* ws, size_t ws_bytes) const override {           \
    return reported(emu::name##_cuda(p, ws, ws_bytes, nullptr), #name);              \
  }
#include "kvprune/entry_points.def"
#undef KVPRUNE_OP
#undef KVPRUNE_OP_WS
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
