// Status codes returned by every entry point of the torch-free core.
// The core never throws and never exits; callers map these to their own errors.
#pragma once

namespace kvprune {

enum class Status : int {
  kOk = 0,
  kInvalidArgument = 1,    // a size, stride, budget or option is out of range
  kUnsupportedDtype = 2,   // dtype not handled by this op / backend
  kUnsupportedHeadDim = 3, // head_dim not handled by this backend
  kWorkspaceTooSmall = 4,  // caller's workspace smaller than the *_workspace_bytes query
  kCudaError = 5,          // a CUDA launch or runtime call failed
  kNotCompiled = 6,        // the backend was not compiled into this build
};

// Short, static, human-readable description of a status code.
const char* status_string(Status status);

}  // namespace kvprune
