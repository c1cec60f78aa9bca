// Running the CUDA backend's kernels under the SIMT emulator on CPU tensors
// (kp.testing.emulate_cuda()). The switch is per host thread, like the emulator's
// options: ops called on CPU tensors by this thread take the emulated CUDA kernels
// while it is on.
#pragma once

#include "kvprune/emu.h"
#include "torch/backend.h"

namespace kvprune::torch_ext {

bool cuda_emulation_enabled();
// Turns emulation on with `options` for the calling thread, or off. Raises if the
// emulator is not compiled in.
void set_cuda_emulation(bool enabled, const emu::Options& options);

// The CUDA backend's entry points executed by the emulator. A launch that breaks the
// execution model raises a RuntimeError with the emulator's report.
const Backend& emulated_cuda_backend();

}  // namespace kvprune::torch_ext
