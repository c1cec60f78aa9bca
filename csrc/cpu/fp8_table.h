// fp8 -> fp32 on the CPU by table: 256 exact values per format (kvprune/fp8.h).
#pragma once

#include <array>

#include "kvprune/dtype.h"
#include "kvprune/fp8.h"

namespace kvprune::cpu {

// The fp32 value of every byte of an fp8 dtype (kFloat8E4M3 or kFloat8E5M2).
inline const float* fp8_table(DType dtype) {
  static const auto tables = [] {
    std::array<std::array<float, 256>, 2> t{};
    for (int i = 0; i < 256; ++i) {
      const auto bits = static_cast<uint8_t>(i);
      t[0][i] = fp8_to_float(Fp8E4M3{bits});
      t[1][i] = fp8_to_float(Fp8E5M2{bits});
    }
    return t;
  }();
  return tables[dtype == DType::kFloat8E5M2 ? 1 : 0].data();
}

}  // namespace kvprune::cpu
