// Plain parameter structs for every op of the torch-free core.
//
// Conventions (all ops):
//  * Sizes and strides are int64 and counted in elements, not bytes.
//  * Token tensors are 4-D [batch, heads, tokens, head_dim] with arbitrary strides
//    for the first three dims and a contiguous last dim (stride 1). That covers both
//    the BHND layout and a BNHD tensor viewed as BHND.
//  * Score tensors are contiguous fp32 [batch, heads, length].
//  * seq_lens, when not null, is a contiguous int32 [batch] array of valid lengths
//    (right padding): positions >= seq_lens[b] are ignored. Null means every row
//    has `length` valid positions. Values must lie in [0, length].
//  * Index tensors are contiguous int32 [batch, heads, budget]. A row that keeps
//    fewer than `budget` tokens is padded with -1.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

#include "kvprune/dtype.h"
#include "kvprune/host_device.h"

namespace kvprune {

// How the per-query-head score rows of one GQA group are combined.
enum class GqaReduce : int { kMean = 0, kMax = 1, kSum = 2 };

// How the window queries' probabilities of one query head are combined per key.
enum class QueryReduce : int { kSum = 0, kMax = 1 };

// 1-D pooling over the prefix [0, len - window): max ignores padding; avg counts
// padding as zeros and always divides by kernel_size. A pool shifted by s (0 <= s <=
// kernel_size / 2) covers the positions [i - r - s, i + r - s] (r = kernel_size / 2)
// for position i: a high score reaches the r + s positions after it, the r - s before.
enum class PoolMode : int { kMax = 0, kAvg = 1 };

// A paged (block-table) token layout, as serving engines keep their KV caches: the
// tokens of batch row b are stored in fixed-size blocks of a shared pool, token t in
// block block_table[b * table_stride + t / block_size] at offset t % block_size. Element
// (b, h, t, d) of a paged token tensor is
//   data[block * block_stride + (t % block_size) * token_stride + h * head_stride + d]
// (batch_stride is unused). Block ids must lie in [0, number of blocks) for every token
// an op reads or writes (the CPU bindings check this; CUDA kernels trust the table).
struct BlockTable {
  const int32_t* blocks = nullptr;  // [batch, table_stride] int32; null = dense layout
  int64_t table_stride = 0;         // blocks per row of the table (max blocks per sequence)
  int64_t block_size = 0;           // tokens per block, >= 1
  int64_t block_stride = 0;         // elements between consecutive blocks of the pool
};

// Read-only strided token tensor [batch, heads, tokens, head_dim], dense or paged.
struct ConstTokens {
  const void* data = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t token_stride = 0;
  BlockTable paged;  // paged.blocks != null: the paged layout above
};

// Writable strided token tensor [batch, heads, tokens, head_dim], dense or paged.
struct MutableTokens {
  void* data = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t token_stride = 0;
  BlockTable paged;
};

// Element offset of (b, h, t, 0) in a dense or paged token tensor (host, or device code
// with the tensor's memory).
template <class Tokens>
KVPRUNE_HOST_DEVICE int64_t token_offset(const Tokens& x, int64_t b, int64_t h, int64_t t) {
  if (x.paged.blocks == nullptr) return b * x.batch_stride + h * x.head_stride + t * x.token_stride;
  const int64_t block = x.paged.blocks[b * x.paged.table_stride + t / x.paged.block_size];
  return block * x.paged.block_stride + (t % x.paged.block_size) * x.token_stride + h * x.head_stride;
}

// Tokens t, t+1, ... of row b that follow token t at token_stride (to its block's end).
template <class Tokens>
KVPRUNE_HOST_DEVICE int64_t contiguous_tokens(const Tokens& x, int64_t t) {
  if (x.paged.blocks == nullptr) return INT64_MAX;
  return x.paged.block_size - t % x.paged.block_size;
}

// SnapKV observation-window voting (DESIGN §1, stage 2).
//   a[h,i,j] = softmax_j(q[h,i].k[h/G,j] * scale) over j <= len-window+i
//   s[h,j] = sum_i a[h,i,j] (qreduce kSum) or max_i a[h,i,j] (kMax; invisible pairs count as 0)
//   kMax with weights: s[h,j] = kw[h,j] * max_i qw[h,i] * a[h,i,j] (a missing weight is 1)
//   new[g,j] = reduce_{h in group g} s[h,j]
// With lse: a = exp(q.k*scale - lse[h,i]) and no normalisation pass.
// Queries whose position len-window+i is negative (len < window) contribute nothing.
// Positions j >= len get new = 0.
// fold_length == 0: scores = new, all `length` keys.
// fold_length == M in [1, length]: scores is an existing [batch, kv_heads, M] array and
// only keys j < M are scored (the normaliser still covers every visible key); each is
// folded in place with the query reduction: scores = max(scores, new) (kMax) or
// scores + new (kSum), positions len <= j < M included (new = 0 there).
// fp8 K (k_dtype): the keys' values are float(k[b,g,j]) * k_scale[g] (k_scale_count ==
// kv_heads) or * k_scale[0] (count 1), null means 1; k_scale needs an fp8 K.
struct WindowScoresParams {
  ConstTokens q;                      // [batch, q_heads, window, head_dim], dtype
  ConstTokens k;                      // [batch, kv_heads, length, head_dim], k_dtype (default dtype)
  std::optional<DType> k_dtype;       // K's element type when it is not dtype (fp8 caches)
  const float* k_scale = nullptr;     // [k_scale_count] fp32 (device of the kernel), or null
  int64_t k_scale_count = 0;          // 1 or kv_heads (with k_scale)
  const float* lse = nullptr;         // [batch, q_heads, window] contiguous fp32, or null
  const int32_t* seq_lens = nullptr;  // [batch] or null
  float* scores = nullptr;            // out: [batch, kv_heads, fold_length or length] contiguous fp32
  DType dtype = DType::kFloat32;
  int64_t batch = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;  // q_heads % kv_heads == 0
  int64_t length = 0;    // N, the padded cache length
  int64_t window = 0;    // W, number of observation queries
  int64_t head_dim = 0;  // D
  float scale = 0.f;     // usually 1/sqrt(D)
  GqaReduce reduce = GqaReduce::kMean;
  QueryReduce qreduce = QueryReduce::kSum;
  int64_t fold_length = 0;  // 0: write scores; M in [1, length]: fold keys [0, M) into scores
  // qreduce = kMax only (KVzip+'s weighting): qw and kw above. A weight that is not > 0
  // (NaN included) counts as 0.
  const float* query_weight = nullptr;  // [batch, q_heads, window] contiguous fp32, or null
  const float* key_weight = nullptr;    // [batch, q_heads, fold_length or length] contiguous fp32, or null
};

// A query row's base-2 normaliser with its query weight w folded in: exp2(x - result) =
// w * exp2(x - lse2). +inf (the row adds nothing) where w is not > 0 (NaN included).
KVPRUNE_HOST_DEVICE float weighted_lse2(float lse2, float w) {
  return w > 0.f ? lse2 - log2f(w) : INFINITY;
}

// A key weight as applied: w where w > 0, else 0 (NaN included).
KVPRUNE_HOST_DEVICE float applied_key_weight(float w) { return w > 0.f ? w : 0.f; }

// K's element type.
inline DType key_dtype(const WindowScoresParams& p) { return p.k_dtype.value_or(p.dtype); }

// Keys per score row of p.scores: M when folding, else length.
inline int64_t score_row_length(const WindowScoresParams& p) {
  return p.fold_length > 0 ? p.fold_length : p.length;
}

// Stage 3: stride-1 pooling over each row's prefix [0, len - window):
//   max: out[i] = max of in[j], j in [i-r-shift, i+r-shift] ∩ [0, len - window)
//   avg: out[i] = sum of in[j] over the same j, / kernel_size
// (r = kernel_size / 2). Positions in [len - window, len) are copied unchanged,
// positions >= len become 0.
struct PoolScoresParams {
  const float* scores_in = nullptr;   // [batch, heads, length]
  float* scores_out = nullptr;        // out: [batch, heads, length]; must not alias scores_in
  const int32_t* seq_lens = nullptr;  // [batch] or null
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t length = 0;
  int64_t window = 0;
  int64_t kernel_size = 7;  // odd, >= 1
  PoolMode mode = PoolMode::kMax;
  int64_t shift = 0;        // in [0, kernel_size / 2]
};

// Stage 4: keep sinks [0,n_sink), the window [len-window, len) and the
// budget-n_sink-window best scores in [n_sink, len-window) (ties: lower position
// wins), written in ascending position order. Rows with len <= budget keep
// 0..len-1 followed by -1 padding.
// pool_kernel_size > 1 pools the scores on the fly first (same rule as
// PoolScoresParams, shifted by pool_shift), so pool + select is one pass; 1 selects
// on raw scores.
struct SelectKeepParams {
  const float* scores = nullptr;      // [batch, heads, length], finite
  const int32_t* seq_lens = nullptr;  // [batch] or null
  int32_t* keep_idx = nullptr;        // out: [batch, heads, budget]
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t length = 0;
  int64_t budget = 0;  // >= n_sink + window
  int64_t n_sink = 4;
  int64_t window = 32;
  int64_t pool_kernel_size = 1;
  PoolMode pool_mode = PoolMode::kMax;
  int64_t pool_shift = 0;  // in [0, pool_kernel_size / 2]
};

// StreamingLLM: keep [0, n_sink) and the last budget - n_sink positions.
struct StreamingKeepParams {
  const int32_t* seq_lens = nullptr;  // [batch] or null
  int32_t* keep_idx = nullptr;        // out: [batch, heads, budget]
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t length = 0;
  int64_t budget = 0;  // >= n_sink
  int64_t n_sink = 4;
};

// Rotary position embedding (RoPE) of cached post-RoPE keys, used to move a key
// from position `old` to position `new` (a delta rotation by new - old).
//   pairs: kNeox  (i, i + rotary_dim/2)   (rotate_half, Llama/NeoX/Qwen)
//          kGptj  (2i, 2i + 1)            (interleaved, GPT-J/ChatGLM)
//   angle_i = (new - old) * inv_freq[i], i in [0, rotary_dim/2)
//   inv_freq[i] = theta^(-2i/rotary_dim) unless inv_freq is given (rope scaling)
//   x' = x cos - y sin,  y' = y cos + x sin   for each pair (x, y)
// Angles are reduced in double precision, cos/sin and the rotation are fp32.
// Dims >= rotary_dim are untouched. rotary_dim == 0 means "no rotation".
enum class RopeLayout : int { kNeox = 0, kGptj = 1 };

struct RopeParams {
  int64_t rotary_dim = 0;            // even, <= head_dim; 0 disables the rotation
  RopeLayout layout = RopeLayout::kNeox;
  double theta = 10000.0;            // base of the default frequencies
  const float* inv_freq = nullptr;   // [rotary_dim/2] fp32 (device of the kernel), or null
};

// Compaction: out[b,h,t,:] = src[b,h,keep_idx[b,h,t],:] for K and V alike; an
// index outside [0, length) (the -1 padding) writes a zero row.
// With rope.rotary_dim > 0 the gathered K row is also re-rotated from position
// keep_idx[b,h,t] to position t (its position inside the compacted cache); V is
// never rotated. The default (rotary_dim 0) is a plain copy, of any dtype (fp8 too:
// the bytes move unchanged, so a cache's scales stay valid); RoPE needs fp32/fp16/bf16.
struct GatherKvParams {
  ConstTokens k;                      // [batch, heads, length, head_dim], dtype
  ConstTokens v;                      // [batch, heads, length, head_dim], dtype
  const int32_t* keep_idx = nullptr;  // [batch, heads, budget]
  MutableTokens out_k;                // out: [batch, heads, budget, head_dim], dtype
  MutableTokens out_v;                // out: [batch, heads, budget, head_dim], dtype
  DType dtype = DType::kFloat32;
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t length = 0;
  int64_t budget = 0;
  int64_t head_dim = 0;
  RopeParams rope;  // optional fused re-rotation of K (default: none)
  // The outputs were just allocated and never written. The CPU backend then maps
  // their pages in bulk before writing (cheaper than one fault per page); leave
  // false for outputs that already hold data, where that would be wasted work.
  bool fresh_outputs = false;
};

// In-place compaction of a (usually paged) K/V cache, so that an engine can hand back
// the blocks a sequence no longer needs. For every row (b, h):
//   x[b, h, t] <- x[b, h, keep_idx[b, h, t]]   for t < kept(b, h), x = K and V,
// where keep_idx[b, h, :] holds strictly ascending positions in [0, seq_lens[b])
// followed by -1 padding (what select_keep and streaming_keep write), kept(b, h) its
// count (seq_lens null: positions below length).
// Since keep_idx[b, h, t] >= t, copying in ascending t never reads a token after it
// was overwritten. Every head of a row must keep the same count (the CPU backend
// checks it); new_seq_lens[b] = kept(b, 0). A sequence's kept tokens then fill its
// first ceil(kept / block_size) blocks. Blocks of different rows must be distinct
// (a block shared between sequences, e.g. a cached prefix, must not be compacted).
struct CompactKvParams {
  MutableTokens k;                    // [batch, heads, length, head_dim], dtype, dense or paged
  MutableTokens v;                    // [batch, heads, length, head_dim], dtype, dense or paged
  const int32_t* keep_idx = nullptr;  // [batch, heads, budget]
  const int32_t* seq_lens = nullptr;  // [batch] tokens per row before compaction, or null
  int32_t* new_seq_lens = nullptr;    // out: [batch] kept tokens per row, or null
  DType dtype = DType::kFloat32;
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t length = 0;
  int64_t budget = 0;
  int64_t head_dim = 0;
};

// SnapKV end to end: window scores -> pooled selection -> gather, in one call.
// The parts describe one problem and must agree: select.{batch, heads, length,
// seq_lens} and gather.{batch, heads, length} equal scores.{batch, kv_heads,
// length, seq_lens}; gather.budget == select.budget; gather.keep_idx ==
// select.keep_idx (the kept positions, an output like out_k/out_v);
// gather.dtype == scores.dtype; gather.k describes the same keys as scores.k.
// scores.scores and select.scores are ignored: the scores live in the workspace.
// select_only: the chain stops after the selection (select.keep_idx written, no K/V
// gathered, `gather` ignored), for an engine that compacts its own cache in place.
struct SnapKvParams {
  WindowScoresParams scores;
  SelectKeepParams select;
  GatherKvParams gather;
  bool select_only = false;
};

}  // namespace kvprune
