// Ops on paged (block-table) KV caches, as serving engines keep them (params.h
// BlockTable). A layer's K (or V) cache is a block pool, viewed per `layout`:
//   "NHD": [num_blocks, block_size, Hkv, D]   (vLLM's GPU layout, flashinfer's NHD)
//   "HND": [num_blocks, Hkv, block_size, D]   (vLLM's CPU layout per K or V half)
// (fp32/fp16/bf16, or fp8 caches: scores dequantise with k_scale, compaction copies
// the bytes) with any strides but a contiguous last dim (e.g. a K half of vLLM's CPU cache
// [num_blocks, Hkv, 2 * block_size, D]). block_table int32 [B, max_blocks], seq_lens
// int32 [B] (each <= max_blocks * block_size).
#pragma once

#include <optional>
#include <string>

#include <ATen/ATen.h>

#include "torch/backend.h"

namespace kvprune::torch_ext {

// q [B,Hq,W,D] (each row's last W positions) -> scores fp32 [B, Hkv, max_blocks * block_size]
at::Tensor paged_window_scores(const Backend& be, const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& block_table, const at::Tensor& seq_lens,
                               const std::optional<at::Tensor>& lse, std::optional<double> scale,
                               const std::string& gqa, const std::string& layout,
                               const std::optional<at::Tensor>& k_scale);
// In place: each row's kept positions idx int32 [B, Hkv, budget] move to its first
// tokens (CompactKvParams) -> new seq_lens int32 [B].
at::Tensor paged_compact(const Backend& be, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const at::Tensor& idx, const std::string& layout);

}  // namespace kvprune::torch_ext
