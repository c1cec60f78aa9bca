// Block-level pieces of a multi-CTA radix select over fp32 scores.
//
// Scores map to uint32 keys whose unsigned order is the float order. The
// threshold key T (the value of the k-th largest key) is found one 8-bit digit
// at a time, most significant first: pass p histograms digit p of the keys whose
// higher digits equal the digits already chosen, then the chosen digit is the one
// where the running count from the top reaches the number still wanted. After
// kRadixPasses passes the chosen digits spell T and the number still wanted is
// how many keys equal to T belong to the top k.
#pragma once

#include "cuda/simt.cuh"


#include <cstdint>

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace cuda_detail {

constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
constexpr int kRadixPasses = 32 / kRadixBits;
constexpr uint32_t kNoDigit = kRadixBins;  // "key not counted in this pass"

// Order-preserving key: a < b (as floats) <=> key(a) < key(b). -0.0 counts as
// +0.0; NaN (not expected) ranks below every number, like the CPU backend.
__device__ __forceinline__ uint32_t order_key(float value) {
  if (value != value) value = -__int_as_float(0x7f800000);  // NaN -> -inf
  const uint32_t bits = value == 0.f ? 0u : __float_as_uint(value);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Digit `pass` of key (pass 0 = most significant).
__device__ __forceinline__ uint32_t radix_digit(uint32_t key, int pass) {
  return (key >> (32 - kRadixBits * (pass + 1))) & (kRadixBins - 1);
}

// Whether key's digits 0..pass-1 equal `prefix` (which holds pass digits).
__device__ __forceinline__ bool has_prefix(uint32_t key, int pass, uint32_t prefix) {
  return pass == 0 || (key >> (32 - kRadixBits * pass)) == prefix;
}

// Adds one to block_hist[digit] for every lane whose digit != kNoDigit. All 32
// lanes of the warp must call it together; lanes with equal digits are merged
// into one shared-memory atomic (scores are concentrated in few exponents).
// block_hist: [kRadixBins] in shared memory.
__device__ __forceinline__ void count_digit(uint32_t* block_hist, uint32_t digit) {
  const unsigned same = __match_any_sync(0xffffffffu, digit);
  const int leader = __ffs(same) - 1;
  if (digit != kNoDigit && leader == static_cast<int>(threadIdx.x % 32))
    atomicAdd(block_hist + digit, static_cast<uint32_t>(__popc(same)));
}

// Digits chosen so far and how many of the wanted keys are still to be found
// among the keys that carry them.
struct RadixThreshold {
  uint32_t prefix;     // chosen digits, most significant first
  uint32_t remaining;  // >= 1: wanted keys with exactly this prefix
};

template <int kBlock>
struct RadixResolveStorage {
  typename simt::BlockScan<uint32_t, kBlock>::TempStorage scan;
  uint32_t digit;
  uint32_t above;
};

// Replays the digit choices of passes [0, passes) from the row's finished global
// histograms. row_hist: [kRadixPasses, kRadixBins], complete for those passes.
// wanted >= 1 and must not exceed the number of keys counted in pass 0.
// Every thread of the block must call it. When passes > 0 it ends with a
// barrier, so `storage` may be reused right after. All CTAs of a row get the
// same answer.
template <int kBlock>
__device__ RadixThreshold resolve_threshold(const uint32_t* row_hist, int passes, uint32_t wanted,
                                            RadixResolveStorage<kBlock>& storage) {
  static_assert(kBlock == kRadixBins, "one histogram bin per thread");
  RadixThreshold threshold{0u, wanted};
  for (int pass = 0; pass < passes; ++pass) {
    // Thread t holds digit 255 - t, so the inclusive scan counts keys from the top.
    const uint32_t digit = kRadixBins - 1 - threadIdx.x;
    const uint32_t count = row_hist[pass * kRadixBins + digit];
    uint32_t at_or_above;
    simt::BlockScan<uint32_t, kBlock>(storage.scan).InclusiveSum(count, at_or_above);
    const uint32_t above = at_or_above - count;
    if (above < threshold.remaining && at_or_above >= threshold.remaining) {
      storage.digit = digit;  // exactly one thread: the running count crosses here
      storage.above = above;
    }
    __syncthreads();
    threshold.prefix = (threshold.prefix << kRadixBits) | storage.digit;
    threshold.remaining -= storage.above;
    __syncthreads();  // storage is rewritten by the next pass or the caller
  }
  return threshold;
}

}  // namespace cuda_detail
KVPRUNE_CUDA_NAMESPACE_END
