// The emulator's side of cuda/simt.cuh: what kernel code sees when the host
// compiler builds it instead of nvcc. Built-in variables, __syncthreads, warp
// shuffles and votes, atomics, fast-math intrinsics, mma.sync and block-wide
// scan/reduce map onto the runtime (emu/runtime.h) or onto plain host code.
// Everything here lives in kvprune::emu, the namespace of the emulated kernels.
#pragma once

#if defined(__CUDACC__)
#error "emu/device.h is for the host compiler; nvcc uses CUDA itself"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <driver_types.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "emu/runtime.h"

// ---- CUDA keywords the host compiler must see differently ---------------------------------
// Static shared memory is declared with KVPRUNE_SHARED (cuda/simt.cuh): a per-block
// allocation from the runtime (block_shared). A plain __shared__ would be one variable
// for every block, never poisoned and outside the limits, so it does not compile here.
#undef __shared__
#define __shared__ __shared___is_not_emulated_declare_static_shared_memory_with_KVPRUNE_SHARED
#define __launch_bounds__(...)
#define threadIdx (::kvprune::emu::detail::t_thread->thread_idx)
#define blockIdx (::kvprune::emu::detail::t_block->block_idx)
#define blockDim (::kvprune::emu::detail::t_block->block_dim)
#define gridDim (::kvprune::emu::detail::t_block->grid_dim)
#define __syncthreads() ::kvprune::emu::detail::syncthreads(__FILE__, __LINE__)

namespace kvprune::emu {

constexpr int warpSize = detail::kWarpSize;

// CUDA's min/max overloads accept mixed operand types (usual arithmetic conversions).
template <typename A, typename B>
constexpr std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <typename A, typename B>
constexpr std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

inline float __expf(float x) { return std::exp(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
inline float __int_as_float(int i) { return __uint_as_float(static_cast<unsigned>(i)); }

// Integer atomics: several host threads may run blocks at once.
template <typename T>
inline T atomicAdd(T* address, T value) {
  static_assert(std::is_integral_v<T>, "the emulator models integer atomics only");
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}

template <typename T>
inline T atomicMin(T* address, T value) {
  static_assert(std::is_integral_v<T>, "the emulator models integer atomics only");
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (value < old &&
         !__atomic_compare_exchange_n(address, &old, value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}

// ---- warp collectives -----------------------------------------------------------------------
namespace detail {

template <typename T>
inline void to_words(const T& value, uint32_t (&words)[3]) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "32- or 64-bit values");
  words[0] = words[1] = words[2] = 0;
  std::memcpy(words, &value, sizeof(T));
}

template <typename T>
inline T from_words(const uint32_t* words) {
  T value;
  std::memcpy(&value, words, sizeof(T));
  return value;
}

}  // namespace detail

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32,
                         const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  if (width != 32) detail::fail_thread("the emulator models __shfl_xor_sync with width 32 only");
  uint32_t in[3], out[2];
  detail::to_words(value, in);
  in[2] = static_cast<uint32_t>(lane_mask);
  detail::warp_collective(detail::Collective::kShuffleXor, mask, file, line, in, 3, out, 2);
  return detail::from_words<T>(out);
}

template <typename T>
inline T __shfl_sync(unsigned mask, T value, int src_lane, int width = 32,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  if (width != 32) detail::fail_thread("the emulator models __shfl_sync with width 32 only");
  uint32_t in[3], out[2];
  detail::to_words(value, in);
  in[2] = static_cast<uint32_t>(src_lane);
  detail::warp_collective(detail::Collective::kShuffleIdx, mask, file, line, in, 3, out, 2);
  return detail::from_words<T>(out);
}

template <typename T>
inline unsigned __match_any_sync(unsigned mask, T value, const char* file = __builtin_FILE(),
                                 int line = __builtin_LINE()) {
  uint32_t in[3], out[1];
  detail::to_words(value, in);
  detail::warp_collective(detail::Collective::kMatchAny, mask, file, line, in, 2, out, 1);
  return out[0];
}

}  // namespace kvprune::emu
