#include "cpu/window_scores_rows.h"

#include <algorithm>
#include <limits>

#include "cpu/half.h"

namespace kvprune::cpu {
namespace {

// Masks keys [first, first+count) of a tile of packed rows [row0, row0 + block_rows):
// key j is hidden from window query i (packed row h*W + i) iff i < j - window_start,
// a prefix of each head's rows, so each (key, head) masks one contiguous run.
void apply_causal_mask(const HeadView& head, int64_t row0, int64_t block_rows, int64_t first,
                       int64_t count, float* tile) {
  const WindowScoresParams& p = *head.p;
  const int64_t rows = std::min(p.q_heads / p.kv_heads * p.window, row0 + block_rows);
  const int64_t window_start = head.len - p.window;
  for (int64_t j = std::max(first, window_start + 1); j < first + count; ++j) {
    float* line = tile + (j - first) * block_rows - row0;
    const int64_t hidden = std::min(j - window_start, p.window);  // queries [0, hidden) of a head
    for (int64_t h = row0 / p.window; h * p.window < rows; ++h) {
      const int64_t begin = std::max(row0, h * p.window);
      const int64_t end = std::min(rows, h * p.window + hidden);
      if (begin < end) std::fill(line + begin, line + end, -std::numeric_limits<float>::infinity());
    }
  }
}

}  // namespace

void pack_query_rows(const WindowScoresParams& p, int64_t b, int64_t g, int64_t row0,
                     int64_t block_rows, float* q_block) {
  const int64_t group = p.q_heads / p.kv_heads;
  const int64_t rows = std::min(group * p.window, row0 + block_rows);
  // The keys' dequantisation scale folds into the queries: q.(s k) = (s q).k.
  const float k_scale = p.k_scale == nullptr ? 1.f : p.k_scale[p.k_scale_count == 1 ? 0 : g];
  const float factor = p.scale * k_scale * kLog2e;
  std::fill(q_block, q_block + p.head_dim * block_rows, 0.f);
  for (int64_t r = row0; r < rows; ++r) {
    const int64_t h = r / p.window, i = r % p.window;
    const int64_t src = b * p.q.batch_stride + (g * group + h) * p.q.head_stride + i * p.q.token_stride;
    for (int64_t d = 0; d < p.head_dim; ++d)
      q_block[d * block_rows + r - row0] = load_as_float(p.q.data, src + d, p.dtype) * factor;
  }
}

void chunk_logits(const HeadView& head, const float* q_block, int64_t row0, int64_t block_rows,
                  int64_t first, int64_t count, float* keys, float* tile,
                  BackgroundWork background) {
  const WindowScoresParams& p = *head.p;
  const DType k_dtype = key_dtype(p);
  const int64_t padded = (count + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const int64_t row_stride = p.k.token_stride * dtype_size(k_dtype);
  // fp32 K is read in place unless the chunk needs zero padding or spans blocks of a
  // paged cache; others are converted, one run of consecutive rows (a block) at a time.
  const float* k_chunk = reinterpret_cast<const float*>(head.key(first));
  int64_t k_stride = p.k.token_stride;
  if (k_dtype != DType::kFloat32 || padded != count || contiguous_tokens(p.k, first) < count) {
    for (int64_t j = 0; j < count;) {
      const int64_t run = std::min(count - j, contiguous_tokens(p.k, first + j));
      const int64_t fill = j + run == count ? padded - j : run;  // the last run zero-pads
      head.kernels->pack_keys(head.key(first + j), p.k.token_stride, k_dtype, p.head_dim, run,
                              fill, keys + j * p.head_dim);
      j += run;
    }
    k_chunk = keys;
    k_stride = p.head_dim;
  }
  KeyPrefetch& next = background.next_keys;  // the chunk after this one (its first block)
  const int64_t next_first = first + count;
  next.rows = std::max<int64_t>(
      0, std::min({kChunkKeys, head.len - next_first, contiguous_tokens(p.k, next_first)}));
  next.base = next.rows > 0 ? head.key(next_first) : nullptr;
  next.stride_bytes = row_stride;
  next.row_bytes = p.head_dim * dtype_size(k_dtype);
  head.kernels->logits(q_block, block_rows, p.head_dim, k_chunk, k_stride, padded, tile, background);
  apply_causal_mask(head, row0, block_rows, first, count, tile);
}

void load_lse(const WindowScoresParams& p, int64_t b, int64_t g, int64_t mp, float* lse2) {
  const int64_t group = p.q_heads / p.kv_heads;
  std::fill(lse2, lse2 + mp, std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < group; ++h)
    for (int64_t i = 0; i < p.window; ++i)
      lse2[h * p.window + i] = p.lse[(b * p.q_heads + g * group + h) * p.window + i] * kLog2e;
}

void finish_row_tail(const WindowScoresParams& p, int64_t len, float* out) {
  for (int64_t j = len; j < score_row_length(p); ++j) fold_score(p, 0.f, out + j);
}

}  // namespace kvprune::cpu
