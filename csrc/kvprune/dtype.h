// Element types understood by the core. Half types are stored as raw 16-bit
// patterns so that these headers need neither CUDA nor a compiler extension.
#pragma once

#include <cstdint>

namespace kvprune {

enum class DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
};

inline int64_t dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

}  // namespace kvprune
