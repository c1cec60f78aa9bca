// The device-specific half of every op: the core entry points of one backend (CPU with
// ATen's thread pool, CUDA on the current stream, or the CUDA kernels under the
// emulator), one virtual per entry point of kvprune/entry_points.def. The ops in ops.h
// and decode_ops.h are written once against this interface.
#pragma once

#include <cstddef>

#include "kvprune/kvprune.h"

namespace kvprune::torch_ext {

class Backend {
 public:
  virtual ~Backend() = default;
#define KVPRUNE_OP(name, Params) virtual Status name(const Params& p) const = 0;
#define KVPRUNE_OP_WS(name, Params)                                                   \
  virtual size_t name##_workspace(const Params& p) const = 0;                         \
  virtual Status name(const Params& p, void* ws, size_t ws_bytes) const = 0;
#include "kvprune/entry_points.def"
#undef KVPRUNE_OP
#undef KVPRUNE_OP_WS
};

}  // namespace kvprune::torch_ext
