// The SIMT emulator's runtime (see runtime.h for the execution model).
#include "emu/runtime.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <driver_types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <map>
#include <unordered_map>
#include <vector>

namespace kvprune::emu {
namespace detail {

__thread EmuThread* t_thread = nullptr;
__thread const BlockContext* t_block = nullptr;

namespace {

thread_local Options t_options;
thread_local int t_error_code = cudaSuccess;  // cudaGetLastError
thread_local std::string t_message;           // last_error()
thread_local bool t_sticky = false;           // a kernel faulted: skip launches until last_error()

std::string format(const char* fmt, ...) {
  char buffer[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buffer, sizeof buffer, fmt, args);
  va_end(args);
  return buffer;
}

// "0-31, 40, 42-43" for a sorted list of thread ids.
std::string id_ranges(const std::vector<int>& ids) {
  std::string text;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!text.empty()) text += ", ";
    text += j == i ? std::to_string(ids[i]) : std::to_string(ids[i]) + "-" + std::to_string(ids[j]);
    i = j + 1;
  }
  return text;
}

std::string lane_ranges(unsigned mask) {
  std::vector<int> lanes;
  for (int l = 0; l < kWarpSize; ++l)
    if (mask >> l & 1u) lanes.push_back(l);
  return id_ranges(lanes);
}

const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash != nullptr ? slash + 1 : path;
}

const char* collective_name(Collective kind) {
  switch (kind) {
    case Collective::kShuffleXor: return "__shfl_xor_sync";
    case Collective::kShuffleIdx: return "__shfl_sync";
    case Collective::kMatchAny: return "__match_any_sync";
    case Collective::kMmaF16: return "mma.sync.m16n8k16 (f16)";
    case Collective::kMmaBf16: return "mma.sync.m16n8k16 (bf16)";
  }
  return "collective";
}

// ---- mma.sync m16n8k16, fragment layouts of the PTX ISA -----------------------------
// groupID g = lane / 4, t = lane % 4.
//   A 16x16 (row-major), registers a0..a3, two elements each (low half first),
//     element i in 0..7: row g + 8 * ((i / 2) % 2), col 2t + (i % 2) + 8 * (i / 4).
//   B 16x8 (column-major), registers b0, b1, element i in 0..3: row 2t + (i % 2) + 8 * (i / 2),
//     col g.
//   C, D 16x8 fp32, c0..c3: row g + 8 * (i / 2), col 2t + (i % 2).
float element_to_float(uint32_t reg, int half, bool bf16) {
  const auto bits = static_cast<unsigned short>(half == 0 ? reg & 0xffffu : reg >> 16);
  if (bf16) {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return __bfloat162float(__nv_bfloat16(raw));
  }
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}

void mma_m16n8k16(EmuThread* const* lanes, bool bf16) {
  float a[16][16], b[16][8], c[16][8];
  for (int lane = 0; lane < kWarpSize; ++lane) {
    const int g = lane / 4, t = lane % 4;
    const uint32_t* in = lanes[lane]->in;  // a0..a3, b0, b1, c0..c3
    for (int i = 0; i < 8; ++i)
      a[g + 8 * ((i / 2) % 2)][2 * t + i % 2 + 8 * (i / 4)] = element_to_float(in[i / 2], i % 2, bf16);
    for (int i = 0; i < 4; ++i)
      b[2 * t + i % 2 + 8 * (i / 2)][g] = element_to_float(in[4 + i / 2], i % 2, bf16);
    for (int i = 0; i < 4; ++i) std::memcpy(&c[g + 8 * (i / 2)][2 * t + i % 2], &in[6 + i], 4);
  }
  for (int lane = 0; lane < kWarpSize; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
      float acc = c[row][col];  // products of f16/bf16 values are exact in fp32
      for (int k = 0; k < 16; ++k) acc += a[row][k] * b[k][col];
      std::memcpy(&lanes[lane]->out[i], &acc, 4);
    }
  }
}

// ---- one block ---------------------------------------------------------------------------
struct PendingCollective {
  Collective kind;
  unsigned mask;
  const char* file;
  int line;
  unsigned arrived;
};

struct Launch {
  KernelRef kernel;
  dim3 grid, block;
  size_t dynamic_smem;
  void (*body)(void*);
  void* ctx;
  Options options;
  std::atomic<uint64_t> next_block{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::string error;  // the first failure

  // Workers (host threads) still taking blocks (all of them from the start), and the flags
  // their blocks wait on.
  std::mutex workers_mutex;
  int running_workers = 0;
  std::vector<const uint32_t*> awaited;  // one entry per waiting worker
  // With a slow worker (Options::slow_worker): set once its first block stalls, waits on a
  // flag or ends; the other workers take no block before, so the slow one's runs first.
  std::atomic<bool> slow_started{false};

  void finish_worker() {
    const std::lock_guard<std::mutex> lock(workers_mutex);
    --running_workers;
  }
  void start_waiting(const uint32_t* flag) {
    const std::lock_guard<std::mutex> lock(workers_mutex);
    awaited.push_back(flag);
  }
  void stop_waiting(const uint32_t* flag) {
    const std::lock_guard<std::mutex> lock(workers_mutex);
    awaited.erase(std::find(awaited.begin(), awaited.end(), flag));
  }
  // Every running worker waits, and on a flag nobody set: nothing can set one any more (a
  // worker sets flags only while it runs a block that does not wait).
  bool deadlocked() { return blocked_on_unset_flags(0); }
  // Every running worker but `others_than` of them waits on a flag nobody set.
  bool blocked_on_unset_flags(int others_than) {
    const std::lock_guard<std::mutex> lock(workers_mutex);
    int blocked = 0;
    for (const uint32_t* f : awaited) blocked += __atomic_load_n(f, __ATOMIC_ACQUIRE) == 0;
    return blocked + others_than >= running_workers;
  }
};

// Fibers (and their stacks) of one host worker, reused from block to block and
// from launch to launch.
struct FiberPool {
  std::vector<std::unique_ptr<EmuThread>> threads;
};

std::mutex g_pools_mutex;
std::vector<std::unique_ptr<FiberPool>> g_free_pools;

std::unique_ptr<FiberPool> acquire_pool() {
  const std::lock_guard<std::mutex> lock(g_pools_mutex);
  if (g_free_pools.empty()) return std::make_unique<FiberPool>();
  auto pool = std::move(g_free_pools.back());
  g_free_pools.pop_back();
  return pool;
}

void release_pool(std::unique_ptr<FiberPool> pool) {
  const std::lock_guard<std::mutex> lock(g_pools_mutex);
  g_free_pools.push_back(std::move(pool));
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

size_t allowed_dynamic_smem(const void* kernel_id);  // after cudaFuncSetAttribute, if any

class BlockRun;
__thread BlockRun* t_run = nullptr;

class BlockRun {
 public:
  BlockRun(Launch& launch, FiberPool& pool, bool slow) : launch_(launch), pool_(pool), slow_(slow) {
    const dim3 b = launch.block;
    size_ = static_cast<int>(b.x * b.y * b.z);
    while (static_cast<int>(pool_.threads.size()) < size_)
      pool_.threads.push_back(std::make_unique<EmuThread>());
    threads_.resize(size_);
    for (int i = 0; i < size_; ++i) threads_[i] = pool_.threads[i].get();
    warps_.resize((size_ + kWarpSize - 1) / kWarpSize);
    allowed_dynamic_smem_ = allowed_dynamic_smem(launch.kernel.id);
    // Exactly the requested bytes (AddressSanitizer sees any access past them), one
    // allocation for all blocks this worker runs, refilled at every block start.
    dynamic_smem_.reset(static_cast<char*>(std::malloc(std::max<size_t>(launch.dynamic_smem, 1))));
  }

  // Runs one block; false (and *error set) when it broke a rule.
  bool run(uint64_t linear_block, std::string* error) {
    const dim3 g = launch_.grid, b = launch_.block;
    context_.block_idx = {static_cast<unsigned>(linear_block % g.x),
                          static_cast<unsigned>(linear_block / g.x % g.y),
                          static_cast<unsigned>(linear_block / g.x / g.y)};
    context_.block_dim = b;
    context_.grid_dim = g;
    // Shared memory is filled with 0xff so that reads before writes show (NaN, -1).
    std::memset(dynamic_smem_.get(), 0xff, launch_.dynamic_smem);
    context_.dynamic_smem = launch_.dynamic_smem > 0 ? dynamic_smem_.get() : nullptr;
    for (const auto& s : static_shared_) std::memset(s.data, 0xff, s.bytes);
    for (int i = 0; i < size_; ++i) {
      EmuThread* t = threads_[i];
      t->linear = i;
      t->thread_idx = {static_cast<unsigned>(i % b.x), static_cast<unsigned>(i / b.x % b.y),
                       static_cast<unsigned>(i / b.x / b.y)};
      t->state = ThreadState::kRunnable;
      t->wait_file = nullptr;
      t->fiber.reset(&thread_main, t);
    }
    for (auto& w : warps_) w.clear();
    at_barrier_ = exited_ = 0;
    failed_ = false;
    linear_block_ = linear_block;
    t_block = &context_;
    t_run = this;
    bool ok = schedule();
    t_block = nullptr;
    t_run = nullptr;
    t_thread = nullptr;
    if (!ok) *error = describe_block() + ": " + failure_;
    return ok;
  }

  void barrier(const char* file, int line) {
    EmuThread* t = t_thread;
    if (slow_ && at_barrier_ == 0) stall();  // the first thread there: what it did shows to others
    t->state = ThreadState::kAtBarrier;
    t->wait_file = file;
    t->wait_line = line;
    ++at_barrier_;
    t->fiber.suspend();
  }

  // A lane joins the pending collective of the same kind, mask and call site, or opens
  // one. Lanes of one warp may wait at different collectives at once (divergent code on
  // sm_70+); only when nothing can run any more does that become an error (a deadlock).
  void collective(Collective kind, unsigned mask, const char* file, int line,
                  const uint32_t* in, int in_words, uint32_t* out, int out_words) {
    EmuThread* t = t_thread;
    const int warp = t->linear / kWarpSize, lane = t->linear % kWarpSize;
    const unsigned bit = 1u << lane;
    const unsigned existing = warp_lanes(warp);
    if ((mask & bit) == 0)
      fail(format("thread %d (warp %d lane %d) calls %s at %s:%d with mask 0x%08x, which does not "
                  "name its own lane",
                  t->linear, warp, lane, collective_name(kind), base_name(file), line, mask));
    if ((mask & ~existing) != 0)
      fail(format("warp %d: %s at %s:%d names lanes %s, which this block does not have", warp,
                  collective_name(kind), base_name(file), line, lane_ranges(mask & ~existing).c_str()));
    auto& pending = warps_[warp];
    PendingCollective* p = nullptr;
    for (auto& candidate : pending) {
      if (candidate.kind == kind && candidate.mask == mask && candidate.file == file &&
          candidate.line == line && (candidate.arrived & bit) == 0)
        p = &candidate;
    }
    if (p == nullptr) {
      pending.push_back({kind, mask, file, line, 0u});
      p = &pending.back();
    }
    std::memcpy(t->in, in, sizeof(uint32_t) * in_words);
    p->arrived |= bit;
    if (p->arrived == mask) {
      complete(warp, *p);
      for (int l = 0; l < kWarpSize; ++l) {
        if ((mask >> l & 1u) && l != lane) {
          thread_of(warp, l)->state = ThreadState::kRunnable;
          released_.push_back(warp * kWarpSize + l);
        }
      }
      pending.erase(pending.begin() + (p - pending.data()));
    } else {
      t->state = ThreadState::kAtCollective;
      t->wait_file = file;
      t->wait_line = line;
      t->fiber.suspend();
    }
    std::memcpy(out, t->out, sizeof(uint32_t) * out_words);
  }

  void* static_shared(const void* site, size_t bytes, size_t align) {
    for (const auto& s : static_shared_)
      if (s.site == site) return s.data;
    static_bytes_ += bytes;
    // As on an H100: static shared memory <= 48 KB; static + dynamic <= 48 KB, or <= 227 KB
    // once cudaFuncSetAttribute raised the kernel's dynamic limit.
    const bool raised = allowed_dynamic_smem_ > kDefaultDynamicSmem;
    const size_t total_limit = raised ? kMaxDynamicSmemOptin : kDefaultDynamicSmem;
    if (static_bytes_ > kDefaultDynamicSmem || static_bytes_ + launch_.dynamic_smem > total_limit)
      fail(format("%zu bytes of static and %zu of dynamic shared memory exceed the limit of %zu "
                  "bytes per block",
                  static_bytes_, launch_.dynamic_smem, static_bytes_ > kDefaultDynamicSmem
                                                           ? kDefaultDynamicSmem : total_limit));
    void* data = align <= alignof(std::max_align_t) ? std::malloc(bytes)
                                                    : std::aligned_alloc(align, (bytes + align - 1) / align * align);
    if (data == nullptr) fail("out of host memory for static shared memory");
    std::memset(data, 0xff, bytes);  // read before written shows (NaN, -1)
    static_shared_.push_back({site, data, bytes});
    return data;
  }

  ~BlockRun() {
    for (const auto& s : static_shared_) std::free(s.data);
  }

  // A GPU thread polling a flag that another block sets. This block keeps its host thread
  // while it waits, so only a block running on another host thread can still set it: when
  // every running worker waits and every flag they wait on is still unset, none ever will
  // (a deadlock on a GPU too).
  void wait_for_flag(const uint32_t* flag, const char* file, int line) {
    const auto start = std::chrono::steady_clock::now();
    if (slow_) launch_.slow_started.store(true, std::memory_order_release);
    launch_.start_waiting(flag);
    for (;;) {
      if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) != 0) break;
      const char* why = nullptr;
      if (launch_.failed.load(std::memory_order_relaxed)) why = "another block of the launch failed";
      else if (launch_.deadlocked())
        why = "no block that could set it is running (every running block waits on an unset flag)";
      else if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60))
        why = "it stayed unset for 60 s";
      if (why != nullptr) {
        launch_.stop_waiting(flag);
        fail(format("thread %d waits at %s:%d on a flag: %s", t_thread->linear, base_name(file),
                    line, why));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    launch_.stop_waiting(flag);
  }

  // A slow SM (Options::slow_worker): it waits until the other workers can go no further
  // (each waits on an unset flag or has no block left), so their blocks overtake this one's.
  void stall() {
    launch_.slow_started.store(true, std::memory_order_release);
    while (!launch_.failed.load(std::memory_order_relaxed) && !launch_.blocked_on_unset_flags(1))
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  }

  [[noreturn]] void fail(std::string what) {
    failed_ = true;
    failure_ = std::move(what);
    t_thread->fiber.suspend();  // never resumed
    std::abort();
  }

 private:
  static void thread_main(void* arg) {
    auto* t = static_cast<EmuThread*>(arg);
    BlockRun* run = t_run;
    run->launch_.body(run->launch_.ctx);
    t->state = ThreadState::kExited;
    ++run->exited_;
  }

  unsigned warp_lanes(int warp) const {
    const int lanes = std::min(kWarpSize, size_ - warp * kWarpSize);
    return lanes == kWarpSize ? 0xffffffffu : (1u << lanes) - 1u;
  }

  EmuThread* thread_of(int warp, int lane) { return threads_[warp * kWarpSize + lane]; }

  void complete(int warp, const PendingCollective& p) {
    EmuThread* lanes[kWarpSize] = {};
    for (int l = 0; l < kWarpSize; ++l)
      if (p.mask >> l & 1u) lanes[l] = thread_of(warp, l);
    switch (p.kind) {
      case Collective::kShuffleXor:
      case Collective::kShuffleIdx:
        for (int l = 0; l < kWarpSize; ++l) {
          if (lanes[l] == nullptr) continue;
          const int operand = static_cast<int>(lanes[l]->in[2] & 31u);  // lane mask or source lane
          const int src = p.kind == Collective::kShuffleXor ? l ^ operand : operand;
          if ((p.mask >> src & 1u) == 0)
            fail(format("warp %d: lane %d of %s at %s:%d reads lane %d, which is not in the mask "
                        "0x%08x",
                        warp, l, collective_name(p.kind), base_name(p.file), p.line, src, p.mask));
          lanes[l]->out[0] = lanes[src]->in[0];
          lanes[l]->out[1] = lanes[src]->in[1];
        }
        break;
      case Collective::kMatchAny:
        for (int l = 0; l < kWarpSize; ++l) {
          if (lanes[l] == nullptr) continue;
          unsigned same = 0;
          for (int m = 0; m < kWarpSize; ++m)
            if (lanes[m] != nullptr && lanes[m]->in[0] == lanes[l]->in[0] &&
                lanes[m]->in[1] == lanes[l]->in[1])
              same |= 1u << m;
          lanes[l]->out[0] = same;
        }
        break;
      case Collective::kMmaF16:
      case Collective::kMmaBf16:
        if (p.mask != 0xffffffffu)
          fail(format("warp %d: %s at %s:%d needs all 32 lanes, mask is 0x%08x", warp,
                      collective_name(p.kind), base_name(p.file), p.line, p.mask));
        mma_m16n8k16(lanes, p.kind == Collective::kMmaBf16);
        break;
    }
  }

  void make_order(uint64_t phase) {
    order_.resize(size_);
    for (int i = 0; i < size_; ++i) order_[i] = i;
    switch (launch_.options.schedule) {
      case Schedule::kForward: break;
      case Schedule::kReverse: std::reverse(order_.begin(), order_.end()); break;
      case Schedule::kShuffled: {
        uint64_t state = launch_.options.seed ^ (linear_block_ * 0x2545f4914f6cdd1dull) ^
                         (phase * 0x9e3779b97f4a7c15ull);
        for (int i = size_ - 1; i > 0; --i)
          std::swap(order_[i], order_[static_cast<int>(splitmix64(state) % (i + 1))]);
        break;
      }
    }
    rank_.resize(size_);
    for (int i = 0; i < size_; ++i) rank_[order_[i]] = i;
  }

  // Between two barriers the block's threads start in the phase's order; a thread
  // runs until it blocks, and the lanes that a collective it completed released run
  // next (in the phase's order), so a warp runs ahead as a unit, as on a GPU, and
  // races between warps (and between lanes) show as schedule-dependent results.
  bool schedule() {
    uint64_t phase = 0;
    make_order(phase);
    std::deque<int> queue(order_.begin(), order_.end());
    for (;;) {
      while (!queue.empty()) {
        EmuThread* t = threads_[queue.front()];
        queue.pop_front();
        released_.clear();
        t_thread = t;
        t->fiber.resume();
        t_thread = nullptr;
        if (failed_) return false;
        std::sort(released_.begin(), released_.end(),
                  [this](int a, int b) { return rank_[a] > rank_[b]; });
        for (int i : released_) queue.push_front(i);
      }
      if (exited_ == size_) return true;
      if (at_barrier_ != size_) {
        failure_ = describe_deadlock();
        return false;
      }
      if (slow_) stall();
      for (EmuThread* t : threads_) t->state = ThreadState::kRunnable;  // the barrier opens
      at_barrier_ = 0;
      make_order(++phase);
      queue.assign(order_.begin(), order_.end());
    }
  }

  std::string describe_block() const {
    const uint3 b = context_.block_idx;
    return format("kvprune emulator: %s, block (%u,%u,%u)", launch_.kernel.name, b.x, b.y, b.z);
  }

  std::string describe_deadlock() const {
    std::vector<int> at_barrier, exited;
    std::string barrier_sites;
    for (const EmuThread* t : threads_) {
      if (t->state == ThreadState::kAtBarrier) {
        at_barrier.push_back(t->linear);
        const std::string site = format("%s:%d", base_name(t->wait_file), t->wait_line);
        if (barrier_sites.find(site) == std::string::npos)
          barrier_sites += (barrier_sites.empty() ? "" : ", ") + site;
      } else if (t->state == ThreadState::kExited) {
        exited.push_back(t->linear);
      }
    }
    std::string text;
    if (!at_barrier.empty() && at_barrier.size() + exited.size() == threads_.size()) {
      return format("__syncthreads (%s) is reached by only part of the block: threads %s wait "
                    "there, threads %s exited without reaching it",
                    barrier_sites.c_str(), id_ranges(at_barrier).c_str(), id_ranges(exited).c_str());
    }
    text = "deadlock:";
    if (!at_barrier.empty())
      text += format(" threads %s wait at __syncthreads (%s);", id_ranges(at_barrier).c_str(),
                     barrier_sites.c_str());
    for (size_t w = 0; w < warps_.size(); ++w) {
      for (const auto& p : warps_[w]) {
        std::string missing;
        for (int l = 0; l < kWarpSize; ++l) {
          if (!(p.mask >> l & 1u) || (p.arrived >> l & 1u)) continue;
          const EmuThread* t = threads_[w * kWarpSize + l];
          const char* where = t->state == ThreadState::kExited      ? "exited"
                              : t->state == ThreadState::kAtBarrier ? "at __syncthreads"
                                                                     : "at another collective";
          missing += format("%s lane %d %s", missing.empty() ? "" : ",", l, where);
        }
        text += format(" warp %zu: %s (mask 0x%08x) at %s:%d has lanes %s, missing%s;", w,
                       collective_name(p.kind), p.mask, base_name(p.file), p.line,
                       lane_ranges(p.arrived).c_str(), missing.c_str());
      }
    }
    if (!exited.empty()) text += format(" threads %s exited", id_ranges(exited).c_str());
    return text;
  }

  Launch& launch_;
  FiberPool& pool_;
  int size_ = 0;
  std::vector<EmuThread*> threads_;
  std::vector<std::vector<PendingCollective>> warps_;
  std::vector<int> order_;     // the phase's thread order
  std::vector<int> rank_;      // position of each thread in order_
  std::vector<int> released_;  // threads the running thread's collective released
  BlockContext context_{};
  struct StaticShared {
    const void* site;  // the declaration's marker
    void* data;
    size_t bytes;
  };
  std::vector<StaticShared> static_shared_;  // this launch's static shared variables
  struct FreeBytes {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, FreeBytes> dynamic_smem_;  // [launch.dynamic_smem] bytes
  size_t static_bytes_ = 0;
  size_t allowed_dynamic_smem_ = 0;
  uint64_t linear_block_ = 0;
  bool slow_ = false;  // stalls when the first thread reaches a barrier and when it opens
  int at_barrier_ = 0;
  int exited_ = 0;
  bool failed_ = false;
  std::string failure_;
};

// slow: this worker stands for a slow SM (Options::slow_worker).
void run_blocks(Launch& launch, bool slow) {
  auto pool = acquire_pool();
  {
    BlockRun run(launch, *pool, slow);
    if (launch.options.slow_worker && !slow)
      while (!launch.slow_started.load(std::memory_order_acquire))
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    const uint64_t blocks = static_cast<uint64_t>(launch.grid.x) * launch.grid.y * launch.grid.z;
    std::string error;
    for (;;) {
      if (launch.failed.load(std::memory_order_relaxed)) break;
      const uint64_t b = launch.next_block.fetch_add(1, std::memory_order_relaxed);
      if (b >= blocks) break;
      const bool ok = run.run(b, &error);
      if (slow) launch.slow_started.store(true, std::memory_order_release);
      if (!ok) {
        const std::lock_guard<std::mutex> lock(launch.error_mutex);
        if (!launch.failed.exchange(true)) launch.error = error;
        break;
      }
    }
    launch.finish_worker();
  }
  release_pool(std::move(pool));
}

std::mutex g_counts_mutex;
std::map<std::string, uint64_t> g_launch_counts;  // kernel name -> launches that ran

void count_launch(const char* kernel) {
  const std::lock_guard<std::mutex> lock(g_counts_mutex);
  ++g_launch_counts[kernel];
}

std::mutex g_attr_mutex;
std::unordered_map<const void*, int> g_max_dynamic_smem;  // cudaFuncSetAttribute

size_t allowed_dynamic_smem(const void* kernel_id) {
  const std::lock_guard<std::mutex> lock(g_attr_mutex);
  const auto it = g_max_dynamic_smem.find(kernel_id);
  return it == g_max_dynamic_smem.end() ? kDefaultDynamicSmem : static_cast<size_t>(it->second);
}

int report(int code, std::string what, bool sticky) {
  t_error_code = code;
  t_message = std::move(what);
  t_sticky = t_sticky || sticky;
  return code;
}

int config_error(std::string what) {
  return report(cudaErrorInvalidConfiguration, std::move(what), false);
}

}  // namespace

void syncthreads(const char* file, int line) { t_run->barrier(file, line); }

void warp_collective(Collective kind, unsigned mask, const char* file, int line,
                     const uint32_t* in, int in_words, uint32_t* out, int out_words) {
  t_run->collective(kind, mask, file, line, in, in_words, out, out_words);
}

void* block_shared_bytes(const void* site, size_t bytes, size_t align) {
  return t_run->static_shared(site, bytes, align);
}

void wait_for_flag(const uint32_t* flag, const char* file, int line) {
  t_run->wait_for_flag(flag, file, line);
}

void fail_thread(const char* what) {
  t_run->fail(format("thread %d: %s", t_thread->linear, what));
}

int launch(const KernelRef& kernel, dim3 grid, dim3 block, size_t dynamic_smem,
           void (*body)(void* ctx), void* ctx) {
  if (t_sticky) {  // an earlier kernel faulted and nobody has looked yet
    t_error_code = cudaErrorLaunchFailure;
    return cudaErrorLaunchFailure;
  }
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  const auto where = [&] {  // only built for a failing launch
    return format("kvprune emulator: launch of %s with grid (%u,%u,%u), block (%u,%u,%u)",
                  kernel.name, grid.x, grid.y, grid.z, block.x, block.y, block.z);
  };
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > kMaxBlockDimZ)
    return config_error(where() + format(": a block has 1 to %u threads (block.z <= %u)",
                                         kMaxThreadsPerBlock, kMaxBlockDimZ));
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > kMaxGridDimX ||
      grid.y > kMaxGridDimYZ || grid.z > kMaxGridDimYZ)
    return config_error(where() + ": grid dimensions out of range (x < 2^31, y, z <= 65535)");
  const size_t allowed = allowed_dynamic_smem(kernel.id);
  if (dynamic_smem > allowed)
    return config_error(where() + format(": %zu bytes of dynamic shared memory, the kernel allows %zu "
                                         "(48 KB unless cudaFuncSetAttribute raised it)",
                                         dynamic_smem, allowed));
  count_launch(kernel.name);
  Launch state;
  state.kernel = kernel;
  state.grid = grid;
  state.block = block;
  state.dynamic_smem = dynamic_smem;
  state.body = body;
  state.ctx = ctx;
  state.options = t_options;
  const uint64_t blocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
  // Each worker keeps a fiber (two mappings: stack and guard page) per thread of the
  // largest block it ran; 8 workers by default stay far below vm.max_map_count.
  int workers = state.options.host_threads > 0
                    ? state.options.host_threads
                    : static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
  workers = static_cast<int>(std::min<uint64_t>(static_cast<uint64_t>(workers), blocks));
  state.running_workers = workers;  // a helper not started yet may still set flags
  std::vector<std::thread> helpers;
  for (int w = 1; w < workers; ++w) helpers.emplace_back([&state] { run_blocks(state, false); });
  run_blocks(state, state.options.slow_worker);
  for (auto& h : helpers) h.join();
  if (state.failed.load()) return report(cudaErrorLaunchFailure, state.error, true);
  return cudaSuccess;
}

int set_max_dynamic_smem(const void* kernel_id, int bytes) {
  if (bytes < 0 || static_cast<size_t>(bytes) > kMaxDynamicSmemOptin)
    return report(cudaErrorInvalidValue,
                  format("kvprune emulator: cudaFuncSetAttribute(MaxDynamicSharedMemorySize, %d): "
                         "at most %zu bytes on an H100",
                         bytes, kMaxDynamicSmemOptin),
                  false);
  const std::lock_guard<std::mutex> lock(g_attr_mutex);
  g_max_dynamic_smem[kernel_id] = bytes;
  return cudaSuccess;
}

int take_last_error_code() {
  const int code = t_error_code;
  t_error_code = cudaSuccess;
  return code;
}

}  // namespace detail

bool compiled() { return true; }

void set_options(const Options& options) { detail::t_options = options; }

Options options() { return detail::t_options; }

void for_each_launch_count(void (*fn)(void* ctx, const char* kernel, uint64_t launches), void* ctx) {
  const std::lock_guard<std::mutex> lock(detail::g_counts_mutex);
  for (const auto& [name, count] : detail::g_launch_counts) fn(ctx, name.c_str(), count);
}

const char* last_error() {
  thread_local std::string message;
  message = std::move(detail::t_message);
  detail::t_message.clear();
  detail::t_sticky = false;
  return message.c_str();
}

}  // namespace kvprune::emu
