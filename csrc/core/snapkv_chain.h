// The SnapKV chain written once over a backend's stage entry points: the CPU ones
// (core/snapkv.cpp) or the CUDA ones (cuda/snapkv.cu, which the emulator build
// compiles too). Workspace: [scores B*Hkv*N fp32][max(window_scores scratch,
// select_keep scratch)]. A Stages type provides score_scratch, select_scratch,
// scores, select and gather with the signatures of CpuStages in core/snapkv.cpp.
#pragma once

#include <algorithm>

#include "core/validate.h"
#include "kvprune/kvprune.h"

namespace kvprune::snapkv_chain {

constexpr size_t kAlign = 256;

inline size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

inline size_t scores_bytes(const SnapKvParams& p) {
  return align_up(static_cast<size_t>(p.scores.batch * p.scores.kv_heads * p.scores.length) *
                  sizeof(float));
}

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
  if (!params.select_only && params.gather.rope.rotary_dim != 0)
    return Status::kInvalidArgument;  // snapkv never rotates
  const size_t scores = scores_bytes(params), scratch = scratch_bytes(params, stages);
  if (workspace_bytes < scores + scratch) return Status::kWorkspaceTooSmall;
  if (workspace == nullptr) return Status::kInvalidArgument;

  char* base = static_cast<char*>(workspace);
  SnapKvParams p = params;
  p.scores.scores = reinterpret_cast<float*>(base);
  p.select.scores = p.scores.scores;
  // Check the later stages before the first one runs, so a bad call changes nothing.
  if (auto s = validate(p.select); s != Status::kOk) return s;
  if (!p.select_only) {
    if (auto s = validate(p.gather); s != Status::kOk) return s;
  }
  if (auto s = stages.scores(p.scores, base + scores, scratch); s != Status::kOk) return s;
  if (auto s = stages.select(p.select, base + scores, scratch); s != Status::kOk) return s;
  return p.select_only ? Status::kOk : stages.gather(p.gather);
}

}  // namespace kvprune::snapkv_chain
