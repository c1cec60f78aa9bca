// CUDA decode_scores: decode attention probabilities over the fixed-capacity cache,
// accumulated into the H2O scores, optionally with the attention output.
//
// The capacity is split into chunks of kChunk slots so that B*Hkv*chunks CTAs
// share the work (a decode step has few (batch, KV head) rows):
//   1. partial_kernel  (per row, chunk): fp32 logits of the G*T query rows of the KV
//      head for its slots -> workspace; per-chunk max m and sum l of exp(logit - m);
//      with V, the per-chunk unnormalised output sum_s exp(logit - m) v[s].
//   2. scores_kernel   (per row, chunk): combines the chunk (m, l) into the softmax
//      normaliser, turns its logits into probabilities and adds the GQA-reduced
//      sum over the T queries to h2o_scores (each slot owned by one thread).
//   3. output_kernel   (per row, with V): rescales and sums the chunk outputs.
// Workspace (floats): logits [rows, R, C] | m, l [rows, chunks, R] each |
// out partials [rows, chunks, R, D] (with V), R = G*T <= 32, D <= 256.
#include <cmath>
#include <cstdint>

#include "cuda/simt.cuh"
#include "core/validate_decode.h"
#include "cuda/common.cuh"
#include "cuda/rope.cuh"
#include "kvprune/kvprune.h"

KVPRUNE_CUDA_NAMESPACE_BEGIN
namespace {

using cuda_detail::from_float;
using cuda_detail::to_float;

// ---- heuristics ---------------------------------------------------------------------
constexpr int kBlock = 128;     // 4 warps
constexpr int kWarps = kBlock / 32;
constexpr int64_t kChunk = 128; // slots per CTA
constexpr int kMaxRows = 32;    // G * T
constexpr int kMaxPerLane = 8;  // head_dim <= 256

struct Layout {
  int64_t rows, chunks, R;
  size_t logits, m, l, acc, total;  // float offsets / count
};

Layout layout_of(const DecodeScoresParams& p) {
  Layout L;
  L.rows = p.batch * p.kv_heads;
  L.chunks = cuda_detail::ceil_div<int64_t>(p.capacity, kChunk);
  L.R = p.q_heads / p.kv_heads * p.num_q;
  L.logits = 0;
  L.m = L.logits + static_cast<size_t>(L.rows * L.R * p.capacity);
  L.l = L.m + static_cast<size_t>(L.rows * L.chunks * L.R);
  L.acc = L.l + static_cast<size_t>(L.rows * L.chunks * L.R);
  L.total = L.acc + (p.v_cache.data != nullptr ? static_cast<size_t>(L.rows * L.chunks * L.R * p.head_dim) : 0);
  return L;
}

struct Args {
  DecodeScoresParams p;
  float* logits;  // [rows, R, C]
  float* part_m;  // [rows, chunks, R]
  float* part_l;  // [rows, chunks, R]
  float* part_acc;  // [rows, chunks, R, D] or null
  int64_t chunks;
  int R;
  int group;
};

template <typename T>
__device__ __forceinline__ const T* token(const ConstTokens& t, int64_t b, int64_t h, int64_t i) {
  return static_cast<const T*>(t.data) + b * t.batch_stride + h * t.head_stride + i * t.token_stride;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <typename T>
__global__ __launch_bounds__(kBlock) void partial_kernel(Args a) {
  float* const q_smem = simt::dynamic_shared<float>();  // [R, D] fp32
  KVPRUNE_SHARED(float, row_m, [kMaxRows]);
  const DecodeScoresParams& p = a.p;
  const int64_t row = blockIdx.x / a.chunks, chunk = blockIdx.x % a.chunks;
  const int64_t b = row / p.kv_heads, g = row % p.kv_heads;
  const int64_t s0 = chunk * kChunk, s1 = min(s0 + kChunk, p.capacity);
  const int D = static_cast<int>(p.head_dim), Tq = static_cast<int>(p.num_q);
  const int64_t C = p.capacity;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = cuda_detail::valid_length(p.seq_lens, b, INT64_MAX);
  const float kNegInf = -INFINITY;

  for (int i = threadIdx.x; i < a.R * D; i += kBlock) {
    const int r = i / D, d = i % D;
    q_smem[i] = to_float(token<T>(p.q, b, g * a.group + r / Tq, r % Tq)[d]);
  }
  __syncthreads();

  float* logits = a.logits + row * a.R * C;  // [R, C]
  const int32_t* slot_pos = p.slot_pos + row * C;
  for (int64_t s = s0 + warp; s < s1; s += kWarps) {  // one warp per slot
    const int64_t sp = __ldg(slot_pos + s);
    if (sp < 0) {
      for (int r = lane; r < a.R; r += 32) logits[r * C + s] = kNegInf;
      continue;
    }
    const T* k = token<T>(p.k_cache, b, g, s);
    float kreg[kMaxPerLane];
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int d = lane + 32 * i;
      kreg[i] = d < D ? to_float(k[d]) : 0.f;
    }
    for (int r = 0; r < a.R; ++r) {
      const float* qr = q_smem + r * D;
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < D) dot = fmaf(kreg[i], qr[d], dot);
      }
      dot = warp_sum(dot);
      if (lane == 0) logits[r * C + s] = sp <= n - Tq + r % Tq ? dot * p.scale : kNegInf;
    }
  }
  __syncthreads();  // the chunk's logits (global, written by this CTA) are visible

  for (int r = warp; r < a.R; r += kWarps) {
    float m = kNegInf;
    for (int64_t s = s0 + lane; s < s1; s += 32) m = fmaxf(m, logits[r * C + s]);
    m = warp_max(m);
    float l = 0.f;
    if (m != kNegInf)
      for (int64_t s = s0 + lane; s < s1; s += 32) l += __expf(logits[r * C + s] - m);
    l = warp_sum(l);
    if (lane == 0) {
      a.part_m[(row * a.chunks + chunk) * a.R + r] = m;
      a.part_l[(row * a.chunks + chunk) * a.R + r] = l;
      row_m[r] = m;
    }
  }
  if (a.part_acc == nullptr) return;
  __syncthreads();
  for (int r = 0; r < a.R; ++r) {
    const float m = row_m[r];
    for (int d = threadIdx.x; d < D; d += kBlock) {
      float acc = 0.f;
      if (m != kNegInf) {
        for (int64_t s = s0; s < s1; ++s) {
          const float w = __expf(logits[r * C + s] - m);
          if (w != 0.f) acc = fmaf(w, to_float(token<T>(p.v_cache, b, g, s)[d]), acc);
        }
      }
      a.part_acc[((row * a.chunks + chunk) * a.R + r) * D + d] = acc;
    }
  }
}

// Softmax normaliser of each of the R rows of `row` from the chunk partials:
// m_out = global max, inv_out = 1 / sum (0 when the row sees no slot).
__device__ __forceinline__ void combine_rows(const Args& a, int64_t row, float* m_out, float* inv_out) {
  const float kNegInf = -INFINITY;
  for (int r = threadIdx.x; r < a.R; r += blockDim.x) {
    float m = kNegInf;
    for (int64_t c = 0; c < a.chunks; ++c) m = fmaxf(m, a.part_m[(row * a.chunks + c) * a.R + r]);
    float l = 0.f;
    if (m != kNegInf)
      for (int64_t c = 0; c < a.chunks; ++c) {
        const float mc = a.part_m[(row * a.chunks + c) * a.R + r];
        if (mc != kNegInf) l += a.part_l[(row * a.chunks + c) * a.R + r] * __expf(mc - m);
      }
    m_out[r] = m;
    inv_out[r] = l > 0.f ? 1.f / l : 0.f;
  }
}

__global__ __launch_bounds__(kBlock) void scores_kernel(Args a) {
  KVPRUNE_SHARED(float, row_m, [kMaxRows]);
  KVPRUNE_SHARED(float, row_inv, [kMaxRows]);
  const DecodeScoresParams& p = a.p;
  const int64_t row = blockIdx.x / a.chunks, chunk = blockIdx.x % a.chunks;
  const int64_t C = p.capacity;
  const int T = static_cast<int>(p.num_q);
  combine_rows(a, row, row_m, row_inv);
  __syncthreads();
  const float* logits = a.logits + row * a.R * C;
  float* scores = p.h2o_scores + row * C;
  const float weight = p.reduce == GqaReduce::kMean ? 1.f / static_cast<float>(a.group) : 1.f;
  const int64_t s1 = min((chunk + 1) * kChunk, C);
  for (int64_t s = chunk * kChunk + threadIdx.x; s < s1; s += kBlock) {
    float acc = 0.f;
    for (int i = 0; i < a.group; ++i) {
      float v = 0.f;
      for (int t = 0; t < T; ++t) {
        const int r = i * T + t;
        if (row_inv[r] != 0.f) v += __expf(logits[r * C + s] - row_m[r]) * row_inv[r];
      }
      acc = p.reduce == GqaReduce::kMax ? (i == 0 ? v : fmaxf(acc, v)) : fmaf(v, weight, acc);
    }
    scores[s] += acc;
  }
}

template <typename T>
__global__ __launch_bounds__(kBlock) void output_kernel(Args a) {
  KVPRUNE_SHARED(float, row_m, [kMaxRows]);
  KVPRUNE_SHARED(float, row_inv, [kMaxRows]);
  const float kNegInf = -INFINITY;
  const DecodeScoresParams& p = a.p;
  const int64_t row = blockIdx.x;
  const int64_t b = row / p.kv_heads, g = row % p.kv_heads;
  const int D = static_cast<int>(p.head_dim), Tq = static_cast<int>(p.num_q);
  combine_rows(a, row, row_m, row_inv);
  __syncthreads();
  for (int i = threadIdx.x; i < a.R * D; i += kBlock) {
    const int r = i / D, d = i % D;
    float sum = 0.f;
    if (row_inv[r] != 0.f)
      for (int64_t c = 0; c < a.chunks; ++c) {
        const float mc = a.part_m[(row * a.chunks + c) * a.R + r];
        if (mc != kNegInf) sum += a.part_acc[((row * a.chunks + c) * a.R + r) * D + d] * __expf(mc - row_m[r]);
      }
    T* out = static_cast<T*>(p.out.data) + b * p.out.batch_stride +
             (g * a.group + r / Tq) * p.out.head_stride + (r % Tq) * p.out.token_stride;
    out[d] = from_float<T>(sum * row_inv[r]);
  }
}

template <typename T>
void launch(const Args& a, int64_t rows, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(rows * a.chunks);
  const size_t smem = static_cast<size_t>(a.R * a.p.head_dim) * sizeof(float);
  if (blocks > 0) {
    simt::launch<partial_kernel<T>>(blocks, kBlock, smem, stream, a);
    if (a.p.h2o_scores != nullptr) simt::launch<scores_kernel>(blocks, kBlock, 0, stream, a);
  }
  if (a.p.v_cache.data != nullptr)  // with capacity 0 it writes zero rows from no partials
    simt::launch<output_kernel<T>>(static_cast<unsigned>(rows), kBlock, 0, stream, a);
}

}  // namespace

size_t decode_scores_workspace_bytes_cuda(const DecodeScoresParams& p) {
  if (validate_sizes(p) != Status::kOk) return 0;
  return layout_of(p).total * sizeof(float);
}

Status decode_scores_cuda(const DecodeScoresParams& p, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  if (auto s = validate(p); s != Status::kOk) return s;
  const Layout L = layout_of(p);
  if (L.rows * p.capacity == 0 && p.v_cache.data == nullptr) return Status::kOk;
  if (p.head_dim > 32 * kMaxPerLane || L.R > kMaxRows) return Status::kUnsupportedHeadDim;
  // capacity 0 with V needs no workspace (the query returns 0): null is fine then.
  if (workspace_bytes < L.total * sizeof(float) || (L.total > 0 && workspace == nullptr))
    return Status::kWorkspaceTooSmall;
  if (L.rows * std::max<int64_t>(L.chunks, 1) > cuda_detail::kMaxGridBlocks) return Status::kInvalidArgument;
  if (L.rows == 0) return Status::kOk;
  float* ws = static_cast<float*>(workspace);
  Args a{p, ws + L.logits, ws + L.m, ws + L.l, p.v_cache.data != nullptr ? ws + L.acc : nullptr,
         L.chunks, static_cast<int>(L.R), static_cast<int>(p.q_heads / p.kv_heads)};
  // capacity 0: no partials; output_kernel alone writes zero rows.
  switch (p.dtype) {
    case DType::kFloat16: launch<__half>(a, L.rows, stream); break;
    case DType::kBFloat16: launch<__nv_bfloat16>(a, L.rows, stream); break;
    default: launch<float>(a, L.rows, stream); break;
  }
  return cuda_detail::launch_status();
}

KVPRUNE_CUDA_NAMESPACE_END
