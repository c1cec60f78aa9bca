// Device-agnostic op bodies: argument checks, output allocation, params structs.
// The Backend does the work on the tensors' device (and stream).
#include "torch/ops.h"

#include <c10/core/DeviceGuard.h>

#include <cmath>

#include "torch/checks.h"

namespace kvprune::torch_ext {
namespace {

void check_cache_pair(const at::Tensor& k, const at::Tensor& v) {
  check_tokens(k, "k", /*fp8_ok=*/true);
  check_tokens(v, "v", /*fp8_ok=*/true);
  check_same_device(v, "v", k, "k");
  TORCH_CHECK_TYPE(v.scalar_type() == k.scalar_type(), "v must have the dtype of k (",
                   k.scalar_type(), "), got ", v.scalar_type());
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), "v must have the shape of k ", k.sizes(), ", got ",
                    v.sizes());
}

void check_budget(int64_t budget, int64_t n_sink, int64_t window) {
  TORCH_CHECK_VALUE(n_sink >= 0, "n_sink must be >= 0, got ", n_sink);
  TORCH_CHECK_VALUE(window >= 0, "window must be >= 0, got ", window);
  TORCH_CHECK_VALUE(budget >= 1 && budget >= n_sink + window, "budget (", budget,
                    ") must be >= 1 and >= n_sink + window (", n_sink, " + ", window, ")");
}

// A pool's kernel_size and its shift (named `name`: shift, pool_shift).
void check_pool(int64_t kernel_size, int64_t shift, const char* name) {
  TORCH_CHECK_VALUE(kernel_size >= 1 && kernel_size % 2 == 1,
                    "kernel_size must be an odd integer >= 1, got ", kernel_size);
  TORCH_CHECK_VALUE(shift >= 0 && shift <= kernel_size / 2, name, " must lie in [0, kernel_size / 2 = ",
                    kernel_size / 2, "], got ", shift);
}

WindowScoresParams window_scores_params(const at::Tensor& q, const at::Tensor& k,
                                        const std::optional<at::Tensor>& lse,
                                        std::optional<double> scale, const std::string& gqa,
                                        const std::optional<at::Tensor>& seq_lens,
                                        const std::optional<at::Tensor>& k_scale) {
  check_tokens(q, "q");
  check_tokens(k, "k", /*fp8_ok=*/true);
  check_same_device(k, "k", q, "q");
  const int64_t batch = q.size(0), q_heads = q.size(1), window = q.size(2), head_dim = q.size(3);
  const int64_t kv_heads = k.size(1), length = k.size(2);
  TORCH_CHECK_VALUE(k.size(0) == batch, "k batch (", k.size(0), ") must equal q batch (", batch, ")");
  TORCH_CHECK_VALUE(k.size(3) == head_dim, "k head_dim (", k.size(3), ") must equal q head_dim (",
                    head_dim, ")");
  TORCH_CHECK_VALUE(kv_heads >= 1 && q_heads % kv_heads == 0, "q heads (", q_heads,
                    ") must be a multiple of k heads (", kv_heads, ")");
  TORCH_CHECK_VALUE(window >= 1, "q must hold at least one window query (q.shape[2] >= 1)");
  TORCH_CHECK_VALUE(seq_lens.has_value() || window <= length, "q window (", window,
                    " queries) exceeds the cache length of k (", length, ")");
  WindowScoresParams p;
  p.q = const_tokens(q);
  p.k = const_tokens(k);
  p.dtype = core_dtype(q, "q");
  p.batch = batch;
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.length = length;
  p.window = window;
  p.head_dim = head_dim;
  p.scale = softmax_scale(scale, head_dim);
  p.reduce = parse_gqa(gqa);
  p.seq_lens = seq_lens_data(seq_lens, batch, q);
  p.lse = lse_data(lse, q);
  set_key_type(p, k, "k", q, k_scale);
  return p;
}

// Selection over [batch, heads, length] scores (pointers are set by the caller).
SelectKeepParams select_params(int64_t batch, int64_t heads, int64_t length, const int32_t* seq_lens,
                               int64_t budget, int64_t n_sink, int64_t window) {
  check_budget(budget, n_sink, window);
  SelectKeepParams p;
  p.seq_lens = seq_lens;
  p.batch = batch;
  p.heads = heads;
  p.length = length;
  p.budget = budget;
  p.n_sink = n_sink;
  p.window = window;
  return p;
}

GatherKvParams gather_params(const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx,
                             at::Tensor& out_k, at::Tensor& out_v) {
  GatherKvParams p;
  p.k = const_tokens(k);
  p.v = const_tokens(v);
  p.keep_idx = idx.data_ptr<int32_t>();
  p.out_k = mutable_tokens(out_k);
  p.out_v = mutable_tokens(out_v);
  p.dtype = storage_dtype(k, "k");
  p.batch = k.size(0);
  p.heads = k.size(1);
  p.length = k.size(2);
  p.budget = idx.size(2);
  p.head_dim = k.size(3);
  return p;
}

void check_index(const at::Tensor& idx, const at::Tensor& k) {
  TORCH_CHECK_TYPE(idx.scalar_type() == at::kInt, "idx must be int32, got ", idx.scalar_type());
  TORCH_CHECK_VALUE(idx.dim() == 3 && idx.size(0) == k.size(0) && idx.size(1) == k.size(1),
                    "idx must have shape [", k.size(0), ", ", k.size(1), ", budget], got ", idx.sizes());
  TORCH_CHECK_VALUE(idx.is_contiguous(), "idx must be contiguous");
  check_same_device(idx, "idx", k, "k");
}

at::Tensor empty_like_kept(const at::Tensor& k, int64_t budget) {
  return at::empty({k.size(0), k.size(1), budget, k.size(3)}, k.options());
}

}  // namespace

namespace {

QueryReduce parse_qreduce(const std::string& qreduce) {
  if (qreduce == "sum") return QueryReduce::kSum;
  TORCH_CHECK_VALUE(qreduce == "max", "qreduce must be 'sum' or 'max', got '", qreduce, "'");
  return QueryReduce::kMax;
}

// out: an existing fp32 [B, Hkv, M] score tensor, 1 <= M <= N, that the op folds into.
void check_fold_out(const at::Tensor& out, const WindowScoresParams& p, const at::Tensor& q,
                    const at::Tensor& k, const std::optional<at::Tensor>& lse,
                    const std::optional<at::Tensor>& seq_lens) {
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, "out must be float32, got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.dim() == 3 && out.size(0) == p.batch && out.size(1) == p.kv_heads,
                    "out must have shape [", p.batch, ", ", p.kv_heads, ", M], got ", out.sizes());
  TORCH_CHECK_VALUE(out.size(2) >= 1 && out.size(2) <= p.length, "out: M = out.shape[2] (",
                    out.size(2), ") must lie in [1, N] with N = ", p.length, " (k.shape[2])");
  TORCH_CHECK_VALUE(out.is_contiguous(), "out must be contiguous");
  check_same_device(out, "out", q, "q");
  check_disjoint(out, "out", q, "q");
  check_disjoint(out, "out", k, "k");
  if (lse.has_value()) check_disjoint(out, "out", *lse, "lse");
  if (seq_lens.has_value()) check_disjoint(out, "out", *seq_lens, "seq_lens");
}

// KVzip+'s weights (qreduce "max" only): query_weight fp32 [B, Hq, W], key_weight fp32
// [B, Hq, M] for the score row's M keys; neither may overlap scores (out).
void set_weights(WindowScoresParams& p, const at::Tensor& q, const std::optional<at::Tensor>& query_weight,
                 const std::optional<at::Tensor>& key_weight, const at::Tensor* out) {
  if (!query_weight.has_value() && !key_weight.has_value()) return;
  TORCH_CHECK_VALUE(p.qreduce == QueryReduce::kMax,
                    "query_weight and key_weight weigh the maxima: they need qreduce='max'");
  p.query_weight = per_query_head_data(query_weight, "query_weight", p.window, q);
  p.key_weight = per_query_head_data(key_weight, "key_weight", score_row_length(p), q);
  if (out == nullptr) return;
  if (query_weight.has_value()) check_disjoint(*out, "out", *query_weight, "query_weight");
  if (key_weight.has_value()) check_disjoint(*out, "out", *key_weight, "key_weight");
}

void run_window_scores(const Backend& be, WindowScoresParams& p, const at::Tensor& q,
                       float* scores) {
  const c10::DeviceGuard guard(q.device());
  p.scores = scores;
  const size_t ws_bytes = be.window_scores_workspace(p);
  at::Tensor ws = allocate_workspace(ws_bytes, q);
  check_status(be.window_scores(p, ws.data_ptr(), ws_bytes), "window_scores");
}

}  // namespace

at::Tensor window_scores(const Backend& be, const at::Tensor& q, const at::Tensor& k,
                         const std::optional<at::Tensor>& lse, std::optional<double> scale,
                         const std::string& gqa, const std::optional<at::Tensor>& seq_lens,
                         const std::string& qreduce, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& query_weight,
                         const std::optional<at::Tensor>& key_weight) {
  WindowScoresParams p = window_scores_params(q, k, lse, scale, gqa, seq_lens, k_scale);
  p.qreduce = parse_qreduce(qreduce);
  set_weights(p, q, query_weight, key_weight, nullptr);
  at::Tensor scores = at::empty({p.batch, p.kv_heads, p.length}, q.options().dtype(at::kFloat));
  run_window_scores(be, p, q, scores.data_ptr<float>());
  return scores;
}

void window_scores_out(const Backend& be, const at::Tensor& q, const at::Tensor& k,
                       const std::optional<at::Tensor>& lse, std::optional<double> scale,
                       const std::string& gqa, const std::optional<at::Tensor>& seq_lens,
                       const std::string& qreduce, at::Tensor& out,
                       const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& query_weight,
                       const std::optional<at::Tensor>& key_weight) {
  WindowScoresParams p = window_scores_params(q, k, lse, scale, gqa, seq_lens, k_scale);
  p.qreduce = parse_qreduce(qreduce);
  check_fold_out(out, p, q, k, lse, seq_lens);
  p.fold_length = out.size(2);
  set_weights(p, q, query_weight, key_weight, &out);
  run_window_scores(be, p, q, out.data_ptr<float>());
}

at::Tensor pool_scores(const Backend& be, const at::Tensor& scores, int64_t kernel_size,
                       const std::string& mode, int64_t window,
                       const std::optional<at::Tensor>& seq_lens, int64_t shift) {
  check_scores(scores, "scores");
  check_pool(kernel_size, shift, "shift");
  TORCH_CHECK_VALUE(window >= 0, "window must be >= 0, got ", window);
  const c10::DeviceGuard guard(scores.device());
  at::Tensor out = at::empty_like(scores);
  PoolScoresParams p;
  p.scores_in = scores.data_ptr<float>();
  p.scores_out = out.data_ptr<float>();
  p.seq_lens = seq_lens_data(seq_lens, scores.size(0), scores);
  p.batch = scores.size(0);
  p.heads = scores.size(1);
  p.length = scores.size(2);
  p.window = window;
  p.kernel_size = kernel_size;
  p.mode = parse_pool(mode, "mode");
  p.shift = shift;
  check_status(be.pool_scores(p), "pool_scores");
  return out;
}

at::Tensor select_keep(const Backend& be, const at::Tensor& scores, int64_t budget, int64_t n_sink,
                       int64_t window, const std::optional<at::Tensor>& seq_lens) {
  check_scores(scores, "scores");
  SelectKeepParams p = select_params(scores.size(0), scores.size(1), scores.size(2),
                                     seq_lens_data(seq_lens, scores.size(0), scores), budget,
                                     n_sink, window);
  p.scores = scores.data_ptr<float>();
  const c10::DeviceGuard guard(scores.device());
  at::Tensor idx = at::empty({p.batch, p.heads, budget}, scores.options().dtype(at::kInt));
  p.keep_idx = idx.data_ptr<int32_t>();
  const size_t ws_bytes = be.select_keep_workspace(p);
  at::Tensor ws = allocate_workspace(ws_bytes, scores);
  check_status(be.select_keep(p, ws.data_ptr(), ws_bytes), "select_keep");
  return idx;
}

GatherKvParams checked_gather_params(const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& idx, at::Tensor& out_k, at::Tensor& out_v) {
  check_cache_pair(k, v);
  check_index(idx, k);
  for (const auto& [out, name] : {std::pair{&out_k, "out_k"}, std::pair{&out_v, "out_v"}}) {
    check_tokens(*out, name, /*fp8_ok=*/true);
    check_same_device(*out, name, k, "k");
    TORCH_CHECK_TYPE(out->scalar_type() == k.scalar_type(), name, " must have the dtype of k (",
                     k.scalar_type(), "), got ", out->scalar_type());
    TORCH_CHECK_VALUE(out->size(0) == k.size(0) && out->size(1) == k.size(1) &&
                          out->size(2) == idx.size(2) && out->size(3) == k.size(3),
                      name, " must have shape [", k.size(0), ", ", k.size(1), ", ", idx.size(2), ", ",
                      k.size(3), "], got ", out->sizes());
  }
  // Rows are copied in parallel: an output sharing memory with an input or with
  // the other output would race.
  check_no_self_overlap(out_k, "out_k");
  check_no_self_overlap(out_v, "out_v");
  for (const auto& [in, in_name] : {std::pair{&k, "k"}, std::pair{&v, "v"}, std::pair{&idx, "idx"}}) {
    check_disjoint(out_k, "out_k", *in, in_name);
    check_disjoint(out_v, "out_v", *in, in_name);
  }
  check_disjoint(out_k, "out_k", out_v, "out_v");
  return gather_params(k, v, idx, out_k, out_v);
}

namespace {

void gather_into(const Backend& be, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& idx, at::Tensor& out_k, at::Tensor& out_v, bool fresh_outputs) {
  GatherKvParams p = checked_gather_params(k, v, idx, out_k, out_v);
  p.fresh_outputs = fresh_outputs;
  const c10::DeviceGuard guard(k.device());
  check_status(be.gather_kv(p), "gather_kv");
}

}  // namespace

void gather_kv_out(const Backend& be, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& idx, at::Tensor& out_k, at::Tensor& out_v) {
  gather_into(be, k, v, idx, out_k, out_v, /*fresh_outputs=*/false);
}

TensorPair gather_kv(const Backend& be, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& idx) {
  check_cache_pair(k, v);
  check_index(idx, k);
  at::Tensor out_k = empty_like_kept(k, idx.size(2));
  at::Tensor out_v = empty_like_kept(v, idx.size(2));
  gather_into(be, k, v, idx, out_k, out_v, /*fresh_outputs=*/true);
  return {out_k, out_v};
}

namespace {

// The chain's scoring and selection of q, k (SnapKvParams without its gather), into idx
// int32 [B, Hkv, budget], allocated here.
SnapKvParams snapkv_selection(const at::Tensor& q, const at::Tensor& k, int64_t budget,
                              int64_t n_sink, int64_t window, int64_t kernel_size,
                              int64_t pool_shift, const std::string& pool, const std::string& gqa,
                              const std::optional<at::Tensor>& lse, std::optional<double> scale,
                              const std::optional<at::Tensor>& seq_lens,
                              const std::optional<at::Tensor>& k_scale, at::Tensor& idx) {
  check_pool(kernel_size, pool_shift, "pool_shift");
  SnapKvParams p;
  p.scores = window_scores_params(q, k, lse, scale, gqa, seq_lens, k_scale);
  p.select = select_params(p.scores.batch, p.scores.kv_heads, p.scores.length, p.scores.seq_lens,
                           budget, n_sink, window);
  p.select.pool_kernel_size = kernel_size;
  p.select.pool_mode = parse_pool(pool, "pool");
  p.select.pool_shift = pool_shift;
  idx = at::empty({p.scores.batch, p.scores.kv_heads, budget}, q.options().dtype(at::kInt));
  p.select.keep_idx = idx.data_ptr<int32_t>();
  return p;
}

// Runs the chain p on q's device; its scores and scratch live in the workspace.
void run_snapkv(const Backend& be, const SnapKvParams& p, const at::Tensor& q) {
  const c10::DeviceGuard guard(q.device());
  const size_t ws_bytes = be.snapkv_workspace(p);
  at::Tensor ws = allocate_workspace(ws_bytes, q);
  check_status(be.snapkv(p, ws.data_ptr(), ws_bytes), "snapkv");
}

// The chain into out_k / out_v (fresh: just allocated here, else the caller's).
at::Tensor snapkv_into(const Backend& be, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, int64_t budget, int64_t n_sink, int64_t window,
                       int64_t kernel_size, int64_t pool_shift, const std::string& pool,
                       const std::string& gqa, const std::optional<at::Tensor>& lse,
                       std::optional<double> scale, const std::optional<at::Tensor>& seq_lens,
                       const std::optional<at::Tensor>& k_scale, at::Tensor& out_k,
                       at::Tensor& out_v, bool fresh) {
  at::Tensor idx;
  SnapKvParams p = snapkv_selection(q, k, budget, n_sink, window, kernel_size, pool_shift, pool,
                                    gqa, lse, scale, seq_lens, k_scale, idx);
  p.gather = fresh ? gather_params(k, v, idx, out_k, out_v)
                   : checked_gather_params(k, v, idx, out_k, out_v);
  p.gather.fresh_outputs = fresh;
  run_snapkv(be, p, q);
  return idx;
}

}  // namespace

at::Tensor snapkv_select(const Backend& be, const at::Tensor& q, const at::Tensor& k,
                         int64_t budget, int64_t n_sink, int64_t window, int64_t kernel_size,
                         const std::string& pool, const std::string& gqa,
                         const std::optional<at::Tensor>& lse, std::optional<double> scale,
                         const std::optional<at::Tensor>& seq_lens,
                         const std::optional<at::Tensor>& k_scale, int64_t pool_shift) {
  at::Tensor idx;
  SnapKvParams p = snapkv_selection(q, k, budget, n_sink, window, kernel_size, pool_shift, pool,
                                    gqa, lse, scale, seq_lens, k_scale, idx);
  p.select_only = true;
  run_snapkv(be, p, q);
  return idx;
}

TensorTriple snapkv(const Backend& be, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, int64_t budget, int64_t n_sink, int64_t window,
                    int64_t kernel_size, const std::string& pool, const std::string& gqa,
                    const std::optional<at::Tensor>& lse, std::optional<double> scale,
                    const std::optional<at::Tensor>& seq_lens,
                    const std::optional<at::Tensor>& k_scale, int64_t pool_shift) {
  check_cache_pair(k, v);
  check_budget(budget, n_sink, window);
  at::Tensor out_k = empty_like_kept(k, budget);
  at::Tensor out_v = empty_like_kept(v, budget);
  at::Tensor idx = snapkv_into(be, q, k, v, budget, n_sink, window, kernel_size, pool_shift, pool,
                               gqa, lse, scale, seq_lens, k_scale, out_k, out_v, /*fresh=*/true);
  return {out_k, out_v, idx};
}

at::Tensor snapkv_out(const Backend& be, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, int64_t budget, int64_t n_sink, int64_t window,
                      int64_t kernel_size, const std::string& pool, const std::string& gqa,
                      const std::optional<at::Tensor>& lse, std::optional<double> scale,
                      const std::optional<at::Tensor>& seq_lens, at::Tensor& out_k,
                      at::Tensor& out_v, const std::optional<at::Tensor>& k_scale,
                      int64_t pool_shift) {
  check_cache_pair(k, v);
  check_budget(budget, n_sink, window);
  return snapkv_into(be, q, k, v, budget, n_sink, window, kernel_size, pool_shift, pool, gqa, lse,
                     scale, seq_lens, k_scale, out_k, out_v, /*fresh=*/false);
}

TensorTriple streaming(const Backend& be, const at::Tensor& k, const at::Tensor& v, int64_t budget,
                       int64_t n_sink, const std::optional<at::Tensor>& seq_lens) {
  check_cache_pair(k, v);
  check_budget(budget, n_sink, 0);
  const c10::DeviceGuard guard(k.device());
  StreamingKeepParams p;
  p.seq_lens = seq_lens_data(seq_lens, k.size(0), k);
  p.batch = k.size(0);
  p.heads = k.size(1);
  p.length = k.size(2);
  p.budget = budget;
  p.n_sink = n_sink;
  at::Tensor idx = at::empty({p.batch, p.heads, budget}, k.options().dtype(at::kInt));
  p.keep_idx = idx.data_ptr<int32_t>();
  check_status(be.streaming_keep(p), "streaming");
  at::Tensor out_k = empty_like_kept(k, budget);
  at::Tensor out_v = empty_like_kept(v, budget);
  GatherKvParams gather_p = gather_params(k, v, idx, out_k, out_v);
  gather_p.fresh_outputs = true;
  check_status(be.gather_kv(gather_p), "streaming (gather)");
  return {out_k, out_v, idx};
}

}  // namespace kvprune::torch_ext
