// Paged-cache op bodies (paged_ops.h): layout and block-table checks, paged params.
#include "torch/paged_ops.h"

#include <c10/core/DeviceGuard.h>

#include "torch/checks.h"

namespace kvprune::torch_ext {
namespace {

struct PagedShape {
  int64_t num_blocks, block_size, heads, head_dim;
};

// The pool's sizes under `layout`; raises ValueError naming `name` on a bad layout or shape.
PagedShape paged_shape(const at::Tensor& cache, const char* name, const std::string& layout) {
  TORCH_CHECK_VALUE(layout == "NHD" || layout == "HND", "layout must be 'NHD' ([num_blocks, "
                    "block_size, Hkv, D]) or 'HND' ([num_blocks, Hkv, block_size, D]), got '",
                    layout, "'");
  TORCH_CHECK_VALUE(cache.dim() == 4, name, " must be a 4-D block pool (layout ", layout, "), got ",
                    cache.dim(), "-D");
  TORCH_CHECK_VALUE(cache.size(3) >= 1 && cache.stride(3) == 1, name,
                    " must have a contiguous last dim (head_dim)");
  const bool nhd = layout == "NHD";
  return {cache.size(0), cache.size(nhd ? 1 : 2), cache.size(nhd ? 2 : 1), cache.size(3)};
}

// Paged tokens of `cache` through `block_table` (layout as in paged_shape).
template <class Tokens>
Tokens paged_tokens(const at::Tensor& cache, const at::Tensor& block_table, const std::string& layout) {
  const bool nhd = layout == "NHD";
  Tokens t;
  t.data = cache.data_ptr();
  t.head_stride = cache.stride(nhd ? 2 : 1);
  t.token_stride = cache.stride(nhd ? 1 : 2);
  t.paged.blocks = block_table.data_ptr<int32_t>();
  t.paged.table_stride = block_table.size(1);
  t.paged.block_size = cache.size(nhd ? 1 : 2);
  t.paged.block_stride = cache.stride(0);
  return t;
}

// block_table int32 [batch, max_blocks] contiguous and seq_lens int32 [batch] on the
// cache's device; on the CPU also every block a sequence uses in [0, num_blocks) and
// seq_lens in [0, max_blocks * block_size] (a CUDA check would need a host sync).
void check_table(const at::Tensor& block_table, const at::Tensor& seq_lens, const PagedShape& s,
                 const at::Tensor& cache) {
  TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt, "block_table must be int32, got ",
                   block_table.scalar_type());
  TORCH_CHECK_VALUE(block_table.dim() == 2 && block_table.size(1) >= 1,
                    "block_table must have shape [batch, max_blocks >= 1], got ", block_table.sizes());
  TORCH_CHECK_VALUE(block_table.is_contiguous(), "block_table must be contiguous");
  check_same_device(block_table, "block_table", cache, "k_cache");
  const int64_t batch = block_table.size(0);
  seq_lens_data(seq_lens, batch, cache);
  if (!cache.is_cpu()) return;
  const int64_t capacity = block_table.size(1) * s.block_size;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 0 && lens[b] <= capacity, "seq_lens[", b, "] = ", lens[b],
                      " must lie in [0, max_blocks * block_size = ", capacity, "]");
    for (int64_t i = 0; i < (lens[b] + s.block_size - 1) / s.block_size; ++i) {
      const int32_t block = table[b * block_table.size(1) + i];
      TORCH_CHECK_VALUE(block >= 0 && block < s.num_blocks, "block_table[", b, ", ", i, "] = ",
                        block, " is not a block of the pool (num_blocks = ", s.num_blocks, ")");
    }
  }
}

}  // namespace

at::Tensor paged_window_scores(const Backend& be, const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& block_table, const at::Tensor& seq_lens,
                               const std::optional<at::Tensor>& lse, std::optional<double> scale,
                               const std::string& gqa, const std::string& layout,
                               const std::optional<at::Tensor>& k_scale) {
  check_tokens(q, "q");
  const PagedShape s = paged_shape(k_cache, "k_cache", layout);
  check_same_device(k_cache, "k_cache", q, "q");
  check_table(block_table, seq_lens, s, k_cache);
  const int64_t batch = q.size(0), q_heads = q.size(1), window = q.size(2);
  TORCH_CHECK_VALUE(block_table.size(0) == batch, "block_table batch (", block_table.size(0),
                    ") must equal q batch (", batch, ")");
  TORCH_CHECK_VALUE(q.size(3) == s.head_dim, "k_cache head_dim (", s.head_dim,
                    ") must equal q head_dim (", q.size(3), ")");
  TORCH_CHECK_VALUE(q_heads % s.heads == 0, "q heads (", q_heads, ") must be a multiple of k_cache "
                    "heads (", s.heads, ")");
  TORCH_CHECK_VALUE(window >= 1, "q must hold at least one window query (q.shape[2] >= 1)");
  WindowScoresParams p;
  p.q = const_tokens(q);
  p.k = paged_tokens<ConstTokens>(k_cache, block_table, layout);
  p.dtype = core_dtype(q, "q");
  p.batch = batch;
  p.q_heads = q_heads;
  p.kv_heads = s.heads;
  p.length = block_table.size(1) * s.block_size;
  p.window = window;
  p.head_dim = s.head_dim;
  p.scale = softmax_scale(scale, s.head_dim);
  p.reduce = parse_gqa(gqa);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.lse = lse_data(lse, q);
  set_key_type(p, k_cache, "k_cache", q, k_scale);
  const c10::DeviceGuard guard(q.device());
  at::Tensor scores = at::empty({batch, s.heads, p.length}, q.options().dtype(at::kFloat));
  p.scores = scores.data_ptr<float>();
  const size_t ws_bytes = be.window_scores_workspace(p);
  at::Tensor ws = allocate_workspace(ws_bytes, q);
  check_status(be.window_scores(p, ws.data_ptr(), ws_bytes), "paged.window_scores");
  return scores;
}

at::Tensor paged_compact(const Backend& be, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const at::Tensor& idx, const std::string& layout) {
  const PagedShape s = paged_shape(k_cache, "k_cache", layout);
  const PagedShape sv = paged_shape(v_cache, "v_cache", layout);
  TORCH_CHECK_VALUE(sv.num_blocks == s.num_blocks && sv.block_size == s.block_size &&
                        sv.heads == s.heads && sv.head_dim == s.head_dim,
                    "v_cache must have the shape of k_cache ", k_cache.sizes(), ", got ", v_cache.sizes());
  TORCH_CHECK_TYPE(v_cache.scalar_type() == k_cache.scalar_type(), "v_cache must have the dtype of "
                   "k_cache (", k_cache.scalar_type(), "), got ", v_cache.scalar_type());
  check_same_device(v_cache, "v_cache", k_cache, "k_cache");
  check_table(block_table, seq_lens, s, k_cache);
  const int64_t batch = block_table.size(0);
  TORCH_CHECK_TYPE(idx.scalar_type() == at::kInt, "idx must be int32, got ", idx.scalar_type());
  TORCH_CHECK_VALUE(idx.dim() == 3 && idx.size(0) == batch && idx.size(1) == s.heads,
                    "idx must have shape [", batch, ", ", s.heads, ", budget], got ", idx.sizes());
  TORCH_CHECK_VALUE(idx.is_contiguous(), "idx must be contiguous");
  check_same_device(idx, "idx", k_cache, "k_cache");
  // K and V may be interleaved views of one buffer (vLLM's CPU cache), so a range test would
  // reject them; passing one pool as both is caught here, other element aliasing is not.
  TORCH_CHECK_VALUE(k_cache.numel() == 0 || k_cache.data_ptr() != v_cache.data_ptr(),
                    "v_cache must not be k_cache");
  CompactKvParams p;
  p.k = paged_tokens<MutableTokens>(k_cache, block_table, layout);
  p.v = paged_tokens<MutableTokens>(v_cache, block_table, layout);
  p.keep_idx = idx.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.dtype = storage_dtype(k_cache, "k_cache");
  p.batch = batch;
  p.heads = s.heads;
  p.length = block_table.size(1) * s.block_size;
  p.budget = idx.size(2);
  p.head_dim = s.head_dim;
  const c10::DeviceGuard guard(k_cache.device());
  at::Tensor new_lens = at::empty({batch}, seq_lens.options());
  p.new_seq_lens = new_lens.data_ptr<int32_t>();
  const size_t ws_bytes = be.compact_kv_workspace(p);
  at::Tensor ws = allocate_workspace(ws_bytes, k_cache);
  const Status status = be.compact_kv(p, ws.data_ptr(), ws_bytes);
  TORCH_CHECK_VALUE(status != Status::kInvalidArgument,
                    "idx: each row must hold ascending positions below its sequence's capacity, "
                    "then -1 padding, and every head of a row the same count");
  check_status(status, "paged.compact");
  return new_lens;
}

}  // namespace kvprune::torch_ext
