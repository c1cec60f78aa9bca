// 8-bit float storage (fp8 KV caches, as vLLM and TensorRT-LLM keep them) and its exact
// conversion to fp32, shared by the CPU kernels, the CUDA kernels and the emulator.
//   e4m3 (OCP "fn", torch.float8_e4m3fn): bias 7, no infinities, S.1111.111 is NaN,
//     largest 448, subnormals m * 2^-9;
//   e5m2 (torch.float8_e5m2): the upper byte of an IEEE binary16.
// Every value of both formats is exact in fp16, bf16 and fp32.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvprune/host_device.h"

namespace kvprune {

// One stored element; the structs only tell the formats apart in templates.
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

KVPRUNE_HOST_DEVICE float float_from_bits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

// A finite fp8 value from its fields: exponent 0 is subnormal, mantissa * 2^(1 - bias - mbits).
KVPRUNE_HOST_DEVICE float fp8_fields_to_float(uint32_t sign, uint32_t exponent, uint32_t mantissa,
                                              int mantissa_bits, int bias) {
  const uint32_t sign_bit = sign << 31;
  if (exponent != 0)
    return float_from_bits(sign_bit | ((exponent - bias + 127) << 23) | (mantissa << (23 - mantissa_bits)));
  // 2^(1 - bias - mantissa_bits) is a normal fp32 power of two for both formats.
  const float step = float_from_bits(static_cast<uint32_t>(127 + 1 - bias - mantissa_bits) << 23);
  const float magnitude = static_cast<float>(mantissa) * step;
  return sign ? -magnitude : magnitude;
}

KVPRUNE_HOST_DEVICE float fp8_to_float(Fp8E4M3 x) {
  const uint32_t e = (x.bits >> 3) & 0xfu, m = x.bits & 0x7u;
  if (e == 0xfu && m == 0x7u) return float_from_bits(0x7fc00000u);  // NaN
  return fp8_fields_to_float(x.bits >> 7, e, m, 3, 7);
}

KVPRUNE_HOST_DEVICE float fp8_to_float(Fp8E5M2 x) {
  const uint32_t e = (x.bits >> 2) & 0x1fu, m = x.bits & 0x3u;
  if (e == 0x1fu) return float_from_bits(m != 0 ? 0x7fc00000u : ((x.bits >> 7) << 31) | 0x7f800000u);
  return fp8_fields_to_float(x.bits >> 7, e, m, 2, 15);
}

}  // namespace kvprune
