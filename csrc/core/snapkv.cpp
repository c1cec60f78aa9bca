// snapkv_cpu / snapkv_cuda: the three stage entry points chained, with the scores
// and the scratch of whichever stage runs in the caller's workspace:
//   [scores B*Hkv*N fp32][max(window_scores scratch, select_keep scratch)].
// In a build without CUDA, snapkv_cuda's first stage reports kNotCompiled.
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

// One backend's stage entry points: the CPU ones with an executor, or the CUDA
// ones with a stream.
struct CpuStages {
  const CpuExecutor& exec;
  size_t score_scratch(const WindowScoresParams& p) const {
    return window_scores_workspace_bytes_cpu(p, exec);
  }
  size_t select_scratch(const SelectKeepParams& p) const {
    return select_keep_workspace_bytes_cpu(p, exec);
  }
  Status scores(const WindowScoresParams& p, void* ws, size_t bytes) const {
    return window_scores_cpu(p, ws, bytes, exec);
  }
  Status select(const SelectKeepParams& p, void* ws, size_t bytes) const {
    return select_keep_cpu(p, ws, bytes, exec);
  }
  Status gather(const GatherKvParams& p) const { return gather_kv_cpu(p, exec); }
};

struct CudaStages {
  cudaStream_t stream;
  size_t score_scratch(const WindowScoresParams& p) const {
    return window_scores_workspace_bytes_cuda(p);
  }
  size_t select_scratch(const SelectKeepParams& p) const {
    return select_keep_workspace_bytes_cuda(p);
  }
  Status scores(const WindowScoresParams& p, void* ws, size_t bytes) const {
    return window_scores_cuda(p, ws, bytes, stream);
  }
  Status select(const SelectKeepParams& p, void* ws, size_t bytes) const {
    return select_keep_cuda(p, ws, bytes, stream);
  }
  Status gather(const GatherKvParams& p) const { return gather_kv_cuda(p, stream); }
};

template <typename Stages>
size_t scratch_bytes(const SnapKvParams& p, const Stages& stages) {
  return std::max(align_up(stages.score_scratch(p.scores)),
                  align_up(stages.select_scratch(p.select)));
}

template <typename Stages>
size_t workspace_bytes(const SnapKvParams& p, const Stages& stages) {
  if (validate_sizes(p.scores) != Status::kOk || validate_sizes(p.select) != Status::kOk) return 0;
  return scores_bytes(p) + scratch_bytes(p, stages);
}

template <typename Stages>
Status run(const SnapKvParams& params, void* workspace, size_t workspace_bytes,
           const Stages& stages) {
  if (auto s = validate_agreement(params); s != Status::kOk) return s;
  if (validate_sizes(params.scores) != Status::kOk || validate_sizes(params.select) != Status::kOk)
    return Status::kInvalidArgument;
  if (params.gather.rope.rotary_dim != 0) return Status::kInvalidArgument;  // snapkv never rotates
  const size_t scores = scores_bytes(params), scratch = scratch_bytes(params, stages);
  if (workspace_bytes < scores + scratch) return Status::kWorkspaceTooSmall;
  if (workspace == nullptr) return Status::kInvalidArgument;

  char* base = static_cast<char*>(workspace);
  SnapKvParams p = params;
  p.scores.scores = reinterpret_cast<float*>(base);
  p.select.scores = p.scores.scores;
  // Check the later stages before the first one runs, so a bad call changes nothing.
  if (auto s = validate(p.select); s != Status::kOk) return s;
  if (auto s = validate(p.gather); s != Status::kOk) return s;
  if (auto s = stages.scores(p.scores, base + scores, scratch); s != Status::kOk) return s;
  if (auto s = stages.select(p.select, base + scores, scratch); s != Status::kOk) return s;
  return stages.gather(p.gather);
}

}  // namespace

size_t snapkv_workspace_bytes_cpu(const SnapKvParams& p, const CpuExecutor& exec) {
  return workspace_bytes(p, CpuStages{exec});
}

Status snapkv_cpu(const SnapKvParams& p, void* workspace, size_t workspace_bytes,
                  const CpuExecutor& exec) {
  return run(p, workspace, workspace_bytes, CpuStages{exec});
}

size_t snapkv_workspace_bytes_cuda(const SnapKvParams& p) {
  return workspace_bytes(p, CudaStages{nullptr});
}

Status snapkv_cuda(const SnapKvParams& p, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream) {
  return run(p, workspace, workspace_bytes, CudaStages{stream});
}

}  // namespace kvprune
