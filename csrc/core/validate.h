// Parameter checks shared by the CPU and CUDA entry points. Each returns kOk or
// the first problem found; they read no device memory (seq_lens values are
// checked by the CPU kernels and clamped to [0, length] by the CUDA kernels).
#pragma once

#include "kvprune/params.h"
#include "kvprune/status.h"

namespace kvprune {

Status validate(const WindowScoresParams& p);
// Sizes and options only (pointers may still be null): for workspace queries.
Status validate_sizes(const WindowScoresParams& p);
Status validate_sizes(const SelectKeepParams& p);
Status validate(const PoolScoresParams& p);
Status validate(const SelectKeepParams& p);
Status validate(const StreamingKeepParams& p);
Status validate(const GatherKvParams& p);
Status validate(const CompactKvParams& p);
// The parts of a SnapKvParams agree (see params.h); each part is checked on its own
// by the stage entry points.
Status validate_agreement(const SnapKvParams& p);

// CPU only (host memory): every seq_lens[b] lies in [0, length]. Null is valid.
Status validate_seq_lens_host(const int32_t* seq_lens, int64_t batch, int64_t length);

}  // namespace kvprune
