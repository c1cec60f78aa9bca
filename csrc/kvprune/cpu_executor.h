// How the CPU kernels run in parallel. The core owns no thread pool: the caller
// passes one (the PyTorch binding passes at::parallel_for, an engine its own pool).
#pragma once

#include <cstdint>

namespace kvprune {

// body(body_ctx, begin, end, worker) must be called for disjoint ranges covering
// [0, n), each at least `grain` long except the last, with worker in
// [0, num_workers) unique among concurrently running calls. Returns after all
// calls finished.
using ParallelForFn = void (*)(int64_t n, int64_t grain, void* body_ctx,
                               void (*body)(void* body_ctx, int64_t begin, int64_t end, int worker),
                               void* executor_ctx);

struct CpuExecutor {
  int num_workers = 1;
  ParallelForFn parallel_for = nullptr;  // null: run serially on the calling thread
  void* executor_ctx = nullptr;
};

}  // namespace kvprune
