// The SIMT emulator: the CUDA backend's kernels, compiled a second time by the host
// compiler and executed on the CPU with CUDA's execution model (blocks of
// cooperatively scheduled threads, barriers, warp collectives, mma.sync fragment
// layouts, H100 launch limits). It proves logic, bounds, barriers and layouts, not
// speed. Pointers are host pointers; `stream` is ignored and every call has finished
// when it returns. A launch that breaks a rule of the execution model fails:
// the entry point returns Status::kCudaError and last_error() says why.
#pragma once

#include <cstdint>

#include "kvprune/kvprune.h"

namespace kvprune::emu {

// Order in which the threads of a block run between two barriers.
enum class Schedule : int {
  kForward = 0,   // thread 0 first
  kReverse = 1,   // the last thread first
  kShuffled = 2,  // a permutation drawn from `seed`, new at every barrier
};

struct Options {
  Schedule schedule = Schedule::kForward;
  uint64_t seed = 0;
  int sm_count = 132;    // what the launch heuristics see (an H100 SXM / H200 has 132)
  int host_threads = 0;  // host threads that run blocks in parallel; 0: one per CPU, at most 8
  // True: the calling host thread (one of the host_threads) stands for a slow SM. Its first
  // block runs before any other, and when the first thread of one of its blocks reaches a
  // barrier and when the barrier opens, it waits until every other host thread waits on an
  // unset flag or has no block left: the others' blocks overtake its blocks as far as they
  // can (ordering bugs between blocks, e.g. a missing wait on a flag or a flag set before the
  // block's loads, then show). With host_threads = 2 the order is the same on every run.
  bool slow_worker = false;
};

// True when this build contains the emulator (otherwise every entry point below
// returns Status::kNotCompiled).
bool compiled();
// Options for the launches made by the calling host thread.
void set_options(const Options& options);
Options options();
// Why the last failed launch (or cudaFuncSetAttribute) of the calling thread failed ("" if
// none). Reading it clears it; after a kernel fault, which is sticky like a device fault
// (later launches on this thread fail without running), it also lets launches run again.
const char* last_error();
// Every kernel (template instantiation) launched so far in this process, with its
// number of launches: fn(ctx, name, launches) once per kernel, for coverage reports.
void for_each_launch_count(void (*fn)(void* ctx, const char* kernel, uint64_t launches), void* ctx);

#include "kvprune/cuda_backend.inc"

}  // namespace kvprune::emu
