// CPU gather_kv: out[b,h,t,:] = src[b,h,keep_idx[b,h,t],:] for K and V; an index
// outside [0, length) writes a zero row. Rows are copied as raw bytes, so every
// dtype shares one path. Parallel over (batch, head, token chunk).
// With p.rope.rotary_dim > 0 each gathered K row is then re-rotated from position
// keep_idx[t] to position t (cpu/rope.h).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/validate.h"
#include "core/validate_decode.h"
#include "cpu/parallel.h"
#include "cpu/populate.h"
#include "cpu/rope.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

// Tokens per task: about this many bytes of K and V copied.
constexpr int64_t kBytesPerTask = 1 << 16;

// Source rows are prefetched this many tokens ahead of the copy.
constexpr int64_t kPrefetchTokens = 8;

// Tokens [t0, t1) of row (b, h). src: [batch, heads, length, head_dim];
// dst: [batch, heads, budget, head_dim]; idx: [budget] indices of this row;
// elem and row_bytes in bytes; fresh_dst: populate the destination pages first.
void gather_tokens(const ConstTokens& src, const MutableTokens& dst, const int32_t* idx,
                   int64_t b, int64_t h, int64_t t0, int64_t t1, int64_t length, int64_t elem,
                   int64_t row_bytes, bool fresh_dst) {
  const char* src_row = static_cast<const char*>(src.data) +
                        (b * src.batch_stride + h * src.head_stride) * elem;
  char* dst_row =
      static_cast<char*>(dst.data) + (b * dst.batch_stride + h * dst.head_stride) * elem;
  const int64_t src_stride = src.token_stride * elem, dst_stride = dst.token_stride * elem;
  if (fresh_dst)
    cpu::populate_for_write(dst_row + t0 * dst_stride, (t1 - 1 - t0) * dst_stride + row_bytes);
  auto prefetch = [&](int64_t t) {
    const int64_t j = idx[t];
    if (j < 0 || j >= length) return;
    for (int64_t byte = 0; byte < row_bytes; byte += 64)
      __builtin_prefetch(src_row + j * src_stride + byte);
  };
  for (int64_t t = t0; t < std::min(t1, t0 + kPrefetchTokens); ++t) prefetch(t);
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kPrefetchTokens < t1) prefetch(t + kPrefetchTokens);
    char* out = dst_row + t * dst_stride;
    const int64_t j = idx[t];
    if (j >= 0 && j < length) {
      std::memcpy(out, src_row + j * src_stride, static_cast<size_t>(row_bytes));
    } else {
      std::memset(out, 0, static_cast<size_t>(row_bytes));
    }
  }
}

// Fused re-rotation of the gathered K rows [t0, t1) of row (b, h): from position
// idx[t] to position t. Zero (padding) rows stay zero.
void rotate_gathered(const GatherKvParams& p, const int32_t* idx, int64_t b, int64_t h,
                     int64_t t0, int64_t t1, int64_t elem) {
  cpu::RopeAngles angles(p.rope);
  float scratch[2 * cpu::RopeAngles::kMaxPairs];
  char* dst_row = static_cast<char*>(p.out_k.data) +
                  (b * p.out_k.batch_stride + h * p.out_k.head_stride) * elem;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t j = idx[t];
    if (j < 0 || j >= p.length) continue;
    angles.rotate_stored(dst_row + t * p.out_k.token_stride * elem, p.dtype, t - j, scratch);
  }
}

}  // namespace

Status gather_kv_cpu(const GatherKvParams& p, const CpuExecutor& exec) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (auto s = validate(p.rope, p.head_dim); s != Status::kOk) return s;
  if (!cpu::RopeAngles::supported(p.rope)) return Status::kUnsupportedHeadDim;
  const int64_t rows = p.batch * p.heads;
  if (rows * p.budget == 0) return Status::kOk;

  const int64_t elem = dtype_size(p.dtype);
  const int64_t row_bytes = p.head_dim * elem;
  const int64_t chunk = std::clamp<int64_t>(kBytesPerTask / (2 * row_bytes), 1, p.budget);
  const int64_t chunks_per_row = (p.budget + chunk - 1) / chunk;
  cpu::parallel_for(exec, rows * chunks_per_row, 1, [&](int64_t begin, int64_t end, int) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / chunks_per_row;
      const int64_t b = row / p.heads, h = row % p.heads;
      const int64_t t0 = (task % chunks_per_row) * chunk;
      const int64_t t1 = std::min(t0 + chunk, p.budget);
      const int32_t* idx = p.keep_idx + row * p.budget;  // [budget]
      gather_tokens(p.k, p.out_k, idx, b, h, t0, t1, p.length, elem, row_bytes, p.fresh_outputs);
      gather_tokens(p.v, p.out_v, idx, b, h, t0, t1, p.length, elem, row_bytes, p.fresh_outputs);
      if (p.rope.rotary_dim > 0) rotate_gathered(p, idx, b, h, t0, t1, elem);
    }
  });
  return Status::kOk;
}

}  // namespace kvprune
