// window_scores inner kernels for AVX-512 with BF16 dot products (flags set in
// CMakeLists.txt): the avx512 kernels plus logits_bf16.
#define KVPRUNE_ISA_NAMESPACE isa_avx512bf16
#define KVPRUNE_ISA_NAME "avx512bf16"
#define KVPRUNE_LANES 16
#define KVPRUNE_ROW_VECS 4
#include "cpu/window_scores_isa.h"

namespace kvprune::cpu {
const WindowScoresKernels& window_scores_kernels_avx512bf16() { return isa_avx512bf16::kernels(); }
}  // namespace kvprune::cpu
