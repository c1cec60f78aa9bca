// CPU window_scores with qreduce = kMax: s[h,j] = max_i a[h,i,j], for windows of
// thousands of queries (KVzip-style reconstruction chunks) in bounded memory.
//
// The G*W packed query rows of a group are cut into blocks of at most kRowBlock
// rows, so per-worker tiles stay [kChunkKeys][kRowBlock] whatever W is.
//  * Pass 1 (no lse only): the keys are split into at most kStatSegments segments of
//    whole chunks; a segment's task computes logits chunk by chunk, row block by row
//    block, and merges each chunk's per-row (max, sum) into the segment's softmax
//    state. Segment states merge in a fixed order into each row's exact base-2 lse,
//    so the result does not depend on how tasks land on workers.
//  * Pass 2 (the only pass with lse): one task per key chunk below the score row's
//    end recomputes the logits, exponentiates against the lse and keeps the per-head
//    maximum of each key over the rows (column_max), then reduces over the group and
//    writes or folds the chunk's scores. Chunks own their keys: no races.
//  * Weights: each row's query weight is folded into its lse (weighted_lse2), each
//    head's key weights multiply its maxima before the group reduction.
// No [keys][rows] buffer spans more than one chunk and one row block.
#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/parallel.h"
#include "cpu/window_scores_rows.h"

namespace kvprune::cpu {
namespace {

constexpr int64_t kRowBlock = 256;      // packed rows per block (a multiple of kRowAlign)
constexpr int64_t kStatSegments = 32;   // pass 1 tasks along the keys (at most)
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Sizes {
  int64_t group, rows, mp, block, blocks, chunks, segments;
  explicit Sizes(const WindowScoresParams& p)
      : group(p.q_heads / p.kv_heads),
        rows(group * p.window),
        mp((rows + kRowAlign - 1) / kRowAlign * kRowAlign),
        block(std::min(mp, kRowBlock)),
        blocks((mp + block - 1) / block),
        chunks((p.length + kChunkKeys - 1) / kChunkKeys),
        segments(p.lse == nullptr ? std::min(chunks, kStatSegments) : 0) {}
  int64_t block_rows(int64_t k) const { return std::min(block, mp - k * block); }
};

// Carves the caller's workspace (all fp32).
struct Workspace {
  float* q_blocks;      // [blocks][D][block] (block k: [D][block_rows(k)])
  float* lse2;          // [mp] base-2 lse per packed row (+inf: the row adds nothing)
  float* seg_max;       // [segments][mp] softmax state (max) per key segment
  float* seg_sum;       // [segments][mp] softmax state (sum, relative to max)
  float* worker_keys;   // [workers][kChunkKeys][D]
  float* worker_tile;   // [workers][kChunkKeys][block]
  float* worker_stats;  // [workers][2][block] one chunk's (max, sum) per row
  float* worker_heads;  // [workers][group][kChunkKeys] per-head maxima of a chunk
  size_t floats;

  Workspace(const WindowScoresParams& p, const Sizes& z, int workers, float* base) {
    float* cursor = base;
    auto take = [&](int64_t count) {
      float* out = cursor;
      cursor += count;
      return out;
    };
    q_blocks = take(z.blocks * p.head_dim * z.block);
    lse2 = take(z.mp);
    seg_max = take(z.segments * z.mp);
    seg_sum = take(z.segments * z.mp);
    worker_keys = take(workers * kChunkKeys * p.head_dim);
    worker_tile = take(workers * kChunkKeys * z.block);
    worker_stats = take(workers * 2 * z.block);
    worker_heads = take(workers * z.group * kChunkKeys);
    floats = static_cast<size_t>(cursor - base);
  }
};

// (m, l) <- the merge of softmax states (m, l) and (cm, cl), base 2; empty: (-inf, 0).
void merge_state(float cm, float cl, float* m, float* l) {
  if (cm == -kInf) return;
  if (*m == -kInf) {
    *m = cm;
    *l = cl;
    return;
  }
  const float top = std::max(*m, cm);
  *l = *l * std::exp2(*m - top) + cl * std::exp2(cm - top);
  *m = top;
}

// Pass 1: lse2 of every packed row from the softmax states of all visible keys.
void row_lse(const HeadView& head, const Sizes& z, const Workspace& ws, const CpuExecutor& exec) {
  const WindowScoresParams& p = *head.p;
  const int64_t chunks = (head.len + kChunkKeys - 1) / kChunkKeys;
  const int64_t segments = std::min(chunks, z.segments);
  parallel_for(exec, segments, 1, [&](int64_t begin, int64_t end, int worker) {
    float* keys = ws.worker_keys + worker * kChunkKeys * p.head_dim;
    float* tile = ws.worker_tile + worker * kChunkKeys * z.block;
    float* chunk_max = ws.worker_stats + worker * 2 * z.block;
    float* chunk_sum = chunk_max + z.block;
    for (int64_t s = begin; s < end; ++s) {
      float* m = ws.seg_max + s * z.mp;
      float* l = ws.seg_sum + s * z.mp;
      std::fill(m, m + z.mp, -kInf);
      std::fill(l, l + z.mp, 0.f);
      for (int64_t c = s * chunks / segments; c < (s + 1) * chunks / segments; ++c) {
        const int64_t first = c * kChunkKeys;
        const int64_t count = std::min(kChunkKeys, head.len - first);
        for (int64_t k = 0; k < z.blocks; ++k) {
          const int64_t row0 = k * z.block, rows = z.block_rows(k);
          chunk_logits(head, ws.q_blocks + k * p.head_dim * z.block, row0, rows, first, count, keys,
                       tile, {});
          head.kernels->softmax_stats(tile, rows, count, chunk_max, chunk_sum);
          for (int64_t r = 0; r < rows; ++r) merge_state(chunk_max[r], chunk_sum[r], m + row0 + r, l + row0 + r);
        }
      }
    }
  });
  for (int64_t r = 0; r < z.mp; ++r) {
    float m = -kInf, l = 0.f;
    for (int64_t s = 0; s < segments; ++s) merge_state(ws.seg_max[s * z.mp + r], ws.seg_sum[s * z.mp + r], &m, &l);
    ws.lse2[r] = r < z.rows && l > 0.f ? m + std::log2(l) : kInf;
  }
}

// lse2[r] of every packed row r = h*W + i with query weight qw[b, g*G + h, i] folded in.
void weigh_queries(const HeadView& head, const Sizes& z, float* lse2) {
  const WindowScoresParams& p = *head.p;
  const float* qw = p.query_weight + (head.b * p.q_heads + head.g * z.group) * p.window;
  for (int64_t r = 0; r < z.rows; ++r) lse2[r] = weighted_lse2(lse2[r], qw[r]);
}

// heads[h][j] *= kw[b, g*G + h, first + j] for the chunk's scored keys j < count.
// heads: [group][kChunkKeys].
void weigh_keys(const HeadView& head, const Sizes& z, int64_t first, int64_t count, float* heads) {
  const WindowScoresParams& p = *head.p;
  const int64_t m = score_row_length(p);
  for (int64_t h = 0; h < z.group; ++h) {
    const float* kw = p.key_weight + (head.b * p.q_heads + head.g * z.group + h) * m + first;
    for (int64_t j = 0; j < count; ++j) heads[h * kChunkKeys + j] *= applied_key_weight(kw[j]);
  }
}

// Pass 2: scores of keys [0, min(len, score row length)), written or folded into out.
void row_scores(const HeadView& head, const Sizes& z, const Workspace& ws, float* out,
                const CpuExecutor& exec) {
  const WindowScoresParams& p = *head.p;
  const int64_t scored = std::min(head.len, score_row_length(p));
  parallel_for(exec, (scored + kChunkKeys - 1) / kChunkKeys, 1, [&](int64_t begin, int64_t end, int worker) {
    float* keys = ws.worker_keys + worker * kChunkKeys * p.head_dim;
    float* tile = ws.worker_tile + worker * kChunkKeys * z.block;
    float* heads = ws.worker_heads + worker * z.group * kChunkKeys;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * kChunkKeys;
      const int64_t count = std::min(kChunkKeys, head.len - first);
      std::fill(heads, heads + z.group * kChunkKeys, 0.f);
      for (int64_t k = 0; k < z.blocks; ++k) {
        const int64_t row0 = k * z.block, rows = z.block_rows(k);
        chunk_logits(head, ws.q_blocks + k * p.head_dim * z.block, row0, rows, first, count, keys,
                     tile, {});
        head.kernels->exp_minus(tile, rows, count, ws.lse2 + row0);
        head.kernels->column_max(tile, rows, count, row0, z.rows, p.window, heads);
      }
      if (p.key_weight != nullptr) weigh_keys(head, z, first, std::min(count, scored - first), heads);
      for (int64_t j = 0; j < std::min(count, scored - first); ++j) {
        float v = 0.f;  // the GQA reduction of the per-head maxima (all >= 0)
        for (int64_t h = 0; h < z.group; ++h) {
          const float x = heads[h * kChunkKeys + j];
          v = p.reduce == GqaReduce::kMax ? std::max(v, x) : v + x;
        }
        if (p.reduce == GqaReduce::kMean) v /= static_cast<float>(z.group);
        fold_score(p, v, out + first + j);
      }
    }
  });
}

}  // namespace

size_t qmax_workspace_floats(const WindowScoresParams& p, int workers) {
  const Sizes z(p);
  return Workspace(p, z, workers, nullptr).floats;
}

void window_scores_qmax(const WindowScoresParams& p, const WindowScoresKernels& kernels,
                        float* workspace, const CpuExecutor& exec) {
  const Sizes z(p);
  const Workspace ws(p, z, num_workers(exec), workspace);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t len = p.seq_lens != nullptr ? p.seq_lens[b] : p.length;
    for (int64_t g = 0; g < p.kv_heads; ++g) {
      float* out = p.scores + (b * p.kv_heads + g) * score_row_length(p);
      finish_row_tail(p, len, out);
      if (len == 0) continue;
      for (int64_t k = 0; k < z.blocks; ++k)
        pack_query_rows(p, b, g, k * z.block, z.block_rows(k), bf16_pairs(p, kernels),
                        ws.q_blocks + k * p.head_dim * z.block);
      const HeadView head{&p, &kernels, b, g, len};
      if (p.lse != nullptr) {
        load_lse(p, b, g, z.mp, ws.lse2);
        for (int64_t r = 0; r < z.rows; ++r)  // rows that see no key add nothing
          if (len - p.window + r % p.window < 0) ws.lse2[r] = kInf;
      } else {
        row_lse(head, z, ws, exec);
      }
      if (p.query_weight != nullptr) weigh_queries(head, z, ws.lse2);
      row_scores(head, z, ws, out, exec);
    }
  }
}

}  // namespace kvprune::cpu
