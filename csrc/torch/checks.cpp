#include "torch/checks.h"

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cmath>

namespace kvprune::torch_ext {

DType core_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return DType::kFloat32;
}

DType storage_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat8_e4m3fn: return DType::kFloat8E4M3;
    case at::kFloat8_e5m2: return DType::kFloat8E5M2;
    case at::kFloat:
    case at::kHalf:
    case at::kBFloat16: return core_dtype(t, name);
    default:
      TORCH_CHECK_TYPE(false, name, " must be float32, float16, bfloat16, float8_e4m3fn or "
                       "float8_e5m2, got ", t.scalar_type());
  }
  return DType::kFloat32;
}

void check_tokens(const at::Tensor& t, const char* name, bool fp8_ok) {
  TORCH_CHECK_VALUE(t.dim() == 4, name, " must be 4-D [batch, heads, tokens, head_dim], got shape ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.size(3) >= 1, name, " must have head_dim >= 1");
  TORCH_CHECK_VALUE(t.stride(3) == 1 || t.size(3) == 1, name,
                    " must have a contiguous last dimension (stride 1), got strides ", t.strides());
  fp8_ok ? storage_dtype(t, name) : core_dtype(t, name);
}

void set_key_type(WindowScoresParams& p, const at::Tensor& k, const char* name, const at::Tensor& q,
                  const std::optional<at::Tensor>& k_scale) {
  const DType storage = storage_dtype(k, name);
  TORCH_CHECK_TYPE(is_fp8(storage) || k.scalar_type() == q.scalar_type(), name,
                   " must have the dtype of q (", q.scalar_type(), ") or be an fp8 cache, got ",
                   k.scalar_type());
  if (is_fp8(storage)) p.k_dtype = storage;
  if (!k_scale.has_value()) return;
  TORCH_CHECK_VALUE(is_fp8(storage), "k_scale dequantises fp8 caches (float8_e4m3fn, float8_e5m2); ",
                    name, " is ", k.scalar_type(), " (scale the softmax with scale= instead)");
  const at::Tensor& s = *k_scale;
  TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, "k_scale must be float32, got ", s.scalar_type());
  TORCH_CHECK_VALUE(s.dim() <= 1 && (s.numel() == 1 || s.numel() == p.kv_heads),
                    "k_scale must have shape [] or [", p.kv_heads, "] (per KV head), got shape ",
                    s.sizes());
  TORCH_CHECK_VALUE(s.is_contiguous(), "k_scale must be contiguous, got strides ", s.strides());
  check_same_device(s, "k_scale", q, "q");
  p.k_scale = s.data_ptr<float>();
  p.k_scale_count = s.numel();
}

ConstTokens const_tokens(const at::Tensor& t) {
  return ConstTokens{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

MutableTokens mutable_tokens(at::Tensor& t) {
  return MutableTokens{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& like,
                       const char* like_name) {
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " is on ", t.device(), " but ", like_name,
                    " is on ", like.device(), "; all tensors must be on one device");
}

void check_no_self_overlap(const at::Tensor& out, const char* name) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(out) != at::MemOverlap::Yes, name,
                    " must not have overlapping elements (e.g. an expanded tensor)");
}

namespace {

// [first byte, one past the last byte] spanned by a strided tensor.
std::pair<uintptr_t, uintptr_t> byte_extent(const at::Tensor& t) {
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const uintptr_t first = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {first, first + (last + 1) * t.element_size()};
}

}  // namespace

void check_disjoint(const at::Tensor& out, const char* name, const at::Tensor& other,
                    const char* other_name) {
  if (out.numel() == 0 || other.numel() == 0) return;
  if (!out.storage().is_alias_of(other.storage())) return;
  const auto [out_first, out_end] = byte_extent(out);
  const auto [other_first, other_end] = byte_extent(other);
  TORCH_CHECK_VALUE(out_end <= other_first || other_end <= out_first, name,
                    " must not share memory with ", other_name);
}

void check_scores(const at::Tensor& scores, const char* name) {
  TORCH_CHECK_VALUE(scores.dim() == 3, name, " must be 3-D [batch, heads, length], got shape ",
                    scores.sizes());
  TORCH_CHECK_TYPE(scores.scalar_type() == at::kFloat, name, " must be float32, got ",
                   scores.scalar_type());
  TORCH_CHECK_VALUE(scores.is_contiguous(), name, " must be contiguous");
}

namespace {

at::Tensor& cached_cpu_workspace() {
  thread_local at::Tensor cached;
  return cached;
}

}  // namespace

size_t cpu_workspace_bytes() {
  const at::Tensor& cached = cached_cpu_workspace();
  return cached.defined() ? static_cast<size_t>(cached.numel()) : 0;
}

void release_cpu_workspace() { cached_cpu_workspace() = at::Tensor(); }

at::Tensor allocate_workspace(size_t bytes, const at::Tensor& like) {
  const auto size = static_cast<int64_t>(std::max<size_t>(bytes, 1));
  if (!like.is_cpu()) return at::empty({size}, like.options().dtype(at::kByte));
  at::Tensor& cached = cached_cpu_workspace();
  if (!cached.defined() || cached.numel() < size) {
    cached = at::Tensor();  // free the old buffer before allocating the larger one
    cached = at::empty({size}, at::TensorOptions().dtype(at::kByte));
  }
  return cached;
}

const int32_t* seq_lens_data(const std::optional<at::Tensor>& seq_lens, int64_t batch,
                             const at::Tensor& like) {
  if (!seq_lens.has_value()) return nullptr;
  const at::Tensor& lens = *seq_lens;
  TORCH_CHECK_TYPE(lens.scalar_type() == at::kInt, "seq_lens must be int32, got ", lens.scalar_type());
  TORCH_CHECK_VALUE(lens.dim() == 1 && lens.size(0) == batch, "seq_lens must have shape [", batch,
                    "], got ", lens.sizes());
  TORCH_CHECK_VALUE(lens.is_contiguous(), "seq_lens must be contiguous");
  check_same_device(lens, "seq_lens", like, "the cache tensors");
  return lens.data_ptr<int32_t>();
}

const float* per_query_head_data(const std::optional<at::Tensor>& t, const char* name,
                                 int64_t last, const at::Tensor& q) {
  if (!t.has_value()) return nullptr;
  const at::Tensor& x = *t;
  const int64_t batch = q.size(0), q_heads = q.size(1);
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, name, " must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 3 && x.size(0) == batch && x.size(1) == q_heads && x.size(2) == last,
                    name, " must have shape [", batch, ", ", q_heads, ", ", last, "], got ", x.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous(), name, " must be contiguous");
  check_same_device(x, name, q, "q");
  return x.data_ptr<float>();
}

const float* lse_data(const std::optional<at::Tensor>& lse, const at::Tensor& q) {
  return per_query_head_data(lse, "lse", q.size(2), q);
}

GqaReduce parse_gqa(const std::string& gqa) {
  if (gqa == "mean") return GqaReduce::kMean;
  if (gqa == "max") return GqaReduce::kMax;
  if (gqa == "sum") return GqaReduce::kSum;
  TORCH_CHECK_VALUE(false, "gqa must be 'mean', 'max' or 'sum', got '", gqa, "'");
  return GqaReduce::kMean;
}

float softmax_scale(std::optional<double> scale, int64_t head_dim) {
  const double value = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
  TORCH_CHECK_VALUE(std::isfinite(value), "scale must be finite, got ", value);
  return static_cast<float>(value);
}

PoolMode parse_pool(const std::string& mode, const char* name) {
  if (mode == "max") return PoolMode::kMax;
  if (mode == "avg") return PoolMode::kAvg;
  TORCH_CHECK_VALUE(false, name, " must be 'max' or 'avg', got '", mode, "'");
  return PoolMode::kMax;
}

void check_status(Status status, const char* op) {
  if (status == Status::kOk) return;
  TORCH_CHECK_VALUE(status != Status::kInvalidArgument, "kvprune.", op,
                    ": invalid argument (seq_lens values must lie in [0, length])");
  TORCH_CHECK(false, "kvprune.", op, " failed: ", status_string(status));
}

void check_keep_indices(const GatherKvParams& p) {
  const int32_t* idx = p.keep_idx;  // [batch, heads, budget]
  for (int64_t row = 0; row < p.batch * p.heads; ++row) {
    for (int64_t t = 0; t < p.budget; ++t) {
      const int32_t j = idx[row * p.budget + t];
      TORCH_CHECK_INDEX(j >= -1 && j < p.length, "idx holds ", j, " at [", row / p.heads, ", ",
                        row % p.heads, ", ", t, "]; kept indices must lie in [-1, ", p.length,
                        ") (-1 marks padding)");
    }
  }
}

}  // namespace kvprune::torch_ext
