#include "cpu/window_scores_rows.h"

#include <algorithm>
#include <cstring>
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

// What turns a query-key dot product into a base-2 logit: scale * log2(e), times K's
// dequantisation scale, which folds into the queries: q.(s k) = (s q).k.
float logit_factor(const WindowScoresParams& p, int64_t g) {
  const float k_scale = p.k_scale == nullptr ? 1.f : p.k_scale[p.k_scale_count == 1 ? 0 : g];
  return p.scale * k_scale * kLog2e;
}

// Copies `count` consecutive key rows from `first` (runs within one block of a paged cache) as
// `pack(src, rows, fill, dst_row)` packs them: rows [j, j + rows) to dst rows [j, j + fill), the
// last run zero-filled up to `padded`.
template <class Pack>
void pack_key_runs(const HeadView& head, int64_t first, int64_t count, int64_t padded, Pack pack) {
  for (int64_t j = 0; j < count;) {
    const int64_t run = std::min(count - j, contiguous_tokens(head.p->k, first + j));
    pack(head.key(first + j), run, j + run == count ? padded - j : run, j);
    j += run;
  }
}

}  // namespace

bool bf16_pairs(const WindowScoresParams& p, const WindowScoresKernels& kernels) {
  return kernels.logits_bf16 != nullptr && p.dtype == DType::kBFloat16 &&
         key_dtype(p) == DType::kBFloat16 && p.head_dim % 2 == 0;
}

void pack_query_rows(const WindowScoresParams& p, int64_t b, int64_t g, int64_t row0,
                     int64_t block_rows, bool pairs, float* q_block) {
  const int64_t group = p.q_heads / p.kv_heads;
  const int64_t rows = std::min(group * p.window, row0 + block_rows);
  const float factor = logit_factor(p, g);
  std::fill(q_block, q_block + p.head_dim * block_rows, 0.f);  // pairs need half of it
  auto* q_pairs = reinterpret_cast<uint32_t*>(q_block);          // [D/2][block_rows]
  const auto* bits = static_cast<const uint16_t*>(p.q.data);
  for (int64_t r = row0; r < rows; ++r) {
    const int64_t h = r / p.window, i = r % p.window;
    const int64_t src = b * p.q.batch_stride + (g * group + h) * p.q.head_stride + i * p.q.token_stride;
    if (pairs) {
      for (int64_t e = 0; e < p.head_dim / 2; ++e)
        q_pairs[e * block_rows + r - row0] =
            bits[src + 2 * e] | static_cast<uint32_t>(bits[src + 2 * e + 1]) << 16;
      continue;
    }
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
  const bool pairs = bf16_pairs(p, *head.kernels);
  // K is read in place (fp32, or bf16 pairs) unless the chunk needs zero padding or spans
  // blocks of a paged cache; otherwise copied (converted to fp32 without pairs), one run of
  // consecutive rows (a block) at a time.
  const bool in_place = (pairs || k_dtype == DType::kFloat32) && padded == count &&
                        contiguous_tokens(p.k, first) >= count;
  const void* k_chunk = head.key(first);
  int64_t k_stride = p.k.token_stride;
  if (!in_place && pairs) {
    auto* rows = reinterpret_cast<uint16_t*>(keys);  // [padded][D] bf16
    pack_key_runs(head, first, count, padded, [&](const char* src, int64_t run, int64_t fill,
                                                  int64_t j) {
      uint16_t* dst = rows + j * p.head_dim;
      for (int64_t t = 0; t < run; ++t)
        std::memcpy(dst + t * p.head_dim, src + t * row_stride, p.head_dim * sizeof(uint16_t));
      std::fill(dst + run * p.head_dim, dst + fill * p.head_dim, uint16_t{0});
    });
  } else if (!in_place) {
    pack_key_runs(head, first, count, padded, [&](const char* src, int64_t run, int64_t fill,
                                                  int64_t j) {
      head.kernels->pack_keys(src, p.k.token_stride, k_dtype, p.head_dim, run, fill,
                              keys + j * p.head_dim);
    });
  }
  if (!in_place) {
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
  if (pairs) {
    head.kernels->logits_bf16(reinterpret_cast<const uint32_t*>(q_block), block_rows,
                              p.head_dim / 2, static_cast<const uint16_t*>(k_chunk), k_stride,
                              padded, logit_factor(p, head.g), tile, background);
  } else {
    head.kernels->logits(q_block, block_rows, p.head_dim, static_cast<const float*>(k_chunk),
                         k_stride, padded, tile, background);
  }
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
