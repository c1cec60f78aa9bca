// snapkv_cpu: the three CPU stage entry points chained (core/snapkv_chain.h).
#include "core/snapkv_chain.h"

namespace kvprune {
namespace {

// The CPU stage entry points, with an executor.
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

}  // namespace

size_t snapkv_workspace_bytes_cpu(const SnapKvParams& p, const CpuExecutor& exec) {
  return snapkv_chain::workspace_bytes(p, CpuStages{exec});
}

Status snapkv_cpu(const SnapKvParams& p, void* workspace, size_t workspace_bytes,
                  const CpuExecutor& exec) {
  return snapkv_chain::run(p, workspace, workspace_bytes, CpuStages{exec});
}

}  // namespace kvprune
