// The CUDA entry points of a build without nvcc: every call reports kNotCompiled.
#include "kvprune/kvprune.h"

namespace kvprune {
#include "core/cuda_stubs.inc"
}  // namespace kvprune
