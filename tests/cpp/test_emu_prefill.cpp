// test_emu cases of the prefill ops: window_scores, pool_scores, select_keep,
// streaming_keep and snapkv (gather_kv: test_emu_gather.cpp). The comments name the
// launch-heuristic edge each case reaches (csrc/cuda/*.cu).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>

#include "test_emu.h"

namespace emu_test {
namespace {

using kvprune::GqaReduce;
using kvprune::PoolMode;
namespace emu = kvprune::emu;

const kvprune::CpuExecutor kSerial{};

std::vector<Config> shuffled_configs(std::vector<int> sms = {132}) { return configs(true, std::move(sms)); }

// ---- window_scores ------------------------------------------------------------------------
struct Ws {
  Ws(const char* name, DType dtype, int64_t B, int64_t Hq, int64_t Hkv, int64_t N, int64_t W, int64_t D)
      : name(name), dtype(dtype), B(B), Hq(Hq), Hkv(Hkv), N(N), W(W), D(D) {}
  Ws& bnhd() { bnhd_view = true; return *this; }
  Ws& padded(int64_t elements) { pad = elements; return *this; }
  Ws& offset(size_t bytes) { q_offset = bytes; return *this; }
  Ws& with_lse() { lse = true; return *this; }
  Ws& gqa(GqaReduce r) { reduce = r; return *this; }
  Ws& qmax() { qreduce = kvprune::QueryReduce::kMax; return *this; }
  Ws& fold(int64_t m) { fold_length = m; return *this; }
  Ws& weighted() { weights = true; return *this; }
  Ws& ragged(std::vector<int32_t> lens) { seq_lens = std::move(lens); return *this; }
  Ws& sm_counts(std::vector<int> s) { sms = std::move(s); return *this; }
  Ws& shuffle() { shuffled = true; return *this; }
  Ws& expect(const char* kernel) { kernels.push_back(kernel); return *this; }
  Ws& paged(int64_t tokens_per_block) { block_size = tokens_per_block; return *this; }
  Ws& fp8(DType storage, int64_t scales) { k_dtype = storage; k_scales = scales; return *this; }
  const char* name;
  DType dtype;
  int64_t B, Hq, Hkv, N, W, D;
  int64_t block_size = 0;  // > 0: K read from a pool of such blocks [blocks, block_size, Hkv, D]
  std::optional<DType> k_dtype;  // fp8 K (q keeps dtype)
  int64_t k_scales = 0;          // k_scale values: 0 (none), 1 or Hkv
  bool bnhd_view = false;
  int64_t pad = 0;       // extra elements after every q and k row
  size_t q_offset = 0;   // bytes the q pointer sits past a 64-byte boundary
  bool lse = false;
  GqaReduce reduce = GqaReduce::kMean;
  kvprune::QueryReduce qreduce = kvprune::QueryReduce::kSum;
  int64_t fold_length = 0;  // > 0: scores [B, Hkv, M] hold earlier scores, folded into
  bool weights = false;     // query_weight [B, Hq, W] and key_weight [B, Hq, M or N] (qmax)
  std::vector<int32_t> seq_lens;
  std::vector<int> sms = {132};
  bool shuffled = false;
  std::vector<std::string> kernels;  // must be launched
};

// The log-sum-exp of each window query (double), what a flash-attention prefill returns.
void fill_lse(Buffer& lse, const Buffer& q, const Tokens& qt, const Buffer& k, const Tokens& kt,
              const Ws& s, float scale) {
  const int64_t G = s.Hq / s.Hkv;
  std::vector<double> qv(q.count), kv(k.count);
  for (int64_t i = 0; i < q.count; ++i) qv[i] = q.value(i);
  for (int64_t i = 0; i < k.count; ++i) kv[i] = k.value(i);
  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t n = s.seq_lens.empty() ? s.N : s.seq_lens[b];
    for (int64_t h = 0; h < s.Hq; ++h)
      for (int64_t i = 0; i < s.W; ++i) {
        const int64_t pos = n - s.W + i;
        double m = -INFINITY, sum = 0;
        std::vector<double> logits;
        for (int64_t j = 0; j <= pos; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < s.D; ++d)
            dot += qv[b * qt.bs + h * qt.hs + i * qt.ts + d] * kv[b * kt.bs + (h / G) * kt.hs + j * kt.ts + d];
          logits.push_back(dot * scale);
          m = std::max(m, dot * scale);
        }
        for (double x : logits) sum += std::exp(x - m);
        lse.as<float>()[(b * s.Hq + h) * s.W + i] = pos >= 0 ? static_cast<float>(m + std::log(sum)) : 0.f;
      }
  }
}

// The window_scores params of shape s over q and k (scores pointer unset), adding the
// seq_lens and lse inputs the shape asks for to case c.
kvprune::WindowScoresParams scores_params(Case& c, const Ws& s, Buffer& q, const Tokens& qt,
                                          Buffer& k, const Tokens& kt) {
  kvprune::WindowScoresParams p;
  p.q = ctok(q, qt);
  p.k = ctok(k, kt);
  p.dtype = s.dtype;
  p.batch = s.B;
  p.q_heads = s.Hq;
  p.kv_heads = s.Hkv;
  p.length = s.N;
  p.window = s.W;
  p.head_dim = s.D;
  p.scale = 1.f / std::sqrt(static_cast<float>(s.D));
  p.reduce = s.reduce;
  p.qreduce = s.qreduce;
  p.fold_length = s.fold_length;
  if (!s.seq_lens.empty()) {
    Buffer& lens = c.add("seq_lens", Role::kIn, Elem::kI32, s.B);
    set_ints(lens, s.seq_lens);
    p.seq_lens = lens.as<int32_t>();
  }
  if (s.lse) {
    Buffer& lse = c.add("lse", Role::kIn, Elem::kF32, s.B * s.Hq * s.W);
    fill_lse(lse, q, qt, k, kt, s, p.scale);
    p.lse = lse.as<float>();
  }
  return p;
}

// K of shape s moved into a pool of blocks [blocks, block_size, Hkv, D] (two spare blocks of
// noise), rows' blocks in shuffled order; returns the paged view of the same keys.
kvprune::ConstTokens paged_copy(Case& c, const Ws& s, const Buffer& k, const Tokens& kt) {
  const int64_t per_row = (s.N + s.block_size - 1) / s.block_size, blocks = s.B * per_row + 2;
  const int64_t block_stride = s.block_size * s.Hkv * s.D;
  Buffer& pool = c.add("k_pool", Role::kIn, elem_of(s.dtype), blocks * block_stride);
  fill_normal(pool, 100.f);  // a key read from a wrong block shows
  std::vector<int32_t> order(blocks);
  for (int64_t i = 0; i < blocks; ++i) order[i] = static_cast<int32_t>(i);
  std::shuffle(order.begin(), order.end(), rng());
  Buffer& table = c.add("block_table", Role::kIn, Elem::kI32, s.B * per_row);
  set_ints(table, std::vector<int32_t>(order.begin(), order.begin() + s.B * per_row));
  const size_t bytes = static_cast<size_t>(dtype_size(s.dtype) * s.D);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.Hkv; ++h)
      for (int64_t t = 0; t < s.N; ++t) {
        const int64_t block = order[b * per_row + t / s.block_size];
        std::memcpy(static_cast<char*>(pool.data()) +
                        (block * block_stride + (t % s.block_size) * s.Hkv * s.D + h * s.D) * dtype_size(s.dtype),
                    static_cast<const char*>(k.data()) + (b * kt.bs + h * kt.hs + t * kt.ts) * dtype_size(s.dtype),
                    bytes);
      }
  kvprune::ConstTokens out{pool.data(), 0, s.D, s.Hkv * s.D};
  out.paged = {table.as<int32_t>(), per_row, s.block_size, block_stride};
  return out;
}

void window_scores_case(const Ws& s) {
  Case c(s.name);
  for (const auto& kernel : s.kernels) c.expect_kernel(kernel);
  const Elem e = elem_of(s.dtype);
  const Tokens qt = layout(s.bnhd_view, s.B, s.Hq, s.W, s.D, s.pad);
  const Tokens kt = layout(s.bnhd_view, s.B, s.Hkv, s.N, s.D, s.pad);
  Buffer& q = c.add("q", Role::kIn, e, qt.span, exact(), s.q_offset);
  Buffer& k = c.add("k", Role::kIn, s.k_dtype ? elem_of(*s.k_dtype) : e, kt.span);
  fill_normal(q);
  fill_normal(k);
  kvprune::WindowScoresParams p = scores_params(c, s, q, qt, k, kt);
  p.k_dtype = s.k_dtype;
  if (s.k_scales > 0) {
    Buffer& scale = c.add("k_scale", Role::kIn, Elem::kF32, s.k_scales);
    fill_uniform(scale, 0.25f, 2.f);
    p.k_scale = scale.as<float>();
    p.k_scale_count = s.k_scales;
  }
  if (s.block_size > 0) p.k = paged_copy(c, s, k, kt);
  const int64_t row = s.fold_length > 0 ? s.fold_length : s.N;
  if (s.weights) {  // some weights <= 0: they count as 0
    Buffer& qw = c.add("query_weight", Role::kIn, Elem::kF32, s.B * s.Hq * s.W);
    Buffer& kw = c.add("key_weight", Role::kIn, Elem::kF32, s.B * s.Hq * row);
    fill_uniform(qw, -0.5f, 3.f);
    fill_uniform(kw, -0.5f, 3.f);
    p.query_weight = qw.as<float>();
    p.key_weight = kw.as<float>();
  }
  Buffer& scores = c.add("scores", s.fold_length > 0 ? Role::kInOut : Role::kOut, Elem::kF32,
                         s.B * s.Hkv * row, within(score_tol(s.dtype), row));
  if (s.fold_length > 0) fill_uniform(scores, -0.2f, 0.5f);
  p.scores = scores.as<float>();
  c.run(
      [&] {
        Workspace ws(kvprune::window_scores_workspace_bytes_cpu(p, kSerial));
        return kvprune::window_scores_cpu(p, ws.ptr(), ws.bytes, kSerial);
      },
      [&] {
        Workspace ws(emu::window_scores_workspace_bytes_cuda(p));
        return emu::window_scores_cuda(p, ws.ptr(), ws.bytes, nullptr);
      },
      configs(s.shuffled, s.sms));
}

void window_scores_cases() {
  const DType f32 = DType::kFloat32, f16 = DType::kFloat16, bf16 = DType::kBFloat16;
  const char* simt_f32 = "window_scores_simt_kernel<float";
  const char* simt_f16 = "window_scores_simt_kernel<__half";
  const char* split = "window_scores_split_reduce_kernel";
  // CUDA-core path (fp32 or a head_dim without tensor cores): key tiles of 256.
  window_scores_case(Ws("window_scores fp32 D=20 simt N=300 W=5 seq{300,3}", f32, 2, 4, 2, 300, 5, 20)
                         .ragged({300, 3}).expect(simt_f32).expect("lse_combine"));
  window_scores_case(Ws("window_scores fp16 D=96 simt BNHD W=1 lse max", f16, 1, 2, 1, 257, 1, 96)
                         .bnhd().with_lse().gqa(GqaReduce::kMax).expect(simt_f16));
  window_scores_case(Ws("window_scores fp32 D=128 simt W=40 lse sum seq{1000,999,40,39}", f32, 4, 2, 1,
                        1000, 40, 128)
                         .with_lse().gqa(GqaReduce::kSum).ragged({1000, 999, 40, 39}).expect(simt_f32));
  // D=64 would take tensor cores, but token stride 68 is not a 16-byte multiple: CUDA cores.
  window_scores_case(Ws("window_scores fp16 D=64 stride 68 -> simt, q+2B", f16, 1, 2, 1, 300, 32, 64)
                         .padded(4).offset(2).expect(simt_f16));
  // Tensor cores, 256-key tiles (D 64/128): N not a tile multiple, W not a multiple of
  // 16, an empty row, chunks past a row's end; SM count 1/2/132 gives 3/2/1 tiles per
  // chunk (the last chunk reaches past N).
  window_scores_case(Ws("window_scores bf16 D=64 mma N=600 W=17 seq{0,300,555} sum BNHD", bf16, 3, 8, 2, 600,
                        17, 64)
                         .bnhd().gqa(GqaReduce::kSum).ragged({0, 300, 555}).sm_counts({1, 2, 132}).shuffle()
                         .expect("mma_kernel<__nv_bfloat16, 64, window_scores_impl::Pass::kStats")
                         .expect("mma_kernel<__nv_bfloat16, 64, window_scores_impl::Pass::kProbs"));
  // fp8 K (q keeps its type): tensor cores convert 8 fp8 bytes per fragment, SIMT per element.
  window_scores_case(Ws("window_scores fp8 e4m3 K bf16 q D=64 mma per-head k_scale seq{200,61}", bf16, 2,
                        4, 2, 200, 8, 64).fp8(DType::kFloat8E4M3, 2).ragged({200, 61})
                         .expect("Pass::kStats, kvprune::Fp8E4M3>"));
  window_scores_case(Ws("window_scores fp8 e5m2 K fp16 q D=128 mma lse", f16, 1, 4, 1, 150, 16, 128)
                         .fp8(DType::kFloat8E5M2, 0).with_lse().expect("Pass::kProbs, kvprune::Fp8E5M2>"));
  window_scores_case(Ws("window_scores fp8 e4m3 K fp32 q D=20 simt k_scale qmax", f32, 1, 2, 2, 90, 5, 20)
                         .fp8(DType::kFloat8E4M3, 1).qmax().expect("simt_kernel<float"));
  // Paged K (block tables, shuffled blocks, a wrong block's keys are 100x larger).
  window_scores_case(Ws("window_scores paged bf16 D=64 mma bs=16 N=200 W=8 seq{200,77}", bf16, 2, 4, 2,
                        200, 8, 64).paged(16).ragged({200, 77}));
  window_scores_case(Ws("window_scores paged fp16 D=128 mma bs=32 N=96 W=16 lse max", f16, 1, 4, 2, 96,
                        16, 128).paged(32).with_lse().gqa(GqaReduce::kMax));
  window_scores_case(Ws("window_scores paged fp32 D=20 simt bs=1 N=50 W=5 seq{50,9}", f32, 2, 2, 1, 50, 5,
                        20).paged(1).ragged({50, 9}));
  window_scores_case(Ws("window_scores paged bf16 D=64 mma bs=16 qmax", bf16, 1, 4, 2, 120, 24, 64)
                         .paged(16).qmax());
  window_scores_case(Ws("window_scores fp16 D=128 mma N=130<tile W=16 lse G=1", f16, 1, 4, 4, 130, 16, 128)
                         .with_lse().expect("mma_kernel<__half, 128, window_scores_impl::Pass::kProbs"));
  window_scores_case(Ws("window_scores bf16 D=128 mma W=1 N=257", bf16, 1, 4, 2, 257, 1, 128)
                         .expect("mma_kernel<__nv_bfloat16, 128, window_scores_impl::Pass::kStats"));
  window_scores_case(Ws("window_scores fp16 D=64 mma N=W=10 max", f16, 1, 2, 1, 10, 10, 64)
                         .gqa(GqaReduce::kMax).expect("mma_kernel<__half, 64, window_scores_impl::Pass::kStats"));
  // More window queries than keys: the first queries have negative positions.
  window_scores_case(Ws("window_scores bf16 D=128 mma W=20 > N=12", bf16, 1, 2, 1, 12, 20, 128)
                         .expect("mma_kernel<__nv_bfloat16, 128"));
  window_scores_case(Ws("window_scores fp32 D=32 simt W=20 > N=12 seq{12,5}", f32, 2, 2, 1, 12, 20, 32)
                         .ragged({12, 5}).expect(simt_f32));
  // D=256 (128-key tiles), W=64: a head needs 64 * 580 B (stats) / 64 * 520 B (probs)
  // of shared memory, 6 of 227 KB: G=7 -> 2 splits of 4 + 3 heads, G=8 -> 4 + 4.
  window_scores_case(Ws("window_scores fp16 D=256 mma split 4+3 heads G=7 Hkv=2 W=64", f16, 1, 14, 2, 200, 64,
                        256)
                         .shuffle().expect("mma_kernel<__half, 256, window_scores_impl::Pass::kStats")
                         .expect(split));
  window_scores_case(Ws("window_scores bf16 D=256 mma split G=8 lse max seq{200,37}", bf16, 2, 8, 1, 200,
                        64, 256)
                         .with_lse().gqa(GqaReduce::kMax).ragged({200, 37})
                         .expect("mma_kernel<__nv_bfloat16, 256, window_scores_impl::Pass::kProbs")
                         .expect(split));
  // qreduce = max (kProbsMax) and folding into existing [B, Hkv, M] scores (exact-size
  // buffers: keys >= M must never be touched).
  window_scores_case(Ws("window_scores qmax bf16 D=64 mma W=40 G=3 fold M=150 seq{200,0,90}", bf16, 3, 6, 2,
                        200, 40, 64)
                         .qmax().fold(150).ragged({200, 0, 90}).sm_counts({1, 132}).shuffle()
                         .expect("mma_kernel<__nv_bfloat16, 64, window_scores_impl::Pass::kProbsMax"));
  window_scores_case(Ws("window_scores qmax fp32 D=24 simt W=33 lse max", f32, 1, 4, 2, 300, 33, 24)
                         .qmax().with_lse().gqa(GqaReduce::kMax).expect(simt_f32));
  window_scores_case(Ws("window_scores qmax fp16 D=256 mma split G=3 W=200 fold M=100 sum", f16, 1, 3, 1,
                        260, 200, 256)
                         .qmax().fold(100).gqa(GqaReduce::kSum).expect(split)
                         .expect("mma_kernel<__half, 256, window_scores_impl::Pass::kProbsMax"));
  // KVzip+'s weights: folded into the lse (the weighting kernel, or the combine kernel), key
  // weights at the store (tensor cores: one query head per CTA, then the split reduce).
  window_scores_case(Ws("window_scores qmax weighted bf16 D=64 mma lse fold M=150 seq{200,0,90}", bf16, 3,
                        6, 2, 200, 40, 64)
                         .qmax().weighted().with_lse().fold(150).ragged({200, 0, 90}).shuffle()
                         .expect("window_scores_lse_weight_kernel").expect(split)
                         .expect("mma_kernel<__nv_bfloat16, 64, window_scores_impl::Pass::kProbsMax"));
  window_scores_case(Ws("window_scores qmax weighted fp16 D=64 mma G=1 fold M=90", f16, 2, 2, 2, 130, 24, 64)
                         .qmax().weighted().fold(90)
                         .expect("mma_kernel<__half, 64, window_scores_impl::Pass::kProbsMax"));
  window_scores_case(Ws("window_scores qmax weighted fp32 D=24 simt W=33 max", f32, 1, 4, 2, 300, 33, 24)
                         .qmax().weighted().gqa(GqaReduce::kMax).expect(simt_f32)
                         .expect("window_scores_lse_combine_kernel"));
  window_scores_case(Ws("window_scores qsum fold M=77 fp16 D=128 mma lse", f16, 1, 4, 1, 300, 20, 128)
                         .fold(77).with_lse().expect("mma_kernel<__half, 128, window_scores_impl::Pass::kProbs"));
}

// ---- pool_scores --------------------------------------------------------------------------
void pool_case(const char* name, int64_t kernel, PoolMode mode, int64_t window) {
  const int64_t B = 4, H = 2, N = 1500;  // 1024 positions per CTA: 2 tiles per row
  Case c(name);
  Buffer& in = c.add("scores_in", Role::kIn, Elem::kF32, B * H * N);
  fill_uniform(in, 0.f, 1.f, 97);
  Buffer& lens = c.add("seq_lens", Role::kIn, Elem::kI32, B);
  set_ints(lens, {1500, 20, 0, 35});  // 35 - 32: a prefix shorter than the kernel
  Buffer& out = c.add("scores_out", Role::kOut, Elem::kF32, B * H * N);
  kvprune::PoolScoresParams p;
  p.scores_in = in.as<float>();
  p.scores_out = out.as<float>();
  p.seq_lens = lens.as<int32_t>();
  p.batch = B;
  p.heads = H;
  p.length = N;
  p.window = window;
  p.kernel_size = kernel;
  p.mode = mode;
  c.run([&] { return kvprune::pool_scores_cpu(p, kSerial); }, [&] { return emu::pool_scores_cuda(p, nullptr); });
}

// ---- select_keep ----------------------------------------------------------------------------
struct Sel {
  const char* name;
  int64_t B, H, N, budget, n_sink, window, pool;
  PoolMode mode;
  std::vector<int32_t> seq_lens;  // empty: none
  int levels;                     // quantised scores (ties) when > 0; -1: all equal
  bool shuffled;
};

void select_case(const Sel& s) {
  Case c(s.name);
  Buffer& scores = c.add("scores", Role::kIn, Elem::kF32, s.B * s.H * s.N);
  if (s.levels < 0) std::fill_n(scores.as<float>(), scores.count, 0.375f);
  else fill_uniform(scores, 0.f, 1.f, s.levels);
  Buffer& idx = c.add("keep_idx", Role::kOut, Elem::kI32, s.B * s.H * s.budget);
  kvprune::SelectKeepParams p;
  p.scores = scores.as<float>();
  p.keep_idx = idx.as<int32_t>();
  p.batch = s.B;
  p.heads = s.H;
  p.length = s.N;
  p.budget = s.budget;
  p.n_sink = s.n_sink;
  p.window = s.window;
  p.pool_kernel_size = s.pool;
  p.pool_mode = s.mode;
  if (!s.seq_lens.empty()) {
    Buffer& lens = c.add("seq_lens", Role::kIn, Elem::kI32, s.B);
    set_ints(lens, s.seq_lens);
    p.seq_lens = lens.as<int32_t>();
  }
  c.run(
      [&] {
        Workspace ws(kvprune::select_keep_workspace_bytes_cpu(p, kSerial));
        return kvprune::select_keep_cpu(p, ws.ptr(), ws.bytes, kSerial);
      },
      [&] {
        Workspace ws(emu::select_keep_workspace_bytes_cuda(p));
        return emu::select_keep_cuda(p, ws.ptr(), ws.bytes, nullptr);
      },
      configs(s.shuffled));
}

void select_cases() {
  const PoolMode mx = PoolMode::kMax, avg = PoolMode::kAvg;
  // > 4096 candidates per row: 3 CTAs per row (9000 - 36 candidates), 2 for the 5000 row.
  select_case({"select_keep N=9000 3 CTAs/row ties seq{9000,5000}", 2, 2, 9000, 500, 4, 32, 1, mx,
               {9000, 5000}, 64, true});
  select_case({"select_keep N=9000 pooled max k=7 ties", 1, 2, 9000, 300, 4, 32, 7, mx, {}, 50, false});
  select_case({"select_keep N=5000 pooled avg k=7", 1, 2, 5000, 200, 4, 16, 7, avg, {}, 0, false});
  // Rows at and just above the budget, an empty row, sink = window = 0.
  select_case({"select_keep N=300 seq{300,65,64,0} sink=window=0", 4, 1, 300, 64, 0, 0, 1, mx,
               {300, 65, 64, 0}, 16, false});
  // budget = n_sink + window: nothing to pick. All scores equal: ties across 3 CTAs.
  select_case({"select_keep N=1000 budget=sink+window", 1, 2, 1000, 36, 4, 32, 1, mx, {}, 8, false});
  select_case({"select_keep N=9000 all scores equal", 1, 1, 9000, 700, 4, 32, 1, mx, {}, -1, true});
  // N <= budget everywhere (no selection): padding only; budget 5000 > 4096 -> 2 CTAs per row.
  select_case({"select_keep N<=budget budget=5000 seq{4800,0}", 2, 1, 4800, 5000, 4, 32, 7, mx,
               {4800, 0}, 0, false});
}

// ---- streaming_keep -------------------------------------------------------------------------
void streaming_case(const char* name, int64_t budget, int64_t n_sink) {
  const int64_t B = 3, H = 2, N = 1000;
  Case c(name);
  Buffer& lens = c.add("seq_lens", Role::kIn, Elem::kI32, B);
  set_ints(lens, {1000, static_cast<int32_t>(budget - 1), 0});
  Buffer& idx = c.add("keep_idx", Role::kOut, Elem::kI32, B * H * budget);
  kvprune::StreamingKeepParams p;
  p.seq_lens = lens.as<int32_t>();
  p.keep_idx = idx.as<int32_t>();
  p.batch = B;
  p.heads = H;
  p.length = N;
  p.budget = budget;
  p.n_sink = n_sink;
  c.run([&] { return kvprune::streaming_keep_cpu(p, kSerial); },
        [&] { return emu::streaming_keep_cuda(p, nullptr); });
}

// ---- snapkv (window_scores -> select_keep -> gather_kv in one call) ---------------------------
// Reference: the emulated window scores (checked against the CPU above), then the CPU
// select and gather on those exact scores, so indices and K/V compare exactly.
void snapkv_case(const Ws& s, int64_t budget, int64_t pool, PoolMode mode) {
  Case c(s.name);
  for (const auto& kernel : s.kernels) c.expect_kernel(kernel);
  const Elem e = elem_of(s.dtype);
  const Tokens qt = layout(s.bnhd_view, s.B, s.Hq, s.W, s.D);
  const Tokens kt = layout(s.bnhd_view, s.B, s.Hkv, s.N, s.D);
  const Tokens ot = bhnd(s.B, s.Hkv, budget, s.D);
  Buffer& q = c.add("q", Role::kIn, e, qt.span);
  Buffer& k = c.add("k", Role::kIn, e, kt.span);
  Buffer& v = c.add("v", Role::kIn, e, kt.span);
  fill_normal(q);
  fill_normal(k);
  fill_normal(v);
  Buffer& idx = c.add("keep_idx", Role::kOut, Elem::kI32, s.B * s.Hkv * budget);
  Buffer& out_k = c.add("out_k", Role::kOut, e, ot.span);
  Buffer& out_v = c.add("out_v", Role::kOut, e, ot.span);
  kvprune::SnapKvParams p;
  p.scores = scores_params(c, s, q, qt, k, kt);
  const auto& sc = p.scores;
  auto& se = p.select;
  se.seq_lens = sc.seq_lens;
  se.keep_idx = idx.as<int32_t>();
  se.batch = s.B;
  se.heads = s.Hkv;
  se.length = s.N;
  se.budget = budget;
  se.n_sink = 4;
  se.window = s.W;
  se.pool_kernel_size = pool;
  se.pool_mode = mode;
  auto& ga = p.gather;
  ga.k = sc.k;
  ga.v = ctok(v, kt);
  ga.keep_idx = se.keep_idx;
  ga.out_k = mtok(out_k, ot);
  ga.out_v = mtok(out_v, ot);
  ga.dtype = s.dtype;
  ga.batch = s.B;
  ga.heads = s.Hkv;
  ga.length = s.N;
  ga.budget = budget;
  ga.head_dim = s.D;
  c.run(
      [&] {
        ExactBuffer scores(static_cast<size_t>(s.B * s.Hkv * s.N) * sizeof(float));
        kvprune::WindowScoresParams wp = sc;
        wp.scores = reinterpret_cast<float*>(scores.data());
        Workspace ws(emu::window_scores_workspace_bytes_cuda(wp));
        if (auto st = emu::window_scores_cuda(wp, ws.ptr(), ws.bytes, nullptr); st != Status::kOk) return st;
        kvprune::SelectKeepParams sp = se;
        sp.scores = wp.scores;
        Workspace ws2(kvprune::select_keep_workspace_bytes_cpu(sp, kSerial));
        if (auto st = kvprune::select_keep_cpu(sp, ws2.ptr(), ws2.bytes, kSerial); st != Status::kOk) return st;
        return kvprune::gather_kv_cpu(ga, kSerial);
      },
      [&] {
        Workspace ws(emu::snapkv_workspace_bytes_cuda(p));
        return emu::snapkv_cuda(p, ws.ptr(), ws.bytes, nullptr);
      },
      configs(s.shuffled, s.sms));
}

}  // namespace

void prefill_cases() {
  window_scores_cases();
  pool_case("pool_scores max k=7 W=32 seq{1500,20,0,35}", 7, PoolMode::kMax, 32);
  pool_case("pool_scores avg k=7 W=32 seq{1500,20,0,35}", 7, PoolMode::kAvg, 32);
  pool_case("pool_scores max k=1 W=32", 1, PoolMode::kMax, 32);
  pool_case("pool_scores avg k=1 W=0", 1, PoolMode::kAvg, 0);
  pool_case("pool_scores avg k=3 W=1500 (no prefix)", 3, PoolMode::kAvg, 1500);
  select_cases();
  streaming_case("streaming_keep budget=300 (2 CTAs/row) seq{1000,299,0}", 300, 4);
  streaming_case("streaming_keep budget=17 sink=0", 17, 0);
  gather_cases();
  snapkv_case(Ws("snapkv fp16 D=64 mma N=700 W=16 seq{700,90} pool max 7", DType::kFloat16, 2, 4, 2, 700, 16,
                 64)
                  .ragged({700, 90}).shuffle().expect("mma_kernel<__half, 64").expect("scatter_keep")
                  .expect("gather_kv_kernel<uint4>"),
              128, 7, PoolMode::kMax);
  // Tensor cores with a head split: the split partials share the chain's workspace.
  snapkv_case(Ws("snapkv bf16 D=256 mma split G=7 W=64 N=150", DType::kBFloat16, 1, 7, 1, 150, 64, 256)
                  .expect("window_scores_split_reduce_kernel"),
              100, 1, PoolMode::kMax);
  snapkv_case(Ws("snapkv fp32 D=20 simt BNHD lse N=300 W=8 pool avg 7", DType::kFloat32, 1, 2, 1, 300, 8, 20)
                  .bnhd().with_lse().expect("simt_kernel<float"),
              50, 7, PoolMode::kAvg);
}

}  // namespace emu_test
