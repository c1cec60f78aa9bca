// CUDA compact_kv: in place, x[b,h,t] <- x[b,h,keep_idx[b,h,t]] for K and V, dense or
// paged (CompactKvParams). Two launches:
//  1. count_kept_kernel, one CTA per (batch, head) row: kept = the position of the row's
//     first -1 (or budget) into the workspace and new_seq_lens; it also clears the row's
//     flags and (CTA 0) the part counter of launch 2.
//  2. move_kept_kernel: rows split into vectors (16, 8, 4, 2 or 1 bytes: the widest that
//     divides the row size, the base addresses and every byte stride) and the vectors into
//     column groups of kGroupBytes (columns never touch each other); a group's kept tokens
//     into slabs of kBlock * kUnroll / group tokens. One CTA per part (slab, row, group):
//     it loads the slab's sources into registers, meets at a barrier, sets the part's
//     flag, waits for the flags of the group's earlier slabs, meets again, then stores.
// Why this is safe: keep_idx is strictly ascending, so keep_idx[t] >= t and slab s, over
// tokens [t0, t1), reads only positions >= t0 and writes [t0, t1). A token u that reads a
// position p in [t0, t1) has u <= keep_idx[u] = p < t1, so the writes of slab s can only
// clobber sources of slab s (read before its first barrier) and of earlier slabs (whose
// flags it waits for); sources of later slabs are never below their own t0 >= t1. Parts
// take their index from a counter in the order their CTAs start (slab-major), so a CTA
// waits only on CTAs that have started, which wait only on earlier ones: no deadlock,
// whatever order the GPU starts CTAs in and however many fit at once.
// K/V are read with plain loads (not the read-only cache): the kernel writes them.
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
constexpr int kUnroll = 8;        // vectors per thread per slab (loads in flight)
constexpr int kGroupBytes = 32;   // bytes of a row per part: one DRAM sector
constexpr int kMaxVecBytes = 16;
constexpr int kMinVecBytes = 1;   // fp8 rows may have an odd size
constexpr int kCountBlock = 256;  // threads per CTA of count_kept_kernel

// The split of the rows into parts, for vectors of vec_bytes; reads only sizes.
struct Split {
  int64_t rows = 0;
  int64_t vecs_per_row = 0;    // head_dim * element_size / vec_bytes
  int group_shift = 0;         // log2(vectors per group); a row's last group may be short
  int64_t groups_per_row = 0;  // ceil(vecs_per_row / group)
  int64_t slab_tokens = 0;     // tokens per slab
  int64_t slabs = 0;           // per (row, group): ceil(budget / slab_tokens)

  Split(const CompactKvParams& p, int vec_bytes) {
    rows = p.batch * p.heads;
    vecs_per_row = p.head_dim * dtype_size(p.dtype) / vec_bytes;
    // Groups of kGroupBytes (a power of two), or of the whole row if shorter.
    while ((vec_bytes << group_shift) < kGroupBytes && (int64_t{1} << group_shift) < vecs_per_row)
      ++group_shift;
    groups_per_row = ceil_div<int64_t>(vecs_per_row, int64_t{1} << group_shift);
    slab_tokens = (kBlock * kUnroll) >> group_shift;
    slabs = ceil_div<int64_t>(p.budget, slab_tokens);
  }
  int64_t parts() const { return slabs * rows * groups_per_row; }
  // Workspace words: the part counter, kept per row, one flag per part.
  int64_t words() const { return 1 + rows + parts(); }
};

// The workspace, cut as Split::words() says.
struct Workspace {
  uint32_t* counter;  // [1] parts started so far
  uint32_t* kept;     // [rows] kept tokens per row
  uint32_t* flags;    // [rows, groups_per_row, slabs] 1 once the part has loaded its sources

  Workspace(void* words, int64_t rows)
      : counter(static_cast<uint32_t*>(words)), kept(counter + 1), flags(kept + rows) {}
};

struct CountArgs {
  const int32_t* keep_idx;  // [rows, budget]
  int32_t* new_seq_lens;    // out [batch], or null
  Workspace ws;             // out: counter 0, kept, flags 0
  int64_t heads;
  int64_t budget;
  int64_t flags_per_row;    // groups_per_row * slabs
};

__global__ __launch_bounds__(kCountBlock) void count_kept_kernel(CountArgs a) {
  const int64_t row = blockIdx.x;
  const int32_t* idx = a.keep_idx + row * a.budget;
  KVPRUNE_SHARED(unsigned long long, first_pad, [1]);
  if (threadIdx.x == 0) first_pad[0] = static_cast<unsigned long long>(a.budget);
  __syncthreads();
  for (int64_t t = threadIdx.x; t < a.budget; t += kCountBlock) {
    if (__ldg(idx + t) < 0) {
      atomicMin(&first_pad[0], static_cast<unsigned long long>(t));
      break;  // this thread's later slots are further on
    }
  }
  uint32_t* flags = a.ws.flags + row * a.flags_per_row;
  for (int64_t i = threadIdx.x; i < a.flags_per_row; i += kCountBlock) flags[i] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t kept = static_cast<int64_t>(first_pad[0]);
    a.ws.kept[row] = static_cast<uint32_t>(kept);
    if (row == 0) a.ws.counter[0] = 0;
    if (a.new_seq_lens != nullptr && row % a.heads == 0)
      a.new_seq_lens[row / a.heads] = static_cast<int32_t>(kept);
  }
}

struct MoveArgs {
  MutableTokens k;           // in/out [batch, heads, length, head_dim], dense or paged
  MutableTokens v;           // in/out [batch, heads, length, head_dim], dense or paged
  int64_t element_size;      // bytes
  const int32_t* keep_idx;   // [rows, budget]
  Workspace ws;              // as count_kept_kernel left it
  int64_t heads;
  int64_t rows;
  int64_t budget;
  int vecs_per_row;
  int group_shift;
  int groups_per_row;
  int64_t slab_tokens;
  int64_t slabs;
};

template <typename Vec>
__global__ __launch_bounds__(kBlock) void move_kept_kernel(MoveArgs a) {
  using Reg = std::conditional_t<(sizeof(Vec) < 4), unsigned int, Vec>;  // no byte registers
  KVPRUNE_SHARED(uint32_t, part_shared, [1]);
  if (threadIdx.x == 0) part_shared[0] = atomicAdd(a.ws.counter, 1u);
  __syncthreads();
  const int64_t part = part_shared[0];
  const int64_t row_groups = a.rows * a.groups_per_row;
  const int64_t slab = part / row_groups;
  const int64_t row = part % row_groups / a.groups_per_row;
  const int first_vec = static_cast<int>(part % a.groups_per_row) << a.group_shift;
  const int group_mask = (1 << a.group_shift) - 1;
  const int64_t b = row / a.heads, h = row % a.heads;
  const int32_t* idx = a.keep_idx + row * a.budget;
  const int64_t kept = a.ws.kept[row];
  const int64_t t0 = slab * a.slab_tokens;
  // Nothing to move: no part waits on this one (they all start at or after t0, too).
  if (t0 >= kept) return;
  uint32_t* flags = a.ws.flags + (part % row_groups) * a.slabs;  // [slabs] of this (row, group)
  // Vector u of token t of row (b, h) in x.
  const auto at = [&](const MutableTokens& x, int64_t t, int u) {
    return reinterpret_cast<Vec*>(static_cast<char*>(x.data) + token_offset(x, b, h, t) * a.element_size) + u;
  };
  // The slab's items j = threadIdx.x + i * kBlock: token t0 + j / group, vector j % group.
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
  __syncthreads();  // every read of the slab happens before any write of it
  if (threadIdx.x == 0) simt::set_flag(flags + slab);
  for (int64_t earlier = threadIdx.x; earlier < slab; earlier += kBlock)
    simt::wait_flag(flags + earlier);
  __syncthreads();  // ... and every read of an earlier slab
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
void launch_moves(const MoveArgs& args, unsigned blocks, cudaStream_t stream) {
  simt::launch<move_kept_kernel<typename cuda_detail::VecOf<kVecBytes>::type>>(blocks, kBlock, 0,
                                                                              stream, args);
}

}  // namespace

size_t compact_kv_workspace_bytes_cuda(const CompactKvParams& p) {
  if (p.batch <= 0 || p.heads <= 0 || p.budget <= 0 || p.head_dim <= 0) return 0;
  // The narrowest vectors make the most parts, whatever the pointers' alignment.
  return static_cast<size_t>(Split(p, kMinVecBytes).words()) * sizeof(uint32_t);
}

Status compact_kv_cuda(const CompactKvParams& p, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  if (auto s = validate(p); s != Status::kOk) return s;
  if (p.batch == 0) return Status::kOk;
  if (p.heads == 0 || p.budget == 0) {  // nothing kept: every row's new length is 0
    if (p.new_seq_lens != nullptr) {
      if (simt::memset_async(p.new_seq_lens, 0, p.batch * sizeof(int32_t), stream) != cudaSuccess)
        return Status::kCudaError;
    }
    return cuda_detail::launch_status();
  }
  if (workspace_bytes < compact_kv_workspace_bytes_cuda(p)) return Status::kWorkspaceTooSmall;
  if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % sizeof(uint32_t) != 0)
    return Status::kInvalidArgument;
  const int64_t element_size = dtype_size(p.dtype);
  const int vec_bytes = vector_bytes(p, element_size);
  const Split split(p, vec_bytes);
  if (split.vecs_per_row > INT32_MAX - kGroupBytes) return Status::kUnsupportedHeadDim;
  if (split.rows > cuda_detail::kMaxGridBlocks || split.parts() > cuda_detail::kMaxGridBlocks)
    return Status::kInvalidArgument;
  const Workspace ws(workspace, split.rows);
  const CountArgs count{p.keep_idx, p.new_seq_lens, ws, p.heads, p.budget,
                        split.groups_per_row * split.slabs};
  simt::launch<count_kept_kernel>(static_cast<unsigned>(split.rows), kCountBlock, 0, stream, count);
  // The moves index the flags by the counter it resets: never launch them after a failed count.
  if (auto s = cuda_detail::launch_status(); s != Status::kOk) return s;
  const MoveArgs moves{p.k, p.v, element_size, p.keep_idx, ws, p.heads, split.rows, p.budget,
                       static_cast<int>(split.vecs_per_row), split.group_shift,
                       static_cast<int>(split.groups_per_row), split.slab_tokens, split.slabs};
  const auto blocks = static_cast<unsigned>(split.parts());
  switch (vec_bytes) {
    case 16: launch_moves<16>(moves, blocks, stream); break;
    case 8: launch_moves<8>(moves, blocks, stream); break;
    case 4: launch_moves<4>(moves, blocks, stream); break;
    case 2: launch_moves<2>(moves, blocks, stream); break;
    default: launch_moves<1>(moves, blocks, stream); break;
  }
  return cuda_detail::launch_status();
}

KVPRUNE_CUDA_NAMESPACE_END
