// window_scores inner kernels for the avx512 instruction set (flags set in CMakeLists.txt).
#define KVPRUNE_ISA_NAMESPACE isa_avx512
#define KVPRUNE_ISA_NAME "avx512"
#define KVPRUNE_LANES 16
#define KVPRUNE_ROW_VECS 4
#include "cpu/window_scores_isa.h"

namespace kvprune::cpu {
const WindowScoresKernels& window_scores_kernels_avx512() { return isa_avx512::kernels(); }
}  // namespace kvprune::cpu
