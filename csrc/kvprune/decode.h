// Entry points of the decode-time eviction ops (torch-free core). Included by
// kvprune.h; see decode_params.h for the cache layout and the exact semantics.
// The CUDA entry points are in cuda_backend.inc.
// Same contract as the other entry points: validate, return a Status, never
// throw or allocate; CUDA work goes on the caller's stream without host syncs.
#pragma once

#include <cstddef>

#include "kvprune/cpu_executor.h"
#include "kvprune/decode_params.h"
#include "kvprune/status.h"

typedef struct CUstream_st* cudaStream_t;

namespace kvprune {

// ---- CPU backend ---------------------------------------------------------------
Status streaming_append_cpu(const StreamingAppendParams& p, const CpuExecutor& exec);
Status rerotate_keys_cpu(const RerotateKeysParams& p, const CpuExecutor& exec);
size_t decode_scores_workspace_bytes_cpu(const DecodeScoresParams& p, const CpuExecutor& exec);
Status decode_scores_cpu(const DecodeScoresParams& p, void* workspace, size_t workspace_bytes,
                         const CpuExecutor& exec);
Status h2o_evict_cpu(const H2oEvictParams& p, const CpuExecutor& exec);

}  // namespace kvprune
