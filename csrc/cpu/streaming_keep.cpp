// CPU streaming_keep (StreamingLLM): per (batch, head) row keep the sinks
// [0, n_sink) and the last budget - n_sink positions; rows with n <= budget keep
// 0..n-1 followed by -1. Parallel over rows.
#include <algorithm>
#include <cstdint>
#include <numeric>

#include "core/validate.h"
#include "cpu/parallel.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

// Rows per task: enough that a task writes at least this many indices.
constexpr int64_t kMinIndicesPerTask = 1 << 14;

}  // namespace

Status streaming_keep_cpu(const StreamingKeepParams& p, const CpuExecutor& exec) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (auto s = validate_seq_lens_host(p.seq_lens, p.batch, p.length); s != Status::kOk) return s;
  const int64_t rows = p.batch * p.heads;
  if (rows == 0) return Status::kOk;

  const int64_t grain = std::max<int64_t>(1, kMinIndicesPerTask / p.budget);
  cpu::parallel_for(exec, rows, grain, [&](int64_t begin, int64_t end, int) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = p.seq_lens != nullptr ? p.seq_lens[row / p.heads] : p.length;
      int32_t* keep = p.keep_idx + row * p.budget;  // [budget]
      if (n <= p.budget) {
        std::iota(keep, keep + n, 0);
        std::fill(keep + n, keep + p.budget, -1);
      } else {
        std::iota(keep, keep + p.n_sink, 0);
        const int64_t recent_start = n - (p.budget - p.n_sink);
        std::iota(keep + p.n_sink, keep + p.budget, static_cast<int32_t>(recent_start));
      }
    }
  });
  return Status::kOk;
}

}  // namespace kvprune
