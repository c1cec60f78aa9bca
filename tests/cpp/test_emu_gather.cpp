// test_emu cases of gather_kv: every vector width (16/8/4/2 bytes), both layouts,
// padded strides, -1 padding, and RoPE fused into the gather (neox/gptj, partial).
#include <algorithm>
#include <cmath>
#include <string>

#include "test_emu.h"

namespace emu_test {
namespace {

using kvprune::RopeLayout;
namespace emu = kvprune::emu;

const kvprune::CpuExecutor kSerial{};

// ---- gather_kv ----------------------------------------------------------------------------------
struct Gat {
  Gat(const char* name, DType dtype, int64_t B, int64_t H, int64_t N, int64_t budget, int64_t D)
      : name(name), dtype(dtype), B(B), H(H), N(N), budget(budget), D(D) {}
  Gat& in_layout(bool bnhd, int64_t pad = 0) { in_bnhd = bnhd; in_pad = pad; return *this; }
  Gat& out_layout(bool bnhd, int64_t pad = 0) { out_bnhd = bnhd; out_pad = pad; return *this; }
  Gat& out_v_offset(size_t bytes) { v_offset = bytes; return *this; }
  Gat& expect(const char* kernel) { kernels.push_back(kernel); return *this; }
  Gat& rope(int64_t dim, RopeLayout l, bool given_freq = false) {
    rotary_dim = dim; layout = l; inv_freq = given_freq; return *this;
  }
  const char* name;
  DType dtype;
  int64_t B, H, N, budget, D;
  bool in_bnhd = false, out_bnhd = false;
  int64_t in_pad = 0, out_pad = 0;
  size_t v_offset = 0;
  int64_t rotary_dim = 0;
  RopeLayout layout = RopeLayout::kNeox;
  bool inv_freq = false;
  std::vector<std::string> kernels;  // must be launched
};

// Kept positions: ascending, distinct, -1 padded; row 0 keeps min(budget, N), the
// last row nothing, the others a random count.
std::vector<int32_t> random_keep(int64_t rows, int64_t N, int64_t budget) {
  std::vector<int32_t> idx(rows * budget, -1);
  std::vector<int32_t> all(N);
  for (int64_t j = 0; j < N; ++j) all[j] = static_cast<int32_t>(j);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t m = std::min(budget, N);
    if (r == rows - 1 && rows > 1) m = 0;
    else if (r > 0) m = std::uniform_int_distribution<int64_t>(0, m)(rng());
    std::shuffle(all.begin(), all.end(), rng());
    std::sort(all.begin(), all.begin() + m);
    std::copy(all.begin(), all.begin() + m, idx.begin() + r * budget);
  }
  return idx;
}

void gather_case(const Gat& s) {
  Case c(s.name);
  for (const auto& kernel : s.kernels) c.expect_kernel(kernel);
  if (s.rotary_dim > 0) c.expect_kernel("rope_rows_kernel");
  const Elem e = elem_of(s.dtype);
  const Tokens it = layout(s.in_bnhd, s.B, s.H, s.N, s.D, s.in_pad);
  const Tokens ot = layout(s.out_bnhd, s.B, s.H, s.budget, s.D, s.out_pad);
  Buffer& k = c.add("k", Role::kIn, e, it.span);
  Buffer& v = c.add("v", Role::kIn, e, it.span);
  fill_normal(k);
  fill_normal(v);
  Buffer& idx = c.add("keep_idx", Role::kIn, Elem::kI32, s.B * s.H * s.budget);
  set_ints(idx, random_keep(s.B * s.H, s.N, s.budget));
  // RoPE too compares exactly: both backends reduce the angle in double and use fp32
  // cos/sin (the frequencies come from pow vs exp2, equal after rounding to float here).
  Buffer& out_k = c.add("out_k", Role::kOut, e, ot.span);
  Buffer& out_v = c.add("out_v", Role::kOut, e, ot.span, exact(), s.v_offset);
  kvprune::GatherKvParams p;
  p.k = ctok(k, it);
  p.v = ctok(v, it);
  p.keep_idx = idx.as<int32_t>();
  p.out_k = mtok(out_k, ot);
  p.out_v = mtok(out_v, ot);
  p.dtype = s.dtype;
  p.batch = s.B;
  p.heads = s.H;
  p.length = s.N;
  p.budget = s.budget;
  p.head_dim = s.D;
  p.rope.rotary_dim = s.rotary_dim;
  p.rope.layout = s.layout;
  if (s.inv_freq) {  // scaled frequencies, as rope scaling would give
    Buffer& f = c.add("inv_freq", Role::kIn, Elem::kF32, s.rotary_dim / 2);
    for (int64_t i = 0; i < s.rotary_dim / 2; ++i)
      f.as<float>()[i] = 0.5f * static_cast<float>(std::pow(10000.0, -2.0 * i / s.rotary_dim));
    p.rope.inv_freq = f.as<float>();
  }
  c.run([&] { return kvprune::gather_kv_cpu(p, kSerial); }, [&] { return emu::gather_kv_cuda(p, nullptr); });
}

// ---- compact_kv (in place, dense or paged) ------------------------------------------------------
struct Cmp {
  Cmp(const char* name, DType dtype, int64_t B, int64_t H, int64_t N, int64_t budget, int64_t D)
      : name(name), dtype(dtype), B(B), H(H), N(N), budget(budget), D(D) {}
  Cmp& paged(int64_t tokens_per_block) { block_size = tokens_per_block; return *this; }
  Cmp& streaming() { sinks_and_recent = true; return *this; }
  Cmp& expect(const char* kernel) { kernels.push_back(kernel); return *this; }
  const char* name;
  DType dtype;
  int64_t B, H, N, budget, D;
  int64_t block_size = 0;         // > 0: a pool of blocks [blocks, block_size, H, D] (else BHND)
  bool sinks_and_recent = false;  // kept = 4 sinks + the last positions (sources far right)
  std::vector<std::string> kernels;
};

void compact_case(const Cmp& s) {
  Case c(s.name);
  for (const auto& kernel : s.kernels) c.expect_kernel(kernel);
  const Elem e = elem_of(s.dtype);
  // Row b holds N - 3b tokens and keeps min(budget, len) of them, the same count per head.
  std::vector<int32_t> lens(s.B), idx(s.B * s.H * s.budget, -1);
  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t len = std::max<int64_t>(s.N - 3 * b, 0), kept = std::min(s.budget, len);
    lens[b] = static_cast<int32_t>(len);
    for (int64_t h = 0; h < s.H; ++h) {
      std::vector<int32_t> pos(len);
      for (int64_t j = 0; j < len; ++j) pos[j] = static_cast<int32_t>(j);
      if (!s.sinks_and_recent) {
        std::shuffle(pos.begin() + std::min<int64_t>(4, len), pos.end(), rng());
        std::sort(pos.begin(), pos.begin() + kept);
      } else if (kept > 4) {
        std::copy(pos.end() - (kept - 4), pos.end(), pos.begin() + 4);
      }
      std::copy(pos.begin(), pos.begin() + kept, idx.begin() + (b * s.H + h) * s.budget);
    }
  }
  kvprune::CompactKvParams p;
  const int64_t per_row = s.block_size > 0 ? (s.N + s.block_size - 1) / s.block_size : 0;
  const int64_t blocks = s.B * per_row + 1;
  const int64_t span = s.block_size > 0 ? blocks * s.block_size * s.H * s.D : s.B * s.H * s.N * s.D;
  Buffer& k = c.add("k", Role::kInOut, e, span);
  Buffer& v = c.add("v", Role::kInOut, e, span);
  fill_normal(k);
  fill_normal(v);
  if (s.block_size > 0) {
    std::vector<int32_t> order(blocks);
    for (int64_t i = 0; i < blocks; ++i) order[i] = static_cast<int32_t>(i);
    std::shuffle(order.begin(), order.end(), rng());
    Buffer& table = c.add("block_table", Role::kIn, Elem::kI32, s.B * per_row);
    set_ints(table, std::vector<int32_t>(order.begin(), order.begin() + s.B * per_row));
    const kvprune::BlockTable pg{table.as<int32_t>(), per_row, s.block_size, s.block_size * s.H * s.D};
    p.k = {k.data(), 0, s.D, s.H * s.D, pg};
    p.v = {v.data(), 0, s.D, s.H * s.D, pg};
  } else {
    const Tokens t = bhnd(s.B, s.H, s.N, s.D);
    p.k = mtok(k, t);
    p.v = mtok(v, t);
  }
  Buffer& keep = c.add("keep_idx", Role::kIn, Elem::kI32, s.B * s.H * s.budget);
  set_ints(keep, idx);
  Buffer& seq = c.add("seq_lens", Role::kIn, Elem::kI32, s.B);
  set_ints(seq, lens);
  Buffer& out = c.add("new_seq_lens", Role::kOut, Elem::kI32, s.B);
  p.keep_idx = keep.as<int32_t>();
  p.seq_lens = seq.as<int32_t>();
  p.new_seq_lens = out.as<int32_t>();
  p.dtype = s.dtype;
  p.batch = s.B;
  p.heads = s.H;
  p.length = s.block_size > 0 ? per_row * s.block_size : s.N;
  p.budget = s.budget;
  p.head_dim = s.D;
  std::vector<uint32_t> ws(emu::compact_kv_workspace_bytes_cuda(p) / sizeof(uint32_t));  // exact
  c.run([&] { return kvprune::compact_kv_cpu(p, nullptr, 0, kSerial); },
        [&] { return emu::compact_kv_cuda(p, ws.data(), ws.size() * sizeof(uint32_t), nullptr); });
}

}  // namespace

void gather_cases() {
  const DType f32 = DType::kFloat32, f16 = DType::kFloat16, bf16 = DType::kBFloat16;
  const char* v16 = "gather_kv_kernel<uint4>";
  const char* v8 = "gather_kv_kernel<uint2>";
  const char* v4 = "gather_kv_kernel<unsigned int>";
  const char* v2 = "gather_kv_kernel<short unsigned int>";
  // Vector width = widest of 16/8/4/2 bytes dividing the row bytes, pointers, byte strides.
  gather_case(Gat("gather fp16 D=128 16B vectors budget=300 (19 CTAs/row)", f16, 2, 2, 500, 300, 128)
                  .expect(v16));
  gather_case(Gat("gather fp32 D=6 8B vectors BNHD in", f32, 2, 3, 100, 40, 6).in_layout(true).expect(v8));
  gather_case(Gat("gather bf16 D=66 4B vectors padded in, BNHD out", bf16, 2, 2, 90, 33, 66)
                  .in_layout(false, 2).out_layout(true).expect(v4));
  gather_case(Gat("gather fp16 D=5 2B vectors", f16, 1, 2, 50, 20, 5).expect(v2));
  gather_case(Gat("gather fp16 D=128 2B vectors (out_v pointer +2B)", f16, 1, 2, 64, 24, 128)
                  .out_v_offset(2).expect(v2));
  gather_case(Gat("gather fp32 D=1024 256 vectors/row BNHD out padded", f32, 1, 2, 40, 12, 1024)
                  .out_layout(true, 4).expect(v16));
  // RoPE fused into the gather: K re-rotated from keep_idx[t] to t.
  gather_case(Gat("gather+rope neox full fp16 D=128", f16, 1, 2, 300, 100, 128).rope(128, RopeLayout::kNeox));
  gather_case(Gat("gather+rope gptj partial 32/64 bf16 BNHD", bf16, 2, 2, 200, 64, 64)
                  .in_layout(true).out_layout(true)
                  .rope(32, RopeLayout::kGptj));
  // 40 pairs: lanes loop past 32.
  gather_case(Gat("gather+rope neox partial 80/256 fp32 inv_freq", f32, 1, 1, 100, 30, 256)
                  .rope(80, RopeLayout::kNeox, true));
  gather_case(Gat("gather+rope gptj full fp16 D=20 8B vectors", f16, 1, 3, 60, 20, 20)
                  .rope(20, RopeLayout::kGptj).expect(v8));
  // compact_kv: in place, every overlap of sources and destinations (CPU = sequential order).
  compact_case(Cmp("compact paged bf16 D=64 bs=16 random kept", bf16, 3, 2, 150, 40, 64).paged(16)
                   .expect("move_kept_kernel<uint4>"));
  compact_case(Cmp("compact paged fp16 D=128 bs=1 sinks+recent", f16, 2, 2, 90, 30, 128).paged(1)
                   .streaming());
  compact_case(Cmp("compact paged fp32 D=6 bs=32 8B vectors budget>len", f32, 2, 3, 40, 64, 6).paged(32)
                   .expect("move_kept_kernel<uint2>"));
  compact_case(Cmp("compact dense fp16 D=5 2B vectors sinks+recent", f16, 2, 2, 70, 25, 5).streaming()
                   .expect("move_kept_kernel<short unsigned int>"));
  // Rows of several slabs (1024 tokens each for 16-byte vectors; 256 for the 1-byte vectors of
  // a 7-byte row), most tokens kept: a slab's sources lie in the next slab, which must wait.
  compact_case(Cmp("compact paged bf16 D=64 3 slabs random kept", bf16, 2, 2, 3000, 2600, 64).paged(16)
                   .expect("move_kept_kernel<uint4>").expect("count_kept_kernel"));
  compact_case(Cmp("compact dense fp8 e5m2 D=7 4 slabs sinks+recent", DType::kFloat8E5M2, 1, 3, 1100, 900, 7)
                   .streaming().expect("move_kept_kernel<unsigned char>"));
  // No KV heads: nothing moves and every row's new length is 0 (CUDA wrote none before).
  compact_case(Cmp("compact paged fp16 no heads", f16, 2, 0, 40, 8, 16).paged(16));
  // fp8 caches move as bytes: odd rows take 1-byte vectors.
  compact_case(Cmp("compact paged fp8 e4m3 D=7 1B vectors", DType::kFloat8E4M3, 2, 2, 60, 20, 7).paged(16)
                   .expect("move_kept_kernel<unsigned char>"));
  gather_case(Gat("gather fp8 e5m2 D=9 1B vectors", DType::kFloat8E5M2, 1, 2, 50, 20, 9)
                  .expect("gather_kv_kernel<unsigned char>"));
  gather_case(Gat("gather fp8 e4m3 D=128 16B vectors", DType::kFloat8E4M3, 2, 2, 80, 30, 128).expect(v16));
}

}  // namespace emu_test
