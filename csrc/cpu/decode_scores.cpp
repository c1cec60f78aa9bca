// CPU decode_scores: decode attention probabilities over the fixed-capacity cache,
// accumulated into the H2O scores, optionally with the attention output.
// One task per (batch, KV head): its G*T query rows against the capacity slots.
// K and V rows are converted to fp32 once per task and reused by all G*T rows;
// everything accumulates in fp32. Per-worker workspace (floats):
//   logits [G*T, C] | head sums [C] | q [G*T, D] | out acc [G*T, D] | row [D]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/validate_decode.h"
#include "cpu/parallel.h"
#include "cpu/rope.h"
#include "kvprune/kvprune.h"

namespace kvprune {
namespace {

size_t worker_floats(const DecodeScoresParams& p) {
  const int64_t rows = p.q_heads / p.kv_heads * p.num_q;
  return static_cast<size_t>(rows * p.capacity + p.capacity + 2 * rows * p.head_dim + p.head_dim);
}

// Loads one stored row [D] of `dtype` as fp32.
void load_row(const void* src, DType dtype, int64_t dims, float* dst) {
  switch (dtype) {
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t d = 0; d < dims; ++d) dst[d] = cpu::bf16_to_float(s[d]);
      break;
    }
    case DType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t d = 0; d < dims; ++d) dst[d] = cpu::fp16_to_float(s[d]);
      break;
    }
    default: std::memcpy(dst, src, static_cast<size_t>(dims) * sizeof(float)); break;
  }
}

// fp32 dot product with 8 independent partial sums (vectorisable without -ffast-math).
float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

const char* token_ptr(const ConstTokens& t, int64_t b, int64_t h, int64_t i, int64_t elem) {
  return static_cast<const char*>(t.data) + (b * t.batch_stride + h * t.head_stride + i * t.token_stride) * elem;
}

void score_group(const DecodeScoresParams& p, int64_t b, int64_t g, float* ws) {
  const int64_t group = p.q_heads / p.kv_heads, T = p.num_q, C = p.capacity, D = p.head_dim;
  const int64_t rows = group * T;  // row r = (head i = r / T, query t = r % T)
  const int64_t elem = dtype_size(p.dtype);
  float* logits = ws;                    // [rows, C]
  float* head_sum = logits + rows * C;   // [C]
  float* qf = head_sum + C;              // [rows, D]
  float* acc = qf + rows * D;            // [rows, D]
  float* kv_row = acc + rows * D;        // [D]
  const int32_t* slot_pos = p.slot_pos + (b * p.kv_heads + g) * C;
  const int64_t n = p.seq_lens[b];

  for (int64_t r = 0; r < rows; ++r)
    load_row(token_ptr(p.q, b, g * group + r / T, r % T, elem), p.dtype, D, qf + r * D);

  // Logits over visible slots (-inf elsewhere).
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < C; ++s) {
    const int64_t sp = slot_pos[s];
    if (sp < 0) {
      for (int64_t r = 0; r < rows; ++r) logits[r * C + s] = kNegInf;
      continue;
    }
    load_row(token_ptr(p.k_cache, b, g, s, elem), p.dtype, D, kv_row);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t qpos = n - T + r % T;
      logits[r * C + s] = sp <= qpos ? dot(qf + r * D, kv_row, D) * p.scale : kNegInf;
    }
  }
  // Softmax per row, in place: logits -> probabilities (rows that see nothing -> 0).
  for (int64_t r = 0; r < rows; ++r) {
    float* l = logits + r * C;
    float mx = kNegInf;
    for (int64_t s = 0; s < C; ++s) mx = std::max(mx, l[s]);
    if (mx == kNegInf) {
      std::fill(l, l + C, 0.f);
      continue;
    }
    float sum = 0.f;
    for (int64_t s = 0; s < C; ++s) {
      l[s] = std::exp(l[s] - mx);
      sum += l[s];
    }
    const float inv = 1.f / sum;
    for (int64_t s = 0; s < C; ++s) l[s] *= inv;
  }
  // H2O scores: per head sum over its T queries, reduced over the group.
  if (p.h2o_scores != nullptr) {
    float* scores = p.h2o_scores + (b * p.kv_heads + g) * C;
    const float weight = p.reduce == GqaReduce::kMean ? 1.f / static_cast<float>(group) : 1.f;
    for (int64_t s = 0; s < C; ++s) head_sum[s] = 0.f;
    for (int64_t i = 0; i < group; ++i) {
      for (int64_t s = 0; s < C; ++s) {
        float v = 0.f;
        for (int64_t t = 0; t < T; ++t) v += logits[(i * T + t) * C + s];
        head_sum[s] = p.reduce == GqaReduce::kMax ? (i == 0 ? v : std::max(head_sum[s], v))
                                                  : head_sum[s] + v * weight;
      }
    }
    for (int64_t s = 0; s < C; ++s) scores[s] += head_sum[s];
  }
  // Attention output: sum_s a[r,s] v[s], V read once.
  if (p.v_cache.data != nullptr) {
    std::fill(acc, acc + rows * D, 0.f);
    for (int64_t s = 0; s < C; ++s) {
      if (slot_pos[s] < 0) continue;
      bool any = false;
      for (int64_t r = 0; r < rows; ++r) any |= logits[r * C + s] != 0.f;
      if (!any) continue;
      load_row(token_ptr(p.v_cache, b, g, s, elem), p.dtype, D, kv_row);
      for (int64_t r = 0; r < rows; ++r) {
        const float a = logits[r * C + s];
        float* o = acc + r * D;
        for (int64_t d = 0; d < D; ++d) o[d] += a * kv_row[d];
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      char* out = static_cast<char*>(p.out.data) +
                  (b * p.out.batch_stride + (g * group + r / T) * p.out.head_stride +
                   (r % T) * p.out.token_stride) * elem;
      for (int64_t d = 0; d < D; ++d) cpu::store_from_float(out, d, p.dtype, acc[r * D + d]);
    }
  }
}

}  // namespace

size_t decode_scores_workspace_bytes_cpu(const DecodeScoresParams& p, const CpuExecutor& exec) {
  if (validate_sizes(p) != Status::kOk) return 0;
  return worker_floats(p) * sizeof(float) * static_cast<size_t>(cpu::num_workers(exec));
}

Status decode_scores_cpu(const DecodeScoresParams& p, void* workspace, size_t workspace_bytes,
                         const CpuExecutor& exec) {
  if (auto s = validate(p); s != Status::kOk) return s;
  for (int64_t b = 0; b < p.batch; ++b)
    if (p.seq_lens[b] < 0) return Status::kInvalidArgument;
  const int64_t tasks = p.batch * p.kv_heads;
  if (tasks == 0) return Status::kOk;
  if (workspace_bytes < decode_scores_workspace_bytes_cpu(p, exec) || workspace == nullptr)
    return Status::kWorkspaceTooSmall;
  const size_t per_worker = worker_floats(p);
  cpu::parallel_for(exec, tasks, 1, [&](int64_t begin, int64_t end, int worker) {
    float* ws = static_cast<float*>(workspace) + static_cast<size_t>(worker) * per_worker;
    for (int64_t task = begin; task < end; ++task) score_group(p, task / p.kv_heads, task % p.kv_heads, ws);
  });
  return Status::kOk;
}

}  // namespace kvprune
