// CPU pool_scores: stride-1 pooling of each row's prefix [0, n - window), the
// window [n - window, n) copied, positions >= n zeroed. Parallel over rows.
#include <algorithm>
#include <cstdint>

#include "core/validate.h"
#include "cpu/parallel.h"
#include "cpu/pooling.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

// Rows per task: enough that a task touches at least this many scores.
constexpr int64_t kMinScoresPerTask = 1 << 14;

}  // namespace

Status pool_scores_cpu(const PoolScoresParams& p, const CpuExecutor& exec) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (auto s = validate_seq_lens_host(p.seq_lens, p.batch, p.length); s != Status::kOk) return s;
  const int64_t rows = p.batch * p.heads;
  if (rows * p.length == 0) return Status::kOk;

  const int64_t grain = std::max<int64_t>(1, kMinScoresPerTask / p.length);
  cpu::parallel_for(exec, rows, grain, [&](int64_t begin, int64_t end, int) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = p.seq_lens != nullptr ? p.seq_lens[row / p.heads] : p.length;
      const int64_t prefix = std::max<int64_t>(n - p.window, 0);
      const float* in = p.scores_in + row * p.length;  // [length]
      float* out = p.scores_out + row * p.length;      // [length]
      cpu::pool_row(in, prefix, p.kernel_size, p.shift, p.mode, out);
      std::copy(in + prefix, in + n, out + prefix);
      std::fill(out + n, out + p.length, 0.f);
    }
  });
  return Status::kOk;
}

}  // namespace kvprune
