// Token ranges of the CPU gather_kv, shared by gather_kv_cpu and the fused snapkv.
#pragma once

#include <cstdint>

#include "kvprune/cpu_executor.h"
#include "kvprune/params.h"

namespace kvprune::cpu {

// Tokens [t0, t1) of K and V row `row` (= b * heads + h), for validated params:
// copied (out-of-range indices give zero rows), K re-rotated when p.rope is set.
void gather_row_tokens(const GatherKvParams& p, int64_t row, int64_t t0, int64_t t1);

// All tokens of rows[0..count) (rows == null: rows 0..count-1), in parallel over
// (row, token chunk).
void gather_row_list(const GatherKvParams& p, const int64_t* rows, int64_t count,
                     const CpuExecutor& exec);

}  // namespace kvprune::cpu
