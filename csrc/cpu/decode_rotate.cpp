// CPU rerotate_keys: k[b,h,s,:] rotated in place from old_pos[b,h,s] to
// new_pos[b,h,s] (RopeParams); slots with a negative position are skipped.
// Parallel over (batch, head, token chunk).
#include <algorithm>
#include <cstdint>

#include "core/validate_decode.h"
#include "cpu/parallel.h"
#include "cpu/rope.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

constexpr int64_t kTokensPerTask = 256;

}  // namespace

Status rerotate_keys_cpu(const RerotateKeysParams& p, const CpuExecutor& exec) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (!cpu::RopeAngles::supported(p.rope)) return Status::kUnsupportedHeadDim;
  const int64_t rows = p.batch * p.heads;
  if (rows * p.length == 0) return Status::kOk;

  const int64_t elem = dtype_size(p.dtype);
  const int64_t chunks_per_row = (p.length + kTokensPerTask - 1) / kTokensPerTask;
  cpu::parallel_for(exec, rows * chunks_per_row, 1, [&](int64_t begin, int64_t end, int) {
    cpu::RopeAngles angles(p.rope);
    float scratch[2 * cpu::RopeAngles::kMaxPairs];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / chunks_per_row;
      const int64_t b = row / p.heads, h = row % p.heads;
      const int64_t t0 = (task % chunks_per_row) * kTokensPerTask;
      const int64_t t1 = std::min(t0 + kTokensPerTask, p.length);
      const int32_t* old_pos = p.old_pos + b * p.old_pos_batch_stride + h * p.old_pos_head_stride;
      const int32_t* new_pos = p.new_pos + b * p.new_pos_batch_stride + h * p.new_pos_head_stride;
      char* k_row = static_cast<char*>(p.k.data) + (b * p.k.batch_stride + h * p.k.head_stride) * elem;
      for (int64_t t = t0; t < t1; ++t) {
        if (old_pos[t] < 0 || new_pos[t] < 0) continue;
        angles.rotate_stored(k_row + t * p.k.token_stride * elem, p.dtype,
                             static_cast<int64_t>(new_pos[t]) - old_pos[t], scratch);
      }
    }
  });
  return Status::kOk;
}

}  // namespace kvprune
