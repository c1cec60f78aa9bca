// Scalar conversions between the core's 16-bit storage types and fp32.
// Vectorised conversions live next to the kernels that need them.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvprune/dtype.h"

namespace kvprune::cpu {

inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, 4);
  return out;
}

// IEEE binary16 -> binary32, exact for every input (normals, subnormals, inf, nan).
inline float fp16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  uint32_t wide;
  if (exponent == 0x1f) {
    wide = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    wide = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    wide = sign;
  } else {  // subnormal: value = mantissa * 2^-24
    float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    std::memcpy(&wide, &magnitude, 4);
    wide |= sign;
  }
  float out;
  std::memcpy(&out, &wide, 4);
  return out;
}

// Reads element `i` of a buffer of the given dtype as fp32.
inline float load_as_float(const void* data, int64_t i, DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return fp16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    default: return static_cast<const float*>(data)[i];
  }
}

}  // namespace kvprune::cpu
