// CPU window_scores: SnapKV observation-window voting, one KV head at a time.
//
// For each (batch, KV head) the G*W window queries of the group form the rows of a
// small fp32 matrix (q_packed). Keys are processed in chunks of kChunkKeys, in
// parallel. Per chunk: convert K to fp32, compute the base-2 logits tile
// [keys][rows] with a register-blocked kernel, apply the causal mask inside the
// window, then
//  * with lse: exponentiate against the given log-sum-exp and sum the columns;
//  * without: exponentiate against the chunk's own row maxima and keep the tile
//    in the workspace. Once all chunks are done, the per-chunk (max, sum) pairs
//    give each row's exact normaliser and a second sweep sums the stored columns
//    with per-(chunk, row) weights. K is read once either way; the only large
//    scratch is one head's [N][rows] fp32 tile.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/validate.h"
#include "cpu/half.h"
#include "cpu/parallel.h"
#include "cpu/window_scores_kernels.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

using cpu::kChunkKeys;
constexpr float kLog2e = 1.4426950408889634f;

int64_t padded_rows(const WindowScoresParams& p) {
  const int64_t rows = p.q_heads / p.kv_heads * p.window;
  return (rows + cpu::kRowAlign - 1) / cpu::kRowAlign * cpu::kRowAlign;
}

int64_t max_chunks(const WindowScoresParams& p) { return (p.length + kChunkKeys - 1) / kChunkKeys; }

// Carves the caller's workspace into the buffers below (all fp32).
struct Workspace {
  float* q_packed;     // [D][Mp]
  float* row_weight;   // [Mp] (lse path: 1 on real rows, 0 on padding)
  float* lse2;         // [Mp] base-2 lse of the current head (lse path)
  float* chunk_max;    // [chunks][Mp] (softmax path)
  float* chunk_weight; // [chunks][Mp] chunk sums, then final weights (softmax path)
  float* exps;         // [chunks * kChunkKeys][Mp] (softmax path)
  float* worker_keys;  // [workers][kChunkKeys][D]
  float* worker_tiles; // [workers][kChunkKeys][Mp]
  size_t floats;       // total size

  Workspace(const WindowScoresParams& p, int workers, float* base) {
    const int64_t mp = padded_rows(p);
    const bool softmax = p.lse == nullptr;
    const int64_t chunks = softmax ? max_chunks(p) : 0;
    float* cursor = base;
    auto take = [&](int64_t count) {
      float* out = cursor;
      cursor += count;
      return out;
    };
    q_packed = take(p.head_dim * mp);
    row_weight = take(mp);
    lse2 = take(mp);
    chunk_max = take(chunks * mp);
    chunk_weight = take(chunks * mp);
    exps = take(chunks * kChunkKeys * mp);
    worker_keys = take(workers * kChunkKeys * p.head_dim);
    worker_tiles = take(workers * kChunkKeys * mp);
    floats = static_cast<size_t>(cursor - base);
  }
};

// Everything one head's chunk tasks need.
struct HeadJob {
  const WindowScoresParams* p;
  const cpu::WindowScoresKernels* kernels;
  const Workspace* ws;
  const char* k_head;  // k[b, g] as bytes
  int64_t len;         // valid keys of this row
  int64_t mp;
  float* out;          // scores[b, g, :]
};

// q_packed[d][h*W+i] = q[b, g*G+h, i, d] * scale * log2(e); padding rows are 0.
void pack_queries(const WindowScoresParams& p, int64_t b, int64_t g, int64_t mp, float* q_packed) {
  const int64_t group = p.q_heads / p.kv_heads;
  std::fill(q_packed, q_packed + p.head_dim * mp, 0.f);
  for (int64_t h = 0; h < group; ++h)
    for (int64_t i = 0; i < p.window; ++i) {
      const int64_t src = b * p.q.batch_stride + (g * group + h) * p.q.head_stride + i * p.q.token_stride;
      for (int64_t d = 0; d < p.head_dim; ++d)
        q_packed[d * mp + h * p.window + i] = cpu::load_as_float(p.q.data, src + d, p.dtype) * p.scale * kLog2e;
    }
}

// Masks keys [first, first+count) of a tile: query i sees key j iff j <= len-W+i.
void apply_causal_mask(const HeadJob& job, int64_t first, int64_t count, float* tile) {
  const WindowScoresParams& p = *job.p;
  const int64_t rows = p.q_heads / p.kv_heads * p.window;
  const int64_t window_start = job.len - p.window;
  for (int64_t j = std::max(first, window_start); j < first + count; ++j) {
    float* line = tile + (j - first) * job.mp;
    for (int64_t r = 0; r < rows; ++r)
      if (j > window_start + r % p.window) line[r] = -std::numeric_limits<float>::infinity();
  }
}

// Logits of keys [first, first+count) into tile, masked.
void chunk_logits(const HeadJob& job, int64_t first, int64_t count, float* keys, float* tile) {
  const WindowScoresParams& p = *job.p;
  const int64_t padded = (count + 5) / 6 * 6;
  job.kernels->pack_keys(job.k_head + first * p.k.token_stride * dtype_size(p.dtype), p.k.token_stride,
                         p.dtype, p.head_dim, count, padded, keys);
  job.kernels->logits(job.ws->q_packed, job.mp, p.head_dim, keys, padded, tile);
  apply_causal_mask(job, first, count, tile);
}

void run_head_with_lse(const HeadJob& job, const CpuExecutor& exec) {
  const WindowScoresParams& p = *job.p;
  const int64_t chunks = (job.len + kChunkKeys - 1) / kChunkKeys;
  cpu::parallel_for(exec, chunks, 1, [&](int64_t begin, int64_t end, int worker) {
    float* keys = job.ws->worker_keys + worker * kChunkKeys * p.head_dim;
    float* tile = job.ws->worker_tiles + worker * kChunkKeys * job.mp;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * kChunkKeys;
      const int64_t count = std::min(kChunkKeys, job.len - first);
      chunk_logits(job, first, count, keys, tile);
      job.kernels->exp_minus(tile, job.mp, count, job.ws->lse2);
      job.kernels->reduce_columns(tile, job.mp, count, job.ws->row_weight, p.q_heads / p.kv_heads,
                                  p.window, p.reduce, job.out + first);
    }
  });
}

void run_head_softmax(const HeadJob& job, const CpuExecutor& exec) {
  const WindowScoresParams& p = *job.p;
  const Workspace& ws = *job.ws;
  const int64_t mp = job.mp;
  const int64_t chunks = (job.len + kChunkKeys - 1) / kChunkKeys;
  cpu::parallel_for(exec, chunks, 1, [&](int64_t begin, int64_t end, int worker) {
    float* keys = ws.worker_keys + worker * kChunkKeys * p.head_dim;
    float* tile = ws.worker_tiles + worker * kChunkKeys * mp;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * kChunkKeys;
      const int64_t count = std::min(kChunkKeys, job.len - first);
      chunk_logits(job, first, count, keys, tile);
      job.kernels->softmax_stats(tile, mp, count, ws.exps + first * mp, ws.chunk_max + c * mp,
                                 ws.chunk_weight + c * mp);
    }
  });
  // Exact normaliser per row from the chunk (max, sum) pairs, then per-chunk weights
  // 2^(chunk_max - row_max) / row_total. Rows that see no key (padding, or a query
  // before position 0) get weight 0.
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t rows = p.q_heads / p.kv_heads * p.window;
  for (int64_t r = 0; r < mp; ++r) {
    float row_max = neg_inf;
    for (int64_t c = 0; c < chunks; ++c) row_max = std::max(row_max, ws.chunk_max[c * mp + r]);
    double total = 0.0;
    if (row_max != neg_inf)
      for (int64_t c = 0; c < chunks; ++c)
        total += ws.chunk_weight[c * mp + r] * std::exp2(static_cast<double>(ws.chunk_max[c * mp + r]) - row_max);
    for (int64_t c = 0; c < chunks; ++c) {
      const float m = ws.chunk_max[c * mp + r];
      const bool live = r < rows && total > 0.0 && m != neg_inf;
      ws.chunk_weight[c * mp + r] = live ? static_cast<float>(std::exp2(static_cast<double>(m) - row_max) / total) : 0.f;
    }
  }
  cpu::parallel_for(exec, chunks, 1, [&](int64_t begin, int64_t end, int) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * kChunkKeys;
      const int64_t count = std::min(kChunkKeys, job.len - first);
      job.kernels->reduce_columns(ws.exps + first * mp, mp, count, ws.chunk_weight + c * mp,
                                  p.q_heads / p.kv_heads, p.window, p.reduce, job.out + first);
    }
  });
}

// lse2[h*W+i] = lse[b, g*G+h, i] * log2(e); padding rows +inf (so they exponentiate to 0).
void load_lse(const WindowScoresParams& p, int64_t b, int64_t g, int64_t mp, float* lse2) {
  const int64_t group = p.q_heads / p.kv_heads;
  std::fill(lse2, lse2 + mp, std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < group; ++h)
    for (int64_t i = 0; i < p.window; ++i)
      lse2[h * p.window + i] = p.lse[(b * p.q_heads + g * group + h) * p.window + i] * kLog2e;
}

}  // namespace

size_t window_scores_workspace_bytes_cpu(const WindowScoresParams& p, const CpuExecutor& exec) {
  if (validate_sizes(p) != Status::kOk) return 0;
  return Workspace(p, cpu::num_workers(exec), nullptr).floats * sizeof(float);
}

Status window_scores_cpu(const WindowScoresParams& p, void* workspace, size_t workspace_bytes,
                         const CpuExecutor& exec) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (auto s = validate_seq_lens_host(p.seq_lens, p.batch, p.length); s != Status::kOk) return s;
  const int workers = cpu::num_workers(exec);
  const Workspace ws(p, workers, static_cast<float*>(workspace));
  if (workspace_bytes < ws.floats * sizeof(float)) return Status::kWorkspaceTooSmall;

  const int64_t mp = padded_rows(p);
  const int64_t rows = p.q_heads / p.kv_heads * p.window;
  for (int64_t r = 0; r < mp; ++r) ws.row_weight[r] = r < rows ? 1.f : 0.f;
  const cpu::WindowScoresKernels& kernels = cpu::best_window_scores_kernels();

  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t len = p.seq_lens != nullptr ? p.seq_lens[b] : p.length;
    for (int64_t g = 0; g < p.kv_heads; ++g) {
      float* out = p.scores + (b * p.kv_heads + g) * p.length;
      std::fill(out + len, out + p.length, 0.f);
      if (len == 0) continue;
      pack_queries(p, b, g, mp, ws.q_packed);
      const char* k_head = static_cast<const char*>(p.k.data) +
                           (b * p.k.batch_stride + g * p.k.head_stride) * dtype_size(p.dtype);
      const HeadJob job{&p, &kernels, &ws, k_head, len, mp, out};
      if (p.lse != nullptr) {
        load_lse(p, b, g, mp, ws.lse2);
        run_head_with_lse(job, exec);
      } else {
        run_head_softmax(job, exec);
      }
    }
  }
  return Status::kOk;
}

}  // namespace kvprune
