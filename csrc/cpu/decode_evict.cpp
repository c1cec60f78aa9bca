// CPU h2o_evict: per (batch, KV head), the slots the next `num` tokens go to.
// In-order positions keep their slot; beyond capacity the best candidate is
// evicted (empty hole first, then the lowest H2O score outside the sinks and the
// recent window, ties to the lowest position). O(num * capacity) per row.
#include <algorithm>
#include <cstdint>

#include "core/validate_decode.h"
#include "cpu/parallel.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

// Candidate order: holes (by slot) before occupied slots (by score, then position).
struct Candidate {
  int64_t slot = -1;
  bool hole = false;
  float score = 0.f;
  int64_t pos = 0;

  bool better_than(const Candidate& o) const {
    if (o.slot < 0) return true;
    if (hole != o.hole) return hole;
    if (hole) return slot < o.slot;
    if (score != o.score) return score < o.score;
    return pos < o.pos;
  }
};

void evict_row(const H2oEvictParams& p, int64_t row, int64_t n) {
  float* scores = p.h2o_scores + row * p.capacity;  // [capacity]
  int32_t* slot_pos = p.slot_pos + row * p.capacity;
  int32_t* next = p.next_slot + row * p.num;  // [num]
  for (int64_t t = 0; t < p.num; ++t) {
    const int64_t pos = n + t;
    if (pos < p.capacity) {
      next[t] = static_cast<int32_t>(pos);
      continue;
    }
    Candidate best;
    for (int64_t s = 0; s < p.capacity; ++s) {
      const int64_t sp = slot_pos[s];
      Candidate c{s, sp < 0, scores[s], sp};
      if (c.hole ? s >= n : (sp < p.n_sink || sp >= n - p.recent)) continue;
      bool taken = false;  // chosen earlier in this call (now a hole)
      for (int64_t u = 0; u < t; ++u) taken |= next[u] == s;
      if (!taken && c.better_than(best)) best = c;
    }
    next[t] = static_cast<int32_t>(best.slot);
    if (best.slot >= 0) {
      slot_pos[best.slot] = -1;
      scores[best.slot] = 0.f;
    }
  }
  // Evicted slots in ascending order (so a repeated call returns the same list).
  const int64_t first_evicted = std::clamp<int64_t>(p.capacity - n, 0, p.num);
  std::sort(next + first_evicted, next + p.num, [](int32_t a, int32_t b) {
    return static_cast<uint32_t>(a) < static_cast<uint32_t>(b);  // -1 (none) last
  });
}

}  // namespace

Status h2o_evict_cpu(const H2oEvictParams& p, const CpuExecutor& exec) {
  if (auto s = validate(p); s != Status::kOk) return s;
  for (int64_t b = 0; b < p.batch; ++b)
    if (p.seq_lens[b] < 0) return Status::kInvalidArgument;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / (p.capacity * p.num));
  cpu::parallel_for(exec, p.batch * p.heads, grain, [&](int64_t begin, int64_t end, int) {
    for (int64_t row = begin; row < end; ++row) evict_row(p, row, p.seq_lens[row / p.heads]);
  });
  return Status::kOk;
}

}  // namespace kvprune
