// CUDA streaming_append: one warp per new token (batch, head, t) copies its K and
// V rows into the destination slot (in order, StreamingLLM ring, or H2O slots) and
// records slot_pos; a second tiny kernel then advances seq_lens (stream order
// makes every copy read the old length first). Negative seq_lens count as 0.
#include <cstdint>

#include "cuda/simt.cuh"
#include "core/validate_decode.h"
#include "cuda/common.cuh"
#include "kvprune/kvprune.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace {

constexpr int kBlock = 256;  // 8 warps, one token each

struct AppendArgs {
  char* k_cache;  // bytes; [batch, heads, capacity, head_dim]
  char* v_cache;
  int64_t kc_b, kc_h, kc_t, vc_b, vc_h, vc_t;  // byte strides
  const char* k_new;  // bytes; [batch, heads, num_new, head_dim]
  const char* v_new;
  int64_t kn_b, kn_h, kn_t, vn_b, vn_h, vn_t;  // byte strides
  int32_t* slot_pos;        // [batch, heads, capacity]
  const int32_t* seq_lens;  // [batch]
  const int32_t* slots;     // [batch, heads, num_new] or null
  int64_t heads, capacity, num_new, n_sink, tokens;  // tokens = batch * heads * num_new
  int vecs_per_row;
};

// Same rule as the CPU kernel (decode_params.h): -1 = not written.
__device__ __forceinline__ int64_t append_slot(const AppendArgs& a, const int32_t* row_slots,
                                               int64_t first, int64_t pos, int64_t t) {
  const int64_t ring = a.capacity - a.n_sink;
  if (pos < a.capacity && row_slots == nullptr) {
    if (pos >= a.n_sink && pos + ring < first + a.num_new) return -1;
    return pos;
  }
  if (row_slots == nullptr) {
    if (pos + ring < first + a.num_new) return -1;
    return a.n_sink + (pos - a.n_sink) % ring;
  }
  if (pos < a.capacity) return pos;
  const int64_t slot = __ldg(row_slots + t);
  return slot >= 0 && slot < a.capacity ? slot : -1;
}

template <typename Vec>
__global__ __launch_bounds__(kBlock) void append_kernel(AppendArgs a) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * (kBlock / 32) + (threadIdx.x >> 5);
  if (token >= a.tokens) return;
  const int lane = threadIdx.x & 31;
  const int64_t row = token / a.num_new, t = token % a.num_new;
  const int64_t b = row / a.heads, h = row % a.heads;
  const int64_t first = max(__ldg(a.seq_lens + b), 0);
  const int32_t* row_slots = a.slots != nullptr ? a.slots + row * a.num_new : nullptr;
  const int64_t slot = append_slot(a, row_slots, first, first + t, t);
  if (slot < 0) return;
  const Vec* ks = reinterpret_cast<const Vec*>(a.k_new + b * a.kn_b + h * a.kn_h + t * a.kn_t);
  const Vec* vs = reinterpret_cast<const Vec*>(a.v_new + b * a.vn_b + h * a.vn_h + t * a.vn_t);
  Vec* kd = reinterpret_cast<Vec*>(a.k_cache + b * a.kc_b + h * a.kc_h + slot * a.kc_t);
  Vec* vd = reinterpret_cast<Vec*>(a.v_cache + b * a.vc_b + h * a.vc_h + slot * a.vc_t);
#pragma unroll 1
  for (int i = lane; i < a.vecs_per_row; i += 32) {
    kd[i] = __ldg(ks + i);
    vd[i] = __ldg(vs + i);
  }
  if (lane == 0) a.slot_pos[row * a.capacity + slot] = static_cast<int32_t>(first + t);
}

__global__ void advance_kernel(int32_t* seq_lens, int64_t batch, int64_t num_new) {
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < batch;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x)
    seq_lens[b] = static_cast<int32_t>(max(seq_lens[b], 0) + num_new);
}

// Widest vector (bytes) dividing the row size, every base address and byte stride.
int vector_bytes(const StreamingAppendParams& p, int64_t elem) {
  uint64_t bits = static_cast<uint64_t>(p.head_dim * elem);
  for (const void* ptr : {static_cast<const void*>(p.k_cache.data), static_cast<const void*>(p.v_cache.data),
                          p.k_new.data, p.v_new.data})
    bits |= reinterpret_cast<uintptr_t>(ptr);
  for (int64_t s : {p.k_cache.batch_stride, p.k_cache.head_stride, p.k_cache.token_stride,
                    p.v_cache.batch_stride, p.v_cache.head_stride, p.v_cache.token_stride,
                    p.k_new.batch_stride, p.k_new.head_stride, p.k_new.token_stride,
                    p.v_new.batch_stride, p.v_new.head_stride, p.v_new.token_stride})
    bits |= static_cast<uint64_t>(s * elem);
  int bytes = 16;
  while (bytes > 2 && bits % bytes != 0) bytes /= 2;
  return bytes;
}

template <int kVecBytes>
void launch(const AppendArgs& a, unsigned blocks, cudaStream_t stream) {
  simt::launch<append_kernel<typename cuda_detail::VecOf<kVecBytes>::type>>(blocks, kBlock, 0, stream, a);
}

}  // namespace

Status streaming_append_cuda(const StreamingAppendParams& p, cudaStream_t stream) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (p.batch == 0) return Status::kOk;
  const int64_t elem = dtype_size(p.dtype);
  const int64_t tokens = p.batch * p.kv_heads * p.num_new;
  if (tokens > 0) {
    const int vec = vector_bytes(p, elem);
    const int64_t vecs = p.head_dim * elem / vec;
    const int64_t blocks = cuda_detail::ceil_div<int64_t>(tokens, kBlock / 32);
    if (vecs > INT32_MAX || blocks > cuda_detail::kMaxGridBlocks) return Status::kInvalidArgument;
    const AppendArgs a{static_cast<char*>(p.k_cache.data), static_cast<char*>(p.v_cache.data),
                       p.k_cache.batch_stride * elem, p.k_cache.head_stride * elem,
                       p.k_cache.token_stride * elem, p.v_cache.batch_stride * elem,
                       p.v_cache.head_stride * elem, p.v_cache.token_stride * elem,
                       static_cast<const char*>(p.k_new.data), static_cast<const char*>(p.v_new.data),
                       p.k_new.batch_stride * elem, p.k_new.head_stride * elem,
                       p.k_new.token_stride * elem, p.v_new.batch_stride * elem,
                       p.v_new.head_stride * elem, p.v_new.token_stride * elem,
                       p.slot_pos, p.seq_lens, p.slots, p.kv_heads, p.capacity, p.num_new,
                       p.n_sink, tokens, static_cast<int>(vecs)};
    const auto grid = static_cast<unsigned>(blocks);
    switch (vec) {
      case 16: launch<16>(a, grid, stream); break;
      case 8: launch<8>(a, grid, stream); break;
      case 4: launch<4>(a, grid, stream); break;
      default: launch<2>(a, grid, stream); break;
    }
  }
  const auto grid = static_cast<unsigned>(std::min<int64_t>(cuda_detail::ceil_div<int64_t>(p.batch, 256), 1024));
  simt::launch<advance_kernel>(grid, 256, 0, stream, p.seq_lens, p.batch, p.num_new);
  return cuda_detail::launch_status();
}

KVPRUNE_CUDA_NAMESPACE_END
