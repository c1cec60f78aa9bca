// Block-wide scan and reduction for the emulator build, with the interface of the
// CUB classes the kernels use under nvcc (cub::BlockScan, cub::BlockReduce with the
// default algorithms, 1-D blocks). CUB does not compile for the host, so these are
// written as ordinary SIMT code: warp shuffles, per-warp totals in the caller's
// TempStorage and one barrier, so the emulator also checks how callers share
// and reuse that storage (reuse needs a __syncthreads in between, as with CUB).
#pragma once

#include "emu/device.h"

namespace kvprune::emu::simt {

template <typename T, int kThreads>
class BlockScan {
  static_assert(kThreads % warpSize == 0, "whole warps");
  static constexpr int kWarps = kThreads / warpSize;

 public:
  struct TempStorage {
    T warp_totals[kWarps];
  };

  explicit BlockScan(TempStorage& storage) : storage_(storage) {}

  void InclusiveSum(T input, T& inclusive) {
    T total;
    scan(input, inclusive, total);
  }
  void ExclusiveSum(T input, T& exclusive, T& block_total) {
    T inclusive;
    scan(input, inclusive, block_total);
    exclusive = inclusive - input;
  }

 private:
  void scan(T input, T& inclusive, T& total) {
    const int lane = static_cast<int>(threadIdx.x) % warpSize;
    const int warp = static_cast<int>(threadIdx.x) / warpSize;
    T x = input;
    for (int offset = 1; offset < warpSize; offset <<= 1) {
      const T up = __shfl_sync(0xffffffffu, x, lane >= offset ? lane - offset : lane);
      if (lane >= offset) x += up;
    }
    if (lane == warpSize - 1) storage_.warp_totals[warp] = x;
    __syncthreads();
    T before = T(), sum = T();
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before += storage_.warp_totals[w];
      sum += storage_.warp_totals[w];
    }
    inclusive = before + x;
    total = sum;
  }

  TempStorage& storage_;
};

template <typename T, int kThreads>
class BlockReduce {
  static_assert(kThreads % warpSize == 0, "whole warps");
  static constexpr int kWarps = kThreads / warpSize;

 public:
  struct TempStorage {
    T warp_sums[kWarps];
  };

  explicit BlockReduce(TempStorage& storage) : storage_(storage) {}

  // The block's sum in thread 0. As with CUB, the other threads' return value is
  // undefined: here it is a recognisable garbage value.
  T Sum(T input) {
    T x = input;
    for (int offset = warpSize / 2; offset > 0; offset >>= 1)
      x += __shfl_xor_sync(0xffffffffu, x, offset);
    const int lane = static_cast<int>(threadIdx.x) % warpSize;
    const int warp = static_cast<int>(threadIdx.x) / warpSize;
    if (lane == 0) storage_.warp_sums[warp] = x;
    __syncthreads();
    if (threadIdx.x != 0) return static_cast<T>(0x5eedbad5eedbad5ull);
    T sum = T();
    for (int w = 0; w < kWarps; ++w) sum += storage_.warp_sums[w];
    return sum;
  }

 private:
  TempStorage& storage_;
};

}  // namespace kvprune::emu::simt
