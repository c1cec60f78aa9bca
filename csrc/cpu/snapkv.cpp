// CPU snapkv: window scores, pooled selection and gather in one pass over the heads.
//
// The score loop (cpu/window_scores_driver.h) finishes one (batch, KV head) row
// at a time. As soon as a row is final it is selected (pooling + top-k, on the
// calling thread) and its K/V rows join the "in flight" set, which the next chunk
// loop gathers in small pieces: each chunk step first prefetches its piece's
// source rows during the chunk's logits, then copies them. The gather's memory
// traffic thus runs under the score arithmetic of the following heads; only the
// last row's gather runs on its own (in parallel) at the end.
//
// Workspace: [scores B*Hkv*N fp32][window_scores scratch][select scratch][ready rows].
#include <algorithm>
#include <cstdint>

#include "core/validate.h"
#include "cpu/gather_rows.h"
#include "cpu/select_rows.h"
#include "cpu/window_scores_driver.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

constexpr size_t kAlign = 64;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Byte offsets of the workspace parts.
struct SnapKvLayout {
  size_t scores = 0, score_scratch = 0, select_scratch = 0, ready_rows = 0, total = 0;

  SnapKvLayout(const SnapKvParams& p, const CpuExecutor& exec) {
    const int64_t rows = p.scores.batch * p.scores.kv_heads;
    size_t at = 0;
    scores = at;
    at += align_up(static_cast<size_t>(rows * p.scores.length) * sizeof(float));
    score_scratch = at;
    at += align_up(window_scores_workspace_bytes_cpu(p.scores, exec));
    select_scratch = at;
    at += align_up(static_cast<size_t>(cpu::select_row_scratch_floats(p.select)) * sizeof(float));
    ready_rows = at;
    at += align_up(static_cast<size_t>(rows) * sizeof(int64_t));
    total = at;
  }
};

// Selects each scores row as it becomes final and gathers its K/V rows in the
// pieces of the following chunk loop.
class GatherBehindScores final : public cpu::ScoredRowSink {
 public:
  GatherBehindScores(const SelectKeepParams& select, const GatherKvParams& gather,
                     float* select_scratch, int64_t* ready_rows)
      : select_(select), gather_(gather), select_scratch_(select_scratch), ready_rows_(ready_rows) {}

  void row_ready(int64_t row) override {
    cpu::select_keep_row(select_, row, select_scratch_);
    ready_rows_[ready_count_++] = row;
  }

  void loop_begin(int64_t pieces) override {
    flight_begin_ = gathered_;
    flight_end_ = ready_count_;
    gathered_ = ready_count_;
    pieces_ = pieces;
  }

  // Hints for the piece's first row segment (a piece rarely spans two rows).
  void prefetch_piece(int64_t piece, cpu::BackgroundWork* background) override {
    int64_t t0, t1;
    piece_tokens(piece, &t0, &t1);
    if (t0 == t1) return;
    const int64_t row = ready_rows_[flight_begin_ + t0 / gather_.budget];
    const int64_t first = t0 % gather_.budget;
    const int64_t count = std::min(t1 - t0, gather_.budget - first);
    const int32_t* idx = gather_.keep_idx + row * gather_.budget + first;
    background->row_lists[0] = row_list(gather_.k, row, idx, count);
    background->row_lists[1] = row_list(gather_.v, row, idx, count);
  }

  void run_piece(int64_t piece) override {
    int64_t t0, t1;
    piece_tokens(piece, &t0, &t1);
    while (t0 < t1) {
      const int64_t row = ready_rows_[flight_begin_ + t0 / gather_.budget];
      const int64_t first = t0 % gather_.budget;
      const int64_t last = std::min(gather_.budget, first + (t1 - t0));
      cpu::gather_row_tokens(gather_, row, first, last);
      t0 += last - first;
    }
  }

  void finish(const CpuExecutor& exec) override {
    cpu::gather_row_list(gather_, ready_rows_ + gathered_, ready_count_ - gathered_, exec);
    gathered_ = ready_count_;
  }

 private:
  // Tokens [t0, t1) of the in-flight rows (laid end to end) that `piece` copies.
  void piece_tokens(int64_t piece, int64_t* t0, int64_t* t1) const {
    const int64_t total = (flight_end_ - flight_begin_) * gather_.budget;
    *t0 = total * piece / pieces_;
    *t1 = total * (piece + 1) / pieces_;
  }

  cpu::RowListPrefetch row_list(const ConstTokens& src, int64_t row, const int32_t* idx,
                                int64_t count) const {
    const int64_t elem = dtype_size(gather_.dtype);
    const int64_t b = row / gather_.heads, h = row % gather_.heads;
    cpu::RowListPrefetch list;
    list.base = static_cast<const char*>(src.data) + (b * src.batch_stride + h * src.head_stride) * elem;
    list.stride_bytes = src.token_stride * elem;
    list.idx = idx;
    list.count = count;
    list.limit = gather_.length;
    list.row_bytes = gather_.head_dim * elem;
    return list;
  }

  const SelectKeepParams& select_;
  const GatherKvParams& gather_;
  float* select_scratch_;    // [select_row_scratch_floats]
  int64_t* ready_rows_;      // [batch * kv_heads] rows in the order they became final
  int64_t ready_count_ = 0;  // rows selected so far
  int64_t gathered_ = 0;     // ready rows handed to a loop (or finished)
  int64_t flight_begin_ = 0, flight_end_ = 0;  // ready rows the current loop gathers
  int64_t pieces_ = 1;
};

}  // namespace

size_t snapkv_workspace_bytes_cpu(const SnapKvParams& p, const CpuExecutor& exec) {
  if (validate_sizes(p.scores) != Status::kOk || validate_sizes(p.select) != Status::kOk) return 0;
  return SnapKvLayout(p, exec).total;
}

Status snapkv_cpu(const SnapKvParams& params, void* workspace, size_t workspace_bytes,
                  const CpuExecutor& exec) {
  if (auto s = validate_agreement(params); s != Status::kOk) return s;
  if (validate_sizes(params.scores) != Status::kOk || validate_sizes(params.select) != Status::kOk)
    return Status::kInvalidArgument;
  const SnapKvLayout layout(params, exec);
  if (workspace_bytes < layout.total) return Status::kWorkspaceTooSmall;
  if (workspace == nullptr) return Status::kInvalidArgument;

  char* base = static_cast<char*>(workspace);
  SnapKvParams p = params;
  p.scores.scores = reinterpret_cast<float*>(base + layout.scores);
  p.select.scores = p.scores.scores;
  if (auto s = validate(p.select); s != Status::kOk) return s;
  if (auto s = validate(p.gather); s != Status::kOk) return s;
  if (p.gather.rope.rotary_dim != 0) return Status::kInvalidArgument;  // snapkv never rotates

  GatherBehindScores sink(p.select, p.gather, reinterpret_cast<float*>(base + layout.select_scratch),
                          reinterpret_cast<int64_t*>(base + layout.ready_rows));
  return cpu::window_scores_with_sink(p.scores, base + layout.score_scratch,
                                      layout.select_scratch - layout.score_scratch, exec, &sink);
}

}  // namespace kvprune
