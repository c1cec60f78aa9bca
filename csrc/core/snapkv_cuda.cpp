// CUDA snapkv: the three stage kernels chained on one stream. The scores and the
// scratch of whichever stage runs live in the caller's workspace:
//   [scores B*Hkv*N fp32][max(window_scores scratch, select_keep scratch)].
// In a build without CUDA the first stage reports kNotCompiled.
#include <algorithm>

#include "core/validate.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

size_t scores_bytes(const SnapKvParams& p) {
  return align_up(static_cast<size_t>(p.scores.batch * p.scores.kv_heads * p.scores.length) *
                  sizeof(float));
}

size_t scratch_bytes(const SnapKvParams& p) {
  return std::max(align_up(window_scores_workspace_bytes_cuda(p.scores)),
                  align_up(select_keep_workspace_bytes_cuda(p.select)));
}

}  // namespace

size_t snapkv_workspace_bytes_cuda(const SnapKvParams& p) {
  if (validate_sizes(p.scores) != Status::kOk || validate_sizes(p.select) != Status::kOk) return 0;
  return scores_bytes(p) + scratch_bytes(p);
}

Status snapkv_cuda(const SnapKvParams& params, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream) {
  if (auto s = validate_agreement(params); s != Status::kOk) return s;
  if (validate_sizes(params.scores) != Status::kOk || validate_sizes(params.select) != Status::kOk)
    return Status::kInvalidArgument;
  const size_t scores = scores_bytes(params), scratch = scratch_bytes(params);
  if (workspace_bytes < scores + scratch) return Status::kWorkspaceTooSmall;
  if (workspace == nullptr) return Status::kInvalidArgument;
  if (params.gather.rope.rotary_dim != 0) return Status::kInvalidArgument;  // snapkv never rotates

  char* base = static_cast<char*>(workspace);
  SnapKvParams p = params;
  p.scores.scores = reinterpret_cast<float*>(base);
  p.select.scores = p.scores.scores;
  if (auto s = validate(p.select); s != Status::kOk) return s;
  if (auto s = validate(p.gather); s != Status::kOk) return s;
  if (auto s = window_scores_cuda(p.scores, base + scores, scratch, stream); s != Status::kOk) return s;
  if (auto s = select_keep_cuda(p.select, base + scores, scratch, stream); s != Status::kOk) return s;
  return gather_kv_cuda(p.gather, stream);
}

}  // namespace kvprune
