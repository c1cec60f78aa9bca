// Stride-1 1-D pooling of one score row (DESIGN §1, stage 3). pool_scores and the
// fused pooling of select_keep both call pool_row, so the rule exists once.
//
// Both modes cover, for output i, the inputs j in [i-r-shift, i+r-shift] ∩ [0, n)
// (r = kernel_size / 2, 0 <= shift <= r; shift 0 is the centred pool):
//   max: out[i] = max of those in[j]   (padding never wins)
//   avg: out[i] = sum of those in[j] / kernel_size
//        (count_include_pad: padding counts as zeros)
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "kvprune/params.h"

namespace kvprune::cpu {

// in: [n], out: [n], no aliasing. O(n log k), no scratch besides `out`: first
// out[i] = max of in[i, i + width) ∩ [0, n), with a width that grows by up to
// itself per pass (vectorisable), then a move right by r + shift places each
// window [i - r - shift, i + r - shift] at i.
inline void max_pool_row(const float* in, int64_t n, int64_t kernel_size, int64_t shift,
                         float* out) {
  const int64_t r = kernel_size / 2;
  const int64_t lag = r + shift;  // output i starts its window at input i - lag
  std::copy(in, in + n, out);
  for (int64_t width = 1; width < kernel_size;) {
    const int64_t step = std::min(width, kernel_size - width);
    for (int64_t i = 0; i + step < n; ++i) out[i] = std::max(out[i], out[i + step]);
    width += step;
  }
  if (n > lag) std::copy_backward(out, out + (n - lag), out + n);
  // The first `lag` outputs see only the row's start, up to i + r - shift (>= i):
  // a running prefix max.
  float running = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0, j = 0; i < std::min(lag, n); ++i) {
    for (; j <= std::min(i + r - shift, n - 1); ++j) running = std::max(running, in[j]);
    out[i] = running;
  }
}

// in: [n], out: [n], no aliasing. Direct sums in double, O(n k): a running sum
// would cancel catastrophically when a large score leaves the window, and the
// direct sum in ascending position order rounds exactly like reference.py.
// Tiles of outputs keep the accumulators in L1 and the loops vectorisable.
inline void avg_pool_row(const float* in, int64_t n, int64_t kernel_size, int64_t shift,
                         float* out) {
  constexpr int64_t kTile = 256;
  const int64_t r = kernel_size / 2;
  double sum[kTile];
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t t1 = std::min(t0 + kTile, n);
    std::fill(sum, sum + (t1 - t0), 0.0);
    for (int64_t d = -r - shift; d <= r - shift; ++d) {
      // outputs i in [t0, t1) whose neighbour i + d lies in [0, n)
      for (int64_t i = std::max(t0, -d); i < std::min(t1, n - d); ++i) sum[i - t0] += in[i + d];
    }
    for (int64_t i = t0; i < t1; ++i) {
      out[i] = static_cast<float>(sum[i - t0] / static_cast<double>(kernel_size));
    }
  }
}

// in: [n] raw scores, out: [n] pooled, no aliasing; kernel_size odd and >= 1,
// 0 <= shift <= kernel_size / 2.
inline void pool_row(const float* in, int64_t n, int64_t kernel_size, int64_t shift,
                     PoolMode mode, float* out) {
  if (mode == PoolMode::kMax) {
    max_pool_row(in, n, kernel_size, shift, out);
  } else {
    avg_pool_row(in, n, kernel_size, shift, out);
  }
}

}  // namespace kvprune::cpu
