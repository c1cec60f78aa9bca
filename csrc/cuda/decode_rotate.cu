// CUDA rerotate_keys: k[b,h,s,:] rotated in place from old_pos[b,h,s] to
// new_pos[b,h,s]; negative positions are skipped. One warp per token row.
#include <cstdint>

#include "cuda/simt.cuh"
#include "core/validate_decode.h"
#include "cuda/common.cuh"
#include "cuda/rope.cuh"
#include "kvprune/kvprune.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace {

// Delta of one row from the two strided position tensors [batch, heads, length].
struct PositionDelta {
  const int32_t* old_pos;
  int64_t old_b, old_h;
  const int32_t* new_pos;
  int64_t new_b, new_h;

  __device__ __forceinline__ bool operator()(int64_t b, int64_t h, int64_t t, int64_t* delta) const {
    const int64_t o = __ldg(old_pos + b * old_b + h * old_h + t);
    const int64_t n = __ldg(new_pos + b * new_b + h * new_h + t);
    *delta = n - o;
    return o >= 0 && n >= 0;
  }
};

template <typename T>
void launch(const RerotateKeysParams& p, int64_t rows, cudaStream_t stream) {
  const PositionDelta delta{p.old_pos, p.old_pos_batch_stride, p.old_pos_head_stride,
                            p.new_pos, p.new_pos_batch_stride, p.new_pos_head_stride};
  simt::launch<cuda_detail::rope_rows_kernel<T, PositionDelta>>(
      cuda_detail::rope_rows_grid(rows), 256, 0, stream,
      static_cast<T*>(p.k.data), p.k.batch_stride, p.k.head_stride, p.k.token_stride, p.heads,
      p.length, rows, cuda_detail::RopeArgs::from(p.rope), delta);
}

}  // namespace

Status rerotate_keys_cuda(const RerotateKeysParams& p, cudaStream_t stream) {
  if (auto s = validate(p); s != Status::kOk) return s;
  const int64_t rows = p.batch * p.heads * p.length;
  if (rows == 0) return Status::kOk;
  switch (p.dtype) {
    case DType::kFloat16: launch<__half>(p, rows, stream); break;
    case DType::kBFloat16: launch<__nv_bfloat16>(p, rows, stream); break;
    default: launch<float>(p, rows, stream); break;
  }
  return cuda_detail::launch_status();
}

KVPRUNE_CUDA_NAMESPACE_END
