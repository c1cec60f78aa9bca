// Device helpers of the decode ops: element conversions and the RoPE delta
// rotation of token rows (RopeParams in params.h). One warp rotates one row.
#pragma once


#include <cmath>
#include <cstdint>

#include "cuda/simt.cuh"
#include "kvprune/params.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace cuda_detail {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// RopeParams flattened for the device.
struct RopeArgs {
  const float* inv_freq;  // [pairs] or null
  double freq_exponent;   // log2(theta) * 2 / rotary_dim: inv_freq[i] = 2^(-i * freq_exponent)
  int pairs;              // rotary_dim / 2
  bool neox;

  static RopeArgs from(const RopeParams& r) {
    return {r.inv_freq, std::log2(r.theta) * 2.0 / static_cast<double>(r.rotary_dim),
            static_cast<int>(r.rotary_dim / 2), r.layout == RopeLayout::kNeox};
  }
};

// cos/sin of delta * inv_freq[i]: argument formed and reduced to [-pi, pi] in double
// precision (positions reach 10^6), then fp32 sincosf (accurate on that range).
__device__ __forceinline__ void rope_cos_sin(const RopeArgs& r, int64_t delta, int i, float* c,
                                             float* s) {
  const double inv_freq = r.inv_freq != nullptr ? static_cast<double>(__ldg(r.inv_freq + i))
                                                : exp2(-static_cast<double>(i) * r.freq_exponent);
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  double angle = static_cast<double>(delta) * inv_freq;
  angle -= kTwoPi * rint(angle / kTwoPi);
  sincosf(static_cast<float>(angle), s, c);
}

// Rotates one row x [head_dim] of T in place by `delta` positions; called by all
// 32 lanes of a warp (lane = threadIdx.x % 32), each lane owning distinct pairs.
template <typename T>
__device__ __forceinline__ void rope_rotate_row_warp(T* x, const RopeArgs& r, int64_t delta, int lane) {
  for (int i = lane; i < r.pairs; i += 32) {
    const int ia = r.neox ? i : 2 * i;
    const int ib = r.neox ? i + r.pairs : 2 * i + 1;
    float c, s;
    rope_cos_sin(r, delta, i, &c, &s);
    const float a = to_float(x[ia]), b = to_float(x[ib]);
    x[ia] = from_float<T>(a * c - b * s);
    x[ib] = from_float<T>(b * c + a * s);
  }
}

// Token rows [rows = batch * heads * length] of a strided tensor (element strides),
// each rotated by delta_of(b, h, t) when that returns true. One warp per row.
template <typename T, typename DeltaOf>
__global__ __launch_bounds__(256) void rope_rows_kernel(T* data, int64_t batch_stride,
                                                        int64_t head_stride, int64_t token_stride,
                                                        int64_t heads, int64_t length, int64_t rows,
                                                        RopeArgs r, DeltaOf delta_of) {
  const int lane = threadIdx.x & 31;
  const int64_t warps_per_grid = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       row < rows; row += warps_per_grid) {
    const int64_t t = row % length;
    const int64_t bh = row / length;
    const int64_t b = bh / heads, h = bh % heads;
    int64_t delta = 0;
    if (!delta_of(b, h, t, &delta) || delta == 0) continue;
    rope_rotate_row_warp(data + b * batch_stride + h * head_stride + t * token_stride, r, delta, lane);
  }
}

// Grid for rope_rows_kernel: 8 warps per CTA, at most 65535 * 8 CTAs' worth (grid-stride).
inline unsigned rope_rows_grid(int64_t rows) {
  const int64_t blocks = (rows + 7) / 8;
  return static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8);
}

}  // namespace cuda_detail
KVPRUNE_CUDA_NAMESPACE_END
