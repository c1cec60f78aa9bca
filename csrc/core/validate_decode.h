// Parameter checks of the decode-time eviction ops (CPU and CUDA entry points).
// They read sizes, options and pointers only, never device memory.
#pragma once

#include "kvprune/decode_params.h"
#include "kvprune/status.h"

namespace kvprune {

Status validate(const RopeParams& rope, int64_t head_dim);
Status validate(const StreamingAppendParams& p);
Status validate(const RerotateKeysParams& p);
// Sizes and options only (pointers may still be null): for workspace queries.
Status validate_sizes(const DecodeScoresParams& p);
Status validate(const DecodeScoresParams& p);
Status validate(const H2oEvictParams& p);

}  // namespace kvprune
