// The SIMT emulator's runtime: grid launch, the block scheduler, barriers and warp
// collectives. Kernel code never calls it directly; it goes through the device
// shims of emu/device.h (which cuda/simt.cuh includes when not compiled by nvcc).
//
// Execution model
//  * A grid runs block by block; blocks are spread over host threads
//    (Options::host_threads) and never share a host thread's state.
//  * The threads of a block are fibers on one host thread. A thread runs until it
//    reaches __syncthreads, a warp collective or its end; the scheduler then runs
//    the next runnable thread in the block's order (Options::schedule). A barrier
//    opens when every thread of the block has reached it; a collective completes
//    when every lane named in its mask has reached the same collective (same kind,
//    mask and call site).
//  * Blocks may signal each other through flags (simt::set_flag / wait_flag). A block
//    keeps its host thread while it waits, so a wait that no block running on another
//    host thread can end (with one host thread: any unset flag) fails the launch as
//    the deadlock it would be on a GPU, where blocks need not run at once either.
//    Options::slow_worker makes one host thread a slow SM: its first block runs first, and
//    at its barriers it waits until the others can go no further, so their blocks overtake
//    its blocks (with two host threads, the same way on every run).
//  * Anything that would hang or be undefined on a GPU fails the launch with a
//    message naming the kernel, the block and the threads: a barrier that only
//    part of the block reaches, a collective that can never complete (a lane of its
//    mask exited or waits elsewhere), a lane outside its own mask, a shuffle that
//    reads a lane outside the mask, a launch beyond the H100 limits.
//  * Errors follow CUDA's: a bad launch configuration is reported once (like
//    cudaErrorInvalidConfiguration); a kernel that broke a rule is sticky (like a
//    device fault): later launches on that host thread are skipped until
//    kvprune::emu::last_error() has been read.
#pragma once

#include <vector_types.h>  // dim3, uint3 (host-usable CUDA types)

#include <cstddef>
#include <cstdint>

#include "emu/fiber.h"
#include "kvprune/emu.h"

namespace kvprune::emu::detail {

// H100 / H200 launch limits (registers are not modelled).
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockDimZ = 64;
constexpr unsigned kMaxGridDimX = 0x7fffffffu;
constexpr unsigned kMaxGridDimYZ = 65535;
constexpr size_t kDefaultDynamicSmem = 48 * 1024;  // without cudaFuncSetAttribute
constexpr size_t kMaxDynamicSmemOptin = 227 * 1024;
constexpr int kWarpSize = 32;

enum class Collective : uint8_t {
  kShuffleXor,  // operand words: value (2), lane mask
  kShuffleIdx,  // operand words: value (2), source lane
  kMatchAny,
  kMmaF16,      // mma.sync.m16n8k16.row.col.f32.f16.f16.f32
  kMmaBf16,     // mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32
};

// Operand words a lane brings to a collective and result words it takes away.
constexpr int kMaxInWords = 10;  // mma: a0..a3, b0, b1, c0..c3
constexpr int kMaxOutWords = 4;  // mma: d0..d3

enum class ThreadState : uint8_t { kRunnable, kAtBarrier, kAtCollective, kExited };

struct EmuThread {
  uint3 thread_idx;
  int linear = 0;  // x + y * dim.x + z * dim.x * dim.y
  ThreadState state = ThreadState::kRunnable;
  const char* wait_file = nullptr;  // where it waits (for reports)
  int wait_line = 0;
  uint32_t in[kMaxInWords];
  uint32_t out[kMaxOutWords];
  Fiber fiber;
};

// What the shims read: the running thread and its block.
struct BlockContext {
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  void* dynamic_smem;  // exactly the launch's dynamic shared memory bytes
};
extern __thread EmuThread* t_thread;
extern __thread const BlockContext* t_block;

// ---- called by the shims on an emulated thread ------------------------------------
void syncthreads(const char* file, int line);
// Joins a warp collective: `in` holds this lane's operand words (in_words of them),
// `out` receives its result words once every lane of `mask` has joined the same
// collective (same kind, mask and call site).
void warp_collective(Collective kind, unsigned mask, const char* file, int line,
                     const uint32_t* in, int in_words, uint32_t* out, int out_words);
// Returns once *flag != 0 (an acquire load), set by another block. Fails the launch when
// every running block waits on an unset flag (nothing can set one any more), when
// another block failed, or after 60 s.
void wait_for_flag(const uint32_t* flag, const char* file, int line);
// Fails the launch (an error found by a shim, e.g. a bad atomic address).
[[noreturn]] void fail_thread(const char* what);
// The block's copy of the static shared variable declared at `site` (one address per
// declaration): allocated at its exact size on first use in a launch, 0xff-filled at
// each block start, counted against the shared-memory limits.
void* block_shared_bytes(const void* site, size_t bytes, size_t align);
template <typename T>
T* block_shared(const void* site, size_t align) {
  return static_cast<T*>(block_shared_bytes(site, sizeof(T), align));
}

// ---- called by simt::launch & co. on the host ---------------------------------------
struct KernelRef {
  const char* name;  // demangled kernel name, for messages
  const void* id;    // the kernel function's address (cudaFuncSetAttribute key)
};
// Runs body(ctx) on every thread of the grid. Returns cudaSuccess (0) or a CUDA
// error code; the message is kept for last_error().
int launch(const KernelRef& kernel, dim3 grid, dim3 block, size_t dynamic_smem,
           void (*body)(void* ctx), void* ctx);
int set_max_dynamic_smem(const void* kernel_id, int bytes);
int take_last_error_code();  // cudaGetLastError: the first error since the last call

}  // namespace kvprune::emu::detail
