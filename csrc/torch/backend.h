// The device-specific half of every op: the core entry points of one backend
// (CPU with ATen's thread pool, or CUDA on the current stream). The ops in
// ops.h are written once against this interface.
#pragma once

#include <cstddef>

#include "kvprune/kvprune.h"

namespace kvprune::torch_ext {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual size_t window_scores_workspace(const WindowScoresParams& p) const = 0;
  virtual Status window_scores(const WindowScoresParams& p, void* ws, size_t ws_bytes) const = 0;
  virtual Status pool_scores(const PoolScoresParams& p) const = 0;
  virtual size_t select_keep_workspace(const SelectKeepParams& p) const = 0;
  virtual Status select_keep(const SelectKeepParams& p, void* ws, size_t ws_bytes) const = 0;
  virtual Status streaming_keep(const StreamingKeepParams& p) const = 0;
  virtual Status gather_kv(const GatherKvParams& p) const = 0;
  virtual Status compact_kv(const CompactKvParams& p) const = 0;
  virtual size_t snapkv_workspace(const SnapKvParams& p) const = 0;
  virtual Status snapkv(const SnapKvParams& p, void* ws, size_t ws_bytes) const = 0;
};

}  // namespace kvprune::torch_ext
