// The ops, written once against a Backend, plus the template that registers
// them for one dispatch key (instantiated by ops_cpu.cpp and ops_cuda.cpp).
#pragma once

#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch/backend.h"
#include "torch/paged_ops.h"

namespace kvprune::torch_ext {

using TensorPair = std::tuple<at::Tensor, at::Tensor>;
using TensorTriple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// q [B,Hq,W,D], k [B,Hkv,N,D] (q's dtype, or fp8 with k_scale fp32 [] / [Hkv]),
// lse [B,Hq,W] fp32, with qreduce "max" query_weight [B,Hq,W] and key_weight [B,Hq,N]
// fp32 -> scores fp32 [B,Hkv,N]
at::Tensor window_scores(const Backend& be, const at::Tensor& q, const at::Tensor& k,
                         const std::optional<at::Tensor>& lse, std::optional<double> scale,
                         const std::string& gqa, const std::optional<at::Tensor>& seq_lens,
                         const std::string& qreduce, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& query_weight,
                         const std::optional<at::Tensor>& key_weight);
// The same, folded into out fp32 [B,Hkv,M] (1 <= M <= N): keys [0, M) only (key_weight
// [B,Hq,M]), max(out, new) for qreduce "max", out + new for "sum".
void window_scores_out(const Backend& be, const at::Tensor& q, const at::Tensor& k,
                       const std::optional<at::Tensor>& lse, std::optional<double> scale,
                       const std::string& gqa, const std::optional<at::Tensor>& seq_lens,
                       const std::string& qreduce, at::Tensor& out,
                       const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& query_weight,
                       const std::optional<at::Tensor>& key_weight);
// scores fp32 [B,H,N] -> fp32 [B,H,N]
at::Tensor pool_scores(const Backend& be, const at::Tensor& scores, int64_t kernel_size,
                       const std::string& mode, int64_t window,
                       const std::optional<at::Tensor>& seq_lens, int64_t shift);
// scores fp32 [B,H,N] -> int32 [B,H,budget]
at::Tensor select_keep(const Backend& be, const at::Tensor& scores, int64_t budget, int64_t n_sink,
                       int64_t window, const std::optional<at::Tensor>& seq_lens);
// k, v [B,H,N,D], idx int32 [B,H,budget] -> [B,H,budget,D] each
TensorPair gather_kv(const Backend& be, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& idx);
// Checks gather_kv's arguments (shapes, dtypes, devices, no overlap between
// outputs and inputs) and returns the core params for them.
GatherKvParams checked_gather_params(const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& idx, at::Tensor& out_k, at::Tensor& out_v);
void gather_kv_out(const Backend& be, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& idx, at::Tensor& out_k, at::Tensor& out_v);
// -> (k_kept, v_kept, idx)
TensorTriple snapkv(const Backend& be, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, int64_t budget, int64_t n_sink, int64_t window,
                    int64_t kernel_size, const std::string& pool, const std::string& gqa,
                    const std::optional<at::Tensor>& lse, std::optional<double> scale,
                    const std::optional<at::Tensor>& seq_lens,
                    const std::optional<at::Tensor>& k_scale, int64_t pool_shift);
// The same without the gather: q [B,Hq,W,D], k [B,Hkv,N,D] -> idx int32 [B,Hkv,budget]
at::Tensor snapkv_select(const Backend& be, const at::Tensor& q, const at::Tensor& k,
                         int64_t budget, int64_t n_sink, int64_t window, int64_t kernel_size,
                         const std::string& pool, const std::string& gqa,
                         const std::optional<at::Tensor>& lse, std::optional<double> scale,
                         const std::optional<at::Tensor>& seq_lens,
                         const std::optional<at::Tensor>& k_scale, int64_t pool_shift);
// The same into the caller's out_k / out_v [B,Hkv,budget,D] (checked like gather_kv_out) -> idx
at::Tensor snapkv_out(const Backend& be, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, int64_t budget, int64_t n_sink, int64_t window,
                      int64_t kernel_size, const std::string& pool, const std::string& gqa,
                      const std::optional<at::Tensor>& lse, std::optional<double> scale,
                      const std::optional<at::Tensor>& seq_lens, at::Tensor& out_k,
                      at::Tensor& out_v, const std::optional<at::Tensor>& k_scale,
                      int64_t pool_shift);
TensorTriple streaming(const Backend& be, const at::Tensor& k, const at::Tensor& v, int64_t budget,
                       int64_t n_sink, const std::optional<at::Tensor>& seq_lens);

// Registers every op for one dispatch key; Backends::get() returns the Backend that
// runs a call (looked up per call: the CPU key may run the emulated CUDA kernels).
template <typename Backends>
struct OpsFor {
  static at::Tensor window_scores_impl(const at::Tensor& q, const at::Tensor& k,
                                       const std::optional<at::Tensor>& lse,
                                       std::optional<double> scale, std::string gqa,
                                       const std::optional<at::Tensor>& seq_lens,
                                       std::string qreduce,
                                       const std::optional<at::Tensor>& k_scale,
                                       const std::optional<at::Tensor>& query_weight,
                                       const std::optional<at::Tensor>& key_weight) {
    return window_scores(Backends::get(), q, k, lse, scale, gqa, seq_lens, qreduce, k_scale,
                         query_weight, key_weight);
  }
  static void window_scores_out_impl(const at::Tensor& q, const at::Tensor& k,
                                     const std::optional<at::Tensor>& lse,
                                     std::optional<double> scale, std::string gqa,
                                     const std::optional<at::Tensor>& seq_lens,
                                     std::string qreduce, at::Tensor out,
                                     const std::optional<at::Tensor>& k_scale,
                                     const std::optional<at::Tensor>& query_weight,
                                     const std::optional<at::Tensor>& key_weight) {
    window_scores_out(Backends::get(), q, k, lse, scale, gqa, seq_lens, qreduce, out, k_scale,
                      query_weight, key_weight);
  }
  static at::Tensor pool_scores_impl(const at::Tensor& scores, int64_t kernel_size,
                                     std::string mode, int64_t window,
                                     const std::optional<at::Tensor>& seq_lens, int64_t shift) {
    return pool_scores(Backends::get(), scores, kernel_size, mode, window, seq_lens, shift);
  }
  static at::Tensor select_keep_impl(const at::Tensor& scores, int64_t budget, int64_t n_sink,
                                     int64_t window, const std::optional<at::Tensor>& seq_lens) {
    return select_keep(Backends::get(), scores, budget, n_sink, window, seq_lens);
  }
  static TensorPair gather_kv_impl(const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx) {
    return gather_kv(Backends::get(), k, v, idx);
  }
  static void gather_kv_out_impl(const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx,
                                 at::Tensor out_k, at::Tensor out_v) {
    gather_kv_out(Backends::get(), k, v, idx, out_k, out_v);
  }
  static TensorTriple snapkv_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  int64_t budget, int64_t n_sink, int64_t window,
                                  int64_t kernel_size, std::string pool, std::string gqa,
                                  const std::optional<at::Tensor>& lse, std::optional<double> scale,
                                  const std::optional<at::Tensor>& seq_lens,
                                  const std::optional<at::Tensor>& k_scale, int64_t pool_shift) {
    return snapkv(Backends::get(), q, k, v, budget, n_sink, window, kernel_size, pool, gqa, lse,
                  scale, seq_lens, k_scale, pool_shift);
  }
  static at::Tensor snapkv_out_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    int64_t budget, int64_t n_sink, int64_t window,
                                    int64_t kernel_size, std::string pool, std::string gqa,
                                    const std::optional<at::Tensor>& lse,
                                    std::optional<double> scale,
                                    const std::optional<at::Tensor>& seq_lens, at::Tensor out_k,
                                    at::Tensor out_v, const std::optional<at::Tensor>& k_scale,
                                    int64_t pool_shift) {
    return snapkv_out(Backends::get(), q, k, v, budget, n_sink, window, kernel_size, pool, gqa,
                      lse, scale, seq_lens, out_k, out_v, k_scale, pool_shift);
  }
  static at::Tensor snapkv_select_impl(const at::Tensor& q, const at::Tensor& k, int64_t budget,
                                       int64_t n_sink, int64_t window, int64_t kernel_size,
                                       std::string pool, std::string gqa,
                                       const std::optional<at::Tensor>& lse,
                                       std::optional<double> scale,
                                       const std::optional<at::Tensor>& seq_lens,
                                       const std::optional<at::Tensor>& k_scale,
                                       int64_t pool_shift) {
    return snapkv_select(Backends::get(), q, k, budget, n_sink, window, kernel_size, pool, gqa,
                         lse, scale, seq_lens, k_scale, pool_shift);
  }
  static TensorTriple streaming_impl(const at::Tensor& k, const at::Tensor& v, int64_t budget,
                                     int64_t n_sink, const std::optional<at::Tensor>& seq_lens) {
    return streaming(Backends::get(), k, v, budget, n_sink, seq_lens);
  }

  static at::Tensor paged_window_scores_impl(const at::Tensor& q, const at::Tensor& k_cache,
                                             const at::Tensor& block_table,
                                             const at::Tensor& seq_lens,
                                             const std::optional<at::Tensor>& lse,
                                             std::optional<double> scale, std::string gqa,
                                             std::string layout,
                                             const std::optional<at::Tensor>& k_scale) {
    return paged_window_scores(Backends::get(), q, k_cache, block_table, seq_lens, lse, scale, gqa,
                               layout, k_scale);
  }
  static at::Tensor paged_compact_impl(at::Tensor k_cache, at::Tensor v_cache,
                                       const at::Tensor& block_table, const at::Tensor& seq_lens,
                                       const at::Tensor& idx, std::string layout) {
    return paged_compact(Backends::get(), k_cache, v_cache, block_table, seq_lens, idx, layout);
  }

  static void register_all(torch::Library& m) {
    m.impl("paged_window_scores", &paged_window_scores_impl);
    m.impl("paged_compact", &paged_compact_impl);
    m.impl("window_scores", &window_scores_impl);
    m.impl("window_scores_out", &window_scores_out_impl);
    m.impl("pool_scores", &pool_scores_impl);
    m.impl("select_keep", &select_keep_impl);
    m.impl("gather_kv", &gather_kv_impl);
    m.impl("gather_kv_out", &gather_kv_out_impl);
    m.impl("snapkv", &snapkv_impl);
    m.impl("snapkv_out", &snapkv_out_impl);
    m.impl("snapkv_select", &snapkv_select_impl);
    m.impl("streaming", &streaming_impl);
  }
};

}  // namespace kvprune::torch_ext
