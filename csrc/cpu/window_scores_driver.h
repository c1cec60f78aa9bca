// The CPU window_scores head loop, open to work that rides along with it.
//
// The loop finishes one (batch, KV head) scores row at a time and runs a parallel
// loop over key chunks per head. A ScoredRowSink hears when each row is final and
// gets a share of every later chunk loop: the fused snapkv selects a finished row
// and gathers its K/V rows in those shares, so the gather's memory traffic runs
// under the next heads' arithmetic.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/window_scores_kernels.h"
#include "kvprune/cpu_executor.h"
#include "kvprune/params.h"
#include "kvprune/status.h"

namespace kvprune::cpu {

class ScoredRowSink {
 public:
  virtual ~ScoredRowSink() = default;
  // scores[row] (row = b * kv_heads + g) is final. Calling thread, between loops.
  virtual void row_ready(int64_t row) = 0;
  // A chunk loop of `pieces` steps is about to start (calling thread).
  virtual void loop_begin(int64_t pieces) = 0;
  // Inside the loop, by the worker that runs step `piece`: first add prefetch
  // hints for the piece to the chunk's background work, then (after the chunk's
  // arithmetic) do the piece. Different pieces run concurrently.
  virtual void prefetch_piece(int64_t piece, BackgroundWork* background) = 0;
  virtual void run_piece(int64_t piece) = 0;
  // After the last row is ready: do everything still pending, in parallel.
  virtual void finish(const CpuExecutor& exec) = 0;
};

// window_scores_cpu with a sink (null: none). Same contract and workspace.
Status window_scores_with_sink(const WindowScoresParams& p, void* workspace,
                               size_t workspace_bytes, const CpuExecutor& exec,
                               ScoredRowSink* sink);

}  // namespace kvprune::cpu
