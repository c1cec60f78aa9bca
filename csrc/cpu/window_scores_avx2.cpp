// window_scores inner kernels for the avx2 instruction set (flags set in CMakeLists.txt).
#define KVPRUNE_ISA_NAMESPACE isa_avx2
#define KVPRUNE_ISA_NAME "avx2"
#define KVPRUNE_LANES 8
#define KVPRUNE_ROW_VECS 2
#include "cpu/window_scores_isa.h"

namespace kvprune::cpu {
const WindowScoresKernels& window_scores_kernels_avx2() { return isa_avx2::kernels(); }
}  // namespace kvprune::cpu
