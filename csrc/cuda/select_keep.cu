// CUDA select_keep (DESIGN §1, stage 4): per (batch, head) row keep the sinks
// [0, n_sink), the window [n - window, n) and the `picks` = budget - n_sink -
// window best (optionally pooled) scores of the candidates [n_sink, n - window),
// ties to the lower position, written in ascending position order.
//
// Rows are few and long, so each row is split into `ctas_per_row` contiguous
// chunks of candidates, one CTA each, in every kernel below:
//   1. memset              zero the per-row radix histograms (workspace)
//   2. radix_histogram x4  each CTA histograms one 8-bit digit of its chunk's keys
//                          (only keys carrying the digits chosen so far) and adds
//                          it to the row's histogram with integer atomics
//   3. chunk_count         each CTA finds the threshold key T and the number of
//                          ties to take, and counts its keys > T and == T
//   4. scatter_keep        each CTA sums the counts of the chunks before it, then
//                          walks its chunk in position order with block scans and
//                          writes every kept position to its final slot; the CTAs
//                          of a row also share writing sinks, window and padding
// Every CTA replays the digit choices from the finished histograms, so no CTA
// waits for another and the result does not depend on scheduling. Nothing
// persists between calls besides what step 1 resets: CUDA-graph replayable.
// Pooling (kernel_size > 1) runs once first, pool_scores into the workspace
// (step 0), and every pass reads the pooled row: one read of a score per pass
// instead of kernel_size.

#include <algorithm>
#include <cstdint>

#include "cuda/simt.cuh"
#include "core/validate.h"
#include "cuda/common.cuh"
#include "cuda/radix_select.cuh"
#include "kvprune/emu.h"  // the emulator build calls its own pool_scores_cuda
#include "kvprune/kvprune.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace {

using cuda_detail::ceil_div;
using cuda_detail::kRadixBins;
using cuda_detail::kRadixPasses;
using cuda_detail::RadixThreshold;

// ---- launch heuristics ----------------------------------------------------------
constexpr int kBlock = kRadixBins;            // threads per CTA: one histogram bin each
constexpr int64_t kCandidatesPerCta = 4096;   // target chunk length
constexpr int64_t kMaxCtasPerRow = 512;       // bounds the per-CTA sum over earlier chunks

// Split of the rows into CTAs and the workspace it needs. Computed on the host
// from sizes only, so the size query and the launch agree.
struct SelectPlan {
  int64_t rows = 0;
  bool may_select = false;    // some row can be longer than budget (length > budget)
  int64_t ctas_per_row = 1;
  int64_t chunk_len = 0;      // candidates per CTA
  size_t hist_bytes = 0;      // uint32 [rows, kRadixPasses, kRadixBins]
  size_t counts_bytes = 0;    // uint64 [rows, ctas_per_row]
  size_t pooled_bytes = 0;    // fp32 [rows, length]: the pooled scores (kernel_size > 1)
  size_t bytes() const { return hist_bytes + counts_bytes + pooled_bytes; }
};

SelectPlan plan_select(const SelectKeepParams& p) {
  SelectPlan plan;
  plan.rows = p.batch * p.heads;
  plan.may_select = p.length > p.budget;
  // Rows with n > budget have n - n_sink - window >= 1 candidates, at most this many.
  const int64_t max_candidates = plan.may_select ? p.length - p.n_sink - p.window : 0;
  // Without selection the CTAs of a row only write `budget` indices.
  const int64_t work = plan.may_select ? max_candidates : p.budget;
  plan.ctas_per_row =
      std::min(std::max<int64_t>(ceil_div(work, kCandidatesPerCta), 1), kMaxCtasPerRow);
  plan.chunk_len = ceil_div(max_candidates, plan.ctas_per_row);
  if (plan.may_select) {
    plan.hist_bytes = static_cast<size_t>(plan.rows) * kRadixPasses * kRadixBins * sizeof(uint32_t);
    plan.counts_bytes = static_cast<size_t>(plan.rows * plan.ctas_per_row) * sizeof(uint64_t);
    if (p.pool_kernel_size > 1)
      plan.pooled_bytes = static_cast<size_t>(plan.rows * p.length) * sizeof(float);
  }
  return plan;
}

struct SelectArgs {
  const float* scores;             // [rows, length], pooled already (step 0)
  const int32_t* seq_lens;         // [batch] or null
  int32_t* keep_idx;               // out: [rows, budget]
  uint32_t* hist;                  // workspace: [rows, kRadixPasses, kRadixBins]
  unsigned long long* counts;      // workspace: [rows, ctas_per_row], (greater << 32) | equal
  int64_t heads;
  int64_t length;
  int64_t budget;
  int64_t n_sink;
  int64_t window;
  uint32_t ctas_per_row;
  int64_t chunk_len;
};

// What one CTA works on: its row and its chunk [begin, end) of the candidates.
struct CtaTask {
  int64_t row;
  int64_t chunk;
  int64_t n;        // valid length of the row
  int64_t picks;    // budget - n_sink - window
  bool selects;     // n > budget and picks > 0: the row needs the radix select
  int64_t begin;    // first candidate of the chunk
  int64_t end;      // one past the last (end <= begin: empty chunk)
  const float* scores;  // the row's scores [length]
};

__device__ __forceinline__ CtaTask cta_task(const SelectArgs& a) {
  CtaTask task;
  task.row = blockIdx.x / a.ctas_per_row;
  task.chunk = blockIdx.x % a.ctas_per_row;
  task.n = cuda_detail::valid_length(a.seq_lens, task.row / a.heads, a.length);
  task.picks = a.budget - a.n_sink - a.window;
  task.selects = task.n > a.budget && task.picks > 0;
  task.begin = a.n_sink + task.chunk * a.chunk_len;
  task.end = min(task.begin + a.chunk_len, task.n - a.window);
  task.scores = a.scores + task.row * a.length;
  return task;
}

__device__ __forceinline__ uint32_t key_at(const CtaTask& task, int64_t j) {
  return cuda_detail::order_key(__ldg(task.scores + j));
}

__device__ __forceinline__ uint32_t* row_hist(const SelectArgs& a, int64_t row) {
  return a.hist + row * kRadixPasses * kRadixBins;  // [kRadixPasses, kRadixBins]
}

using BlockScan = simt::BlockScan<uint32_t, kBlock>;
using BlockReduce = simt::BlockReduce<unsigned long long, kBlock>;

union SharedStorage {
  cuda_detail::RadixResolveStorage<kBlock> resolve;
  BlockScan::TempStorage scan;
  BlockReduce::TempStorage reduce;
};

// Step 2: histogram of digit `pass` over the chunk's keys that carry the digits
// chosen by passes [0, pass).
__global__ __launch_bounds__(kBlock) void radix_histogram_kernel(SelectArgs a, int pass) {
  KVPRUNE_SHARED(SharedStorage, shared);
  KVPRUNE_SHARED(uint32_t, block_hist, [kRadixBins]);
  const CtaTask task = cta_task(a);
  if (!task.selects) return;  // uniform per CTA

  uint32_t* hist = row_hist(a, task.row);
  block_hist[threadIdx.x] = 0;
  const RadixThreshold chosen =
      cuda_detail::resolve_threshold(hist, pass, static_cast<uint32_t>(task.picks), shared.resolve);
  __syncthreads();  // block_hist zeroed (resolve has no barrier when pass == 0)

  // Block-uniform trip count: count_digit needs whole warps.
  for (int64_t base = task.begin; base < task.end; base += kBlock) {
    const int64_t j = base + threadIdx.x;
    uint32_t digit = cuda_detail::kNoDigit;
    if (j < task.end) {
      const uint32_t key = key_at(task, j);
      if (cuda_detail::has_prefix(key, pass, chosen.prefix))
        digit = cuda_detail::radix_digit(key, pass);
    }
    cuda_detail::count_digit(block_hist, digit);
  }
  __syncthreads();
  const uint32_t count = block_hist[threadIdx.x];
  if (count != 0) atomicAdd(hist + pass * kRadixBins + threadIdx.x, count);
}

// Step 3: per chunk, the number of keys above the threshold and equal to it.
__global__ __launch_bounds__(kBlock) void chunk_count_kernel(SelectArgs a) {
  KVPRUNE_SHARED(SharedStorage, shared);
  const CtaTask task = cta_task(a);
  if (!task.selects) return;  // uniform per CTA

  const RadixThreshold threshold = cuda_detail::resolve_threshold(
      row_hist(a, task.row), kRadixPasses, static_cast<uint32_t>(task.picks), shared.resolve);
  unsigned long long tally = 0;  // (greater << 32) | equal
  for (int64_t j = task.begin + threadIdx.x; j < task.end; j += kBlock) {
    const uint32_t key = key_at(task, j);
    tally += key > threshold.prefix ? (1ull << 32) : (key == threshold.prefix ? 1ull : 0ull);
  }
  tally = BlockReduce(shared.reduce).Sum(tally);  // storage free: resolve ended on a barrier
  if (threadIdx.x == 0) a.counts[task.row * a.ctas_per_row + task.chunk] = tally;
}

// Step 4: write the row's kept positions; see the file comment.
__global__ __launch_bounds__(kBlock) void scatter_keep_kernel(SelectArgs a) {
  KVPRUNE_SHARED(SharedStorage, shared);
  KVPRUNE_SHARED(unsigned long long, counts_before_chunk);
  const CtaTask task = cta_task(a);
  int32_t* out = a.keep_idx + task.row * a.budget;  // [budget]
  const int64_t first = task.chunk * kBlock + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(a.ctas_per_row) * kBlock;

  if (task.n <= a.budget) {  // keep everything, pad with -1
    for (int64_t t = first; t < a.budget; t += stride)
      out[t] = t < task.n ? static_cast<int32_t>(t) : -1;
    return;
  }
  // Sinks go to slots [0, n_sink), the window to [budget - window, budget).
  for (int64_t i = first; i < a.n_sink + a.window; i += stride) {
    const bool sink = i < a.n_sink;
    const int64_t position = sink ? i : task.n - a.window + (i - a.n_sink);
    out[sink ? i : i + task.picks] = static_cast<int32_t>(position);
  }
  if (!task.selects) return;  // uniform per CTA

  const RadixThreshold threshold = cuda_detail::resolve_threshold(
      row_hist(a, task.row), kRadixPasses, static_cast<uint32_t>(task.picks), shared.resolve);
  const uint32_t ties_wanted = threshold.remaining;  // keys == T that are kept, lowest first

  unsigned long long partial = 0;
  for (int64_t c = threadIdx.x; c < task.chunk; c += kBlock)
    partial += a.counts[task.row * a.ctas_per_row + c];
  partial = BlockReduce(shared.reduce).Sum(partial);
  if (threadIdx.x == 0) counts_before_chunk = partial;
  __syncthreads();  // also frees shared.reduce for the scans below
  uint32_t greater_before = static_cast<uint32_t>(counts_before_chunk >> 32);
  uint32_t equal_before = static_cast<uint32_t>(counts_before_chunk);

  // Block-uniform trip count: every thread takes part in every scan.
  for (int64_t base = task.begin; base < task.end; base += kBlock) {
    const int64_t j = base + threadIdx.x;
    const uint32_t key = j < task.end ? key_at(task, j) : 0u;
    const bool greater = j < task.end && key > threshold.prefix;
    const bool equal = j < task.end && key == threshold.prefix;
    // Both flags in one scan: per tile each count is <= kBlock < 2^16.
    uint32_t flags_before, tile_flags;
    BlockScan(shared.scan).ExclusiveSum((static_cast<uint32_t>(greater) << 16) | equal,
                                        flags_before, tile_flags);
    const uint32_t greater_rank = greater_before + (flags_before >> 16);
    const uint32_t equal_rank = equal_before + (flags_before & 0xffffu);
    if (greater || (equal && equal_rank < ties_wanted))
      out[a.n_sink + greater_rank + min(equal_rank, ties_wanted)] = static_cast<int32_t>(j);
    greater_before += tile_flags >> 16;
    equal_before += tile_flags & 0xffffu;
    __syncthreads();  // shared.scan is reused by the next tile
  }
}

}  // namespace

size_t select_keep_workspace_bytes_cuda(const SelectKeepParams& p) {
  if (validate_sizes(p) != Status::kOk) return 0;
  return plan_select(p).bytes();
}

Status select_keep_cuda(const SelectKeepParams& p, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (p.length > INT32_MAX) return Status::kInvalidArgument;  // positions are int32
  const SelectPlan plan = plan_select(p);
  if (workspace_bytes < plan.bytes()) return Status::kWorkspaceTooSmall;
  if (plan.rows == 0) return Status::kOk;
  if (plan.may_select &&
      (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % sizeof(uint64_t) != 0))
    return Status::kInvalidArgument;
  const int64_t blocks = plan.rows * plan.ctas_per_row;
  if (blocks > cuda_detail::kMaxGridBlocks) return Status::kInvalidArgument;

  auto* hist = static_cast<uint32_t*>(workspace);
  const float* scores = p.scores;
  if (plan.pooled_bytes != 0) {  // step 0: pool once; the passes read the pooled row
    auto* pooled = reinterpret_cast<float*>(static_cast<char*>(workspace) + plan.hist_bytes +
                                            plan.counts_bytes);
    PoolScoresParams pool;
    pool.scores_in = p.scores;
    pool.scores_out = pooled;
    pool.seq_lens = p.seq_lens;
    pool.batch = p.batch;
    pool.heads = p.heads;
    pool.length = p.length;
    pool.window = p.window;
    pool.kernel_size = p.pool_kernel_size;
    pool.mode = p.pool_mode;
    pool.shift = p.pool_shift;
    if (auto s = pool_scores_cuda(pool, stream); s != Status::kOk) return s;
    scores = pooled;
  }
  const SelectArgs args{scores,
                        p.seq_lens,
                        p.keep_idx,
                        hist,
                        plan.may_select ? reinterpret_cast<unsigned long long*>(
                                              static_cast<char*>(workspace) + plan.hist_bytes)
                                        : nullptr,
                        p.heads,
                        p.length,
                        p.budget,
                        p.n_sink,
                        p.window,
                        static_cast<uint32_t>(plan.ctas_per_row),
                        plan.chunk_len};
  const auto grid = static_cast<unsigned>(blocks);
  if (plan.may_select) {
    if (simt::memset_async(hist, 0, plan.hist_bytes, stream) != cudaSuccess) return Status::kCudaError;
    for (int pass = 0; pass < kRadixPasses; ++pass)
      simt::launch<radix_histogram_kernel>(grid, kBlock, 0, stream, args, pass);
    simt::launch<chunk_count_kernel>(grid, kBlock, 0, stream, args);
  }
  simt::launch<scatter_keep_kernel>(grid, kBlock, 0, stream, args);
  return cuda_detail::launch_status();
}

KVPRUNE_CUDA_NAMESPACE_END
