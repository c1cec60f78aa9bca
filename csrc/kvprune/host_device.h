// KVPRUNE_HOST_DEVICE: small inline helpers of the core's headers that CUDA kernels call
// too (nvcc: __host__ __device__; the host compiler, the emulator included: inline).
#pragma once

#if defined(__CUDACC__)
#define KVPRUNE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVPRUNE_HOST_DEVICE inline
#endif
