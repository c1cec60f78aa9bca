// Checks the torch-free core through its public header only: status codes for
// bad parameters, and the CPU ops against straightforward loops on small inputs.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "kvprune/kvprune.h"

namespace {

int failures = 0;

void expect(bool condition, const char* what) {
  if (!condition) {
    std::printf("FAIL: %s\n", what);
    ++failures;
  }
}

// Naive scores for one batch row, dense (no seq_lens), fp32, gqa mean.
std::vector<float> naive_scores(const std::vector<float>& q, const std::vector<float>& k, int hq,
                                int hkv, int w, int n, int d) {
  const int group = hq / hkv;
  std::vector<float> out(hkv * n, 0.f);
  for (int h = 0; h < hq; ++h)
    for (int i = 0; i < w; ++i) {
      std::vector<double> logits(n, -INFINITY);
      double max_logit = -INFINITY;
      for (int j = 0; j <= n - w + i; ++j) {
        double dot = 0;
        for (int x = 0; x < d; ++x) dot += q[(h * w + i) * d + x] * k[((h / group) * n + j) * d + x];
        logits[j] = dot / std::sqrt(static_cast<double>(d));
        max_logit = std::max(max_logit, logits[j]);
      }
      double total = 0;
      for (int j = 0; j < n; ++j) total += std::exp(logits[j] - max_logit);
      for (int j = 0; j < n; ++j)
        out[(h / group) * n + j] += static_cast<float>(std::exp(logits[j] - max_logit) / total / group);
    }
  return out;
}

void test_window_scores_matches_naive() {
  const int hq = 4, hkv = 2, w = 3, n = 50, d = 8;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> q(hq * w * d), k(hkv * n * d), scores(hkv * n, -1.f);
  for (auto& x : q) x = normal(rng);
  for (auto& x : k) x = normal(rng);
  kvprune::WindowScoresParams p;
  p.q = {q.data(), hq * w * d, w * d, d};
  p.k = {k.data(), hkv * n * d, n * d, d};
  p.scores = scores.data();
  p.batch = 1;
  p.q_heads = hq;
  p.kv_heads = hkv;
  p.length = n;
  p.window = w;
  p.head_dim = d;
  p.scale = 1.f / std::sqrt(static_cast<float>(d));
  const kvprune::CpuExecutor serial;
  std::vector<char> workspace(kvprune::window_scores_workspace_bytes_cpu(p, serial));
  expect(kvprune::window_scores_cpu(p, workspace.data(), workspace.size(), serial) == kvprune::Status::kOk,
         "window_scores_cpu returns kOk");
  const std::vector<float> expected = naive_scores(q, k, hq, hkv, w, n, d);
  double worst = 0;
  for (size_t i = 0; i < expected.size(); ++i) worst = std::max(worst, std::fabs(double(expected[i]) - scores[i]));
  expect(worst < 1e-5, "window_scores_cpu matches the naive loops");
  expect(kvprune::window_scores_cpu(p, workspace.data(), workspace.size() - 1, serial) ==
             kvprune::Status::kWorkspaceTooSmall,
         "a short workspace is reported");
  p.kv_heads = 3;
  expect(kvprune::window_scores_cpu(p, workspace.data(), workspace.size(), serial) ==
             kvprune::Status::kInvalidArgument,
         "q_heads not a multiple of kv_heads is rejected");
}

void test_select_and_gather() {
  const int n = 20, budget = 8, d = 4;
  std::vector<float> scores(n);
  for (int j = 0; j < n; ++j) scores[j] = static_cast<float>((j * 7) % n);  // distinct
  std::vector<int32_t> idx(budget, -7);
  kvprune::SelectKeepParams p;
  p.scores = scores.data();
  p.keep_idx = idx.data();
  p.batch = 1;
  p.heads = 1;
  p.length = n;
  p.budget = budget;
  p.n_sink = 2;
  p.window = 3;
  const kvprune::CpuExecutor serial;
  std::vector<char> workspace(kvprune::select_keep_workspace_bytes_cpu(p, serial));
  expect(kvprune::select_keep_cpu(p, workspace.data(), workspace.size(), serial) == kvprune::Status::kOk,
         "select_keep_cpu returns kOk");
  // Candidates 2..16 with scores (7j mod 20): the best three are j=14 (18), 17 is in the window,
  // j=11 (17), j=8 (16).
  const std::vector<int32_t> expected = {0, 1, 8, 11, 14, 17, 18, 19};
  expect(idx == expected, "select_keep_cpu keeps sinks, window and the best scores, ascending");
  p.budget = 4;
  expect(kvprune::select_keep_cpu(p, workspace.data(), workspace.size(), serial) ==
             kvprune::Status::kInvalidArgument,
         "budget < n_sink + window is rejected");

  std::vector<float> cache(n * d), kept(budget * d, NAN);
  for (int i = 0; i < n * d; ++i) cache[i] = static_cast<float>(i + 1);  // no zeros
  std::vector<int32_t> gather_idx = {3, 0, -1, 19};
  kvprune::GatherKvParams g;
  g.k = g.v = {cache.data(), n * d, n * d, d};
  g.out_k = g.out_v = {kept.data(), 4 * d, 4 * d, d};
  g.keep_idx = gather_idx.data();
  g.batch = 1;
  g.heads = 1;
  g.length = n;
  g.budget = 4;
  g.head_dim = d;
  expect(kvprune::gather_kv_cpu(g, serial) == kvprune::Status::kOk, "gather_kv_cpu returns kOk");
  // Every value of the 4 output rows: a copy of cache row idx (values idx*d+1 .. idx*d+d), or
  // zeros for the -1 padding; a zero fill or a stale NaN anywhere shows.
  bool rows_ok = true;
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < d; ++c) {
      const float want = gather_idx[t] < 0 ? 0.f : static_cast<float>(gather_idx[t] * d + c + 1);
      rows_ok = rows_ok && kept[t * d + c] == want;
    }
  expect(rows_ok, "gather_kv_cpu copies every value of the kept rows and zero-fills padding");
}

// A 3-thread executor handing out ranges of `grain` items from a shared counter,
// so every worker runs several small ranges per parallel loop.
void threaded_parallel_for(int64_t n, int64_t grain, void* body_ctx,
                           void (*body)(void*, int64_t, int64_t, int), void*) {
  std::atomic<int64_t> next{0};
  auto work = [&](int worker) {
    for (int64_t begin = next.fetch_add(grain); begin < n; begin = next.fetch_add(grain))
      body(body_ctx, begin, std::min(n, begin + grain), worker);
  };
  std::vector<std::thread> helpers;
  for (int worker = 1; worker < 3; ++worker) helpers.emplace_back(work, worker);
  work(0);
  for (auto& t : helpers) t.join();
}

// snapkv_cpu equals window_scores_cpu -> select_keep_cpu (pooled, shifted) -> gather_kv_cpu,
// on a ragged batch (one row shorter than the budget), with and without lse; with
// select_only it writes the same positions and gathers nothing.
void test_snapkv_matches_chained_stages(const kvprune::CpuExecutor& exec, bool with_lse) {
  const int batch = 2, hq = 4, hkv = 2, w = 4, n = 700, d = 16, budget = 90;
  const std::vector<int32_t> lens = {700, 61};
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> q(batch * hq * w * d), k(batch * hkv * n * d), v(batch * hkv * n * d);
  std::vector<float> lse(batch * hq * w, 3.f);  // any finite values: scores need not sum to 1
  for (auto* t : {&q, &k, &v})
    for (auto& x : *t) x = normal(rng);
  kvprune::SnapKvParams p;
  kvprune::WindowScoresParams& sc = p.scores;
  sc.q = {q.data(), hq * w * d, w * d, d};
  sc.k = {k.data(), hkv * n * d, n * d, d};
  sc.lse = with_lse ? lse.data() : nullptr;
  sc.seq_lens = lens.data();
  sc.batch = batch;
  sc.q_heads = hq;
  sc.kv_heads = hkv;
  sc.length = n;
  sc.window = w;
  sc.head_dim = d;
  sc.scale = 1.f / std::sqrt(static_cast<float>(d));
  std::vector<int32_t> idx(batch * hkv * budget, -7);
  kvprune::SelectKeepParams& se = p.select;
  se.keep_idx = idx.data();
  se.seq_lens = lens.data();
  se.batch = batch;
  se.heads = hkv;
  se.length = n;
  se.budget = budget;
  se.n_sink = 2;
  se.window = w;
  se.pool_kernel_size = 5;
  se.pool_shift = 2;
  std::vector<float> kept_k(batch * hkv * budget * d, NAN), kept_v(kept_k);
  kvprune::GatherKvParams& ga = p.gather;
  ga.k = sc.k;
  ga.v = {v.data(), hkv * n * d, n * d, d};
  ga.keep_idx = idx.data();
  ga.out_k = {kept_k.data(), hkv * budget * d, budget * d, d};
  ga.out_v = {kept_v.data(), hkv * budget * d, budget * d, d};
  ga.batch = batch;
  ga.heads = hkv;
  ga.length = n;
  ga.budget = budget;
  ga.head_dim = d;
  std::vector<char> workspace(kvprune::snapkv_workspace_bytes_cpu(p, exec));
  expect(kvprune::snapkv_cpu(p, workspace.data(), workspace.size(), exec) == kvprune::Status::kOk,
         "snapkv_cpu returns kOk");

  const kvprune::CpuExecutor serial;
  std::vector<float> scores(batch * hkv * n);
  sc.scores = scores.data();
  std::vector<char> score_ws(kvprune::window_scores_workspace_bytes_cpu(sc, serial));
  kvprune::window_scores_cpu(sc, score_ws.data(), score_ws.size(), serial);
  std::vector<int32_t> chained_idx(idx.size());
  kvprune::SelectKeepParams chained_select = se;
  chained_select.scores = scores.data();
  chained_select.keep_idx = chained_idx.data();
  std::vector<char> select_ws(kvprune::select_keep_workspace_bytes_cpu(chained_select, serial));
  kvprune::select_keep_cpu(chained_select, select_ws.data(), select_ws.size(), serial);
  expect(idx == chained_idx, "snapkv_cpu keeps what the chained stages keep");
  bool rows_copied = true;
  for (int row = 0; row < batch * hkv; ++row)
    for (int t = 0; t < budget; ++t)
      for (int x = 0; x < d; ++x) {
        const int j = idx[row * budget + t], dst = (row * budget + t) * d + x;
        const float want_k = j < 0 ? 0.f : k[(row * n + j) * d + x];
        const float want_v = j < 0 ? 0.f : v[(row * n + j) * d + x];
        rows_copied = rows_copied && kept_k[dst] == want_k && kept_v[dst] == want_v;
      }
  expect(rows_copied, "snapkv_cpu gathers the kept K/V rows (zero rows for padding)");

  ga.budget = budget - 1;
  expect(kvprune::snapkv_cpu(p, workspace.data(), workspace.size(), exec) ==
             kvprune::Status::kInvalidArgument,
         "snapkv_cpu rejects parts that disagree");

  p.select_only = true;  // the disagreeing gather is ignored
  std::fill(idx.begin(), idx.end(), -7);
  std::fill(kept_k.begin(), kept_k.end(), NAN);
  expect(kvprune::snapkv_cpu(p, workspace.data(), workspace.size(), exec) == kvprune::Status::kOk,
         "snapkv_cpu with select_only returns kOk");
  expect(idx == chained_idx, "snapkv_cpu with select_only keeps what the chained stages keep");
  expect(std::all_of(kept_k.begin(), kept_k.end(), [](float x) { return std::isnan(x); }),
         "snapkv_cpu with select_only gathers nothing");
}

}  // namespace

int main() {
  test_window_scores_matches_naive();
  test_select_and_gather();
  const kvprune::CpuExecutor serial, threaded{3, threaded_parallel_for, nullptr};
  for (bool with_lse : {false, true}) {
    test_snapkv_matches_chained_stages(serial, with_lse);
    test_snapkv_matches_chained_stages(threaded, with_lse);
  }
  std::printf("kvprune %s core tests: %s\n", kvprune::version(), failures == 0 ? "passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}
