// The device-specific half of every op: the core entry points of one backend
// (CPU with ATen's thread pool, CUDA on the current stream, or the CUDA kernels
// under the emulator). The ops in ops.h and decode_ops.h are written once
// against this interface.
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
  // decode time
  virtual Status streaming_append(const StreamingAppendParams& p) const = 0;
  virtual Status rerotate_keys(const RerotateKeysParams& p) const = 0;
  virtual size_t decode_scores_workspace(const DecodeScoresParams& p) const = 0;
  virtual Status decode_scores(const DecodeScoresParams& p, void* ws, size_t ws_bytes) const = 0;
  virtual Status h2o_evict(const H2oEvictParams& p) const = 0;
};

}  // namespace kvprune::torch_ext
