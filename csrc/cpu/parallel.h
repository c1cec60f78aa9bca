// parallel_for over a CpuExecutor with a C++ lambda body.
#pragma once

#include <cstdint>

#include "kvprune/cpu_executor.h"

namespace kvprune::cpu {

// Calls body(begin, end, worker) over disjoint ranges covering [0, n).
template <typename Body>
void parallel_for(const CpuExecutor& exec, int64_t n, int64_t grain, const Body& body) {
  if (n <= 0) return;
  if (exec.parallel_for == nullptr || exec.num_workers <= 1) {
    body(int64_t{0}, n, 0);
    return;
  }
  auto trampoline = [](void* ctx, int64_t begin, int64_t end, int worker) {
    (*static_cast<const Body*>(ctx))(begin, end, worker);
  };
  exec.parallel_for(n, grain, const_cast<Body*>(&body), trampoline, exec.executor_ctx);
}

inline int num_workers(const CpuExecutor& exec) {
  return exec.parallel_for == nullptr || exec.num_workers < 1 ? 1 : exec.num_workers;
}

}  // namespace kvprune::cpu
