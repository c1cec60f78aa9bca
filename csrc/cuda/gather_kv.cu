// CUDA gather_kv: out[b,h,t,:] = src[b,h,keep_idx[b,h,t],:] for K and V; an index
// outside [0, length) writes a zero row.
//
// Rows are copied as raw bytes in vectors of 16, 8, 4, 2 or 1 bytes: the widest
// width that divides the row size, every base address and every byte stride.
// A group of `lanes` threads (a power of two <= 32) copies one output row, so a
// warp moves whole rows with coalesced vector loads and stores.
// With p.rope.rotary_dim > 0 a second kernel (same stream) re-rotates each
// gathered K row in place from position keep_idx[t] to position t (cuda/rope.cuh).
#include <cstdint>

#include "cuda/simt.cuh"
#include "core/validate.h"
#include "core/validate_decode.h"
#include "cuda/common.cuh"
#include "cuda/rope.cuh"
#include "kvprune/kvprune.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace {

using cuda_detail::ceil_div;

// ---- launch heuristics ----------------------------------------------------------
constexpr int kBlock = 256;     // threads per CTA
constexpr int kMaxLanes = 32;   // most threads per output row
constexpr int kMaxVecBytes = 16;
constexpr int kMinVecBytes = 1;  // fp8 rows may have an odd size

// Token tensor as bytes: byte strides, last dim contiguous. Byte is char or const char.
template <typename Byte>
struct ByteTokens {
  Byte* data;  // [batch, heads, tokens, head_dim] of element_size bytes each
  int64_t batch_stride;
  int64_t head_stride;
  int64_t token_stride;

  __device__ __forceinline__ Byte* row(int64_t b, int64_t h, int64_t t) const {
    return data + b * batch_stride + h * head_stride + t * token_stride;
  }
};

struct GatherArgs {
  ByteTokens<const char> k;  // [batch, heads, length, head_dim]
  ByteTokens<const char> v;  // [batch, heads, length, head_dim]
  ByteTokens<char> out_k;    // out: [batch, heads, budget, head_dim]
  ByteTokens<char> out_v;    // out: [batch, heads, budget, head_dim]
  const int32_t* keep_idx;   // [rows, budget]
  int64_t heads;
  int64_t length;
  int64_t budget;
  int vecs_per_row;          // head_dim * element_size / sizeof(Vec)
  int lanes_log2;            // threads per output row = 1 << lanes_log2
  uint32_t tiles_per_row;    // CTAs per (batch, head) row
};

template <typename Vec>
__global__ __launch_bounds__(kBlock) void gather_kv_kernel(GatherArgs a) {
  const int64_t row = blockIdx.x / a.tiles_per_row;
  const int64_t rows_per_cta = kBlock >> a.lanes_log2;
  const int64_t t = static_cast<int64_t>(blockIdx.x % a.tiles_per_row) * rows_per_cta +
                    (threadIdx.x >> a.lanes_log2);
  if (t >= a.budget) return;
  const int lane = threadIdx.x & ((1 << a.lanes_log2) - 1);
  const int64_t b = row / a.heads;
  const int64_t h = row % a.heads;
  const int64_t j = __ldg(a.keep_idx + row * a.budget + t);
  const bool in_range = j >= 0 && j < a.length;
  const Vec* k_src = in_range ? reinterpret_cast<const Vec*>(a.k.row(b, h, j)) : nullptr;
  const Vec* v_src = in_range ? reinterpret_cast<const Vec*>(a.v.row(b, h, j)) : nullptr;
  Vec* k_dst = reinterpret_cast<Vec*>(a.out_k.row(b, h, t));
  Vec* v_dst = reinterpret_cast<Vec*>(a.out_v.row(b, h, t));
  for (int i = lane; i < a.vecs_per_row; i += 1 << a.lanes_log2) {
    Vec k_val{};
    Vec v_val{};
    if (in_range) {
      k_val = __ldg(k_src + i);
      v_val = __ldg(v_src + i);
    }
    k_dst[i] = k_val;
    v_dst[i] = v_val;
  }
}

// Widest vector (bytes) dividing the row size, every base address and every stride.
int vector_bytes(const GatherKvParams& p, int64_t element_size) {
  uint64_t bits = static_cast<uint64_t>(p.head_dim * element_size);
  for (const void* ptr : {p.k.data, p.v.data, static_cast<const void*>(p.out_k.data),
                          static_cast<const void*>(p.out_v.data)})
    bits |= reinterpret_cast<uintptr_t>(ptr);
  for (int64_t stride : {p.k.batch_stride, p.k.head_stride, p.k.token_stride, p.v.batch_stride,
                         p.v.head_stride, p.v.token_stride, p.out_k.batch_stride,
                         p.out_k.head_stride, p.out_k.token_stride, p.out_v.batch_stride,
                         p.out_v.head_stride, p.out_v.token_stride})
    bits |= static_cast<uint64_t>(stride * element_size);
  int bytes = kMaxVecBytes;
  while (bytes > kMinVecBytes && bits % bytes != 0) bytes /= 2;
  return bytes;
}

ByteTokens<const char> as_bytes(const ConstTokens& tokens, int64_t element_size) {
  return {static_cast<const char*>(tokens.data), tokens.batch_stride * element_size,
          tokens.head_stride * element_size, tokens.token_stride * element_size};
}

ByteTokens<char> as_mutable_bytes(const MutableTokens& tokens, int64_t element_size) {
  return {static_cast<char*>(tokens.data), tokens.batch_stride * element_size,
          tokens.head_stride * element_size, tokens.token_stride * element_size};
}

template <int kVecBytes>
void launch(const GatherArgs& args, unsigned blocks, cudaStream_t stream) {
  simt::launch<gather_kv_kernel<typename cuda_detail::VecOf<kVecBytes>::type>>(blocks, kBlock, 0,
                                                                              stream, args);
}

// Delta of gathered row t: from its source position keep_idx[t] to t; padding rows
// (index outside [0, length)) are zero and stay untouched.
struct GatherDelta {
  const int32_t* keep_idx;  // [rows, budget]
  int64_t heads;
  int64_t budget;
  int64_t length;

  __device__ __forceinline__ bool operator()(int64_t b, int64_t h, int64_t t, int64_t* delta) const {
    const int64_t j = __ldg(keep_idx + (b * heads + h) * budget + t);
    *delta = t - j;
    return j >= 0 && j < length;
  }
};

template <typename T>
void launch_rope(const GatherKvParams& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads * p.budget;
  simt::launch<cuda_detail::rope_rows_kernel<T, GatherDelta>>(
      cuda_detail::rope_rows_grid(rows), 256, 0, stream, static_cast<T*>(p.out_k.data), p.out_k.batch_stride, p.out_k.head_stride,
      p.out_k.token_stride, p.heads, p.budget, rows, cuda_detail::RopeArgs::from(p.rope),
      GatherDelta{p.keep_idx, p.heads, p.budget, p.length});
}

}  // namespace

Status gather_kv_cuda(const GatherKvParams& p, cudaStream_t stream) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (auto s = validate(p.rope, p.head_dim); s != Status::kOk) return s;
  const int64_t rows = p.batch * p.heads;
  if (rows == 0 || p.budget == 0) return Status::kOk;

  const int64_t element_size = dtype_size(p.dtype);
  const int vec_bytes = vector_bytes(p, element_size);
  const int64_t vecs_per_row = p.head_dim * element_size / vec_bytes;
  if (vecs_per_row > INT32_MAX) return Status::kUnsupportedHeadDim;
  int lanes_log2 = 0;
  while ((1 << lanes_log2) < kMaxLanes && (1 << lanes_log2) < vecs_per_row) ++lanes_log2;
  const int64_t tiles_per_row = ceil_div<int64_t>(p.budget, kBlock >> lanes_log2);
  if (rows * tiles_per_row > cuda_detail::kMaxGridBlocks) return Status::kInvalidArgument;

  const GatherArgs args{
      as_bytes(p.k, element_size),
      as_bytes(p.v, element_size),
      as_mutable_bytes(p.out_k, element_size),
      as_mutable_bytes(p.out_v, element_size),
      p.keep_idx,
      p.heads,
      p.length,
      p.budget,
      static_cast<int>(vecs_per_row),
      lanes_log2,
      static_cast<uint32_t>(tiles_per_row)};
  const auto blocks = static_cast<unsigned>(rows * tiles_per_row);
  switch (vec_bytes) {
    case 16: launch<16>(args, blocks, stream); break;
    case 8: launch<8>(args, blocks, stream); break;
    case 4: launch<4>(args, blocks, stream); break;
    case 2: launch<2>(args, blocks, stream); break;
    default: launch<1>(args, blocks, stream); break;
  }
  if (p.rope.rotary_dim > 0) {
    switch (p.dtype) {
      case DType::kFloat16: launch_rope<__half>(p, stream); break;
      case DType::kBFloat16: launch_rope<__nv_bfloat16>(p, stream); break;
      default: launch_rope<float>(p, stream); break;
    }
  }
  return cuda_detail::launch_status();
}

KVPRUNE_CUDA_NAMESPACE_END
