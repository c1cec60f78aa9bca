// CPU select_keep: per (batch, head) row keep the sinks, the observation window
// and the best (optionally pooled) scores in between, in ascending position order.
//
// Per row, O(n) expected: nth_element finds the score of the last pick (the
// threshold), then one ascending scan takes every score above it and the
// lowest-positioned ties at it. The scan writes positions in order, so nothing
// is sorted.
//
// Scratch: rows are split into `chunks` contiguous groups and group c uses
// scratch slice c, so the workspace grows with min(workers, rows), not with the
// worker ids an executor hands out.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>

#include "core/validate.h"
#include "cpu/parallel.h"
#include "cpu/pooling.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

int64_t num_chunks(const SelectKeepParams& p, const CpuExecutor& exec) {
  return std::min<int64_t>(cpu::num_workers(exec), p.batch * p.heads);
}

// Scratch floats per chunk: the pooled row (only when pooling) and the
// candidate scores that nth_element reorders.
int64_t chunk_floats(const SelectKeepParams& p) {
  return (p.pool_kernel_size > 1 ? 2 : 1) * p.length;
}

// Ranking key: NaN ranks below every number, so the ordering stays strict-weak.
float rank_key(float v) { return v == v ? v : -std::numeric_limits<float>::infinity(); }

// One row with n > budget. row: [>= n] scores; scratch: [chunk_floats];
// keep: out [budget] ascending positions.
void select_row(const SelectKeepParams& p, const float* row, int64_t n, float* scratch,
                int32_t* keep) {
  const int64_t prefix = n - p.window;                     // candidates: [n_sink, prefix)
  const int64_t num_cand = prefix - p.n_sink;              // > num_pick, as n > budget
  const int64_t num_pick = p.budget - p.n_sink - p.window;
  const float* values = row;  // [prefix], what candidates are ranked by
  float* cand = scratch;      // [num_cand]
  if (p.pool_kernel_size > 1) {
    cpu::pool_row(row, prefix, p.pool_kernel_size, p.pool_shift, p.pool_mode, scratch);
    values = scratch;
    cand = scratch + p.length;
  }

  int32_t* out = keep;
  for (int64_t j = 0; j < p.n_sink; ++j) *out++ = static_cast<int32_t>(j);
  if (num_pick > 0) {
    std::transform(values + p.n_sink, values + prefix, cand, rank_key);
    std::nth_element(cand, cand + (num_pick - 1), cand + num_cand, std::greater<float>());
    const float threshold = cand[num_pick - 1];
    // Everything above the threshold lies before it; the remaining picks are ties.
    int64_t ties = num_pick - std::count_if(cand, cand + (num_pick - 1),
                                            [&](float v) { return v > threshold; });
    for (int64_t j = p.n_sink, picked = 0; j < prefix && picked < num_pick; ++j) {
      const float v = rank_key(values[j]);
      if (v < threshold || (v == threshold && ties == 0)) continue;
      if (v == threshold) --ties;
      *out++ = static_cast<int32_t>(j);
      ++picked;
    }
  }
  for (int64_t j = prefix; j < n; ++j) *out++ = static_cast<int32_t>(j);
}

}  // namespace

size_t select_keep_workspace_bytes_cpu(const SelectKeepParams& p, const CpuExecutor& exec) {
  if (validate_sizes(p) != Status::kOk) return 0;
  return static_cast<size_t>(num_chunks(p, exec) * chunk_floats(p)) * sizeof(float);
}

Status select_keep_cpu(const SelectKeepParams& p, void* workspace, size_t workspace_bytes,
                       const CpuExecutor& exec) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (auto s = validate_seq_lens_host(p.seq_lens, p.batch, p.length); s != Status::kOk) return s;
  const size_t need = select_keep_workspace_bytes_cpu(p, exec);
  if (workspace_bytes < need) return Status::kWorkspaceTooSmall;
  if (need > 0 && workspace == nullptr) return Status::kInvalidArgument;
  const int64_t rows = p.batch * p.heads;
  if (rows == 0) return Status::kOk;

  const int64_t chunks = num_chunks(p, exec);
  float* ws = static_cast<float*>(workspace);  // [chunks, chunk_floats]
  cpu::parallel_for(exec, chunks, 1, [&](int64_t begin, int64_t end, int) {
    for (int64_t c = begin; c < end; ++c) {
      float* scratch = ws + c * chunk_floats(p);
      for (int64_t row = c * rows / chunks; row < (c + 1) * rows / chunks; ++row) {
        const int64_t n = p.seq_lens != nullptr ? p.seq_lens[row / p.heads] : p.length;
        int32_t* keep = p.keep_idx + row * p.budget;  // [budget]
        if (n <= p.budget) {
          for (int64_t j = 0; j < n; ++j) keep[j] = static_cast<int32_t>(j);
          std::fill(keep + n, keep + p.budget, -1);
        } else {
          select_row(p, p.scores + row * p.length, n, scratch, keep);
        }
      }
    }
  });
  return Status::kOk;
}

}  // namespace kvprune
