#include "torch/aten_executor.h"

#include <ATen/Parallel.h>

namespace kvprune::torch_ext {
namespace {

void aten_parallel_for(int64_t n, int64_t grain, void* body_ctx,
                       void (*body)(void*, int64_t, int64_t, int), void*) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    body(body_ctx, begin, end, at::get_thread_num());
  });
}

}  // namespace

CpuExecutor aten_executor() {
  CpuExecutor exec;
  exec.num_workers = at::get_num_threads();
  exec.parallel_for = aten_parallel_for;
  return exec;
}

}  // namespace kvprune::torch_ext
