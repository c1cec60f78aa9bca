// The one portability header of the CUDA kernels. Kernel sources include it instead
// of CUDA's headers and write everything device-specific through it, so the same
// source is compiled twice:
//  * by nvcc for the GPU: CUDA, CUB and inline PTX;
//  * by the host compiler for the SIMT emulator (KVPRUNE_EMU): emu/device.h maps
//    the CUDA built-ins onto the emulator's runtime, and the kernels and their
//    launchers land in namespace kvprune::emu (kvprune/emu.h), beside the real ones.
// Kernel logic is never written twice; what differs lives below, in simt::.
//
// Namespaces: files under csrc/cuda open KVPRUNE_CUDA_NAMESPACE_BEGIN instead of
// `namespace kvprune {`.
// Static shared memory: KVPRUNE_SHARED(type, name) or KVPRUNE_SHARED(type, name, [n][m])
// declares `__shared__ type name[n][m];` (KVPRUNE_SHARED_ALIGNED(16, ...) adds
// __align__(16)). Under the emulator each such variable is a per-block allocation of its
// exact size, filled with 0xff at every block start and counted against the launch's
// shared-memory limits; plain `__shared__` does not compile there.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#define KVPRUNE_CUDA_NAMESPACE_BEGIN namespace kvprune {
#define KVPRUNE_CUDA_NAMESPACE_END }
#define KVPRUNE_SHARED(T, name, ...) __shared__ T name __VA_ARGS__
#define KVPRUNE_SHARED_ALIGNED(align, T, name, ...) __shared__ __align__(align) T name __VA_ARGS__

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace simt {

// ---- host side ----------------------------------------------------------------------------
struct DeviceProperties {
  int sm_count = 0;
  int max_dynamic_smem_optin = 0;  // bytes per block after cudaFuncSetAttribute
};

inline bool current_device_properties(DeviceProperties* props) {
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&props->sm_count, cudaDevAttrMultiProcessorCount, device) ==
             cudaSuccess &&
         cudaDeviceGetAttribute(&props->max_dynamic_smem_optin,
                                cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess;
}

// kernel<<<grid, block, dynamic_smem, stream>>>(args...); errors via get_last_error().
template <auto Kernel, typename... Args>
void launch(dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream, const Args&... args) {
  Kernel<<<grid, block, dynamic_smem, stream>>>(args...);
}

template <typename Kernel>
cudaError_t set_max_dynamic_smem(Kernel* kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

inline cudaError_t memset_async(void* p, int value, size_t bytes, cudaStream_t stream) {
  return cudaMemsetAsync(p, value, bytes, stream);
}

inline cudaError_t get_last_error() { return cudaGetLastError(); }

// ---- device side --------------------------------------------------------------------------
// 2^x with ex2.approx.ftz.f32 (about 2 ulp; subnormal inputs and results flush to zero).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// acc += A (16x16, row-major) * B (16x8, col-major) with mma.sync.m16n8k16, fp32
// accumulate; a0..a3, b0, b1 hold two fp16/bf16 elements each in the PTX ISA's
// fragment layout (see emu/runtime.cpp for the table).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "fp16 or bf16 only");
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Flags between the blocks of one launch (a word that starts 0 and is set once):
// set_flag after a __syncthreads publishes everything the block wrote or read before
// that barrier (a release at GPU scope); wait_flag returns once the flag is set (an
// acquire), and a __syncthreads after it orders the whole block after the setter's.
// A block may only wait on one that has already started (e.g. by taking its work from
// a counter in start order): CUDA does not promise that all blocks run at once.
__device__ __forceinline__ void set_flag(uint32_t* flag) {
  __threadfence();
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(1u) : "memory");
}

__device__ __forceinline__ void wait_flag(const uint32_t* flag) {
  for (;;) {
    uint32_t value;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
    if (value != 0) return;
    __nanosleep(64);
  }
}

// The block's dynamic shared memory (the launch's dynamic_smem bytes, 16-byte aligned).
template <typename T>
__device__ __forceinline__ T* dynamic_shared() {
  extern __shared__ __align__(16) unsigned char kvprune_dynamic_smem[];
  return reinterpret_cast<T*>(kvprune_dynamic_smem);
}

template <typename T, int kThreads>
using BlockScan = cub::BlockScan<T, kThreads>;
template <typename T, int kThreads>
using BlockReduce = cub::BlockReduce<T, kThreads>;

}  // namespace simt
KVPRUNE_CUDA_NAMESPACE_END

#else  // the SIMT emulator

#if !defined(KVPRUNE_EMULATOR_BUILD)
#error "kernel sources are compiled for the emulator through the wrappers CMake generates"
#endif

#include <string>

#include "emu/block.h"
#include "emu/device.h"

#define KVPRUNE_CUDA_NAMESPACE_BEGIN \
  namespace kvprune {                \
  namespace emu {
#define KVPRUNE_CUDA_NAMESPACE_END \
  }                                \
  }
#define KVPRUNE_SHARED_ALIGNED(align, T, name, ...) \
  static const char name##_shared_site = 0;         \
  auto& name = *::kvprune::emu::detail::block_shared<T __VA_ARGS__>(&name##_shared_site, align)
#define KVPRUNE_SHARED(T, name, ...) KVPRUNE_SHARED_ALIGNED(alignof(T), T, name, __VA_ARGS__)

namespace kvprune::emu::simt {

struct DeviceProperties {
  int sm_count = 0;
  int max_dynamic_smem_optin = 0;
};

// An H100/H200 with Options::sm_count SMs.
inline bool current_device_properties(DeviceProperties* props) {
  props->sm_count = options().sm_count;
  props->max_dynamic_smem_optin = static_cast<int>(detail::kMaxDynamicSmemOptin);
  return props->sm_count > 0;
}

// "window_scores_mma_kernel<__half, 64, ...>" from this template's signature.
template <auto Kernel>
const char* kernel_name() {
  static const std::string name = [signature = std::string(__PRETTY_FUNCTION__)] {
    const size_t begin = signature.find("Kernel = ");
    if (begin == std::string::npos) return signature;
    const size_t end = signature.find_first_of(";]", begin);
    std::string text = signature.substr(begin + 9, end - begin - 9);
    for (const char* prefix : {"kvprune::emu::", "{anonymous}::"}) {
      for (size_t at; (at = text.find(prefix)) != std::string::npos;)
        text.erase(at, std::char_traits<char>::length(prefix));
    }
    return text;
  }();
  return name.c_str();
}

// Runs the whole grid now, on the host (the stream is ignored).
template <auto Kernel, typename... Args>
void launch(dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t, const Args&... args) {
  auto call = [&] { Kernel(args...); };
  using Call = decltype(call);
  detail::launch({kernel_name<Kernel>(), reinterpret_cast<const void*>(Kernel)}, grid, block,
                 dynamic_smem, [](void* c) { (*static_cast<Call*>(c))(); }, &call);
}

template <typename Kernel>
cudaError_t set_max_dynamic_smem(Kernel* kernel, int bytes) {
  return static_cast<cudaError_t>(
      detail::set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes));
}

inline cudaError_t memset_async(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}

inline cudaError_t get_last_error() { return static_cast<cudaError_t>(detail::take_last_error_code()); }

// ex2.approx.ftz.f32 emulated as exact exp2 with the same flushing of subnormals. The GPU's
// result is up to 2 ulp away: tolerances are set for the GPU, not from emulator runs.
inline float fast_exp2(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = std::copysign(0.f, x);
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? std::copysign(0.f, y) : y;
}

// A warp collective of all 32 lanes, computed by the runtime from the PTX ISA's
// fragment layouts.
template <typename T>
inline void mma_m16n8k16(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                         uint32_t b0, uint32_t b1, const char* file = __builtin_FILE(),
                         int line = __builtin_LINE()) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "fp16 or bf16 only");
  uint32_t in[detail::kMaxInWords] = {a0, a1, a2, a3, b0, b1};
  std::memcpy(in + 6, acc, sizeof acc);
  uint32_t out[4];
  detail::warp_collective(std::is_same_v<T, __half> ? detail::Collective::kMmaF16
                                                     : detail::Collective::kMmaBf16,
                          0xffffffffu, file, line, in, detail::kMaxInWords, out, 4);
  std::memcpy(acc, out, sizeof acc);
}

// Flags between blocks: a release store and an acquire poll. A block keeps its host
// thread, so the runtime fails a wait that no running block can end (a GPU deadlock).
inline void set_flag(uint32_t* flag) { __atomic_store_n(flag, 1u, __ATOMIC_RELEASE); }

inline void wait_flag(const uint32_t* flag, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  detail::wait_for_flag(flag, file, line);
}

template <typename T>
inline T* dynamic_shared() {
  return static_cast<T*>(detail::t_block->dynamic_smem);
}

}  // namespace kvprune::emu::simt

#endif
