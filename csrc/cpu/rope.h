// CPU helpers of the decode ops: fp32 -> fp16/bf16 stores (round to nearest even)
// and the RoPE delta rotation of one key row (RopeParams in params.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/half.h"
#include "kvprune/params.h"

namespace kvprune::cpu {

inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // nan
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// IEEE binary32 -> binary16, round to nearest even (overflow -> inf).
inline uint16_t float_to_fp16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return sign | 0x7e00u;   // nan
  if (mag >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (mag < 0x38800000u) {                        // below 2^-14: subnormal half
    float abs_value;
    std::memcpy(&abs_value, &mag, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(abs_value * 16777216.0f));  // / 2^-24
  }
  uint32_t half = (((mag >> 23) - 112u) << 10) | ((mag >> 13) & 0x3ffu);
  const uint32_t rest = mag & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return sign | static_cast<uint16_t>(half);
}

// Writes element `i` of a buffer of the given dtype from fp32.
inline void store_from_float(void* data, int64_t i, DType dtype, float value) {
  switch (dtype) {
    case DType::kFloat16: static_cast<uint16_t*>(data)[i] = float_to_fp16(value); break;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[i] = float_to_bf16(value); break;
    default: static_cast<float*>(data)[i] = value; break;
  }
}

// cos/sin of delta * inv_freq[i] for the pairs of one rotation, recomputed only
// when delta changes (rows of one cache are often shifted by the same delta).
class RopeAngles {
 public:
  static constexpr int64_t kMaxPairs = 512;  // rotary_dim <= 1024

  explicit RopeAngles(const RopeParams& rope) : rope_(rope), pairs_(rope.rotary_dim / 2) {}

  static bool supported(const RopeParams& rope) { return rope.rotary_dim / 2 <= kMaxPairs; }

  // Angles for `delta`: the argument is formed and reduced to [-pi, pi] in double
  // precision (positions reach 10^6), cos/sin are fp32.
  void set(int64_t delta) {
    if (valid_ && delta == delta_) return;
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    for (int64_t i = 0; i < pairs_; ++i) {
      const double inv_freq = rope_.inv_freq != nullptr
                                  ? static_cast<double>(rope_.inv_freq[i])
                                  : std::pow(rope_.theta, -2.0 * static_cast<double>(i) /
                                                               static_cast<double>(rope_.rotary_dim));
      double angle = static_cast<double>(delta) * inv_freq;
      angle -= kTwoPi * std::nearbyint(angle / kTwoPi);
      cos_[i] = std::cos(static_cast<float>(angle));
      sin_[i] = std::sin(static_cast<float>(angle));
    }
    delta_ = delta;
    valid_ = true;
  }

  // Rotates the first rotary_dim elements of one fp32 row x [head_dim] in place.
  void rotate(float* x) const {
    const bool neox = rope_.layout == RopeLayout::kNeox;
    for (int64_t i = 0; i < pairs_; ++i) {
      float* a = neox ? x + i : x + 2 * i;
      float* b = neox ? x + i + pairs_ : x + 2 * i + 1;
      const float xa = *a, xb = *b;
      *a = xa * cos_[i] - xb * sin_[i];
      *b = xb * cos_[i] + xa * sin_[i];
    }
  }

  // Rotates one stored row [head_dim] of `dtype` in place by `delta` positions;
  // scratch holds rotary_dim floats.
  void rotate_stored(void* row, DType dtype, int64_t delta, float* scratch) {
    if (delta == 0) return;
    set(delta);
    const int64_t dims = rope_.rotary_dim;
    for (int64_t d = 0; d < dims; ++d) scratch[d] = load_as_float(row, d, dtype);
    rotate(scratch);
    for (int64_t d = 0; d < dims; ++d) store_from_float(row, d, dtype, scratch[d]);
  }

 private:
  const RopeParams& rope_;
  int64_t pairs_;
  int64_t delta_ = 0;
  bool valid_ = false;
  float cos_[kMaxPairs];
  float sin_[kMaxPairs];
};

}  // namespace kvprune::cpu
