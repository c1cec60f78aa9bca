// Parameter structs of the decode-time eviction ops (StreamingLLM ring cache,
// RoPE re-rotation, H2O heavy hitters). Same conventions as params.h: int64
// sizes and strides in elements, token tensors [batch, heads, tokens, head_dim]
// with a contiguous last dim.
//
// The fixed-capacity decode cache of one layer (owned by the engine):
//   k_cache, v_cache  [batch, kv_heads, capacity, head_dim]   any strides, dim 3 contiguous
//   slot_pos          int32 [batch, kv_heads, capacity]        contiguous; the original stream
//                     position of the token held by each slot, -1 = empty
//   seq_lens          int32 [batch]                            tokens seen so far per sequence
//   h2o_scores        fp32 [batch, kv_heads, capacity]         contiguous (H2O only)
// Slots are per (batch, KV head), so H2O heads may hold different tokens.
#pragma once

#include <cstdint>

#include "kvprune/params.h"

namespace kvprune {

// Writes num_new tokens per sequence at stream positions p = seq_lens[b] + t and
// then advances seq_lens[b] by num_new. Destination slot of position p:
//   p < capacity                 slot p (the cache fills in order)
//   p >= capacity, slots null    n_sink + (p - n_sink) % (capacity - n_sink)
//                                (StreamingLLM ring: sinks stay, the oldest
//                                non-sink token is overwritten)
//   p >= capacity, slots given   slots[b,h,t] (from h2o_evict); a value outside
//                                [0, capacity) drops the token
// Writing also sets slot_pos[b,h,slot] = p. When one call writes more ring tokens
// than the ring holds, only the last capacity - n_sink of them are written.
// Slots given for one row must be distinct (h2o_evict guarantees it).
struct StreamingAppendParams {
  MutableTokens k_cache;              // in/out [batch, kv_heads, capacity, head_dim], dtype
  MutableTokens v_cache;              // in/out [batch, kv_heads, capacity, head_dim], dtype
  int32_t* slot_pos = nullptr;        // in/out [batch, kv_heads, capacity]
  int32_t* seq_lens = nullptr;        // in/out [batch], >= 0 (CUDA clamps negatives to 0)
  ConstTokens k_new;                  // [batch, kv_heads, num_new, head_dim], dtype
  ConstTokens v_new;                  // [batch, kv_heads, num_new, head_dim], dtype
  const int32_t* slots = nullptr;     // [batch, kv_heads, num_new] or null
  DType dtype = DType::kFloat32;
  int64_t batch = 0;
  int64_t kv_heads = 0;
  int64_t capacity = 0;  // C >= 1
  int64_t num_new = 0;   // T >= 0
  int64_t head_dim = 0;
  int64_t n_sink = 4;    // 0 <= n_sink < capacity
};

// Rotates cached post-RoPE keys in place from old_pos to new_pos (see RopeParams).
// Entries whose old or new position is negative (empty slots) are left alone.
// The position tensors are [batch, heads, length] int32 with the given strides for
// dims 0 and 1 and a contiguous last dim (stride 0 strides allow broadcasting).
struct RerotateKeysParams {
  MutableTokens k;                    // in/out [batch, heads, length, head_dim], dtype
  const int32_t* old_pos = nullptr;   // [batch, heads, length]
  int64_t old_pos_batch_stride = 0;
  int64_t old_pos_head_stride = 0;
  const int32_t* new_pos = nullptr;   // [batch, heads, length]
  int64_t new_pos_batch_stride = 0;
  int64_t new_pos_head_stride = 0;
  DType dtype = DType::kFloat32;
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t length = 0;
  int64_t head_dim = 0;
  RopeParams rope;  // rotary_dim >= 2
};

// Decode attention probabilities over the cache, for H2O.
// The num_q queries of row b sit at positions n-num_q+t (n = seq_lens[b], so the
// new tokens must already be appended). Query t of head h sees slot s of KV head
// g = h / G iff 0 <= slot_pos[b,g,s] <= n-num_q+t (causal among speculative tokens):
//   a[h,t,s] = softmax_s(q[b,h,t] . k_cache[b,g,s] * scale)   over visible slots, fp32
//   h2o_scores[b,g,s] += reduce_{h in group g} sum_t a[h,t,s]   (mean | max | sum)
//   out[b,h,t,:] = sum_s a[h,t,s] v_cache[b,g,s,:]              (when v_cache.data != null)
// A query that sees no slot gets a = 0 and a zero output row.
struct DecodeScoresParams {
  ConstTokens q;                      // [batch, q_heads, num_q, head_dim], dtype
  ConstTokens k_cache;                // [batch, kv_heads, capacity, head_dim], dtype
  ConstTokens v_cache;                // same shape as k_cache, or data null (no output)
  const int32_t* slot_pos = nullptr;  // [batch, kv_heads, capacity]
  const int32_t* seq_lens = nullptr;  // [batch], required
  float* h2o_scores = nullptr;        // in/out [batch, kv_heads, capacity], or null
  MutableTokens out;                  // out [batch, q_heads, num_q, head_dim], dtype; with v_cache
  DType dtype = DType::kFloat32;
  int64_t batch = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;   // q_heads % kv_heads == 0
  int64_t capacity = 0;
  int64_t num_q = 0;      // T >= 1 (1 for plain decode, a few for speculative tokens)
                          // CUDA: (q_heads / kv_heads) * num_q <= 32 and head_dim <= 256
  int64_t head_dim = 0;
  float scale = 0.f;
  GqaReduce reduce = GqaReduce::kMean;
};

// H2O eviction: chooses the slots the next num tokens of each (batch, KV head)
// go to, at positions p = n + t (n = seq_lens[b]).
//   p < capacity:  next_slot[b,h,t] = p (still filling in order)
//   p >= capacity: a slot is evicted: empty slots (slot_pos < 0) first (lowest slot),
//                  then the lowest h2o score among slots whose position lies in
//                  [n_sink, n - recent) (ties: lowest position). Evicted slots get
//                  slot_pos = -1 and h2o_scores = 0; next_slot lists them in
//                  ascending slot order (-1 last if no candidate is left).
// capacity >= n_sink + recent + num guarantees a candidate for a full cache.
struct H2oEvictParams {
  float* h2o_scores = nullptr;        // in/out [batch, heads, capacity]
  int32_t* slot_pos = nullptr;        // in/out [batch, heads, capacity]
  const int32_t* seq_lens = nullptr;  // [batch]
  int32_t* next_slot = nullptr;       // out [batch, heads, num]
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t capacity = 0;
  int64_t num = 1;      // tokens the next append writes, in [1, 64]
  int64_t n_sink = 4;   // >= 0
  int64_t recent = 32;  // >= 0
};

}  // namespace kvprune
