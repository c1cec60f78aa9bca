// CPU compact_kv: in place, x[b,h,t] <- x[b,h,keep_idx[b,h,t]] for K and V, t ascending
// (CompactKvParams). One task per (batch, head) row: the copies of a row must run in
// order (a token may be overwritten right after it was read), rows are independent.
// keep_idx is checked first, on every row, so bad indices write nothing.
#include <cstdint>
#include <cstring>

#include "core/validate.h"
#include "cpu/parallel.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

// Kept tokens of one row: ascending positions in [0, length) then -1 padding; -1 if the
// row breaks that rule.
int64_t kept_count(const int32_t* idx, int64_t budget, int64_t length) {
  int64_t kept = 0;
  while (kept < budget && idx[kept] >= 0) {
    if (idx[kept] >= length || (kept > 0 && idx[kept] <= idx[kept - 1])) return -1;
    ++kept;
  }
  for (int64_t t = kept; t < budget; ++t)
    if (idx[t] != -1) return -1;
  return kept;
}

// Rows t < kept of (b, h) from their kept positions, in ascending t.
void compact_row(const MutableTokens& x, const int32_t* idx, int64_t kept, int64_t b, int64_t h,
                 int64_t elem, int64_t row_bytes) {
  char* base = static_cast<char*>(x.data);
  for (int64_t t = 0; t < kept; ++t) {
    if (idx[t] == t) continue;  // already in place
    std::memcpy(base + token_offset(x, b, h, t) * elem, base + token_offset(x, b, h, idx[t]) * elem,
                static_cast<size_t>(row_bytes));
  }
}

}  // namespace

size_t compact_kv_workspace_bytes_cpu(const CompactKvParams&, const CpuExecutor&) { return 0; }

Status compact_kv_cpu(const CompactKvParams& p, void*, size_t, const CpuExecutor& exec) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (auto s = validate_seq_lens_host(p.seq_lens, p.batch, p.length); s != Status::kOk) return s;
  const int64_t rows = p.batch * p.heads;
  for (int64_t b = 0; b < p.batch; ++b) {
    int64_t row_kept = 0;
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t len = p.seq_lens != nullptr ? p.seq_lens[b] : p.length;
      const int64_t kept = kept_count(p.keep_idx + (b * p.heads + h) * p.budget, p.budget, len);
      if (kept < 0 || (h > 0 && kept != row_kept)) return Status::kInvalidArgument;
      row_kept = kept;
    }
    if (p.new_seq_lens != nullptr) p.new_seq_lens[b] = static_cast<int32_t>(p.heads > 0 ? row_kept : 0);
  }
  if (rows * p.budget == 0) return Status::kOk;
  const int64_t elem = dtype_size(p.dtype);
  const int64_t row_bytes = p.head_dim * elem;
  cpu::parallel_for(exec, rows, 1, [&](int64_t begin, int64_t end, int) {
    for (int64_t row = begin; row < end; ++row) {
      const int32_t* idx = p.keep_idx + row * p.budget;
      int64_t kept = 0;
      while (kept < p.budget && idx[kept] >= 0) ++kept;
      compact_row(p.k, idx, kept, row / p.heads, row % p.heads, elem, row_bytes);
      compact_row(p.v, idx, kept, row / p.heads, row % p.heads, elem, row_bytes);
    }
  });
  return Status::kOk;
}

}  // namespace kvprune
