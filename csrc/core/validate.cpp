#include "core/validate.h"

namespace kvprune {
namespace {

bool valid_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

// A type tokens may be stored in (fp8 included).
bool valid_storage(DType dtype) { return valid_dtype(dtype) || is_fp8(dtype); }

// Positions are stored as int32 indices.
constexpr int64_t kMaxLength = 2147483647;

template <class Tokens>
bool dense(const Tokens& t) {
  return t.paged.blocks == nullptr;
}

// A paged layout covering `length` tokens per row (or a dense one).
template <class Tokens>
bool valid_layout(const Tokens& t, int64_t length) {
  if (dense(t)) return true;
  const BlockTable& pg = t.paged;
  return pg.block_size >= 1 && pg.table_stride >= 1 && pg.block_stride >= 0 &&
         pg.table_stride <= kMaxLength / pg.block_size && pg.table_stride * pg.block_size >= length;
}

bool valid_pool(int64_t kernel_size, int64_t shift, PoolMode mode) {
  return kernel_size >= 1 && kernel_size % 2 == 1 && shift >= 0 && shift <= kernel_size / 2 &&
         (mode == PoolMode::kMax || mode == PoolMode::kAvg);
}

}  // namespace

Status validate_sizes(const WindowScoresParams& p) {
  if (!valid_dtype(p.dtype) || !valid_storage(key_dtype(p))) return Status::kUnsupportedDtype;
  if (p.k_scale != nullptr &&
      (!is_fp8(key_dtype(p)) || (p.k_scale_count != 1 && p.k_scale_count != p.kv_heads)))
    return Status::kInvalidArgument;
  if (p.batch < 0 || p.length < 0 || p.window < 1 || p.head_dim < 1) return Status::kInvalidArgument;
  if (p.kv_heads < 1 || p.q_heads < p.kv_heads || p.q_heads % p.kv_heads != 0)
    return Status::kInvalidArgument;
  if (p.reduce != GqaReduce::kMean && p.reduce != GqaReduce::kMax && p.reduce != GqaReduce::kSum)
    return Status::kInvalidArgument;
  if (p.qreduce != QueryReduce::kSum && p.qreduce != QueryReduce::kMax) return Status::kInvalidArgument;
  if (p.fold_length < 0 || p.fold_length > p.length) return Status::kInvalidArgument;
  if ((p.query_weight != nullptr || p.key_weight != nullptr) && p.qreduce != QueryReduce::kMax)
    return Status::kInvalidArgument;
  if (!dense(p.q) || !valid_layout(p.k, p.length)) return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate(const WindowScoresParams& p) {
  if (auto s = validate_sizes(p); s != Status::kOk) return s;
  if (p.batch * p.length > 0 && (p.q.data == nullptr || p.k.data == nullptr || p.scores == nullptr))
    return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate(const PoolScoresParams& p) {
  if (p.batch < 0 || p.heads < 0 || p.length < 0 || p.window < 0) return Status::kInvalidArgument;
  if (!valid_pool(p.kernel_size, p.shift, p.mode)) return Status::kInvalidArgument;
  if (p.batch * p.heads * p.length > 0 && (p.scores_in == nullptr || p.scores_out == nullptr))
    return Status::kInvalidArgument;
  if (p.scores_in == p.scores_out && p.scores_in != nullptr) return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate_sizes(const SelectKeepParams& p) {
  if (p.batch < 0 || p.heads < 0 || p.length < 0 || p.length > kMaxLength) return Status::kInvalidArgument;
  if (p.n_sink < 0 || p.window < 0 || p.budget < p.n_sink + p.window || p.budget < 1)
    return Status::kInvalidArgument;
  if (!valid_pool(p.pool_kernel_size, p.pool_shift, p.pool_mode)) return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate(const SelectKeepParams& p) {
  if (auto s = validate_sizes(p); s != Status::kOk) return s;
  if (p.batch * p.heads > 0 && p.keep_idx == nullptr) return Status::kInvalidArgument;
  if (p.batch * p.heads * p.length > 0 && p.scores == nullptr) return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate(const StreamingKeepParams& p) {
  if (p.batch < 0 || p.heads < 0 || p.length < 0 || p.length > kMaxLength) return Status::kInvalidArgument;
  if (p.n_sink < 0 || p.budget < p.n_sink || p.budget < 1) return Status::kInvalidArgument;
  if (p.batch * p.heads > 0 && p.keep_idx == nullptr) return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate(const GatherKvParams& p) {
  if (!valid_storage(p.dtype) || (is_fp8(p.dtype) && p.rope.rotary_dim > 0)) return Status::kUnsupportedDtype;
  if (p.batch < 0 || p.heads < 0 || p.length < 0 || p.budget < 0 || p.head_dim < 1)
    return Status::kInvalidArgument;
  if (p.batch * p.heads * p.budget > 0 &&
      (p.keep_idx == nullptr || p.out_k.data == nullptr || p.out_v.data == nullptr))
    return Status::kInvalidArgument;
  if (p.batch * p.heads * p.length > 0 && (p.k.data == nullptr || p.v.data == nullptr))
    return Status::kInvalidArgument;
  if (!dense(p.k) || !dense(p.v) || !dense(p.out_k) || !dense(p.out_v)) return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate(const CompactKvParams& p) {
  if (!valid_storage(p.dtype)) return Status::kUnsupportedDtype;
  if (p.batch < 0 || p.heads < 0 || p.length < 0 || p.length > kMaxLength || p.budget < 0 ||
      p.head_dim < 1)
    return Status::kInvalidArgument;
  if (!valid_layout(p.k, p.length) || !valid_layout(p.v, p.length)) return Status::kInvalidArgument;
  if (p.batch * p.heads * p.budget > 0 &&
      (p.keep_idx == nullptr || p.k.data == nullptr || p.v.data == nullptr))
    return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate_agreement(const SnapKvParams& p) {
  const WindowScoresParams& sc = p.scores;
  const SelectKeepParams& se = p.select;
  const GatherKvParams& ga = p.gather;
  const bool same_selection = sc.fold_length == 0 && se.batch == sc.batch &&
                              se.heads == sc.kv_heads && se.length == sc.length &&
                              se.seq_lens == sc.seq_lens;
  if (p.select_only) return same_selection ? Status::kOk : Status::kInvalidArgument;
  const bool same_problem = same_selection && ga.batch == sc.batch && ga.heads == sc.kv_heads &&
                            ga.length == sc.length && ga.head_dim == sc.head_dim &&
                            ga.dtype == key_dtype(sc) && ga.budget == se.budget &&
                            ga.keep_idx == se.keep_idx && ga.k.data == sc.k.data &&
                            ga.k.batch_stride == sc.k.batch_stride &&
                            ga.k.head_stride == sc.k.head_stride &&
                            ga.k.token_stride == sc.k.token_stride && dense(sc.k);
  return same_problem ? Status::kOk : Status::kInvalidArgument;
}

Status validate_seq_lens_host(const int32_t* seq_lens, int64_t batch, int64_t length) {
  if (seq_lens == nullptr) return Status::kOk;
  for (int64_t b = 0; b < batch; ++b)
    if (seq_lens[b] < 0 || seq_lens[b] > length) return Status::kInvalidArgument;
  return Status::kOk;
}

}  // namespace kvprune
