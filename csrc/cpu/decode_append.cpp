// CPU streaming_append: writes the new tokens of every (batch, KV head) into the
// fixed-capacity cache (in order, then the StreamingLLM ring or the H2O slots),
// records their positions in slot_pos and advances seq_lens. O(1) per token.
// Parallel over (batch, head, token).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/validate_decode.h"
#include "cpu/parallel.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

constexpr int64_t kMaxTokensPerTask = 64;

// Destination slot of stream position `pos` (token t of the call, which writes
// positions [first, first + num_new)), or -1 when the token is not written.
int64_t append_slot(const StreamingAppendParams& p, const int32_t* row_slots, int64_t first,
                    int64_t pos, int64_t t) {
  const int64_t ring = p.capacity - p.n_sink;
  if (pos < p.capacity && row_slots == nullptr) {
    // In-order fill; a later token of this call may take the same ring slot.
    if (pos >= p.n_sink && pos + ring < first + p.num_new) return -1;
    return pos;
  }
  if (row_slots == nullptr) {
    if (pos + ring < first + p.num_new) return -1;  // overwritten within this call
    return p.n_sink + (pos - p.n_sink) % ring;
  }
  if (pos < p.capacity) return pos;
  const int64_t slot = row_slots[t];
  return slot >= 0 && slot < p.capacity ? slot : -1;
}

}  // namespace

Status streaming_append_cpu(const StreamingAppendParams& p, const CpuExecutor& exec) {
  if (auto s = validate(p); s != Status::kOk) return s;
  for (int64_t b = 0; b < p.batch; ++b)
    if (p.seq_lens[b] < 0 || p.seq_lens[b] > INT32_MAX - p.num_new) return Status::kInvalidArgument;
  const int64_t rows = p.batch * p.kv_heads;
  if (rows * p.num_new > 0) {
    const int64_t elem = dtype_size(p.dtype);
    const size_t row_bytes = static_cast<size_t>(p.head_dim * elem);
    const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(kMaxTokensPerTask, (1 << 15) / row_bytes));
    cpu::parallel_for(exec, rows * p.num_new, grain, [&](int64_t begin, int64_t end, int) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task / p.num_new, t = task % p.num_new;
        const int64_t b = row / p.kv_heads, h = row % p.kv_heads;
        const int64_t first = p.seq_lens[b];
        const int32_t* row_slots = p.slots != nullptr ? p.slots + row * p.num_new : nullptr;
        const int64_t slot = append_slot(p, row_slots, first, first + t, t);
        if (slot < 0) continue;
        for (const auto& [src, dst] : {std::pair{&p.k_new, &p.k_cache}, std::pair{&p.v_new, &p.v_cache}}) {
          const char* from = static_cast<const char*>(src->data) +
                             (b * src->batch_stride + h * src->head_stride + t * src->token_stride) * elem;
          char* to = static_cast<char*>(dst->data) +
                     (b * dst->batch_stride + h * dst->head_stride + slot * dst->token_stride) * elem;
          std::memcpy(to, from, row_bytes);
        }
        p.slot_pos[row * p.capacity + slot] = static_cast<int32_t>(first + t);
      }
    });
  }
  for (int64_t b = 0; b < p.batch; ++b) p.seq_lens[b] += static_cast<int32_t>(p.num_new);
  return Status::kOk;
}

}  // namespace kvprune
