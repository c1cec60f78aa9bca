// CUDA compact_kv: in place, x[b,h,t] <- x[b,h,keep_idx[b,h,t]] for K and V, dense or
// paged (CompactKvParams).
//
// Each thread owns one vector (16, 8, 4, 2 or 1 bytes: the widest that divides the row
// size, the base addresses and every byte stride) of one (batch, head) row, in K and
// V, and walks that row's kept tokens in ascending order. Every read and write of a
// given vector of a row is made by the same thread, in program order, so the copies
// need no barrier: a position is overwritten only after the thread has read it.
// Within a step of kUnroll tokens all loads come before all stores; that is safe
// because step [t0, t0 + kUnroll) writes positions below t0 + kUnroll and reads
// positions >= t0, and its loads precede its stores. K/V are read with plain loads
// (not the read-only cache): the kernel writes them. keep_idx is trusted.
#include <cstdint>

#include "cuda/simt.cuh"
#include "core/validate.h"
#include "cuda/common.cuh"
#include "kvprune/kvprune.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace {

using cuda_detail::ceil_div;

constexpr int kBlock = 256;  // threads per CTA
constexpr int kUnroll = 8;   // tokens per step (loads in flight per thread)
constexpr int kMaxVecBytes = 16;
constexpr int kMinVecBytes = 1;  // fp8 rows may have an odd size

struct CompactArgs {
  MutableTokens k;           // in/out [batch, heads, length, head_dim], dense or paged
  MutableTokens v;           // in/out [batch, heads, length, head_dim], dense or paged
  int64_t element_size;      // bytes
  const int32_t* keep_idx;   // [rows, budget]
  int32_t* new_seq_lens;     // out [batch], or null
  int64_t rows;              // batch * heads
  int64_t heads;
  int64_t budget;
  int vecs_per_row;          // head_dim * element_size / sizeof(Vec)
};

template <typename Vec>
__global__ __launch_bounds__(kBlock) void compact_kv_kernel(CompactArgs a) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x;
  if (thread >= a.rows * a.vecs_per_row) return;
  const int64_t row = thread / a.vecs_per_row;
  const int u = static_cast<int>(thread % a.vecs_per_row);
  const int64_t b = row / a.heads, h = row % a.heads;
  const int32_t* idx = a.keep_idx + row * a.budget;
  // Vector u of token t of row (b, h) in x.
  const auto at = [&](const MutableTokens& x, int64_t t) {
    return reinterpret_cast<Vec*>(static_cast<char*>(x.data) + token_offset(x, b, h, t) * a.element_size) + u;
  };
  int64_t kept = 0;
  for (int64_t t0 = 0; t0 < a.budget; t0 += kUnroll) {
    int64_t src[kUnroll];
    Vec k_val[kUnroll];
    Vec v_val[kUnroll];
    bool done = false;
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t t = t0 + j;
      src[j] = (!done && t < a.budget) ? __ldg(idx + t) : -1;
      done = src[j] < 0;
      kept += done ? 0 : 1;
      if (!done && src[j] != t) {
        k_val[j] = *at(a.k, src[j]);
        v_val[j] = *at(a.v, src[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t t = t0 + j;
      if (src[j] >= 0 && src[j] != t) {
        *at(a.k, t) = k_val[j];
        *at(a.v, t) = v_val[j];
      }
    }
    if (done) break;
  }
  if (a.new_seq_lens != nullptr && h == 0 && u == 0) a.new_seq_lens[b] = static_cast<int32_t>(kept);
}

// Widest vector (bytes) dividing the row size, both base addresses and every stride.
int vector_bytes(const CompactKvParams& p, int64_t element_size) {
  uint64_t bits = static_cast<uint64_t>(p.head_dim * element_size);
  for (const MutableTokens* x : {&p.k, &p.v}) {
    bits |= reinterpret_cast<uintptr_t>(x->data);
    for (int64_t stride : {x->batch_stride, x->head_stride, x->token_stride, x->paged.block_stride})
      bits |= static_cast<uint64_t>(stride * element_size);
  }
  int bytes = kMaxVecBytes;
  while (bytes > kMinVecBytes && bits % bytes != 0) bytes /= 2;
  return bytes;
}

template <int kVecBytes>
void launch(const CompactArgs& args, unsigned blocks, cudaStream_t stream) {
  simt::launch<compact_kv_kernel<typename cuda_detail::VecOf<kVecBytes>::type>>(blocks, kBlock, 0,
                                                                               stream, args);
}

}  // namespace

Status compact_kv_cuda(const CompactKvParams& p, cudaStream_t stream) {
  if (auto s = validate(p); s != Status::kOk) return s;
  const int64_t rows = p.batch * p.heads;
  if (rows == 0) return Status::kOk;
  if (p.budget == 0) {  // nothing kept
    if (p.new_seq_lens != nullptr) {
      if (simt::memset_async(p.new_seq_lens, 0, p.batch * sizeof(int32_t), stream) != cudaSuccess)
        return Status::kCudaError;
    }
    return cuda_detail::launch_status();
  }
  const int64_t element_size = dtype_size(p.dtype);
  const int vec_bytes = vector_bytes(p, element_size);
  const int64_t vecs_per_row = p.head_dim * element_size / vec_bytes;
  if (vecs_per_row > INT32_MAX) return Status::kUnsupportedHeadDim;
  const int64_t blocks = ceil_div<int64_t>(rows * vecs_per_row, kBlock);
  if (blocks > cuda_detail::kMaxGridBlocks) return Status::kInvalidArgument;
  const CompactArgs args{p.k, p.v, element_size, p.keep_idx, p.new_seq_lens, rows, p.heads,
                         p.budget, static_cast<int>(vecs_per_row)};
  switch (vec_bytes) {
    case 16: launch<16>(args, static_cast<unsigned>(blocks), stream); break;
    case 8: launch<8>(args, static_cast<unsigned>(blocks), stream); break;
    case 4: launch<4>(args, static_cast<unsigned>(blocks), stream); break;
    case 2: launch<2>(args, static_cast<unsigned>(blocks), stream); break;
    default: launch<1>(args, static_cast<unsigned>(blocks), stream); break;
  }
  return cuda_detail::launch_status();
}

KVPRUNE_CUDA_NAMESPACE_END
