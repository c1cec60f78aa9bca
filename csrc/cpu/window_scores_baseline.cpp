// window_scores inner kernels for the baseline instruction set (flags set in CMakeLists.txt).
#define KVPRUNE_ISA_NAMESPACE isa_baseline
#define KVPRUNE_ISA_NAME "baseline"
#define KVPRUNE_LANES 4
#define KVPRUNE_ROW_VECS 2
#include "cpu/window_scores_isa.h"

namespace kvprune::cpu {
const WindowScoresKernels& window_scores_kernels_baseline() { return isa_baseline::kernels(); }
}  // namespace kvprune::cpu
