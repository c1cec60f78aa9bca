// The emulator's execution rules on small kernels of this file: what must run (divergent
// sub-warp collectives, every schedule), what must fail (partial barriers, lanes outside
// their mask, exited lanes a collective waits for, shared memory over the H100 limits),
// poisoned static shared memory, the slow worker's order, and CUDA's error semantics (a bad
// launch configuration is reported once, a kernel fault is sticky until last_error() is read).
#define KVPRUNE_EMULATOR_BUILD 1
#include "cuda/simt.cuh"

#include <cstdio>
#include <cstring>
#include <string>

namespace kvprune::emu::rules_test {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAIL", what.c_str());
  failures += ok ? 0 : 1;
}

// Lanes 0-15 reduce among themselves, then the whole warp broadcasts lane 0's sum.
__global__ void subwarp_then_warp(int* out) {
  const int lane = static_cast<int>(threadIdx.x);
  int v = lane;
  if (lane < 16) {
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0x0000ffffu, v, o);
  }
  out[lane] = __shfl_sync(0xffffffffu, v, 0);
}

// Each block reads its static shared word before writing it.
__global__ void read_before_write(int* out) {
  KVPRUNE_SHARED(int, word);
  if (threadIdx.x == 0) out[blockIdx.x] = word;
  __syncthreads();
  if (threadIdx.x == 0) word = 100 + static_cast<int>(blockIdx.x);
}

__global__ void thread_exits_before_barrier(int* out) {
  if (threadIdx.x == 5) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void lane_outside_its_mask(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(0x7fffffffu, 1, 0);
}

__global__ void collective_waits_for_exited_lane(int* out) {
  if (threadIdx.x == 31) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
}

__global__ void big_static_shared(int* out) {
  KVPRUNE_SHARED(char, bytes, [40 * 1024]);
  bytes[threadIdx.x] = 1;
  out[0] = bytes[0];
}

__global__ void trivial(int* out) { out[threadIdx.x] = static_cast<int>(threadIdx.x); }

// out[block]: the order in which blocks pass their barrier; out[gridDim.x]: the counter.
__global__ void order_past_barrier(int* out) {
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = atomicAdd(out + gridDim.x, 1);
}

// out[0]: a flag block 0 sets after its barrier, having written out[1] = 42; every other
// block waits on it, then copies out[1] to out[1 + blockIdx.x].
__global__ void others_wait_for_block_0(int* out) {
  uint32_t* flag = reinterpret_cast<uint32_t*>(out);
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) out[1] = 42;
    __syncthreads();
    if (threadIdx.x == 0) simt::set_flag(flag);
  } else {
    if (threadIdx.x == 0) simt::wait_flag(flag);
    __syncthreads();
    if (threadIdx.x == 0) out[1 + blockIdx.x] = out[1];
  }
}

template <auto Kernel>
std::string run(dim3 grid, dim3 block, size_t smem, int* out, Schedule schedule = Schedule::kForward) {
  Options options;
  options.schedule = schedule;
  options.host_threads = 1;
  set_options(options);
  simt::launch<Kernel>(grid, block, smem, nullptr, out);
  const cudaError_t code = simt::get_last_error();
  const std::string message = last_error();
  return code == cudaSuccess ? std::string() : message.empty() ? "error" : message;
}

bool contains(const std::string& text, const char* what) { return text.find(what) != std::string::npos; }

void rules() {
  int out[64];
  for (Schedule s : {Schedule::kForward, Schedule::kReverse, Schedule::kShuffled}) {
    std::memset(out, 0, sizeof out);
    const std::string error = run<subwarp_then_warp>(1, 32, 0, out, s);
    bool ok = error.empty();
    for (int l = 0; l < 32; ++l) ok = ok && out[l] == 120;  // 0 + 1 + ... + 15
    expect(ok, "divergent sub-warp shuffles then a full-warp shuffle, schedule " +
                   std::to_string(static_cast<int>(s)) + (error.empty() ? "" : ": " + error));
  }

  std::memset(out, 0, sizeof out);
  std::string error = run<read_before_write>(4, 32, 0, out);
  bool poisoned = error.empty();
  for (int b = 0; b < 4; ++b) poisoned = poisoned && out[b] == -1;
  error = run<read_before_write>(4, 32, 0, out, Schedule::kReverse);
  for (int b = 0; b < 4; ++b) poisoned = poisoned && error.empty() && out[b] == -1;
  expect(poisoned, "static shared memory reads 0xff before it is written, in every block and launch");

  error = run<thread_exits_before_barrier>(1, 64, 0, out);
  expect(contains(error, "reached by only part of the block") && contains(error, "threads 5 exited"),
         "a barrier that thread 5 never reaches fails: " + error);
  error = run<lane_outside_its_mask>(1, 32, 0, out);
  expect(contains(error, "which is not in the mask") || contains(error, "does not name its own lane"),
         "a shuffle whose mask misses a lane fails: " + error);
  error = run<collective_waits_for_exited_lane>(1, 32, 0, out);
  expect(contains(error, "deadlock") && contains(error, "lane 31 exited"),
         "a collective waiting for an exited lane fails: " + error);
  error = run<big_static_shared>(1, 32, 16 * 1024, out);
  expect(contains(error, "exceed the limit of 49152"),
         "40 KB static + 16 KB dynamic shared memory without opt-in fails: " + error);
}

// A slow worker's block runs first and is overtaken by every block the other host thread
// can run, on every run alike; a block waiting on the slow one's flag lets it go on.
void slow_worker() {
  Options options;
  options.host_threads = 2;
  options.slow_worker = true;
  bool overtaken = true;
  for (int repeat = 0; repeat < 20; ++repeat) {
    int buffer[5] = {};
    int* out = buffer;
    set_options(options);
    simt::launch<order_past_barrier>(4, 64, 0, nullptr, out);
    overtaken = overtaken && simt::get_last_error() == cudaSuccess && out[0] == 3 && out[1] == 0 &&
                out[2] == 1 && out[3] == 2;
  }
  expect(overtaken,
         "the slow worker's block 0 passes its barrier after blocks 1-3, in each of 20 runs");
  int words[5] = {};
  int* flagged = words;
  set_options(options);
  simt::launch<others_wait_for_block_0>(4, 64, 0, nullptr, flagged);
  const bool ran = simt::get_last_error() == cudaSuccess;
  expect(ran && words[0] == 1 && words[2] == 42 && words[3] == 42 && words[4] == 42,
         std::string("blocks waiting on the slow worker's flag let it go on, then see what it "
                     "wrote before ") + last_error());
}

void error_semantics() {
  int buffer[64];
  int* out = buffer;
  std::string error = run<trivial>(1, 2048, 0, out);
  expect(contains(error, "a block has 1 to 1024 threads"), "2048 threads per block fail: " + error);
  error = run<trivial>(1, 32, 0, out);
  expect(error.empty(), "a configuration error is not sticky: the next launch runs");

  Options options;
  set_options(options);
  simt::launch<thread_exits_before_barrier>(1, 64, 0, nullptr, out);
  const bool faulted = simt::get_last_error() != cudaSuccess;
  simt::launch<trivial>(1, 32, 0, nullptr, out);
  const bool skipped = simt::get_last_error() == cudaErrorLaunchFailure;
  const std::string why = last_error();
  simt::launch<trivial>(1, 32, 0, nullptr, out);
  const bool runs_again = simt::get_last_error() == cudaSuccess;
  expect(faulted && skipped && contains(why, "reached by only part of the block") && runs_again,
         "a kernel fault is sticky until last_error() is read");
}

}  // namespace kvprune::emu::rules_test

int main() {
  using namespace kvprune::emu::rules_test;
  rules();
  slow_worker();
  error_semantics();
  std::printf("%s: emulator execution rules (%d failed)\n", failures == 0 ? "ok" : "FAILED", failures);
  return failures == 0 ? 0 : 1;
}
