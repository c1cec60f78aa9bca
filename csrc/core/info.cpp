// Build information and status strings. KVPRUNE_VERSION, KVPRUNE_WITH_CUDA and
// KVPRUNE_CUDA_ARCHS are defined by CMake.
#include "kvprune/kvprune.h"

namespace kvprune {

const char* version() { return KVPRUNE_VERSION; }

bool cuda_compiled() {
#ifdef KVPRUNE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

const char* cuda_archs() { return KVPRUNE_CUDA_ARCHS; }

const char* status_string(Status status) {
  switch (status) {
    case Status::kOk: return "ok";
    case Status::kInvalidArgument: return "invalid argument";
    case Status::kUnsupportedDtype: return "unsupported dtype";
    case Status::kUnsupportedHeadDim: return "unsupported head_dim";
    case Status::kWorkspaceTooSmall: return "workspace too small";
    case Status::kCudaError: return "CUDA error";
    case Status::kNotCompiled: return "backend not compiled in this build";
  }
  return "unknown status";
}

}  // namespace kvprune
