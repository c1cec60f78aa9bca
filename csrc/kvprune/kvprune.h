// Entry points of the torch-free core. Include this header and link the
// `kvprune::core` CMake target. Every function validates its parameters and
// returns a Status; none throws, exits or allocates memory (scratch space comes
// from the caller, sized by the *_workspace_bytes queries, which read only the
// sizes and options of their params, so pointers may still be null then).
#pragma once

#include <cstddef>

#include "kvprune/cpu_executor.h"
#include "kvprune/params.h"
#include "kvprune/status.h"

// Same definition as in CUDA's driver_types.h, so this header needs no CUDA.
typedef struct CUstream_st* cudaStream_t;

namespace kvprune {

// ---- build information ---------------------------------------------------------
const char* version();
bool cuda_compiled();          // CUDA kernels are part of this build
const char* cuda_archs();      // e.g. "80;90a", empty when CUDA is not compiled
const char* cpu_kernels();     // the CPU window_scores kernels this CPU runs: "avx512bf16", "avx512", "avx2" or "baseline"

// ---- CPU backend ---------------------------------------------------------------
size_t window_scores_workspace_bytes_cpu(const WindowScoresParams& p, const CpuExecutor& exec);
Status window_scores_cpu(const WindowScoresParams& p, void* workspace, size_t workspace_bytes,
                         const CpuExecutor& exec);
Status pool_scores_cpu(const PoolScoresParams& p, const CpuExecutor& exec);
size_t select_keep_workspace_bytes_cpu(const SelectKeepParams& p, const CpuExecutor& exec);
Status select_keep_cpu(const SelectKeepParams& p, void* workspace, size_t workspace_bytes,
                       const CpuExecutor& exec);
Status streaming_keep_cpu(const StreamingKeepParams& p, const CpuExecutor& exec);
Status gather_kv_cpu(const GatherKvParams& p, const CpuExecutor& exec);
// In-place compaction (CompactKvParams); also checks keep_idx (ascending, in range,
// the same count for every head of a row): kInvalidArgument if not, nothing written.
// It needs no workspace (0 bytes); the CUDA backend's does.
size_t compact_kv_workspace_bytes_cpu(const CompactKvParams& p, const CpuExecutor& exec);
Status compact_kv_cpu(const CompactKvParams& p, void* workspace, size_t workspace_bytes,
                      const CpuExecutor& exec);
// window_scores -> select_keep (pooled) -> gather_kv in one call, the scores and
// the stages' scratch in the workspace (SnapKvParams in params.h).
size_t snapkv_workspace_bytes_cpu(const SnapKvParams& p, const CpuExecutor& exec);
Status snapkv_cpu(const SnapKvParams& p, void* workspace, size_t workspace_bytes,
                  const CpuExecutor& exec);

}  // namespace kvprune

#include "kvprune/decode.h"  // decode-time eviction ops (StreamingLLM ring, RoPE, H2O)

// ---- CUDA backend (return kNotCompiled when built without CUDA) ------------------
// All work is enqueued on `stream`; nothing synchronises with the host. The same
// list, executed by the SIMT emulator, is declared in kvprune/emu.h. (The emulator's
// build of the kernel sources leaves this copy out, so that calls between its entry
// points cannot resolve, by argument-dependent lookup, to the GPU ones.)
#if !defined(KVPRUNE_EMULATOR_BUILD)
namespace kvprune {
#include "kvprune/cuda_backend.inc"
}  // namespace kvprune
#endif
