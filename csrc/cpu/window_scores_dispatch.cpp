// Picks the window_scores kernel variant for the running CPU, once.
#include "cpu/window_scores_kernels.h"

namespace kvprune::cpu {

const WindowScoresKernels& best_window_scores_kernels() {
  static const WindowScoresKernels& best = [] () -> const WindowScoresKernels& {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    if (avx512 && __builtin_cpu_supports("avx512bf16")) return window_scores_kernels_avx512bf16();
    if (avx512) return window_scores_kernels_avx512();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return window_scores_kernels_avx2();
#endif
    return window_scores_kernels_baseline();
  }();
  return best;
}

}  // namespace kvprune::cpu

namespace kvprune {

const char* cpu_kernels() { return cpu::best_window_scores_kernels().name; }

}  // namespace kvprune
