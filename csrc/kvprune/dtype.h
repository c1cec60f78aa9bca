// Element types understood by the core. Half types are stored as raw 16-bit
// patterns so that these headers need neither CUDA nor a compiler extension. The
// fp8 types (kvprune/fp8.h) are storage only: K/V caches that window_scores
// dequantises and that gather_kv / compact_kv copy; queries and scores never are.
#pragma once

#include <cstdint>

namespace kvprune {

enum class DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,  // torch.float8_e4m3fn
  kFloat8E5M2 = 4,  // torch.float8_e5m2
};

inline bool is_fp8(DType dtype) { return dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E5M2; }

inline int64_t dtype_size(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : is_fp8(dtype) ? 1 : 2;
}

}  // namespace kvprune
