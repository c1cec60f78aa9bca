// Decode-time eviction ops (StreamingLLM ring cache, RoPE re-rotation, H2O),
// written once against a Backend, plus the template that registers them for one
// dispatch key (beside OpsFor, in ops_cpu.cpp and ops_cuda.cpp). Schemas are in
// registration.cpp.
#pragma once

#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch/backend.h"

namespace kvprune::torch_ext {

// k_cache, v_cache [B,Hkv,C,D], slot_pos int32 [B,Hkv,C], seq_lens int32 [B] (all mutated);
// k_new, v_new [B,Hkv,T,D]; slots int32 [B,Hkv,T] or none (ring).
void streaming_append(const Backend& be, at::Tensor& k_cache, at::Tensor& v_cache,
                      at::Tensor& slot_pos, at::Tensor& seq_lens, const at::Tensor& k_new,
                      const at::Tensor& v_new, int64_t n_sink, const std::optional<at::Tensor>& slots);
// k [B,H,N,D] rotated in place; old_pos, new_pos int32 [B,H,N] (dims 0, 1 may be broadcast).
void rerotate_keys(const Backend& be, at::Tensor& k, const at::Tensor& old_pos,
                   const at::Tensor& new_pos, double theta, int64_t rotary_dim,
                   const std::string& layout, const std::optional<at::Tensor>& inv_freq);
// q [B,Hq,T,D]; h2o_scores fp32 [B,Hkv,C] accumulated in place -> out [B,Hq,T,D] with
// v_cache, else an empty tensor.
at::Tensor decode_scores(const Backend& be, const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& slot_pos, const at::Tensor& seq_lens,
                         const std::optional<at::Tensor>& h2o_scores, std::optional<double> scale,
                         const std::string& gqa, const std::optional<at::Tensor>& v_cache);
// -> next_slot int32 [B,Hkv,num]; h2o_scores and slot_pos updated in place.
at::Tensor h2o_evict(const Backend& be, at::Tensor& h2o_scores, at::Tensor& slot_pos,
                     const at::Tensor& seq_lens, int64_t n_sink, int64_t recent, int64_t num);
// gather_kv with K re-rotated from position idx[t] to position t.
std::tuple<at::Tensor, at::Tensor> gather_kv_rope(const Backend& be, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& idx,
                                                  double theta, int64_t rotary_dim,
                                                  const std::string& layout,
                                                  const std::optional<at::Tensor>& inv_freq);
void gather_kv_rope_out(const Backend& be, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& idx, at::Tensor& out_k, at::Tensor& out_v, double theta,
                        int64_t rotary_dim, const std::string& layout,
                        const std::optional<at::Tensor>& inv_freq);

// Backends::get() returns the Backend that runs a call (see OpsFor in ops.h).
template <typename Backends>
struct DecodeOpsFor {
  static void streaming_append_impl(at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_pos,
                                    at::Tensor seq_lens, const at::Tensor& k_new,
                                    const at::Tensor& v_new, int64_t n_sink,
                                    const std::optional<at::Tensor>& slots) {
    streaming_append(Backends::get(), k_cache, v_cache, slot_pos, seq_lens, k_new, v_new, n_sink, slots);
  }
  static void rerotate_keys_impl(at::Tensor k, const at::Tensor& old_pos, const at::Tensor& new_pos,
                                 double theta, int64_t rotary_dim, std::string layout,
                                 const std::optional<at::Tensor>& inv_freq) {
    rerotate_keys(Backends::get(), k, old_pos, new_pos, theta, rotary_dim, layout, inv_freq);
  }
  static at::Tensor decode_scores_impl(const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& slot_pos, const at::Tensor& seq_lens,
                                       const std::optional<at::Tensor>& h2o_scores,
                                       std::optional<double> scale, std::string gqa,
                                       const std::optional<at::Tensor>& v_cache) {
    return decode_scores(Backends::get(), q, k_cache, slot_pos, seq_lens, h2o_scores, scale, gqa, v_cache);
  }
  static at::Tensor h2o_evict_impl(at::Tensor h2o_scores, at::Tensor slot_pos,
                                   const at::Tensor& seq_lens, int64_t n_sink, int64_t recent,
                                   int64_t num) {
    return h2o_evict(Backends::get(), h2o_scores, slot_pos, seq_lens, n_sink, recent, num);
  }
  static std::tuple<at::Tensor, at::Tensor> gather_kv_rope_impl(
      const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx, double theta,
      int64_t rotary_dim, std::string layout, const std::optional<at::Tensor>& inv_freq) {
    return gather_kv_rope(Backends::get(), k, v, idx, theta, rotary_dim, layout, inv_freq);
  }
  static void gather_kv_rope_out_impl(const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& idx, at::Tensor out_k, at::Tensor out_v,
                                      double theta, int64_t rotary_dim, std::string layout,
                                      const std::optional<at::Tensor>& inv_freq) {
    gather_kv_rope_out(Backends::get(), k, v, idx, out_k, out_v, theta, rotary_dim, layout, inv_freq);
  }

  static void register_all(torch::Library& m) {
    m.impl("streaming_append", &streaming_append_impl);
    m.impl("rerotate_keys", &rerotate_keys_impl);
    m.impl("decode_scores", &decode_scores_impl);
    m.impl("h2o_evict", &h2o_evict_impl);
    m.impl("gather_kv_rope", &gather_kv_rope_impl);
    m.impl("gather_kv_rope_out", &gather_kv_rope_out_impl);
  }
};

}  // namespace kvprune::torch_ext
