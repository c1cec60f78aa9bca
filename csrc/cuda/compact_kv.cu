// CUDA compact_kv: in place, x[b,h,t] <- x[b,h,keep_idx[b,h,t]] for K and V, dense or
// paged (CompactKvParams).
//
// Rows split into vectors (16, 8, 4, 2 or 1 bytes: the widest that divides the row size,
// the base addresses and every byte stride). Vector columns never touch each other, so
// each CTA owns one (batch, head) row and a group of kGroupBytes-wide columns of it, and
// moves that row's kept tokens in waves of kBlock * kUnroll / group tokens: every thread
// loads its part of the wave, the CTA meets at a barrier, then every thread stores.
// Why waves in order are safe: keep_idx is strictly ascending, so keep_idx[t] >= t and a
// wave over tokens [t0, t1) reads positions >= t0 and writes positions [t0, t1). Earlier
// waves wrote below t0 (never a later read) and read positions that this wave may
// overwrite, but they read them before this wave's barrier; later waves read at or after
// t1. K/V are read with plain loads (not the read-only cache): the kernel writes them.
// keep_idx is trusted.
#include <cstdint>
#include <type_traits>

#include "cuda/simt.cuh"
#include "core/validate.h"
#include "cuda/common.cuh"
#include "kvprune/kvprune.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace {

using cuda_detail::ceil_div;

constexpr int kBlock = 256;       // threads per CTA
constexpr int kUnroll = 8;        // vectors per thread per wave (loads in flight)
constexpr int kGroupBytes = 32;   // bytes of a row per CTA: one DRAM sector
constexpr int kMaxVecBytes = 16;
constexpr int kMinVecBytes = 1;   // fp8 rows may have an odd size

struct CompactArgs {
  MutableTokens k;           // in/out [batch, heads, length, head_dim], dense or paged
  MutableTokens v;           // in/out [batch, heads, length, head_dim], dense or paged
  int64_t element_size;      // bytes
  const int32_t* keep_idx;   // [rows, budget]
  int32_t* new_seq_lens;     // out [batch], or null
  int64_t heads;
  int64_t budget;
  int vecs_per_row;          // head_dim * element_size / sizeof(Vec)
  int group_shift;           // log2(vectors per CTA); a row's last group may be short
  int groups_per_row;        // ceil(vecs_per_row / group)
};

template <typename Vec>
__global__ __launch_bounds__(kBlock) void compact_kv_kernel(CompactArgs a) {
  using Reg = std::conditional_t<(sizeof(Vec) < 4), unsigned int, Vec>;  // no byte registers
  const int64_t row = blockIdx.x / a.groups_per_row;
  const int first_vec = static_cast<int>(blockIdx.x % a.groups_per_row) << a.group_shift;
  const int group_mask = (1 << a.group_shift) - 1;
  const int64_t b = row / a.heads, h = row % a.heads;
  const int32_t* idx = a.keep_idx + row * a.budget;
  const int64_t wave = (kBlock * kUnroll) >> a.group_shift;  // tokens per wave
  // Vector u of token t of row (b, h) in x.
  const auto at = [&](const MutableTokens& x, int64_t t, int u) {
    return reinterpret_cast<Vec*>(static_cast<char*>(x.data) + token_offset(x, b, h, t) * a.element_size) + u;
  };
  // kept = the first padded slot (idx ascends, then -1s): a binary search by one thread,
  // shared, so that the CTA moves exactly the tokens below the count it reports.
  KVPRUNE_SHARED(int64_t, kept_shared, [1]);
  if (threadIdx.x == 0) {
    int64_t lo = 0, hi = a.budget;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (__ldg(idx + mid) >= 0) lo = mid + 1; else hi = mid;
    }
    kept_shared[0] = lo;
  }
  __syncthreads();
  const int64_t kept = kept_shared[0];
  // The wave's items j = threadIdx.x + i * kBlock: token t0 + j / group, vector j % group.
  for (int64_t t0 = 0; t0 < kept; t0 += wave) {  // CTA-uniform
    int32_t src[kUnroll];
    Reg k_val[kUnroll];
    Reg v_val[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int j = threadIdx.x + i * kBlock;
      const int64_t t = t0 + (j >> a.group_shift);
      const int u = first_vec + (j & group_mask);
      src[i] = (t < kept && u < a.vecs_per_row) ? __ldg(idx + t) : -1;
      if (src[i] >= 0 && src[i] != t) {
        k_val[i] = *at(a.k, src[i], u);
        v_val[i] = *at(a.v, src[i], u);
      }
    }
    __syncthreads();  // every read of the wave happens before any write of it
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int j = threadIdx.x + i * kBlock;
      const int64_t t = t0 + (j >> a.group_shift);
      const int u = first_vec + (j & group_mask);
      if (src[i] >= 0 && src[i] != t) {
        *at(a.k, t, u) = static_cast<Vec>(k_val[i]);
        *at(a.v, t, u) = static_cast<Vec>(v_val[i]);
      }
    }
  }
  if (a.new_seq_lens != nullptr && h == 0 && first_vec == 0 && threadIdx.x == 0)
    a.new_seq_lens[b] = static_cast<int32_t>(kept);
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
  if (p.batch == 0) return Status::kOk;
  if (p.heads == 0 || p.budget == 0) {  // nothing kept: every row's new length is 0
    if (p.new_seq_lens != nullptr) {
      if (simt::memset_async(p.new_seq_lens, 0, p.batch * sizeof(int32_t), stream) != cudaSuccess)
        return Status::kCudaError;
    }
    return cuda_detail::launch_status();
  }
  const int64_t element_size = dtype_size(p.dtype);
  const int vec_bytes = vector_bytes(p, element_size);
  const int64_t vecs_per_row = p.head_dim * element_size / vec_bytes;
  if (vecs_per_row > INT32_MAX - kGroupBytes) return Status::kUnsupportedHeadDim;
  int group_shift = 0;  // groups of kGroupBytes (a power of two), or of the whole row if shorter
  while ((vec_bytes << group_shift) < kGroupBytes && (int64_t{1} << group_shift) < vecs_per_row) ++group_shift;
  const int64_t groups_per_row = ceil_div<int64_t>(vecs_per_row, int64_t{1} << group_shift);
  const int64_t blocks = p.batch * p.heads * groups_per_row;
  if (blocks > cuda_detail::kMaxGridBlocks) return Status::kInvalidArgument;
  const CompactArgs args{p.k, p.v, element_size, p.keep_idx, p.new_seq_lens, p.heads, p.budget,
                         static_cast<int>(vecs_per_row), group_shift,
                         static_cast<int>(groups_per_row)};
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
