// Picks the window_scores kernel variant for the running CPU, once: the best it supports, or the
// one the environment variable KVPRUNE_CPU_KERNELS names (to measure a variant against another
// on one host; a name the CPU cannot run, or no variant's name, is an error naming it).
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cpu/window_scores_kernels.h"

namespace kvprune::cpu {
namespace {

struct Variant {
  const char* name;
  bool supported;
  const WindowScoresKernels& (*kernels)();
};

const WindowScoresKernels& pick(const char* wanted) {
  bool avx512 = false, avx512bf16 = false, avx2 = false;
#if defined(__x86_64__)
  __builtin_cpu_init();
  avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  avx512bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
  const Variant variants[] = {{"avx512bf16", avx512bf16, window_scores_kernels_avx512bf16},
                              {"avx512", avx512, window_scores_kernels_avx512},
                              {"avx2", avx2, window_scores_kernels_avx2},
                              {"baseline", true, window_scores_kernels_baseline}};
  const std::string name = wanted == nullptr ? "" : wanted;
  std::string names;
  for (const Variant& v : variants) {
    if (name.empty() ? v.supported : name == v.name) {
      if (!v.supported)
        throw std::invalid_argument("KVPRUNE_CPU_KERNELS=" + name + ": this CPU cannot run it");
      return v.kernels();
    }
    names += std::string(names.empty() ? "" : ", ") + v.name;
  }
  throw std::invalid_argument("KVPRUNE_CPU_KERNELS=" + name + ": expected one of " + names);
}

}  // namespace

const WindowScoresKernels& best_window_scores_kernels() {
  static const WindowScoresKernels& best = pick(std::getenv("KVPRUNE_CPU_KERNELS"));
  return best;
}

}  // namespace kvprune::cpu

namespace kvprune {

const char* cpu_kernels() { return cpu::best_window_scores_kernels().name; }

}  // namespace kvprune
