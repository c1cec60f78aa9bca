// Small helpers shared by the CUDA launchers of pool_scores, select_keep,
// streaming_keep and gather_kv.
#pragma once


#include <cstdint>

#include "cuda/simt.cuh"
#include "kvprune/status.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace cuda_detail {

template <typename T>
constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// Launch configurations use a flat 1-D grid; this is the most blocks it can hold.
constexpr int64_t kMaxGridBlocks = 0x7fffffff;

// Status of the launches enqueued so far (call right after them).
inline Status launch_status() {
  return simt::get_last_error() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

// Valid length of batch row b: seq_lens[b] clamped to [0, length], or length.
// seq_lens: [batch] int32 or null.
__device__ __forceinline__ int64_t valid_length(const int32_t* __restrict__ seq_lens, int64_t b,
                                                int64_t length) {
  if (seq_lens == nullptr) return length;
  const int64_t n = __ldg(seq_lens + b);
  return n < 0 ? 0 : (n > length ? length : n);
}

// Unsigned integer type of exactly kBytes bytes (2, 4, 8 or 16), used to copy
// raw element bytes with one load/store per vector.
template <int kBytes>
struct VecOf;
template <>
struct VecOf<16> {
  using type = uint4;
};
template <>
struct VecOf<8> {
  using type = uint2;
};
template <>
struct VecOf<4> {
  using type = unsigned int;
};
template <>
struct VecOf<2> {
  using type = unsigned short;
};
template <>
struct VecOf<1> {
  using type = unsigned char;
};

}  // namespace cuda_detail
KVPRUNE_CUDA_NAMESPACE_END
