// The CpuExecutor the bindings hand to the core's CPU kernels: ATen's intra-op
// thread pool (sized by torch.set_num_threads).
#pragma once

#include "kvprune/cpu_executor.h"

namespace kvprune::torch_ext {

CpuExecutor aten_executor();

}  // namespace kvprune::torch_ext
