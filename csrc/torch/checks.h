// Input checks and tensor -> core-struct conversions shared by all ops. Every
// failed check raises ValueError or TypeError naming the offending argument.
#pragma once

#include <optional>
#include <string>

#include <ATen/ATen.h>

#include "kvprune/kvprune.h"

namespace kvprune::torch_ext {

// fp32 / fp16 / bf16 -> core dtype; anything else raises TypeError naming `name`.
DType core_dtype(const at::Tensor& t, const char* name);

// Also the fp8 storage types (float8_e4m3fn, float8_e5m2) -> core dtype.
DType storage_dtype(const at::Tensor& t, const char* name);

// A 4-D [batch, heads, tokens, head_dim] tensor whose last dim is contiguous, of a core
// dtype, or a storage dtype (fp8 too) with fp8_ok.
void check_tokens(const at::Tensor& t, const char* name, bool fp8_ok = false);

// K's element type for p (p.k_dtype when k, named `name`, is an fp8 cache; otherwise it
// must have q's dtype) and, for an fp8 cache, its optional dequantisation scale k_scale:
// fp32 [] or [Hkv] (p.kv_heads must be set).
void set_key_type(WindowScoresParams& p, const at::Tensor& k, const char* name, const at::Tensor& q,
                  const std::optional<at::Tensor>& k_scale);
ConstTokens const_tokens(const at::Tensor& t);
MutableTokens mutable_tokens(at::Tensor& t);

// `t` lives on the same device as `like` (named `like_name`).
void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& like,
                       const char* like_name);

// `out` has no two elements at one address (e.g. not an expanded tensor).
void check_no_self_overlap(const at::Tensor& out, const char* name);
// The address ranges of `out` and `other` do not intersect (when they share a storage).
void check_disjoint(const at::Tensor& out, const char* name, const at::Tensor& other,
                    const char* other_name);

// A contiguous fp32 [batch, heads, length] score tensor.
void check_scores(const at::Tensor& scores, const char* name);

// seq_lens: optional contiguous int32 [batch] on the device of `like`; returns its
// data pointer or null.
const int32_t* seq_lens_data(const std::optional<at::Tensor>& seq_lens, int64_t batch,
                             const at::Tensor& like);

// Scratch memory for one call. CUDA: a block from PyTorch's caching allocator.
// CPU: PyTorch's CPU allocator does not cache, and the first-touch page faults of
// a fresh multi-MB buffer cost as much as the arithmetic, so each calling thread
// keeps its largest CPU workspace for the next call.
at::Tensor allocate_workspace(size_t bytes, const at::Tensor& like);
// The calling thread's cached CPU workspace: its size, and freeing it (the next CPU op
// allocates again). A buffer an op is still using stays alive until the op returns.
size_t cpu_workspace_bytes();
void release_cpu_workspace();

// t (named `name`): optional contiguous fp32 [batch, q_heads, last] beside the queries
// q [B, Hq, W, D], on q's device; returns its data pointer or null.
const float* per_query_head_data(const std::optional<at::Tensor>& t, const char* name,
                                 int64_t last, const at::Tensor& q);
// lse: the same with last = W.
const float* lse_data(const std::optional<at::Tensor>& lse, const at::Tensor& q);

GqaReduce parse_gqa(const std::string& gqa);
// The softmax scale: `scale` if given (must be finite), else 1/sqrt(head_dim).
float softmax_scale(std::optional<double> scale, int64_t head_dim);
PoolMode parse_pool(const std::string& mode, const char* name);

// Raises RuntimeError (ValueError for kInvalidArgument) if status is not kOk.
void check_status(Status status, const char* op);
// CPU gather: every kept index lies in [-1, length) (-1 marks padding and gives a zero
// row). The CUDA kernels do not check (that would need a host sync): any index
// outside [0, length) gives a zero row there.
void check_keep_indices(const GatherKvParams& p);

}  // namespace kvprune::torch_ext
