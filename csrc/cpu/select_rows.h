// One row of the CPU select_keep, shared by select_keep_cpu and the fused snapkv.
#pragma once

#include <cstdint>

#include "kvprune/params.h"

namespace kvprune::cpu {

// Scratch floats select_keep_row needs.
int64_t select_row_scratch_floats(const SelectKeepParams& p);

// keep_idx[row] from scores[row] (row = b * heads + h), for validated params;
// scratch: [select_row_scratch_floats(p)].
void select_keep_row(const SelectKeepParams& p, int64_t row, float* scratch);

}  // namespace kvprune::cpu
