// Parameter checks shared by the CPU and CUDA entry points. Each returns kOk or
// the first problem found; they read no device memory (seq_lens values are
// checked by the CPU kernels and clamped to [0, length] by the CUDA kernels).
#pragma once

#include "kvprune/params.h"
#include "kvprune/status.h"

namespace kvprune {

Status validate(const WindowScoresParams& p);
Status validate(const PoolScoresParams& p);
Status validate(const SelectKeepParams& p);
Status validate(const StreamingKeepParams& p);
Status validate(const GatherKvParams& p);

}  // namespace kvprune
