// Runs one emulated CUDA entry point on exact-size buffers, as the emulator's
// mutation tests (run_mutants.py) need it: under two thread schedules that must
// agree bit for bit, then against the CPU backend. Exit status 0: passed; 2: the
// emulator rejected a launch (its report is printed); 3: schedules differ (a race);
// 4: the result differs from the CPU backend. AddressSanitizer, when linked in,
// aborts on its own.
//   mutant_driver window_scores | pool_scores | select_keep | compact_kv
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda_bf16.h"
#include "kvprune/emu.h"
#include "kvprune/kvprune.h"

namespace {

using kvprune::Status;

std::vector<float> random_floats(size_t n, unsigned seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = uniform(rng);
  return v;
}

std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16_rn(v[i]);
  return out;
}

// Runs `emulated` (which writes into `out`) under the forward and reverse schedules.
template <typename T>
int run_schedules(std::vector<T>& out, const std::function<Status()>& emulated,
                  kvprune::emu::Options options = {}) {
  std::vector<T> first;
  for (auto schedule : {kvprune::emu::Schedule::kForward, kvprune::emu::Schedule::kReverse}) {
    options.schedule = schedule;
    kvprune::emu::set_options(options);
    std::memset(out.data(), 0x7f, out.size() * sizeof(T));  // poison
    if (emulated() != Status::kOk) {
      std::printf("emulator: %s\n", kvprune::emu::last_error());
      return 2;
    }
    if (first.empty()) {
      first = out;
    } else if (std::memcmp(first.data(), out.data(), out.size() * sizeof(T)) != 0) {
      std::printf("race: the forward and reverse schedules give different results\n");
      return 3;
    }
  }
  return 0;
}

int window_scores() {
  const int64_t hq = 8, hkv = 1, w = 32, n = 700, d = 128;  // stats pass: 83 KB of shared memory
  const auto q = to_bf16(random_floats(hq * w * d, 1, -2.f, 2.f));
  const auto k = to_bf16(random_floats(hkv * n * d, 2, -2.f, 2.f));
  kvprune::WindowScoresParams p;
  p.q = {q.data(), hq * w * d, w * d, d};
  p.k = {k.data(), hkv * n * d, n * d, d};
  p.dtype = kvprune::DType::kBFloat16;
  p.batch = 1;
  p.q_heads = hq;
  p.kv_heads = hkv;
  p.length = n;
  p.window = w;
  p.head_dim = d;
  p.scale = 1.f / std::sqrt(static_cast<float>(d));
  std::vector<float> emu(hkv * n), cpu(hkv * n);
  const int status = run_schedules(emu, [&] {
    p.scores = emu.data();
    std::vector<char> ws(kvprune::emu::window_scores_workspace_bytes_cuda(p));
    return kvprune::emu::window_scores_cuda(p, ws.empty() ? nullptr : ws.data(), ws.size(), nullptr);
  });
  if (status != 0) return status;
  p.scores = cpu.data();
  std::vector<char> ws(kvprune::window_scores_workspace_bytes_cpu(p, {}));
  if (kvprune::window_scores_cpu(p, ws.data(), ws.size(), {}) != Status::kOk) return 5;
  float row_max = 0.f, err = 0.f;
  for (size_t i = 0; i < cpu.size(); ++i) {
    row_max = std::fmax(row_max, std::fabs(cpu[i]));
    err = std::isfinite(emu[i]) ? std::fmax(err, std::fabs(emu[i] - cpu[i])) : INFINITY;
  }
  if (!(err <= 2e-3f * row_max)) {
    std::printf("wrong: scores differ from the CPU backend by %g (row max %g)\n", err, row_max);
    return 4;
  }
  return 0;
}

int pool_scores() {
  const int64_t heads = 2, n = 1000;  // the last CTA's tile runs past n
  const auto in = random_floats(heads * n, 3, 0.f, 1.f);
  kvprune::PoolScoresParams p;
  p.scores_in = in.data();
  p.batch = 1;
  p.heads = heads;
  p.length = n;
  p.window = 32;
  p.kernel_size = 7;
  std::vector<float> emu(heads * n), cpu(heads * n);
  const int status = run_schedules(emu, [&] {
    p.scores_out = emu.data();
    return kvprune::emu::pool_scores_cuda(p, nullptr);
  });
  if (status != 0) return status;
  p.scores_out = cpu.data();
  if (kvprune::pool_scores_cpu(p, {}) != Status::kOk) return 5;
  if (emu != cpu) {
    std::printf("wrong: pooled scores differ from the CPU backend\n");
    return 4;
  }
  return 0;
}

int select_keep() {
  const int64_t heads = 2, n = 9000, budget = 1200;  // two CTAs per row, many scan tiles each
  auto scores = random_floats(heads * n, 4, 0.f, 1.f);
  for (int64_t j = 2000; j < 2600; ++j) scores[j] = 0.5f;  // ties
  kvprune::SelectKeepParams p;
  p.scores = scores.data();
  p.batch = 1;
  p.heads = heads;
  p.length = n;
  p.budget = budget;
  p.n_sink = 4;
  p.window = 32;
  p.pool_kernel_size = 7;
  std::vector<int32_t> emu(heads * budget), cpu(heads * budget);
  const int status = run_schedules(emu, [&] {
    p.keep_idx = emu.data();
    std::vector<char> ws(kvprune::emu::select_keep_workspace_bytes_cuda(p));
    return kvprune::emu::select_keep_cuda(p, ws.empty() ? nullptr : ws.data(), ws.size(), nullptr);
  });
  if (status != 0) return status;
  p.keep_idx = cpu.data();
  std::vector<char> ws(kvprune::select_keep_workspace_bytes_cpu(p, {}));
  if (kvprune::select_keep_cpu(p, ws.empty() ? nullptr : ws.data(), ws.size(), {}) != Status::kOk)
    return 5;
  if (emu != cpu) {
    std::printf("wrong: kept indices differ from the CPU backend\n");
    return 4;
  }
  return 0;
}

int compact_kv() {
  // Keeping every other token moves each one from 2t (+ head) to t: sources of a slab's first
  // half lie in its second half, and of its second half in the next slab (1024 tokens each).
  const int64_t heads = 2, n = 3000, d = 8, budget = 1500;
  const auto k0 = random_floats(heads * n * d, 5), v0 = random_floats(heads * n * d, 6);
  std::vector<int32_t> idx(heads * budget);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t t = 0; t < budget; ++t) idx[h * budget + t] = static_cast<int32_t>(2 * t + h);
  kvprune::CompactKvParams p;
  p.keep_idx = idx.data();
  p.batch = 1;
  p.heads = heads;
  p.length = n;
  p.budget = budget;
  p.head_dim = d;
  const auto point_at = [&](std::vector<float>& k, std::vector<float>& v) {
    p.k = {k.data(), heads * n * d, n * d, d};
    p.v = {v.data(), heads * n * d, n * d, d};
  };
  std::vector<float> k(k0.size()), v(v0.size());
  // Two host threads, the caller's a slow SM. Forward schedule: its block takes slab 0 of row
  // 0 and stalls at a barrier, while the other thread's block of slab 1 of the same row may
  // store only after slab 0's loads. Reverse: its block stalls before taking a part and ends
  // with the last one, a correct order, so a race shows as forward != reverse.
  kvprune::emu::Options options;
  options.host_threads = 2;
  options.slow_worker = true;
  const int status = run_schedules(k, [&] {
    k = k0;
    v = v0;
    point_at(k, v);
    std::vector<char> ws(kvprune::emu::compact_kv_workspace_bytes_cuda(p));
    return kvprune::emu::compact_kv_cuda(p, ws.data(), ws.size(), nullptr);
  }, options);
  if (status != 0) return status;
  std::vector<float> k_cpu = k0, v_cpu = v0;
  point_at(k_cpu, v_cpu);
  if (kvprune::compact_kv_cpu(p, nullptr, 0, {}) != Status::kOk) return 5;
  if (k != k_cpu || v != v_cpu) {
    std::printf("wrong: the compacted K/V differ from the CPU backend\n");
    return 4;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "";
  int status = 1;
  if (which == "window_scores") status = window_scores();
  else if (which == "pool_scores") status = pool_scores();
  else if (which == "select_keep") status = select_keep();
  else if (which == "compact_kv") status = compact_kv();
  else std::printf("usage: mutant_driver window_scores|pool_scores|select_keep|compact_kv\n");
  if (status == 0) std::printf("ok: %s\n", which.c_str());
  return status;
}
