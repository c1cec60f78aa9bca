// Pieces of the CPU window_scores drivers that work on a block of packed query rows
// (window_scores.cpp: all rows of a group at once; window_scores_qmax.cpp: blocks).
// Packed row r = (query head in group) * W + window index; rows >= G*W are padding.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/window_scores_kernels.h"
#include "kvprune/cpu_executor.h"
#include "kvprune/params.h"

namespace kvprune::cpu {

constexpr float kLog2e = 1.4426950408889634f;

// One (batch row, KV head) as the chunk helpers see it.
struct HeadView {
  const WindowScoresParams* p;
  const WindowScoresKernels* kernels;
  int64_t b;    // batch row
  int64_t g;    // KV head: keys k[b, g, :len] (dense or paged, p->k)
  int64_t len;  // valid keys of this row

  // Key t of this row as bytes: head_dim elements of key_dtype(*p).
  const char* key(int64_t t) const {
    return static_cast<const char*>(p->k.data) + token_offset(p->k, b, g, t) * dtype_size(key_dtype(*p));
  }
};

// Whether the logits of p run on bf16 pairs (kernels.logits_bf16: the host has bf16 dot
// products, Q and K are bf16 and D is even); then q blocks hold pairs, not fp32 rows.
bool bf16_pairs(const WindowScoresParams& p, const WindowScoresKernels& kernels);

// fp32: q_block[d][r - row0] = q[b, g*G + r/W, r%W, d] * scale * k_scale[g] * log2(e) for
// packed rows r in [row0, row0 + block_rows), q_block [D][block_rows]. With `pairs` (see
// bf16_pairs) instead the unscaled bf16 pairs (q[.., 2e], q[.., 2e+1]) as uint32 [D/2][block_rows]
// in the same buffer (the logits kernel scales). Padding rows are 0.
void pack_query_rows(const WindowScoresParams& p, int64_t b, int64_t g, int64_t row0,
                     int64_t block_rows, bool pairs, float* q_block);

// Base-2 logits of keys [first, first + count) against packed rows [row0, row0 +
// block_rows) (q_block as pack_query_rows wrote it, pairs if bf16_pairs) into tile
// [kChunkKeys][block_rows], causally masked (-inf where query i does not see key j, i.e.
// j > len - W + i). keys: [kChunkKeys][D] fp32 scratch.
// `background` (whose next_keys this fills in) runs during the arithmetic.
void chunk_logits(const HeadView& head, const float* q_block, int64_t row0, int64_t block_rows,
                  int64_t first, int64_t count, float* keys, float* tile,
                  BackgroundWork background);

// lse2[h*W+i] = lse[b, g*G+h, i] * log2(e) (lse: [B, Hq, W]); padding rows up to mp
// are +inf (so they exponentiate to 0). lse2: [mp].
void load_lse(const WindowScoresParams& p, int64_t b, int64_t g, int64_t mp, float* lse2);

// out = value without folding, else max(out, value) (kMax) or out + value (kSum).
inline void fold_score(const WindowScoresParams& p, float value, float* out) {
  if (p.fold_length == 0)
    *out = value;
  else if (p.qreduce == QueryReduce::kMax)
    *out = value > *out ? value : *out;
  else
    *out += value;
}

// Positions [len, score_row_length(p)) of one score row out: new scores are 0 there.
void finish_row_tail(const WindowScoresParams& p, int64_t len, float* out);

// qreduce = kMax (window_scores_qmax.cpp): workspace floats, and the op itself after
// window_scores_cpu has validated p and the workspace.
size_t qmax_workspace_floats(const WindowScoresParams& p, int workers);
void window_scores_qmax(const WindowScoresParams& p, const WindowScoresKernels& kernels,
                        float* workspace, const CpuExecutor& exec);

}  // namespace kvprune::cpu
