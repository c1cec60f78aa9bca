// CUDA window_scores (DESIGN §1 stage 2, §5): SnapKV observation-window voting.
//
// Paths
//  * tensor cores (window_scores_mma.cuh): fp16/bf16, head_dim 64/128/256, q and k
//    pointers and strides in 16-byte multiples, and one query head's rows fit in
//    shared memory;
//  * CUDA cores (window_scores_simt.cuh): everything else.
// Passes
//  * lse given: one probs pass writes the scores;
//  * no lse: a stats pass writes per-chunk softmax states, a combine kernel turns
//    them into lse, then the probs pass runs on that lse.
// qreduce = max takes a max instead of a sum over a head's rows in the probs pass and
// finishes each head before the GQA reduction, where its key weights apply; query
// weights are folded into the lse the probs pass reads (by the combine kernel, or by a
// weighting kernel into the workspace when the caller gave the lse). With fold_length = M > 0 the probs
// pass covers keys [0, M) only and folds them into the caller's scores at the final
// store (probs kernel, or split reduce).
// When the tensor-core path spreads a group's query heads over several CTAs (too
// many rows for shared memory, or key weights: one head per CTA, weighted at the
// store), the probs pass writes one score array per split into the workspace and a
// split-reduce kernel finishes the scores.
//
// Workspace layout (only the parts needed, each 256-byte aligned):
//   stats    float2 [num_chunks, batch*q_heads*window]   no lse
//   lse      float  [batch, q_heads, window]              no lse, or query weights
//   partial  float  [splits, batch, kv_heads, M]          splits > 1 (M = score row length)

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "cuda/simt.cuh"
#include "core/validate.h"
#include "cuda/window_scores_mma.cuh"
#include "cuda/window_scores_reduce.cuh"
#include "cuda/window_scores_simt.cuh"
#include "kvprune/kvprune.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace {

using window_scores_impl::KernelArgs;
using window_scores_impl::MmaShape;
using window_scores_impl::Pass;
using window_scores_impl::SimtShape;

// ---- launch heuristics ----------------------------------------------------------
constexpr int64_t kTargetCtasPerSm = 4;     // key chunks are sized for about this many CTAs
constexpr int64_t kMaxTilesPerChunk = 64;   // key tiles one CTA walks at most
constexpr int kReduceThreads = 256;         // threads per CTA of the small kernels
constexpr int64_t kMaxGridX = 0x7fffffff;
constexpr int64_t kMaxGridY = 65535;
// Key positions are 32-bit in the kernels; one chunk past the end must still fit.
constexpr int64_t kMaxLength = INT32_MAX - kMaxTilesPerChunk * MmaShape<64>::kTileKeys;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
size_t align_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

struct DeviceLimits {
  int64_t sm_count = 0;
  int64_t max_smem_per_cta = 0;  // opt-in dynamic shared memory
};

bool query_device_limits(DeviceLimits* limits) {
  simt::DeviceProperties props;
  if (!simt::current_device_properties(&props)) return false;
  *limits = {props.sm_count, props.max_dynamic_smem_optin};
  return true;
}

// How one pass is cut into CTAs: grid (num_chunks * batch * kv_heads, splits).
struct PassPlan {
  bool fits = false;           // tensor cores: one query head's rows fit in shared memory
  int64_t tile_keys = 0;       // keys per CTA iteration
  int64_t tiles_per_chunk = 1; // key tiles per CTA
  int64_t num_chunks = 0;      // CTAs along the keys of one (batch, kv head)
  int64_t heads_per_cta = 0;   // query heads of a group per CTA
  int64_t splits = 1;          // CTAs along the query heads of a group
  size_t smem_bytes = 0;       // dynamic shared memory per CTA
};

struct Plan {
  bool tensor_cores = false;
  PassPlan stats;  // pass 1, only without lse
  PassPlan probs;  // pass 2
};

int64_t group_size(const WindowScoresParams& p) { return p.q_heads / p.kv_heads; }

// Keys a pass walks: the stats cover all N (the normaliser), the probs only the
// score row's keys (M when folding).
int64_t pass_keys(const WindowScoresParams& p, Pass pass) {
  return pass == Pass::kProbs ? score_row_length(p) : p.length;
}

PassPlan simt_plan(const WindowScoresParams& p, Pass pass) {
  PassPlan plan;
  plan.fits = true;
  plan.tile_keys = SimtShape::kTileKeys;
  plan.num_chunks = ceil_div(pass_keys(p, pass), plan.tile_keys);
  plan.heads_per_cta = group_size(p);
  return plan;
}

template <int kHeadDim>
PassPlan mma_plan(const WindowScoresParams& p, Pass pass, const DeviceLimits& dev) {
  using Shape = MmaShape<kHeadDim>;
  PassPlan plan;
  const int64_t group = group_size(p);
  const int64_t head_bytes = 16 * ceil_div(p.window, 16) * Shape::row_bytes(pass);
  // Key weights apply to each query head's maxima (kProbsMax): one head per CTA.
  const int64_t heads = pass == Pass::kProbs && p.key_weight != nullptr ? 1 : group;
  const int64_t heads_that_fit = std::min(heads, dev.max_smem_per_cta / head_bytes);
  if (heads_that_fit < 1) return plan;
  plan.fits = true;
  plan.splits = ceil_div(group, heads_that_fit);
  plan.heads_per_cta = ceil_div(group, plan.splits);
  plan.smem_bytes = static_cast<size_t>(plan.heads_per_cta * head_bytes);
  plan.tile_keys = Shape::kTileKeys;
  const int64_t tiles = ceil_div(pass_keys(p, pass), plan.tile_keys);
  const int64_t work = tiles * p.batch * p.kv_heads * plan.splits;
  plan.tiles_per_chunk = std::clamp(ceil_div(work, kTargetCtasPerSm * dev.sm_count), int64_t{1},
                                    std::min(tiles, kMaxTilesPerChunk));
  plan.num_chunks = ceil_div(tiles, plan.tiles_per_chunk);
  return plan;
}

PassPlan mma_plan_for_dim(const WindowScoresParams& p, Pass pass, const DeviceLimits& dev) {
  switch (p.head_dim) {
    case 64: return mma_plan<64>(p, pass, dev);
    case 128: return mma_plan<128>(p, pass, dev);
    default: return mma_plan<256>(p, pass, dev);
  }
}

bool mma_dtype_and_dim(const WindowScoresParams& p) {
  return (p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16) &&
         (p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256);
}

// 16-byte fragments: base pointer and every stride that matters in 8-element multiples.
bool mma_aligned(const ConstTokens& t, int64_t batch, int64_t heads, int64_t tokens) {
  const bool blocks = t.paged.blocks == nullptr || t.paged.block_stride % 8 == 0;
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && (batch == 1 || t.batch_stride % 8 == 0) &&
         (heads == 1 || t.head_stride % 8 == 0) && (tokens == 1 || t.token_stride % 8 == 0) && blocks;
}

// check_alignment = false plans as if the pointers and strides were aligned (the
// workspace query covers both paths).
Plan make_plan(const WindowScoresParams& p, const DeviceLimits& dev, bool check_alignment) {
  Plan plan;
  if (mma_dtype_and_dim(p) &&
      (!check_alignment || (mma_aligned(p.q, p.batch, p.q_heads, p.window) &&
                            mma_aligned(p.k, p.batch, p.kv_heads, p.length)))) {
    plan.probs = mma_plan_for_dim(p, Pass::kProbs, dev);
    if (p.lse == nullptr) plan.stats = mma_plan_for_dim(p, Pass::kStats, dev);
    plan.tensor_cores = plan.probs.fits && (p.lse != nullptr || plan.stats.fits);
  }
  if (!plan.tensor_cores) {
    plan.stats = simt_plan(p, Pass::kStats);
    plan.probs = simt_plan(p, Pass::kProbs);
  }
  return plan;
}

struct WorkspaceLayout {  // byte offsets into the workspace
  size_t stats = 0;
  size_t lse = 0;
  size_t partial = 0;
  size_t total = 0;
};

WorkspaceLayout workspace_layout(const WindowScoresParams& p, const Plan& plan) {
  WorkspaceLayout layout;
  const size_t rows_total = static_cast<size_t>(p.batch * p.q_heads * p.window);
  size_t offset = 0;
  if (p.lse == nullptr) {
    layout.stats = offset;
    offset = align_256(offset + static_cast<size_t>(plan.stats.num_chunks) * rows_total * sizeof(float2));
  }
  if (p.lse == nullptr || p.query_weight != nullptr) {
    layout.lse = offset;
    offset = align_256(offset + rows_total * sizeof(float));
  }
  if (plan.probs.splits > 1) {
    layout.partial = offset;
    offset += static_cast<size_t>(plan.probs.splits * p.batch * p.kv_heads * score_row_length(p)) *
              sizeof(float);
  }
  layout.total = offset;
  return layout;
}

bool grid_fits(const WindowScoresParams& p, const PassPlan& plan) {
  return plan.num_chunks * p.batch * p.kv_heads <= kMaxGridX && plan.splits <= kMaxGridY &&
         plan.tiles_per_chunk <= INT32_MAX;
}

KernelArgs pass_args(const WindowScoresParams& p, const PassPlan& plan) {
  KernelArgs a{};
  a.q = p.q.data;
  a.q_batch_stride = p.q.batch_stride;
  a.q_head_stride = p.q.head_stride;
  a.q_token_stride = p.q.token_stride;
  a.k = p.k.data;
  a.k_batch_stride = p.k.batch_stride;
  a.k_head_stride = p.k.head_stride;
  a.k_token_stride = p.k.token_stride;
  a.k_scale = p.k_scale;
  a.k_scale_per_head = p.k_scale_count > 1 ? 1 : 0;
  a.k_blocks = p.k.paged.blocks;
  a.k_table_stride = p.k.paged.table_stride;
  a.k_block_stride = p.k.paged.block_stride;
  a.k_block_size = static_cast<int>(p.k.paged.block_size);
  a.lse = p.lse;
  a.seq_lens = p.seq_lens;
  a.length = static_cast<int>(p.length);
  a.out_length = static_cast<int>(score_row_length(p));
  a.fold = p.fold_length > 0 ? 1 : 0;
  a.batch = static_cast<int>(p.batch);
  a.q_heads = static_cast<int>(p.q_heads);
  a.kv_heads = static_cast<int>(p.kv_heads);
  a.group = static_cast<int>(group_size(p));
  a.window = static_cast<int>(p.window);
  a.head_dim = static_cast<int>(p.head_dim);
  a.reduce_max = p.reduce == GqaReduce::kMax ? 1 : 0;
  a.scale_log2 = p.scale * window_scores_impl::kLog2e;
  a.out_scale = 1.f;
  a.key_weight = p.key_weight;
  a.heads_per_cta = static_cast<int>(plan.heads_per_cta);
  a.tiles_per_chunk = static_cast<int>(plan.tiles_per_chunk);
  a.num_chunks = static_cast<int>(plan.num_chunks);
  return a;
}

template <typename T, int kHeadDim, Pass kPass, typename KT>
cudaError_t launch_mma(const KernelArgs& a, const PassPlan& plan, int64_t rows_bh,
                       int64_t max_smem, cudaStream_t stream) {
  constexpr auto kernel = &window_scores_impl::window_scores_mma_kernel<T, kHeadDim, kPass, KT>;
  // The attribute is process-wide state of this kernel. Setting it to each call's own
  // size would let a call with a smaller plan lower it under another host thread's
  // pending launch (or a captured graph replayed later): launch failure. So it only
  // ever grows (under a lock), clamped to this device's opt-in limit, which every
  // plan fits. Host-only calls: legal during stream capture.
  static std::mutex mutex;
  static int64_t raised = 0;
  cudaError_t err;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    raised = std::max(raised, static_cast<int64_t>(plan.smem_bytes));
    err = simt::set_max_dynamic_smem(kernel, static_cast<int>(std::min(raised, max_smem)));
  }
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(plan.num_chunks * rows_bh), static_cast<unsigned>(plan.splits));
  simt::launch<kernel>(grid, MmaShape<kHeadDim>::kThreads, plan.smem_bytes, stream, a);
  return simt::get_last_error();
}

template <typename T, Pass kPass, typename KT>
cudaError_t launch_simt(const KernelArgs& a, const PassPlan& plan, int64_t rows_bh,
                        cudaStream_t stream) {
  const auto grid = static_cast<unsigned>(plan.num_chunks * rows_bh);
  simt::launch<window_scores_impl::window_scores_simt_kernel<T, kPass, KT>>(
      grid, SimtShape::kThreads, 0, stream, a);
  return simt::get_last_error();
}

template <typename T, int kHeadDim, Pass kPass>
cudaError_t launch_mma_for_key(const WindowScoresParams& p, const KernelArgs& a,
                               const PassPlan& plan, int64_t rows_bh, int64_t max_smem,
                               cudaStream_t stream) {
  switch (key_dtype(p)) {
    case DType::kFloat8E4M3: return launch_mma<T, kHeadDim, kPass, Fp8E4M3>(a, plan, rows_bh, max_smem, stream);
    case DType::kFloat8E5M2: return launch_mma<T, kHeadDim, kPass, Fp8E5M2>(a, plan, rows_bh, max_smem, stream);
    default: return launch_mma<T, kHeadDim, kPass, T>(a, plan, rows_bh, max_smem, stream);
  }
}

template <typename T, Pass kPass>
cudaError_t launch_simt_for_key(const WindowScoresParams& p, const KernelArgs& a,
                                const PassPlan& plan, int64_t rows_bh, cudaStream_t stream) {
  switch (key_dtype(p)) {
    case DType::kFloat8E4M3: return launch_simt<T, kPass, Fp8E4M3>(a, plan, rows_bh, stream);
    case DType::kFloat8E5M2: return launch_simt<T, kPass, Fp8E5M2>(a, plan, rows_bh, stream);
    default: return launch_simt<T, kPass, T>(a, plan, rows_bh, stream);
  }
}

template <Pass kPass>
cudaError_t launch_pass(const WindowScoresParams& p, bool tensor_cores, const KernelArgs& a,
                        const PassPlan& plan, int64_t max_smem, cudaStream_t stream) {
  const int64_t rows_bh = p.batch * p.kv_heads;
  if (!tensor_cores) {
    switch (p.dtype) {
      case DType::kFloat16: return launch_simt_for_key<__half, kPass>(p, a, plan, rows_bh, stream);
      case DType::kBFloat16: return launch_simt_for_key<__nv_bfloat16, kPass>(p, a, plan, rows_bh, stream);
      default: return launch_simt_for_key<float, kPass>(p, a, plan, rows_bh, stream);
    }
  }
  const bool bf16 = p.dtype == DType::kBFloat16;
  switch (p.head_dim) {
    case 64:
      return bf16 ? launch_mma_for_key<__nv_bfloat16, 64, kPass>(p, a, plan, rows_bh, max_smem, stream)
                  : launch_mma_for_key<__half, 64, kPass>(p, a, plan, rows_bh, max_smem, stream);
    case 128:
      return bf16 ? launch_mma_for_key<__nv_bfloat16, 128, kPass>(p, a, plan, rows_bh, max_smem, stream)
                  : launch_mma_for_key<__half, 128, kPass>(p, a, plan, rows_bh, max_smem, stream);
    default:
      return bf16 ? launch_mma_for_key<__nv_bfloat16, 256, kPass>(p, a, plan, rows_bh, max_smem, stream)
                  : launch_mma_for_key<__half, 256, kPass>(p, a, plan, rows_bh, max_smem, stream);
  }
}

unsigned small_kernel_blocks(int64_t items, const DeviceLimits& dev) {
  return static_cast<unsigned>(
      std::clamp(ceil_div(items, kReduceThreads), int64_t{1}, 32 * dev.sm_count));
}

}  // namespace

size_t window_scores_workspace_bytes_cuda(const WindowScoresParams& p) {
  if (validate_sizes(p) != Status::kOk || p.batch == 0 || p.length == 0) return 0;
  DeviceLimits dev;
  if (!query_device_limits(&dev)) return 0;
  const Plan simt{false, simt_plan(p, Pass::kStats), simt_plan(p, Pass::kProbs)};
  return std::max(workspace_layout(p, make_plan(p, dev, false)).total,
                  workspace_layout(p, simt).total);
}

Status window_scores_cuda(const WindowScoresParams& p, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (workspace_bytes < window_scores_workspace_bytes_cuda(p)) return Status::kWorkspaceTooSmall;
  if (p.batch == 0 || p.length == 0) return Status::kOk;
  if (p.length > kMaxLength || p.head_dim > INT32_MAX || p.batch * p.kv_heads > INT32_MAX ||
      p.q_heads * p.window > INT32_MAX)
    return Status::kInvalidArgument;
  DeviceLimits dev;
  if (!query_device_limits(&dev)) return Status::kCudaError;
  const Plan plan = make_plan(p, dev, true);
  if (!grid_fits(p, plan.probs) || (p.lse == nullptr && !grid_fits(p, plan.stats)))
    return Status::kInvalidArgument;
  const WorkspaceLayout layout = workspace_layout(p, plan);
  if (layout.total > 0 && (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 8 != 0))
    return Status::kInvalidArgument;  // the stats are float2
  char* ws = static_cast<char*>(workspace);
  const float mean_scale = p.reduce == GqaReduce::kMean ? 1.f / static_cast<float>(group_size(p)) : 1.f;

  KernelArgs probs = pass_args(p, plan.probs);
  const int64_t rows_total = p.batch * p.q_heads * p.window;
  float* lse = reinterpret_cast<float*>(ws + layout.lse);
  if (p.lse != nullptr && p.query_weight != nullptr) {
    simt::launch<window_scores_impl::window_scores_lse_weight_kernel>(
        small_kernel_blocks(rows_total, dev), kReduceThreads, 0, stream, p.lse, p.query_weight, lse,
        rows_total);
    probs.lse = lse;
  }
  if (p.lse == nullptr) {
    KernelArgs stats = pass_args(p, plan.stats);
    stats.stats = reinterpret_cast<float2*>(ws + layout.stats);
    if (launch_pass<Pass::kStats>(p, plan.tensor_cores, stats, plan.stats, dev.max_smem_per_cta,
                                  stream) != cudaSuccess)
      return Status::kCudaError;
    simt::launch<window_scores_impl::window_scores_lse_combine_kernel>(
        small_kernel_blocks(rows_total, dev), kReduceThreads, 0, stream, stats.stats, p.seq_lens,
        p.query_weight, lse, rows_total, p.q_heads * p.window, stats.length,
        static_cast<int>(plan.stats.tiles_per_chunk * plan.stats.tile_keys));
    probs.lse = lse;
  }
  const bool split = plan.probs.splits > 1;
  float* partial = reinterpret_cast<float*>(ws + layout.partial);
  probs.out = split ? partial : p.scores;
  probs.out_scale = split ? 1.f : mean_scale;
  probs.fold = split ? 0 : probs.fold;  // the split reduce folds
  const bool query_max = p.qreduce == QueryReduce::kMax;
  const cudaError_t err =
      query_max ? launch_pass<Pass::kProbsMax>(p, plan.tensor_cores, probs, plan.probs,
                                               dev.max_smem_per_cta, stream)
                : launch_pass<Pass::kProbs>(p, plan.tensor_cores, probs, plan.probs,
                                            dev.max_smem_per_cta, stream);
  if (err != cudaSuccess) return Status::kCudaError;
  if (split) {
    const int64_t count = p.batch * p.kv_heads * score_row_length(p);
    simt::launch<window_scores_impl::window_scores_split_reduce_kernel>(
        small_kernel_blocks(count, dev), kReduceThreads, 0, stream, partial, p.scores, count,
        static_cast<int>(plan.probs.splits), probs.reduce_max, mean_scale,
        p.fold_length > 0 ? 1 : 0, query_max ? 1 : 0);
  }
  return simt::get_last_error() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

KVPRUNE_CUDA_NAMESPACE_END
