#include "core/validate_decode.h"

namespace kvprune {
namespace {

bool valid_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

// Slots and positions are int32.
constexpr int64_t kMaxLength = 2147483647;

// The decode ops read and write dense token tensors only.
template <class... Tokens>
bool dense(const Tokens&... t) {
  return ((t.paged.blocks == nullptr) && ...);
}

}  // namespace

Status validate(const RopeParams& rope, int64_t head_dim) {
  if (rope.rotary_dim == 0) return Status::kOk;
  if (rope.rotary_dim < 2 || rope.rotary_dim % 2 != 0 || rope.rotary_dim > head_dim)
    return Status::kInvalidArgument;
  if (rope.layout != RopeLayout::kNeox && rope.layout != RopeLayout::kGptj)
    return Status::kInvalidArgument;
  if (rope.inv_freq == nullptr && !(rope.theta > 0.0)) return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate(const StreamingAppendParams& p) {
  if (!valid_dtype(p.dtype)) return Status::kUnsupportedDtype;
  if (p.batch < 0 || p.kv_heads < 0 || p.num_new < 0 || p.head_dim < 1) return Status::kInvalidArgument;
  if (p.capacity < 1 || p.capacity > kMaxLength) return Status::kInvalidArgument;
  if (p.n_sink < 0 || p.n_sink >= p.capacity) return Status::kInvalidArgument;
  if (p.batch > 0 && p.seq_lens == nullptr) return Status::kInvalidArgument;
  if (p.batch * p.kv_heads > 0 &&
      (p.k_cache.data == nullptr || p.v_cache.data == nullptr || p.slot_pos == nullptr))
    return Status::kInvalidArgument;
  if (p.batch * p.kv_heads * p.num_new > 0 && (p.k_new.data == nullptr || p.v_new.data == nullptr))
    return Status::kInvalidArgument;
  if (!dense(p.k_cache, p.v_cache, p.k_new, p.v_new)) return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate(const RerotateKeysParams& p) {
  if (!valid_dtype(p.dtype)) return Status::kUnsupportedDtype;
  if (p.batch < 0 || p.heads < 0 || p.length < 0 || p.head_dim < 1) return Status::kInvalidArgument;
  if (p.rope.rotary_dim == 0) return Status::kInvalidArgument;
  if (auto s = validate(p.rope, p.head_dim); s != Status::kOk) return s;
  if (p.batch * p.heads * p.length > 0 &&
      (p.k.data == nullptr || p.old_pos == nullptr || p.new_pos == nullptr))
    return Status::kInvalidArgument;
  if (!dense(p.k)) return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate_sizes(const DecodeScoresParams& p) {
  if (!valid_dtype(p.dtype)) return Status::kUnsupportedDtype;
  if (p.batch < 0 || p.capacity < 0 || p.capacity > kMaxLength || p.num_q < 1 || p.head_dim < 1)
    return Status::kInvalidArgument;
  if (p.kv_heads < 1 || p.q_heads < p.kv_heads || p.q_heads % p.kv_heads != 0)
    return Status::kInvalidArgument;
  if (p.reduce != GqaReduce::kMean && p.reduce != GqaReduce::kMax && p.reduce != GqaReduce::kSum)
    return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate(const DecodeScoresParams& p) {
  if (auto s = validate_sizes(p); s != Status::kOk) return s;
  if (p.h2o_scores == nullptr && p.v_cache.data == nullptr) return Status::kInvalidArgument;
  if ((p.v_cache.data == nullptr) != (p.out.data == nullptr)) return Status::kInvalidArgument;
  if (p.batch > 0 && (p.q.data == nullptr || p.seq_lens == nullptr)) return Status::kInvalidArgument;
  if (p.batch * p.capacity > 0 && (p.k_cache.data == nullptr || p.slot_pos == nullptr))
    return Status::kInvalidArgument;
  if (!dense(p.q, p.k_cache, p.v_cache, p.out)) return Status::kInvalidArgument;
  return Status::kOk;
}

Status validate(const H2oEvictParams& p) {
  if (p.batch < 0 || p.heads < 0 || p.capacity < 1 || p.capacity > kMaxLength || p.num < 1 ||
      p.num > 64)
    return Status::kInvalidArgument;
  if (p.n_sink < 0 || p.recent < 0 || p.capacity < p.n_sink + p.recent + p.num)
    return Status::kInvalidArgument;
  if (p.batch * p.heads > 0 && (p.h2o_scores == nullptr || p.slot_pos == nullptr ||
                                p.seq_lens == nullptr || p.next_slot == nullptr))
    return Status::kInvalidArgument;
  return Status::kOk;
}

}  // namespace kvprune
