// Device-agnostic bodies of the decode-time eviction ops (schemas: registration.cpp):
// argument checks (ValueError / TypeError naming the argument), params structs, outputs.
#include "torch/decode_ops.h"

#include <c10/core/DeviceGuard.h>

#include <cmath>

#include "torch/checks.h"
#include "torch/ops.h"

namespace kvprune::torch_ext {
namespace {

void check_decode_status(Status status, const char* op, const char* invalid_hint) {
  if (status == Status::kOk) return;
  TORCH_CHECK_VALUE(status != Status::kInvalidArgument, "kvprune.", op, ": invalid argument (",
                    invalid_hint, ")");
  TORCH_CHECK_VALUE(status != Status::kUnsupportedHeadDim, "kvprune.", op,
                    ": shape not supported by this backend (rope: rotary_dim <= 1024; CUDA "
                    "decode_scores: head_dim <= 256 and (Hq / Hkv) * T <= 32)");
  TORCH_CHECK(false, "kvprune.", op, " failed: ", status_string(status));
}

void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& like, const char* like_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must have the dtype of ", like_name,
                   " (", like.scalar_type(), "), got ", t.scalar_type());
}

// int32 tensor of exactly `shape`, contiguous, on the device of `like`.
void check_int_tensor(const at::Tensor& t, const char* name, at::IntArrayRef shape,
                      const at::Tensor& like, const char* like_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
  check_same_device(t, name, like, like_name);
}

// A fixed-capacity cache tensor [B,Hkv,C,D]; `like` (if given) fixes dtype, shape and device.
void check_cache(const at::Tensor& t, const char* name, const at::Tensor* like, const char* like_name) {
  check_tokens(t, name);
  if (like == nullptr) return;
  check_same_device(t, name, *like, like_name);
  check_same_dtype(t, name, *like, like_name);
  TORCH_CHECK_VALUE(t.sizes() == like->sizes(), name, " must have the shape of ", like_name, " ",
                    like->sizes(), ", got ", t.sizes());
}

RopeParams rope_params(double theta, int64_t rotary_dim, const std::string& layout,
                       const std::optional<at::Tensor>& inv_freq, int64_t head_dim,
                       const at::Tensor& like) {
  TORCH_CHECK_VALUE(rotary_dim >= 2 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
                    "rotary_dim must be even, >= 2 and <= head_dim (", head_dim, "), got ", rotary_dim);
  TORCH_CHECK_VALUE(layout == "neox" || layout == "gptj",
                    "layout must be 'neox' (half split) or 'gptj' (interleaved), got '", layout, "'");
  RopeParams r;
  r.rotary_dim = rotary_dim;
  r.layout = layout == "neox" ? RopeLayout::kNeox : RopeLayout::kGptj;
  r.theta = theta;
  if (inv_freq.has_value()) {
    const at::Tensor& f = *inv_freq;
    TORCH_CHECK_TYPE(f.scalar_type() == at::kFloat, "inv_freq must be float32, got ", f.scalar_type());
    TORCH_CHECK_VALUE(f.dim() == 1 && f.size(0) == rotary_dim / 2, "inv_freq must have shape [",
                      rotary_dim / 2, "] (rotary_dim / 2), got ", f.sizes());
    TORCH_CHECK_VALUE(f.is_contiguous(), "inv_freq must be contiguous");
    check_same_device(f, "inv_freq", like, "k");
    r.inv_freq = f.data_ptr<float>();
  } else {
    TORCH_CHECK_VALUE(std::isfinite(theta) && theta > 0.0, "theta must be finite and > 0, got ", theta);
  }
  return r;
}

// An int32 position tensor broadcastable to [B,H,N] with a contiguous last dim.
at::Tensor position_view(const at::Tensor& pos, const char* name, const at::Tensor& k) {
  TORCH_CHECK_TYPE(pos.scalar_type() == at::kInt, name, " must be int32, got ", pos.scalar_type());
  check_same_device(pos, name, k, "k");
  const std::vector<int64_t> shape{k.size(0), k.size(1), k.size(2)};
  bool broadcastable = pos.dim() <= 3;
  for (int64_t i = 1; broadcastable && i <= pos.dim(); ++i) {
    const int64_t have = pos.size(pos.dim() - i), want = shape[3 - i];
    broadcastable = have == want || have == 1;
  }
  TORCH_CHECK_VALUE(broadcastable, name, " must be broadcastable to [", shape[0], ", ", shape[1],
                    ", ", shape[2], "], got ", pos.sizes());
  at::Tensor view = pos.expand(shape);
  TORCH_CHECK_VALUE(view.stride(2) == 1 || view.size(2) <= 1, name,
                    " must be contiguous along its last dimension");
  return view;
}

}  // namespace

void streaming_append(const Backend& be, at::Tensor& k_cache, at::Tensor& v_cache,
                      at::Tensor& slot_pos, at::Tensor& seq_lens, const at::Tensor& k_new,
                      const at::Tensor& v_new, int64_t n_sink, const std::optional<at::Tensor>& slots) {
  check_cache(k_cache, "k_cache", nullptr, nullptr);
  check_cache(v_cache, "v_cache", &k_cache, "k_cache");
  check_no_self_overlap(k_cache, "k_cache");  // written in place, in parallel
  check_no_self_overlap(v_cache, "v_cache");
  check_disjoint(k_cache, "k_cache", v_cache, "v_cache");
  check_tokens(k_new, "k_new");
  check_same_device(k_new, "k_new", k_cache, "k_cache");
  check_same_dtype(k_new, "k_new", k_cache, "k_cache");
  const int64_t batch = k_cache.size(0), heads = k_cache.size(1), capacity = k_cache.size(2);
  TORCH_CHECK_VALUE(k_new.size(0) == batch && k_new.size(1) == heads && k_new.size(3) == k_cache.size(3),
                    "k_new must have shape [", batch, ", ", heads, ", T, ", k_cache.size(3), "], got ",
                    k_new.sizes());
  check_cache(v_new, "v_new", &k_new, "k_new");
  TORCH_CHECK_VALUE(capacity >= 1, "k_cache must have capacity (dim 2) >= 1");
  TORCH_CHECK_VALUE(n_sink >= 0 && n_sink < capacity, "n_sink must lie in [0, capacity) = [0, ",
                    capacity, "), got ", n_sink);
  check_int_tensor(slot_pos, "slot_pos", {batch, heads, capacity}, k_cache, "k_cache");
  check_int_tensor(seq_lens, "seq_lens", {batch}, k_cache, "k_cache");
  StreamingAppendParams p;
  if (slots.has_value()) {
    check_int_tensor(*slots, "slots", {batch, heads, k_new.size(2)}, k_cache, "k_cache");
    p.slots = slots->data_ptr<int32_t>();
  }
  p.k_cache = mutable_tokens(k_cache);
  p.v_cache = mutable_tokens(v_cache);
  p.slot_pos = slot_pos.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.k_new = const_tokens(k_new);
  p.v_new = const_tokens(v_new);
  p.dtype = core_dtype(k_cache, "k_cache");
  p.batch = batch;
  p.kv_heads = heads;
  p.capacity = capacity;
  p.num_new = k_new.size(2);
  p.head_dim = k_cache.size(3);
  p.n_sink = n_sink;
  const c10::DeviceGuard guard(k_cache.device());
  check_decode_status(be.streaming_append(p), "streaming_append",
                      "seq_lens values must be >= 0 and stay below 2^31");
}

void rerotate_keys(const Backend& be, at::Tensor& k, const at::Tensor& old_pos,
                   const at::Tensor& new_pos, double theta, int64_t rotary_dim,
                   const std::string& layout, const std::optional<at::Tensor>& inv_freq) {
  check_tokens(k, "k");
  check_no_self_overlap(k, "k");  // rotated in place, in parallel
  RerotateKeysParams p;
  p.rope = rope_params(theta, rotary_dim, layout, inv_freq, k.size(3), k);
  const at::Tensor old_view = position_view(old_pos, "old_pos", k);
  const at::Tensor new_view = position_view(new_pos, "new_pos", k);
  p.k = mutable_tokens(k);
  p.old_pos = old_view.data_ptr<int32_t>();
  p.old_pos_batch_stride = old_view.stride(0);
  p.old_pos_head_stride = old_view.stride(1);
  p.new_pos = new_view.data_ptr<int32_t>();
  p.new_pos_batch_stride = new_view.stride(0);
  p.new_pos_head_stride = new_view.stride(1);
  p.dtype = core_dtype(k, "k");
  p.batch = k.size(0);
  p.heads = k.size(1);
  p.length = k.size(2);
  p.head_dim = k.size(3);
  const c10::DeviceGuard guard(k.device());
  check_decode_status(be.rerotate_keys(p), "rerotate_keys", "rope parameters");
}

at::Tensor decode_scores(const Backend& be, const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& slot_pos, const at::Tensor& seq_lens,
                         const std::optional<at::Tensor>& h2o_scores, std::optional<double> scale,
                         const std::string& gqa, const std::optional<at::Tensor>& v_cache) {
  check_tokens(q, "q");
  check_cache(k_cache, "k_cache", nullptr, nullptr);
  check_same_device(k_cache, "k_cache", q, "q");
  check_same_dtype(k_cache, "k_cache", q, "q");
  const int64_t batch = q.size(0), q_heads = q.size(1), num_q = q.size(2), head_dim = q.size(3);
  const int64_t kv_heads = k_cache.size(1), capacity = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.size(0) == batch, "k_cache batch (", k_cache.size(0),
                    ") must equal q batch (", batch, ")");
  TORCH_CHECK_VALUE(k_cache.size(3) == head_dim, "k_cache head_dim (", k_cache.size(3),
                    ") must equal q head_dim (", head_dim, ")");
  TORCH_CHECK_VALUE(kv_heads >= 1 && q_heads % kv_heads == 0, "q heads (", q_heads,
                    ") must be a multiple of k_cache heads (", kv_heads, ")");
  TORCH_CHECK_VALUE(num_q >= 1, "q must hold at least one query (q.shape[2] >= 1)");
  check_int_tensor(slot_pos, "slot_pos", {batch, kv_heads, capacity}, q, "q");
  check_int_tensor(seq_lens, "seq_lens", {batch}, q, "q");
  TORCH_CHECK_VALUE(h2o_scores.has_value() || v_cache.has_value(),
                    "decode_scores needs h2o_scores and/or v_cache (nothing to compute)");
  DecodeScoresParams p;
  if (h2o_scores.has_value()) {
    const at::Tensor& s = *h2o_scores;
    TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, "h2o_scores must be float32, got ", s.scalar_type());
    TORCH_CHECK_VALUE(s.sizes() == slot_pos.sizes(), "h2o_scores must have shape ", slot_pos.sizes(),
                      ", got ", s.sizes());
    TORCH_CHECK_VALUE(s.is_contiguous(), "h2o_scores must be contiguous");
    check_same_device(s, "h2o_scores", q, "q");
    p.h2o_scores = s.data_ptr<float>();
  }
  at::Tensor out;
  if (v_cache.has_value()) {
    check_cache(*v_cache, "v_cache", &k_cache, "k_cache");
    p.v_cache = const_tokens(*v_cache);
    out = at::empty(q.sizes(), q.options());
    p.out = mutable_tokens(out);
  } else {
    out = at::empty({0}, q.options());
  }
  p.q = const_tokens(q);
  p.k_cache = const_tokens(k_cache);
  p.slot_pos = slot_pos.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.dtype = core_dtype(q, "q");
  p.batch = batch;
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.capacity = capacity;
  p.num_q = num_q;
  p.head_dim = head_dim;
  p.scale = softmax_scale(scale, head_dim);
  p.reduce = parse_gqa(gqa);
  const c10::DeviceGuard guard(q.device());
  const size_t ws_bytes = be.decode_scores_workspace(p);
  at::Tensor ws = at::empty({static_cast<int64_t>(std::max<size_t>(ws_bytes, 1))},
                            q.options().dtype(at::kByte));
  check_decode_status(be.decode_scores(p, ws.data_ptr(), ws_bytes), "decode_scores",
                      "seq_lens values must be >= 0");
  return out;
}

at::Tensor h2o_evict(const Backend& be, at::Tensor& h2o_scores, at::Tensor& slot_pos,
                     const at::Tensor& seq_lens, int64_t n_sink, int64_t recent, int64_t num) {
  check_scores(h2o_scores, "h2o_scores");
  const int64_t batch = h2o_scores.size(0), heads = h2o_scores.size(1), capacity = h2o_scores.size(2);
  check_int_tensor(slot_pos, "slot_pos", {batch, heads, capacity}, h2o_scores, "h2o_scores");
  check_int_tensor(seq_lens, "seq_lens", {batch}, h2o_scores, "h2o_scores");
  TORCH_CHECK_VALUE(n_sink >= 0, "n_sink must be >= 0, got ", n_sink);
  TORCH_CHECK_VALUE(recent >= 0, "recent must be >= 0, got ", recent);
  TORCH_CHECK_VALUE(num >= 1 && num <= 64, "num must lie in [1, 64], got ", num);
  TORCH_CHECK_VALUE(capacity >= n_sink + recent + num, "capacity (", capacity,
                    ") must be >= n_sink + recent + num (", n_sink, " + ", recent, " + ", num, ")");
  const c10::DeviceGuard guard(h2o_scores.device());
  at::Tensor next = at::empty({batch, heads, num}, slot_pos.options());
  H2oEvictParams p;
  p.h2o_scores = h2o_scores.data_ptr<float>();
  p.slot_pos = slot_pos.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.next_slot = next.data_ptr<int32_t>();
  p.batch = batch;
  p.heads = heads;
  p.capacity = capacity;
  p.num = num;
  p.n_sink = n_sink;
  p.recent = recent;
  check_decode_status(be.h2o_evict(p), "h2o_evict", "seq_lens values must be >= 0");
  return next;
}

void gather_kv_rope_out(const Backend& be, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& idx, at::Tensor& out_k, at::Tensor& out_v, double theta,
                        int64_t rotary_dim, const std::string& layout,
                        const std::optional<at::Tensor>& inv_freq) {
  GatherKvParams p = checked_gather_params(k, v, idx, out_k, out_v);
  TORCH_CHECK_TYPE(!is_fp8(p.dtype), "k: RoPE re-rotation needs float32, float16 or bfloat16 keys, "
                   "got ", k.scalar_type(), " (an fp8 cache is gathered without rope=)");
  p.rope = rope_params(theta, rotary_dim, layout, inv_freq, k.size(3), k);
  const c10::DeviceGuard guard(k.device());
  check_decode_status(be.gather_kv(p), "gather_kv", "rope parameters");
}

std::tuple<at::Tensor, at::Tensor> gather_kv_rope(const Backend& be, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& idx,
                                                  double theta, int64_t rotary_dim,
                                                  const std::string& layout,
                                                  const std::optional<at::Tensor>& inv_freq) {
  check_cache(k, "k", nullptr, nullptr);
  TORCH_CHECK_VALUE(idx.dim() == 3, "idx must have shape [", k.size(0), ", ", k.size(1),
                    ", budget], got ", idx.sizes());
  at::Tensor out_k = at::empty({k.size(0), k.size(1), idx.size(2), k.size(3)}, k.options());
  at::Tensor out_v = at::empty({k.size(0), k.size(1), idx.size(2), k.size(3)}, k.options());
  gather_kv_rope_out(be, k, v, idx, out_k, out_v, theta, rotary_dim, layout, inv_freq);
  return {out_k, out_v};
}

}  // namespace kvprune::torch_ext
