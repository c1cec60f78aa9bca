// test_emu cases of the decode ops: streaming_append (ring and H2O slots, every
// vector width), rerotate_keys, decode_scores (with/without V and H2O scores) and
// h2o_evict. The decode cache state (k/v cache, slot_pos, seq_lens, h2o_scores) is
// in/out: restored before every call, compared after it.
#include <algorithm>
#include <cmath>
#include <string>

#include "test_emu.h"

namespace emu_test {
namespace {

using kvprune::GqaReduce;
using kvprune::RopeLayout;
namespace emu = kvprune::emu;

const kvprune::CpuExecutor kSerial{};

// slot_pos [B, H, C] of a cache that has seen seq_lens[b] tokens with the
// StreamingLLM ring: slots fill in order, then the ring [n_sink, C) rotates.
std::vector<int32_t> ring_slot_pos(const std::vector<int32_t>& seq_lens, int64_t H, int64_t C,
                                   int64_t n_sink) {
  std::vector<int32_t> pos(seq_lens.size() * H * C, -1);
  for (size_t b = 0; b < seq_lens.size(); ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t p = 0; p < seq_lens[b]; ++p) {
        const int64_t slot = p < C ? p : n_sink + (p - n_sink) % (C - n_sink);
        pos[(b * H + h) * C + slot] = static_cast<int32_t>(p);
      }
  return pos;
}

// ---- streaming_append -------------------------------------------------------------------------
struct App {
  App(const char* name, DType dtype, int64_t H, int64_t C, int64_t T, int64_t D, int64_t n_sink)
      : name(name), dtype(dtype), H(H), C(C), T(T), D(D), n_sink(n_sink) {}
  App& bnhd(int64_t pad = 0) { bnhd_view = true; cache_pad = pad; return *this; }
  App& with_slots() { slots = true; return *this; }
  App& expect(const char* kernel) { kernel_name = kernel; return *this; }
  const char* name;
  DType dtype;
  int64_t H, C, T, D, n_sink;
  bool bnhd_view = false;  // BNHD cache and new tokens
  int64_t cache_pad = 0;
  bool slots = false;      // H2O slots instead of the ring
  const char* kernel_name = nullptr;
  // Tokens seen per sequence: still filling, crossing the capacity, long past it, none.
  std::vector<int32_t> seq_lens() const {
    return {3, static_cast<int32_t>(C - 2), static_cast<int32_t>(5 * C + 3), 0};
  }
};

void append_case(const App& s) {
  Case c(s.name);
  if (s.kernel_name) c.expect_kernel(s.kernel_name);
  c.expect_kernel("advance_kernel");
  const std::vector<int32_t> lens = s.seq_lens();
  const int64_t B = static_cast<int64_t>(lens.size());
  const Elem e = elem_of(s.dtype);
  const Tokens ct = layout(s.bnhd_view, B, s.H, s.C, s.D, s.cache_pad);
  const Tokens nt = layout(s.bnhd_view, B, s.H, s.T, s.D);
  Buffer& k_cache = c.add("k_cache", Role::kInOut, e, ct.span);
  Buffer& v_cache = c.add("v_cache", Role::kInOut, e, ct.span);
  fill_normal(k_cache);
  fill_normal(v_cache);
  Buffer& slot_pos = c.add("slot_pos", Role::kInOut, Elem::kI32, B * s.H * s.C);
  set_ints(slot_pos, ring_slot_pos(lens, s.H, s.C, s.n_sink));
  Buffer& seq = c.add("seq_lens", Role::kInOut, Elem::kI32, B);
  set_ints(seq, lens);
  Buffer& k_new = c.add("k_new", Role::kIn, e, nt.span);
  Buffer& v_new = c.add("v_new", Role::kIn, e, nt.span);
  fill_normal(k_new);
  fill_normal(v_new);
  kvprune::StreamingAppendParams p;
  if (s.slots) {
    // Distinct slots per row, a few dropped (-1 or >= capacity). Never the last two
    // slots: the row crossing the capacity fills them in order first.
    Buffer& slots = c.add("slots", Role::kIn, Elem::kI32, B * s.H * s.T);
    std::vector<int32_t> v(B * s.H * s.T);
    std::vector<int32_t> all(s.C - 2);
    for (int64_t i = 0; i < s.C - 2; ++i) all[i] = static_cast<int32_t>(i);
    for (int64_t r = 0; r < B * s.H; ++r) {
      std::shuffle(all.begin(), all.end(), rng());
      std::copy(all.begin(), all.begin() + s.T, v.begin() + r * s.T);
      if (s.T > 1) v[r * s.T + 1] = r % 2 ? -1 : static_cast<int32_t>(s.C);
    }
    set_ints(slots, v);
    p.slots = slots.as<int32_t>();
  }
  p.k_cache = mtok(k_cache, ct);
  p.v_cache = mtok(v_cache, ct);
  p.slot_pos = slot_pos.as<int32_t>();
  p.seq_lens = seq.as<int32_t>();
  p.k_new = ctok(k_new, nt);
  p.v_new = ctok(v_new, nt);
  p.dtype = s.dtype;
  p.batch = B;
  p.kv_heads = s.H;
  p.capacity = s.C;
  p.num_new = s.T;
  p.head_dim = s.D;
  p.n_sink = s.n_sink;
  c.run([&] { return kvprune::streaming_append_cpu(p, kSerial); },
        [&] { return emu::streaming_append_cuda(p, nullptr); });
}

void append_cases() {
  const DType f32 = DType::kFloat32, f16 = DType::kFloat16, bf16 = DType::kBFloat16;
  append_case(App("streaming_append ring fp16 D=128 16B C=40 T=5", f16, 2, 40, 5, 128, 4)
                  .expect("append_kernel<uint4>"));
  append_case(App("streaming_append ring fp32 D=6 8B BNHD T=50 > ring", f32, 3, 40, 50, 6, 4)
                  .bnhd().expect("append_kernel<uint2>"));
  append_case(App("streaming_append ring bf16 D=66 4B BNHD padded sink=0", bf16, 2, 33, 7, 66, 0)
                  .bnhd(2).expect("append_kernel<unsigned int>"));
  append_case(App("streaming_append slots fp16 D=5 2B T=9", f16, 2, 30, 9, 5, 4)
                  .with_slots().expect("append_kernel<short unsigned int>"));
  append_case(App("streaming_append slots bf16 D=256 16B T=3", bf16, 3, 50, 3, 256, 4)
                  .with_slots().expect("append_kernel<uint4>"));
  append_case(App("streaming_append T=0 (advance only)", f32, 2, 20, 0, 8, 4));
}

// ---- rerotate_keys ------------------------------------------------------------------------------
void rotate_case(const char* name, DType dtype, int64_t H, int64_t L, int64_t D, int64_t rotary,
                 RopeLayout rope_layout, bool bnhd_view, bool broadcast_new, bool given_freq) {
  const int64_t B = 2;
  Case c(name);
  c.expect_kernel("rope_rows_kernel");
  const Tokens kt = layout(bnhd_view, B, H, L, D);
  Buffer& k = c.add("k", Role::kInOut, elem_of(dtype), kt.span);  // exact, as in gather
  fill_normal(k);
  // Old positions: a ring cache's slot_pos (holes -1); new: the slot index itself.
  Buffer& old_pos = c.add("old_pos", Role::kIn, Elem::kI32, B * H * L);
  set_ints(old_pos, ring_slot_pos({static_cast<int32_t>(L / 2), static_cast<int32_t>(7 * L + 1)}, H, L, 4));
  Buffer& new_pos = c.add("new_pos", Role::kIn, Elem::kI32, broadcast_new ? L : B * H * L);
  for (int64_t i = 0; i < new_pos.count; ++i) new_pos.as<int32_t>()[i] = static_cast<int32_t>(i % L);
  if (!broadcast_new) new_pos.as<int32_t>()[L + 3] = -1;  // a negative new position: left alone
  kvprune::RerotateKeysParams p;
  p.k = mtok(k, kt);
  p.old_pos = old_pos.as<int32_t>();
  p.old_pos_batch_stride = H * L;
  p.old_pos_head_stride = L;
  p.new_pos = new_pos.as<int32_t>();
  p.new_pos_batch_stride = broadcast_new ? 0 : H * L;
  p.new_pos_head_stride = broadcast_new ? 0 : L;
  p.dtype = dtype;
  p.batch = B;
  p.heads = H;
  p.length = L;
  p.head_dim = D;
  p.rope.rotary_dim = rotary;
  p.rope.layout = rope_layout;
  if (given_freq) {
    Buffer& f = c.add("inv_freq", Role::kIn, Elem::kF32, rotary / 2);
    for (int64_t i = 0; i < rotary / 2; ++i)
      f.as<float>()[i] = static_cast<float>(std::pow(500000.0, -2.0 * i / rotary));
    p.rope.inv_freq = f.as<float>();
  } else {
    p.rope.theta = 10000.0;
  }
  c.run([&] { return kvprune::rerotate_keys_cpu(p, kSerial); }, [&] { return emu::rerotate_keys_cuda(p, nullptr); });
}

// ---- decode_scores ------------------------------------------------------------------------------
struct Dec {
  Dec(const char* name, DType dtype, int64_t Hq, int64_t Hkv, int64_t C, int64_t T, int64_t D)
      : name(name), dtype(dtype), Hq(Hq), Hkv(Hkv), C(C), T(T), D(D) {}
  Dec& values(bool v) { with_v = v; return *this; }
  Dec& h2o(bool h) { with_h2o = h; return *this; }
  Dec& gqa(GqaReduce r) { reduce = r; return *this; }
  Dec& bnhd() { bnhd_view = true; return *this; }
  Dec& shuffle() { shuffled = true; return *this; }
  const char* name;
  DType dtype;
  int64_t Hq, Hkv, C, T, D;
  bool with_v = true, with_h2o = true, bnhd_view = false, shuffled = false;
  GqaReduce reduce = GqaReduce::kMean;
};

void decode_scores_case(const Dec& s) {
  Case c(s.name);
  c.expect_kernel("partial_kernel");
  if (s.with_h2o) c.expect_kernel("scores_kernel");
  if (s.with_v) c.expect_kernel("output_kernel");
  // Rows: a ring cache long past its capacity (speculative queries see a causal
  // part of it), one still filling, one with an empty cache (its queries see nothing),
  // one with a single token (earlier speculative queries have negative positions).
  const std::vector<int32_t> lens = {static_cast<int32_t>(3 * s.C + 5), static_cast<int32_t>(s.C / 2), 0, 1};
  const int64_t B = static_cast<int64_t>(lens.size());
  const Elem e = elem_of(s.dtype);
  const Tokens qt = layout(s.bnhd_view, B, s.Hq, s.T, s.D);
  const Tokens kt = layout(s.bnhd_view, B, s.Hkv, s.C, s.D);
  Buffer& q = c.add("q", Role::kIn, e, qt.span);
  Buffer& k_cache = c.add("k_cache", Role::kIn, e, kt.span);
  fill_normal(q);
  fill_normal(k_cache, 2.f);  // peaked softmax rows
  Buffer& slot_pos = c.add("slot_pos", Role::kIn, Elem::kI32, B * s.Hkv * s.C);
  set_ints(slot_pos, ring_slot_pos(lens, s.Hkv, s.C, 4));
  Buffer& seq = c.add("seq_lens", Role::kIn, Elem::kI32, B);
  set_ints(seq, lens);
  kvprune::DecodeScoresParams p;
  if (s.with_v) {
    Buffer& v_cache = c.add("v_cache", Role::kIn, e, kt.span);
    fill_normal(v_cache);
    Buffer& out = c.add("out", Role::kOut, e, qt.span, within(score_tol(s.dtype)));
    p.v_cache = ctok(v_cache, kt);
    p.out = mtok(out, qt);
  }
  if (s.with_h2o) {
    Buffer& h2o = c.add("h2o_scores", Role::kInOut, Elem::kF32, B * s.Hkv * s.C, within(score_tol(s.dtype), s.C));
    fill_uniform(h2o, 0.f, 2.f);
    p.h2o_scores = h2o.as<float>();
  }
  p.q = ctok(q, qt);
  p.k_cache = ctok(k_cache, kt);
  p.slot_pos = slot_pos.as<int32_t>();
  p.seq_lens = seq.as<int32_t>();
  p.dtype = s.dtype;
  p.batch = B;
  p.q_heads = s.Hq;
  p.kv_heads = s.Hkv;
  p.capacity = s.C;
  p.num_q = s.T;
  p.head_dim = s.D;
  p.scale = 1.f / std::sqrt(static_cast<float>(s.D));
  p.reduce = s.reduce;
  c.run(
      [&] {
        Workspace ws(kvprune::decode_scores_workspace_bytes_cpu(p, kSerial));
        return kvprune::decode_scores_cpu(p, ws.ptr(), ws.bytes, kSerial);
      },
      [&] {
        Workspace ws(emu::decode_scores_workspace_bytes_cuda(p));
        return emu::decode_scores_cuda(p, ws.ptr(), ws.bytes, nullptr);
      },
      configs(s.shuffled));
}

// Capacity 0 with V: nothing to attend to, every output row is zero. The workspace
// query returns 0, so the workspace is null.
void decode_scores_empty_cache_case() {
  const int64_t B = 2, Hq = 2, Hkv = 1, T = 1, D = 16;
  Case c("decode_scores capacity=0 with V (null workspace)");
  const Tokens qt = bhnd(B, Hq, T, D);
  Buffer& q = c.add("q", Role::kIn, Elem::kF32, qt.span);
  fill_normal(q);
  Buffer& k_cache = c.add("k_cache", Role::kIn, Elem::kF32, 0);
  Buffer& v_cache = c.add("v_cache", Role::kIn, Elem::kF32, 0);
  Buffer& slot_pos = c.add("slot_pos", Role::kIn, Elem::kI32, 0);
  Buffer& seq = c.add("seq_lens", Role::kIn, Elem::kI32, B);
  set_ints(seq, {0, 0});
  Buffer& out = c.add("out", Role::kOut, Elem::kF32, qt.span);
  kvprune::DecodeScoresParams p;
  p.q = ctok(q, qt);
  p.k_cache = ctok(k_cache, bhnd(B, Hkv, 0, D));
  p.v_cache = ctok(v_cache, bhnd(B, Hkv, 0, D));
  p.slot_pos = slot_pos.as<int32_t>();
  p.seq_lens = seq.as<int32_t>();
  p.out = mtok(out, qt);
  p.batch = B;
  p.q_heads = Hq;
  p.kv_heads = Hkv;
  p.capacity = 0;
  p.num_q = T;
  p.head_dim = D;
  p.scale = 0.25f;
  c.run(
      [&] {
        Workspace ws(kvprune::decode_scores_workspace_bytes_cpu(p, kSerial));
        return kvprune::decode_scores_cpu(p, ws.ptr(), ws.bytes, kSerial);
      },
      [&] {
        Workspace ws(emu::decode_scores_workspace_bytes_cuda(p));
        return emu::decode_scores_cuda(p, ws.ptr(), ws.bytes, nullptr);
      });
}

// ---- h2o_evict ------------------------------------------------------------------------------------
void evict_case(const char* name, int64_t C, int64_t num, int64_t n_sink, int64_t recent, bool shuffled) {
  const int64_t H = 2;
  // Rows: filling (every p < C), crossing the capacity, full, full with holes.
  const std::vector<int32_t> lens = {static_cast<int32_t>(C / 3), static_cast<int32_t>(C - 2),
                                     static_cast<int32_t>(4 * C), static_cast<int32_t>(2 * C + 1)};
  const int64_t B = static_cast<int64_t>(lens.size());
  Case c(name);
  c.expect_kernel("evict_kernel");
  Buffer& scores = c.add("h2o_scores", Role::kInOut, Elem::kF32, B * H * C);
  fill_uniform(scores, 0.f, 1.f, 16);  // many ties: the position decides
  Buffer& slot_pos = c.add("slot_pos", Role::kInOut, Elem::kI32, B * H * C);
  std::vector<int32_t> pos(B * H * C, -1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      int32_t* row = pos.data() + (b * H + h) * C;
      const int64_t n = lens[b];
      if (n <= C) {
        for (int64_t s = 0; s < n; ++s) row[s] = static_cast<int32_t>(s);
        continue;
      }
      // A full cache after H2O evictions: sinks, the recent window, and distinct
      // older positions in random slots (heads differ).
      std::vector<int32_t> older;
      for (int64_t p = n_sink; p < n - recent; ++p) older.push_back(static_cast<int32_t>(p));
      std::shuffle(older.begin(), older.end(), rng());
      std::vector<int32_t> held;
      for (int64_t p = 0; p < n_sink; ++p) held.push_back(static_cast<int32_t>(p));
      for (int64_t p = n - recent; p < n; ++p) held.push_back(static_cast<int32_t>(p));
      held.insert(held.end(), older.begin(), older.begin() + (C - static_cast<int64_t>(held.size())));
      std::shuffle(held.begin(), held.end(), rng());
      std::copy(held.begin(), held.end(), row);
      if (b == 3) row[h + 5] = row[C - 1 - h] = -1;  // holes
    }
  set_ints(slot_pos, pos);
  Buffer& seq = c.add("seq_lens", Role::kIn, Elem::kI32, B);
  set_ints(seq, lens);
  Buffer& next = c.add("next_slot", Role::kOut, Elem::kI32, B * H * num);
  kvprune::H2oEvictParams p;
  p.h2o_scores = scores.as<float>();
  p.slot_pos = slot_pos.as<int32_t>();
  p.seq_lens = seq.as<int32_t>();
  p.next_slot = next.as<int32_t>();
  p.batch = B;
  p.heads = H;
  p.capacity = C;
  p.num = num;
  p.n_sink = n_sink;
  p.recent = recent;
  c.run([&] { return kvprune::h2o_evict_cpu(p, kSerial); }, [&] { return emu::h2o_evict_cuda(p, nullptr); },
        configs(shuffled));
}

}  // namespace

void decode_cases() {
  const DType f32 = DType::kFloat32, f16 = DType::kFloat16, bf16 = DType::kBFloat16;
  append_cases();
  rotate_case("rerotate_keys fp32 D=64 neox full L=37", f32, 2, 37, 64, 64, RopeLayout::kNeox, false, false,
              false);
  rotate_case("rerotate_keys bf16 D=20 gptj 12/20 BNHD new_pos broadcast", bf16, 3, 41, 20, 12, RopeLayout::kGptj,
              true, true, false);
  rotate_case("rerotate_keys fp16 D=256 neox full inv_freq", f16, 2, 20, 256, 256, RopeLayout::kNeox, false,
              true, true);
  // 3 slot chunks of 128 (the last partial), G*T = 4*3 = 12 query rows.
  decode_scores_case(Dec("decode_scores fp16 D=128 C=300 G=4 T=3 v+h2o mean", f16, 8, 2, 300, 3, 128).shuffle());
  // G*T = 32 rows (the most), D = 256 (8 dims per lane), no V.
  decode_scores_case(Dec("decode_scores bf16 D=256 C=130 G=8 T=4 h2o only max BNHD", bf16, 8, 1, 130, 4, 256)
                         .values(false).gqa(GqaReduce::kMax).bnhd());
  decode_scores_case(Dec("decode_scores fp32 D=20 C=77 G=1 T=1 v only sum", f32, 2, 2, 77, 1, 20)
                         .h2o(false).gqa(GqaReduce::kSum));
  decode_scores_case(Dec("decode_scores fp16 D=96 C=129 G=2 T=2 v+h2o BNHD", f16, 4, 2, 129, 2, 96).bnhd());
  decode_scores_empty_cache_case();
  evict_case("h2o_evict C=300 num=5 sink=4 recent=32", 300, 5, 4, 32, true);
  evict_case("h2o_evict C=50 num=1 sink=0 recent=0", 50, 1, 0, 0, false);
  evict_case("h2o_evict C=200 num=64 (most) sink=4 recent=16", 200, 64, 4, 16, false);
}

}  // namespace emu_test
