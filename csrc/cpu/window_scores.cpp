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
//    with per-(chunk, row) weights. That sweep is memory-bound, so it runs in the
//    same tasks as the next head's (compute-bound) logits, with two exps buffers
//    alternating between heads. Its memory traffic hides under the logits
//    arithmetic: while chunk c's logits are computed, the logits kernel also
//    streams this worker's previous tile out to the exps buffer and prefetches
//    the previous head's exps of chunk c, which the sweep reads right after.
//    K is read once either way; the only large scratch is two heads' [N][rows]
//    fp32 exps.
// That is qreduce = sum; qreduce = max runs window_scores_qmax.cpp (bounded memory).
// With fold_length > 0 each chunk's scores fold into the caller's [.., M] rows.
#include <algorithm>

#include "core/validate.h"
#include "cpu/parallel.h"
#include "cpu/window_scores_rows.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

using cpu::kChunkKeys;

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
  // Softmax path, two of each (alternating heads):
  float* chunk_max[2];    // [chunks][Mp]
  float* chunk_weight[2]; // [chunks][Mp] chunk sums, then final weights
  float* exps[2];         // [chunks * kChunkKeys][Mp]
  float* worker_keys;  // [workers][kChunkKeys][D]
  float* worker_tiles; // [workers][2][kChunkKeys][Mp] (the current and the previous chunk)
  float* worker_fold;  // [workers][kChunkKeys] a chunk's scores before they fold into the output
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
    for (int i = 0; i < 2; ++i) {
      chunk_max[i] = take(chunks * mp);
      chunk_weight[i] = take(chunks * mp);
      exps[i] = take(chunks * kChunkKeys * mp);
    }
    worker_keys = take(workers * kChunkKeys * p.head_dim);
    worker_tiles = take(workers * 2 * kChunkKeys * mp);
    worker_fold = take(p.fold_length > 0 ? workers * kChunkKeys : 0);
    floats = static_cast<size_t>(cursor - base);
  }
};

// Everything one head's chunk tasks need.
struct HeadJob {
  const WindowScoresParams* p;
  const cpu::WindowScoresKernels* kernels;
  const Workspace* ws;
  int64_t b, g;        // batch row, KV head
  int64_t len;         // valid keys of this row
  int64_t mp;
  float* out;          // scores[b, g, :], score_row_length(p) floats
  int buffers;         // softmax path: which exps / chunk_max / chunk_weight set
  int64_t chunks() const { return (len + kChunkKeys - 1) / kChunkKeys; }
};

cpu::HeadView head_view(const HeadJob& job) { return {job.p, job.kernels, job.b, job.g, job.len}; }

// Writes (or folds) the scores of keys [first, first + count) below the score row's end:
// the weighted column sums of tile [count][mp]. fold_scratch: [kChunkKeys].
void reduce_chunk(const HeadJob& job, const float* tile, int64_t first, int64_t count,
                  const float* weight, float* fold_scratch) {
  const WindowScoresParams& p = *job.p;
  const int64_t keys = std::min(count, score_row_length(p) - first);
  if (keys <= 0) return;
  float* dst = p.fold_length > 0 ? fold_scratch : job.out + first;
  job.kernels->reduce_columns(tile, job.mp, keys, weight, p.q_heads / p.kv_heads, p.window, p.reduce, dst);
  if (p.fold_length > 0)
    for (int64_t j = 0; j < keys; ++j) cpu::fold_score(p, dst[j], job.out + first + j);
}

void run_head_with_lse(const HeadJob& job, const CpuExecutor& exec) {
  const WindowScoresParams& p = *job.p;
  const int64_t chunks = job.chunks();
  cpu::parallel_for(exec, chunks, 1, [&](int64_t begin, int64_t end, int worker) {
    float* keys = job.ws->worker_keys + worker * kChunkKeys * p.head_dim;
    float* tile = job.ws->worker_tiles + worker * 2 * kChunkKeys * job.mp;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * kChunkKeys;
      const int64_t count = std::min(kChunkKeys, job.len - first);
      cpu::chunk_logits(head_view(job), job.ws->q_packed, 0, job.mp, first, count, keys, tile, {});
      job.kernels->exp_minus(tile, job.mp, count, job.ws->lse2);
      reduce_chunk(job, tile, first, count, job.ws->row_weight, job.ws->worker_fold + worker * kChunkKeys);
    }
  });
}

// Softmax pass 1 for chunk c: logits, then in place exps and per-row (max, sum) of
// the chunk; the tile reaches the exps buffer during the worker's next logits (or
// its final flush).
void softmax_chunk_stats(const HeadJob& job, int64_t c, float* keys, float* tile,
                         const cpu::BackgroundWork& background) {
  const Workspace& ws = *job.ws;
  const int64_t first = c * kChunkKeys;
  const int64_t count = std::min(kChunkKeys, job.len - first);
  cpu::chunk_logits(head_view(job), ws.q_packed, 0, job.mp, first, count, keys, tile, background);
  job.kernels->softmax_stats(tile, job.mp, count, ws.chunk_max[job.buffers] + c * job.mp,
                             ws.chunk_weight[job.buffers] + c * job.mp);
}

// Exact normaliser per row from the chunk (max, sum) pairs, then per-chunk weights
// 2^(chunk_max - row_max) / row_total, in parallel over blocks of rows.
void softmax_chunk_weights(const HeadJob& job, const CpuExecutor& exec) {
  const WindowScoresParams& p = *job.p;
  const int64_t live_rows = p.q_heads / p.kv_heads * p.window;
  cpu::parallel_for(exec, job.mp / cpu::kRowAlign, 1, [&](int64_t begin, int64_t end, int) {
    job.kernels->chunk_weights(job.ws->chunk_max[job.buffers], job.ws->chunk_weight[job.buffers],
                               job.chunks(), job.mp, begin * cpu::kRowAlign, end * cpu::kRowAlign,
                               live_rows);
  });
}

// Softmax pass 2 for chunk c: weighted column sums of the stored exps.
void softmax_chunk_scores(const HeadJob& job, int64_t c, float* fold_scratch) {
  const int64_t first = c * kChunkKeys;
  const int64_t count = std::min(kChunkKeys, job.len - first);
  reduce_chunk(job, job.ws->exps[job.buffers] + first * job.mp, first, count,
               job.ws->chunk_weight[job.buffers] + c * job.mp, fold_scratch);
}

// Runs pass 1 of `current` (if any) and pass 2 of `previous` (if any) in one
// parallel loop over chunks. Each worker alternates between its two tiles: the
// one finished last is copied out while the other receives the next logits.
void softmax_overlapped(const HeadJob* current, const HeadJob* previous, const CpuExecutor& exec) {
  const HeadJob& any = current != nullptr ? *current : *previous;
  const int64_t current_chunks = current != nullptr ? current->chunks() : 0;
  const int64_t previous_chunks = previous != nullptr ? previous->chunks() : 0;
  cpu::parallel_for(exec, std::max(current_chunks, previous_chunks), 1,
                    [&](int64_t begin, int64_t end, int worker) {
    float* keys = any.ws->worker_keys + worker * kChunkKeys * any.p->head_dim;
    float* tiles = any.ws->worker_tiles + worker * 2 * kChunkKeys * any.mp;
    cpu::BackgroundWork pending;  // copy-out of this worker's last finished tile
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * kChunkKeys;
      cpu::BackgroundWork background = pending;
      pending = {};
      if (c < previous_chunks) {  // the exps pass 2 reads after these logits
        background.prefetch = previous->ws->exps[previous->buffers] + first * any.mp;
        background.prefetch_floats = std::min(kChunkKeys, previous->len - first) * any.mp;
      }
      if (c < current_chunks) {
        float* tile = tiles + (c - begin) % 2 * kChunkKeys * any.mp;
        softmax_chunk_stats(*current, c, keys, tile, background);
        pending.copy_from = tile;
        pending.copy_to = current->ws->exps[current->buffers] + first * any.mp;
        pending.copy_floats = std::min(kChunkKeys, current->len - first) * any.mp;
      } else {
        any.kernels->stream_copy(background);
      }
      if (c < previous_chunks) softmax_chunk_scores(*previous, c, any.ws->worker_fold + worker * kChunkKeys);
    }
    any.kernels->stream_copy(pending);  // also fences this worker's streaming stores
  });
}

}  // namespace

size_t window_scores_workspace_bytes_cpu(const WindowScoresParams& p, const CpuExecutor& exec) {
  if (validate_sizes(p) != Status::kOk) return 0;
  const int workers = cpu::num_workers(exec);
  if (p.qreduce == QueryReduce::kMax) return cpu::qmax_workspace_floats(p, workers) * sizeof(float);
  return Workspace(p, workers, nullptr).floats * sizeof(float);
}

Status window_scores_cpu(const WindowScoresParams& p, void* workspace, size_t workspace_bytes,
                         const CpuExecutor& exec) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (auto s = validate_seq_lens_host(p.seq_lens, p.batch, p.length); s != Status::kOk) return s;
  if (workspace_bytes < window_scores_workspace_bytes_cpu(p, exec)) return Status::kWorkspaceTooSmall;
  const cpu::WindowScoresKernels& kernels = cpu::best_window_scores_kernels();
  if (p.qreduce == QueryReduce::kMax) {
    cpu::window_scores_qmax(p, kernels, static_cast<float*>(workspace), exec);
    return Status::kOk;
  }
  const Workspace ws(p, cpu::num_workers(exec), static_cast<float*>(workspace));

  const int64_t mp = padded_rows(p);
  const int64_t rows = p.q_heads / p.kv_heads * p.window;
  for (int64_t r = 0; r < mp; ++r) ws.row_weight[r] = r < rows ? 1.f : 0.f;

  // Softmax path: head i's pass 1 overlaps head i-1's pass 2 (see the top comment).
  HeadJob previous{};
  bool have_previous = false;
  int buffers = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t len = p.seq_lens != nullptr ? p.seq_lens[b] : p.length;
    for (int64_t g = 0; g < p.kv_heads; ++g) {
      float* out = p.scores + (b * p.kv_heads + g) * score_row_length(p);
      cpu::finish_row_tail(p, len, out);
      if (len == 0) continue;
      cpu::pack_query_rows(p, b, g, 0, mp, cpu::bf16_pairs(p, kernels), ws.q_packed);
      const HeadJob job{&p, &kernels, &ws, b, g, len, mp, out, buffers};
      if (p.lse != nullptr) {
        cpu::load_lse(p, b, g, mp, ws.lse2);
        run_head_with_lse(job, exec);
        continue;
      }
      softmax_overlapped(&job, have_previous ? &previous : nullptr, exec);
      softmax_chunk_weights(job, exec);
      previous = job;
      have_previous = true;
      buffers ^= 1;
    }
  }
  if (have_previous) softmax_overlapped(nullptr, &previous, exec);
  return Status::kOk;
}

}  // namespace kvprune
