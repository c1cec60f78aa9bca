// Definitions of the window_scores inner kernels (see window_scores_kernels.h),
// compiled once per instruction set. The including .cpp defines
//   KVPRUNE_ISA_NAMESPACE  a namespace unique to its instruction set
//   KVPRUNE_ISA_NAME       its name, as kvprune::cpu_kernels() reports it
//   KVPRUNE_LANES          floats per vector register (16, 8 or 4)
//   KVPRUNE_ROW_VECS       row vectors per register block (MR)
// and then instantiates `kernels()` under that namespace.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "cpu/fp8_table.h"
#include "cpu/half.h"
#include "cpu/simd.h"
#include "cpu/window_scores_kernels.h"

namespace kvprune::cpu::KVPRUNE_ISA_NAMESPACE {
namespace {

constexpr int kLanes = KVPRUNE_LANES;
using V = simd::Vec<kLanes>;

void convert_row(const void* src, DType dtype, int64_t count, float* dst) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  if (is_fp8(dtype)) {
    const float* table = fp8_table(dtype);
    const uint8_t* bytes = static_cast<const uint8_t*>(src);
    for (int64_t i = 0; i < count; ++i) dst[i] = table[bytes[i]];
    return;
  }
  const uint16_t* bits = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  if (dtype == DType::kBFloat16) {
    for (; i < count; ++i) {
      const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
      std::memcpy(dst + i, &wide, 4);
    }
    return;
  }
#if defined(__F16C__)
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i))));
#endif
  for (; i < count; ++i) dst[i] = fp16_to_float(bits[i]);
}

void pack_keys(const void* k, int64_t token_stride, DType dtype, int64_t head_dim,
               int64_t num_keys, int64_t padded_keys, float* k_chunk) {
  const char* base = static_cast<const char*>(k);
  const int64_t row_bytes = token_stride * dtype_size(dtype);
  for (int64_t j = 0; j < num_keys; ++j)
    convert_row(base + j * row_bytes, dtype, head_dim, k_chunk + j * head_dim);
  std::memset(k_chunk + num_keys * head_dim, 0, (padded_keys - num_keys) * head_dim * sizeof(float));
}

// Copies floats [begin, end) of work.copy_from to work.copy_to past the caches
// (begin and end are multiples of kLanes).
inline void stream_copy_range(const BackgroundWork& work, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += kLanes)
    simd::stream_store<kLanes>(work.copy_to + i, simd::load<kLanes>(work.copy_from + i));
}

// Part `step` of `steps` equal parts of the background work: prefetch the next
// chunk's K rows and the floats read soon after, and copy the finished tile out.
inline void background_slice(const BackgroundWork& work, int64_t step, int64_t steps) {
  constexpr int64_t kLineFloats = 16;  // one 64-byte cache line
  auto part = [&](int64_t total, int64_t unit, int64_t* begin, int64_t* end) {
    const int64_t units = (total + unit - 1) / unit;
    *begin = std::min(total, units * step / steps * unit);
    *end = std::min(total, units * (step + 1) / steps * unit);
  };
  int64_t begin, end;
  const KeyPrefetch& keys = work.next_keys;
  part(keys.rows, 1, &begin, &end);
  for (int64_t r = begin; r < end; ++r)
    for (int64_t byte = 0; byte < keys.row_bytes; byte += 64)
      __builtin_prefetch(keys.base + r * keys.stride_bytes + byte, 0, 2);
  part(work.prefetch_floats, kLineFloats, &begin, &end);
  for (int64_t i = begin; i < end; i += kLineFloats) __builtin_prefetch(work.prefetch + i, 0, 2);
  part(work.copy_floats, kLineFloats, &begin, &end);
  stream_copy_range(work, begin, end);
}

// Background parts per register block: one after each quarter of the D loop.
constexpr int64_t kSlicesPerBlock = 4;

// One MR x NR register block: rows [row0, row0 + kRowVecs*kLanes), keys [key0, key0+6),
// with background parts [first_slice, first_slice + kSlicesPerBlock) of `slices`.
template <int kRowVecs>
inline void logits_block(const float* q_packed, int64_t mp, int64_t head_dim,
                         const float* k_chunk, int64_t k_stride, int64_t key0, int64_t row0,
                         float* tile, const BackgroundWork& background, int64_t first_slice,
                         int64_t slices) {
  V acc[kRowVecs][kKeyBlock] = {};
  const float* k_rows = k_chunk + key0 * k_stride;
  for (int64_t quarter = 0; quarter < kSlicesPerBlock; ++quarter) {
    const int64_t d_end = head_dim * (quarter + 1) / kSlicesPerBlock;
    for (int64_t d = head_dim * quarter / kSlicesPerBlock; d < d_end; ++d) {
      V q[kRowVecs];
#pragma GCC unroll 8
      for (int m = 0; m < kRowVecs; ++m) q[m] = simd::load<kLanes>(q_packed + d * mp + row0 + m * kLanes);
#pragma GCC unroll 8
      for (int n = 0; n < kKeyBlock; ++n) {
        const float k_value = k_rows[n * k_stride + d];
#pragma GCC unroll 8
        for (int m = 0; m < kRowVecs; ++m) acc[m][n] += q[m] * k_value;
      }
    }
    background_slice(background, first_slice + quarter, slices);
  }
#pragma GCC unroll 8
  for (int n = 0; n < kKeyBlock; ++n)
#pragma GCC unroll 8
    for (int m = 0; m < kRowVecs; ++m)
      simd::store<kLanes>(tile + (key0 + n) * mp + row0 + m * kLanes, acc[m][n]);
}

// Calls block(std::integral_constant<int, R>, row0, key0, first_slice, slices) for every
// register block of an [num_keys][mp] tile, in order: full blocks of KVPRUNE_ROW_VECS row
// vectors, then the leftover row vectors one at a time (R = 1); each key block in turn. Block
// b of the walk does background parts [b * kSlicesPerBlock, (b + 1) * kSlicesPerBlock) of
// `slices`.
template <class Block>
void over_register_blocks(int64_t mp, int64_t num_keys, Block block) {
  constexpr int kBlock = KVPRUNE_ROW_VECS;
  const int64_t row_vecs = mp / kLanes;
  const int64_t passes = row_vecs / kBlock + row_vecs % kBlock;  // full blocks, then leftovers
  const int64_t blocks = num_keys / kKeyBlock;
  const int64_t slices = passes * blocks * kSlicesPerBlock;
  int64_t v = 0, pass = 0;
  auto rows = [&](auto vecs) {
    for (int64_t key0 = 0; key0 < num_keys; key0 += kKeyBlock)
      block(vecs, v * kLanes, key0, (pass * blocks + key0 / kKeyBlock) * kSlicesPerBlock, slices);
  };
  for (; v + kBlock <= row_vecs; v += kBlock, ++pass) rows(std::integral_constant<int, kBlock>{});
  for (; v < row_vecs; ++v, ++pass) rows(std::integral_constant<int, 1>{});
}

void logits(const float* q_packed, int64_t mp, int64_t head_dim, const float* k_chunk,
            int64_t k_stride, int64_t num_keys, float* tile, const BackgroundWork& background) {
  over_register_blocks(mp, num_keys, [&](auto vecs, int64_t row0, int64_t key0,
                                         int64_t first_slice, int64_t slices) {
    logits_block<decltype(vecs)::value>(q_packed, mp, head_dim, k_chunk, k_stride, key0, row0,
                                        tile, background, first_slice, slices);
  });
}

#if defined(__AVX512BF16__)
// One MR x NR register block of bf16 pair dot products (vdpbf16ps): rows [row0, row0 +
// kRowVecs*16), keys [key0, key0+6), with background parts [first_slice, first_slice +
// kSlicesPerBlock) of `slices`; the sums scaled by `factor` on the way out.
template <int kRowVecs>
inline void logits_bf16_block(const uint32_t* q_pairs, int64_t mp, int64_t pairs,
                              const uint16_t* k_chunk, int64_t k_stride, int64_t key0,
                              int64_t row0, float factor, float* tile,
                              const BackgroundWork& background, int64_t first_slice,
                              int64_t slices) {
  static_assert(kLanes == 16, "vdpbf16ps on zmm registers: 16 rows per vector");
  __m512 acc[kRowVecs][kKeyBlock];
#pragma GCC unroll 8
  for (int m = 0; m < kRowVecs; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < kKeyBlock; ++n) acc[m][n] = _mm512_setzero_ps();
  const uint16_t* k_rows = k_chunk + key0 * k_stride;
  for (int64_t quarter = 0; quarter < kSlicesPerBlock; ++quarter) {
    const int64_t e_end = pairs * (quarter + 1) / kSlicesPerBlock;
    for (int64_t e = pairs * quarter / kSlicesPerBlock; e < e_end; ++e) {
      __m512bh q[kRowVecs];
#pragma GCC unroll 8
      for (int m = 0; m < kRowVecs; ++m)
        q[m] = (__m512bh)_mm512_loadu_si512(q_pairs + e * mp + row0 + m * kLanes);
#pragma GCC unroll 8
      for (int n = 0; n < kKeyBlock; ++n) {
        uint32_t pair;
        std::memcpy(&pair, k_rows + n * k_stride + 2 * e, sizeof(pair));
        const __m512bh k_pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 8
        for (int m = 0; m < kRowVecs; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], q[m], k_pair);
      }
    }
    background_slice(background, first_slice + quarter, slices);
  }
  const __m512 scale = _mm512_set1_ps(factor);
#pragma GCC unroll 8
  for (int n = 0; n < kKeyBlock; ++n)
#pragma GCC unroll 8
    for (int m = 0; m < kRowVecs; ++m)
      _mm512_storeu_ps(tile + (key0 + n) * mp + row0 + m * kLanes, _mm512_mul_ps(acc[m][n], scale));
}

void logits_bf16(const uint32_t* q_pairs, int64_t mp, int64_t pairs, const uint16_t* k_chunk,
                 int64_t k_stride, int64_t num_keys, float factor, float* tile,
                 const BackgroundWork& background) {
  over_register_blocks(mp, num_keys, [&](auto vecs, int64_t row0, int64_t key0,
                                         int64_t first_slice, int64_t slices) {
    logits_bf16_block<decltype(vecs)::value>(q_pairs, mp, pairs, k_chunk, k_stride, key0, row0,
                                             factor, tile, background, first_slice, slices);
  });
}
constexpr auto kLogitsBf16 = logits_bf16;
#else
constexpr decltype(WindowScoresKernels::logits_bf16) kLogitsBf16 = nullptr;
#endif

void softmax_stats(float* tile, int64_t mp, int64_t num_keys, float* chunk_max, float* chunk_sum) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < mp; r += kLanes) {
    V row_max = simd::splat<kLanes>(neg_inf);
    for (int64_t j = 0; j < num_keys; ++j)
      row_max = simd::vmax<kLanes>(row_max, simd::load<kLanes>(tile + j * mp + r));
    // A fully masked row keeps max -inf but subtracts 0, so its exps are 0 not NaN.
    const V finite_max = row_max == simd::splat<kLanes>(neg_inf) ? V{} : row_max;
    V row_sum = V{};
    for (int64_t j = 0; j < num_keys; ++j) {
      float* line = tile + j * mp + r;
      const V e = simd::exp2<kLanes>(simd::load<kLanes>(line) - finite_max);
      simd::store<kLanes>(line, e);
      row_sum += e;
    }
    simd::store<kLanes>(chunk_max + r, row_max);
    simd::store<kLanes>(chunk_sum + r, row_sum);
  }
}

void chunk_weights(const float* chunk_max, float* chunk_weight, int64_t chunks, int64_t mp,
                   int64_t row_begin, int64_t row_end, int64_t live_rows) {
  typedef double Wide __attribute__((vector_size(kLanes * 8)));  // the total, in double
  const V neg_inf = simd::splat<kLanes>(-std::numeric_limits<float>::infinity());
  for (int64_t r = row_begin; r < row_end; r += kLanes) {
    V row_max = neg_inf;
    for (int64_t c = 0; c < chunks; ++c)
      row_max = simd::vmax<kLanes>(row_max, simd::load<kLanes>(chunk_max + c * mp + r));
    const V finite_max = row_max == neg_inf ? V{} : row_max;
    Wide total = Wide{};
    for (int64_t c = 0; c < chunks; ++c) {  // chunk_weight: chunk sums -> 2^(chunk max - row max)
      float* weight = chunk_weight + c * mp + r;
      const V scale = simd::exp2<kLanes>(simd::load<kLanes>(chunk_max + c * mp + r) - finite_max);
      total += __builtin_convertvector(simd::load<kLanes>(weight) * scale, Wide);
      simd::store<kLanes>(weight, scale);
    }
    V live = V{};  // 1 on rows that are real and see a key
    for (int i = 0; i < kLanes; ++i) live[i] = r + i < live_rows && total[i] > 0.0 ? 1.f : 0.f;
    const Wide safe_total = total > Wide{} ? total : Wide{} + 1.0;
    const V inverse = live / __builtin_convertvector(safe_total, V);
    for (int64_t c = 0; c < chunks; ++c) {
      float* weight = chunk_weight + c * mp + r;
      simd::store<kLanes>(weight, simd::load<kLanes>(weight) * inverse);
    }
  }
}

void stream_copy(const BackgroundWork& work) {
  stream_copy_range(work, 0, work.copy_floats);
  simd::stream_fence();
}

void exp_minus(float* tile, int64_t mp, int64_t num_keys, const float* lse2) {
  for (int64_t j = 0; j < num_keys; ++j)
    for (int64_t r = 0; r < mp; r += kLanes) {
      float* line = tile + j * mp + r;
      simd::store<kLanes>(line, simd::exp2<kLanes>(simd::load<kLanes>(line) - simd::load<kLanes>(lse2 + r)));
    }
}

void reduce_columns(const float* tile, int64_t mp, int64_t num_keys, const float* weight,
                    int64_t group, int64_t window, GqaReduce reduce, float* out) {
  if (reduce != GqaReduce::kMax) {
    const float divisor = reduce == GqaReduce::kMean ? static_cast<float>(group) : 1.f;
    for (int64_t j = 0; j < num_keys; ++j) {
      V total = V{};
      for (int64_t r = 0; r < mp; r += kLanes)
        total += simd::load<kLanes>(tile + j * mp + r) * simd::load<kLanes>(weight + r);
      out[j] = simd::horizontal_sum<kLanes>(total) / divisor;
    }
    return;
  }
  for (int64_t j = 0; j < num_keys; ++j) {
    const float* line = tile + j * mp;
    float best = 0.f;  // sums of probabilities are >= 0
    for (int64_t h = 0; h < group; ++h) {
      float head_sum = 0.f;
      for (int64_t i = h * window; i < (h + 1) * window; ++i) head_sum += line[i] * weight[i];
      best = head_sum > best ? head_sum : best;
    }
    out[j] = best;
  }
}

void column_max(const float* tile, int64_t block_rows, int64_t num_keys, int64_t row0,
                int64_t live_rows, int64_t window, float* head_max) {
  const int64_t row_end = std::min(row0 + block_rows, live_rows);
  for (int64_t h = row0 / window; h * window < row_end; ++h) {
    const int64_t begin = std::max(row0, h * window) - row0;
    const int64_t end = std::min(row_end, (h + 1) * window) - row0;
    float* best = head_max + h * kChunkKeys;
    for (int64_t j = 0; j < num_keys; ++j) {
      const float* line = tile + j * block_rows;
      V acc = V{};  // probabilities are >= 0
      int64_t r = begin;
      for (; r + kLanes <= end; r += kLanes) acc = simd::vmax<kLanes>(simd::load<kLanes>(line + r), acc);
      float m = best[j];
      for (; r < end; ++r) m = line[r] > m ? line[r] : m;
      for (int i = 0; i < kLanes; ++i) m = acc[i] > m ? acc[i] : m;
      best[j] = m;
    }
  }
}

}  // namespace

const WindowScoresKernels& kernels() {
  static const WindowScoresKernels table{KVPRUNE_ISA_NAME,
                                          pack_keys,     logits,      kLogitsBf16,
                                          softmax_stats, chunk_weights, stream_copy,
                                          exp_minus,     reduce_columns, column_max};
  return table;
}

}  // namespace kvprune::cpu::KVPRUNE_ISA_NAMESPACE
