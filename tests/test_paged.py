"""kp.paged (block-table KV caches) against the dense ops and reference.paged_*.

Every pool is built so that reading the wrong memory shows: the slots of a row's
tokens hold unit-variance values and every other slot of the pool (unused blocks,
blocks of a row past its length, the rest of a row's last block) holds large
garbage (64x). Block ids are a random permutation with spare blocks in the pool.

Window scores must match the dense op on the same tokens (``reference.paged_to_dense``)
and the float64 oracle. Compaction is a byte copy and must be bit-exact: after it,
the whole storage the K/V views live in equals ``reference.paged_compact`` on a
clone, except row b's slots [new_len, old_len), which the spec leaves open
(``blank_unspecified`` zeroes them on both sides before the comparison).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda import reference as ref

from helpers import (
    HAS_EMULATOR, assert_scores_close, check_selection, dtype_id, lse_f64, rng, score_tol,
    window_scores_f64,
)

GARBAGE = 64.0  # scale of the values in slots no row owns
SPARE_BLOCKS = 3  # pool blocks in no block table
WINDOW = 8  # observation queries W
BLOCK_SIZES = (1, 16, 32)
# Blocks per row: a capacity of 70 / 80 / 96 tokens.
MAX_BLOCKS = {1: 70, 16: 5, 32: 3}
# Storage behind the K/V views, per layout (module docstring of kp.paged):
#   contig:   [2, nb, *block, D], K = [0], V = [1] (for NHD: vLLM's GPU cache);
#   vllm_cpu: [nb, Hkv, 2 * bs, D], K / V = the two halves of dim 2 (HND only);
#   sliced:   K / V = padded, misaligned views (odd element offsets and strides).
POOL_KINDS = {"NHD": ("contig", "sliced"), "HND": ("contig", "vllm_cpu", "sliced")}


def ragged_lens(block_size: int) -> list[int]:
    """Full row (ends on a block boundary), empty, exactly 2 blocks, mid-block, shorter than W."""
    capacity = MAX_BLOCKS[block_size] * block_size
    return [capacity, 0, 2 * block_size, capacity - 5, 3]


class Pool(NamedTuple):
    base: torch.Tensor  # the storage the K/V views live in
    kind: str
    layout: str
    block_size: int

    def _views(self):
        bs = self.block_size
        if self.kind == "contig":
            return self.base[0], self.base[1]
        if self.kind == "vllm_cpu":
            return self.base[:, :, :bs], self.base[:, :, bs:]
        # sliced: base [2, nb, bs + 1, Hkv + 1, D + 3] (NHD) / [2, nb, Hkv + 1, bs + 1, D + 3]
        return self.base[0, :, 1:, 1:, 3:], self.base[1, :, :-1, :-1, :-3]

    @property
    def k(self) -> torch.Tensor:
        return self._views()[0]

    @property
    def v(self) -> torch.Tensor:
        return self._views()[1]

    def clone(self, device="cpu") -> "Pool":
        return self._replace(base=self.base.to(device, copy=True))


def nhd(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """A pool view as [num_blocks, block_size, Hkv, D]."""
    return cache if layout == "NHD" else cache.transpose(1, 2)


def slots(block_table: torch.Tensor, row: int, start: int, end: int, block_size: int):
    """Index tensors (block, offset) of tokens [start, end) of a row."""
    t = torch.arange(start, max(start, end))
    return block_table[row, t // block_size].long(), t % block_size


def make_pool(layout, kind, lens, block_size, heads, dim, dtype, gen):
    """Garbage-filled pool whose rows' tokens are unit-variance, and its shuffled block table
    int32 [B, ceil(max(lens) / block_size)] (rows shorter than the longest own unused blocks)."""
    batch, max_blocks = len(lens), max(1, -(-max(lens) // block_size))
    num_blocks = batch * max_blocks + SPARE_BLOCKS
    block = (block_size, heads) if layout == "NHD" else (heads, block_size)
    shape = {
        "contig": (2, num_blocks, *block, dim),
        "vllm_cpu": (num_blocks, heads, 2 * block_size, dim),
        "sliced": (2, num_blocks, block[0] + 1, block[1] + 1, dim + 3),
    }[kind]
    pool = Pool(torch.randn(shape, generator=gen) * GARBAGE, kind, layout, block_size)
    table = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks]
    table = table.view(batch, max_blocks).to(torch.int32)
    for cache in (pool.k, pool.v):
        for b, n in enumerate(lens):
            nhd(cache, layout)[slots(table, b, 0, n, block_size)] = torch.randn(
                n, heads, dim, generator=gen)
    return pool._replace(base=pool.base.to(dtype)), table


def blank_unspecified(pool: Pool, table, old_lens, new_lens) -> None:
    """Zero row b's slots [new_lens[b], old_lens[b]) in K and V (left open by compact)."""
    for cache in (pool.k, pool.v):
        for b, (old, new) in enumerate(zip(old_lens.tolist(), new_lens.tolist())):
            nhd(cache, pool.layout)[slots(table, b, new, old, pool.block_size)] = 0


def int32(values, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


# ---------------------------------------------------------------- window_scores

class ScoreCase(NamedTuple):
    head_dim: int
    group: int  # Hq / Hkv
    gqa: str
    with_lse: bool
    dtype: torch.dtype

    def id(self) -> str:
        return (f"D{self.head_dim}-G{self.group}-{self.gqa}{'-lse' if self.with_lse else ''}"
                f"-{dtype_id(self.dtype)}")


# Every gqa mode with and without lse, every dtype. On CUDA fp16/bf16 with D 64 / 128 run
# on tensor cores; fp32 and D 40 / 96 on the SIMT kernel.
SCORE_CASES = [
    ScoreCase(64, 2, "mean", False, torch.bfloat16),
    ScoreCase(64, 4, "sum", True, torch.float16),
    ScoreCase(128, 2, "max", True, torch.bfloat16),
    ScoreCase(64, 1, "mean", False, torch.float32),
    ScoreCase(128, 3, "mean", True, torch.float32),
    ScoreCase(40, 3, "sum", False, torch.float16),
    ScoreCase(96, 2, "max", False, torch.bfloat16),
]


def paged_scores_check(pool, table, lens, q, case, device):
    """paged.window_scores == dense op on the same tokens == float64 oracle."""
    seq_lens = int32(lens, device)
    dense_k = ref.paged_to_dense(pool.k, table, seq_lens, pool.layout).to(device)
    lse = lse_f64(q, dense_k, seq_lens=seq_lens) if case.with_lse else None
    before = pool.base.clone()
    out = kp.paged.window_scores(q, pool.k, table.to(device), seq_lens, lse=lse, gqa=case.gqa,
                                 layout=pool.layout)
    assert torch.equal(pool.base, before), "window_scores modified the cache"
    tol = score_tol(device, q.dtype)
    expected = window_scores_f64(q, dense_k, lse=lse, gqa=case.gqa, seq_lens=seq_lens)
    assert_scores_close(out, expected, tol, seq_lens)
    dense = kp.window_scores(q, dense_k, lse=lse, gqa=case.gqa, seq_lens=seq_lens)
    assert_scores_close(out, dense, tol, seq_lens)
    return out


@pytest.mark.parametrize("case", SCORE_CASES, ids=ScoreCase.id)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_window_scores_match_dense(layout, block_size, case, device, gen):
    lens, heads, dtype = ragged_lens(block_size), 2, case.dtype
    pool, table = make_pool(layout, "contig", lens, block_size, heads, case.head_dim, dtype, gen)
    pool = pool.clone(device)
    q = torch.randn(len(lens), heads * case.group, WINDOW, case.head_dim, generator=gen)
    out = paged_scores_check(pool, table, lens, q.to(device, dtype), case, device)
    assert out.shape == (len(lens), heads, MAX_BLOCKS[block_size] * block_size)


@pytest.mark.parametrize("layout,kind", [(lay, kind) for lay, kinds in POOL_KINDS.items()
                                         for kind in kinds if kind != "contig"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
def test_window_scores_strided_pools(layout, kind, dtype, device, gen):
    """vLLM's CPU halves and misaligned views score as a contiguous pool with the same tokens."""
    lens, block_size, case = ragged_lens(16), 16, ScoreCase(64, 2, "mean", True, dtype)
    pool, table = make_pool(layout, kind, lens, block_size, 2, 64, dtype, gen)
    pool = pool.clone(device)
    contig = Pool(torch.zeros(2, *pool.k.shape, dtype=dtype, device=device), "contig", layout,
                  block_size)
    contig.k.copy_(pool.k)
    q = torch.randn(len(lens), 4, WINDOW, 64, generator=gen).to(device, dtype)
    out = paged_scores_check(pool, table, lens, q, case, device)
    expected = paged_scores_check(contig, table, lens, q, case, device)
    assert_scores_close(out, expected, score_tol(device, dtype), int32(lens))


@pytest.mark.skipif(not HAS_EMULATOR, reason="no CUDA emulator")
@pytest.mark.parametrize("kind,kernel", [("contig", "window_scores_mma_kernel"),
                                         ("sliced", "window_scores_simt_kernel")])
def test_window_scores_kernel_choice(kind, kernel, gen):
    """Aligned fp16 D=64 pools run the tensor-core kernel, misaligned ones the SIMT kernel
    (so the tests above cover both paths of the CUDA backend)."""
    lens = ragged_lens(16)
    pool, table = make_pool("NHD", kind, lens, 16, 1, 64, torch.float16, gen)
    q = torch.randn(len(lens), 2, WINDOW, 64, generator=gen).half()
    before = dict(kp._C._emulated_launch_counts())
    with kp.testing.emulate_cuda():
        out = kp.paged.window_scores(q, pool.k, table, int32(lens))
    ran = {name for name, n in kp._C._emulated_launch_counts().items() if n > before.get(name, 0)}
    assert any(kernel in name for name in ran), ran
    dense_k = ref.paged_to_dense(pool.k, table, int32(lens))
    assert_scores_close(out, window_scores_f64(q, dense_k, seq_lens=int32(lens)),
                        score_tol("cuda", torch.float16), int32(lens))


def test_window_scores_every_row_shorter_than_window(device, gen):
    lens = [5, 1, 7]
    pool, table = make_pool("HND", "contig", lens, 4, 2, 64, torch.float32, gen)
    q = torch.randn(3, 2, 16, 64, generator=gen)
    case = ScoreCase(64, 1, "max", True, torch.float32)
    paged_scores_check(pool.clone(device), table, lens, q.to(device), case, device)


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_window_scores_custom_scale(scale, device, gen):
    lens = [40, 17]
    pool, table = make_pool("NHD", "contig", lens, 16, 1, 64, torch.float32, gen)
    pool, seq_lens = pool.clone(device), int32(lens, device)
    q = torch.randn(2, 2, WINDOW, 64, generator=gen).to(device)
    dense_k = ref.paged_to_dense(pool.k, table, seq_lens).to(device)
    expected = window_scores_f64(q, dense_k, scale=scale, seq_lens=seq_lens)
    out = kp.paged.window_scores(q, pool.k, table.to(device), seq_lens, scale=scale)
    assert_scores_close(out, expected, score_tol(device, torch.float32), seq_lens)


# ---------------------------------------------------------------- compact

BUDGET = 24


def shifted_idx(lens, heads, budget, shift):
    """Head h keeps positions t + shift(h, n) for t < count (same count for every head)."""
    idx = torch.full((len(lens), heads, budget), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        shifts = [shift(h, n) for h in range(heads)]
        count = max(0, min(budget, n - max(shifts)))
        for h, s in enumerate(shifts):
            idx[b, h, :count] = torch.arange(s, s + count, dtype=torch.int32)
    return idx


def gap_idx(lens, heads, budget):
    """All but one position (n // 3 + h) per head, truncated to the budget: from the gap on,
    every source is one slot to the right of its destination."""
    idx = torch.full((len(lens), heads, budget), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        for h in range(heads):
            dropped = min(n // 3 + h, n - 1)
            keep = [t for t in range(n) if t != dropped][:budget]
            idx[b, h, : len(keep)] = int32(keep)
    return idx


def kept_indices(kind, lens, heads, block_size, gen):
    """int32 [B, heads, budget] kept positions of the given kind, on the CPU."""
    capacity, seq_lens = MAX_BLOCKS[block_size] * block_size, int32(lens)
    if kind == "select_keep":
        scores = torch.rand(len(lens), heads, capacity, generator=gen)
        return kp.select_keep(scores, BUDGET, n_sink=4, window=WINDOW, seq_lens=seq_lens)
    if kind == "streaming":  # sinks + the last positions: sources far to the right
        return ref.streaming_indices(len(lens), heads, capacity, BUDGET, n_sink=4,
                                     seq_lens=seq_lens)
    if kind == "keep_all":  # identity prefix, budget > every length (-1 padding)
        return shifted_idx(lens, heads, capacity + 3, lambda h, n: 0)
    if kind == "shift":  # sources 1-2 slots right: mostly in the block being written
        return shifted_idx(lens, heads, BUDGET, lambda h, n: 1 + h)
    if kind == "later_block":  # every source one block or more right of its destination
        return shifted_idx(lens, heads, capacity, lambda h, n: block_size + h)
    if kind == "gap":
        return gap_idx(lens, heads, BUDGET)
    raise ValueError(kind)


IDX_KINDS = ("select_keep", "streaming", "keep_all", "shift", "later_block", "gap")


def compact_check(pool: Pool, table, lens, idx, device) -> torch.Tensor:
    """Runs paged.compact on `pool` (on `device`) and checks it against the reference."""
    seq_lens = int32(lens)
    expected = pool.clone()
    exp_lens = ref.paged_compact(expected.k, expected.v, table, seq_lens, idx, pool.layout)
    new_lens = kp.paged.compact(pool.k, pool.v, table.to(device), seq_lens.to(device),
                                idx.to(device), layout=pool.layout)
    assert new_lens.dtype == torch.int32 and new_lens.device == pool.base.device
    assert torch.equal(new_lens.cpu(), exp_lens), (new_lens, exp_lens)
    assert torch.equal(exp_lens, (idx[:, 0] >= 0).sum(dim=-1).int())
    result = pool.clone()
    for p in (result, expected):
        blank_unspecified(p, table, seq_lens, exp_lens)
    assert torch.equal(result.base, expected.base), "compacted pool differs from the reference"
    return new_lens


@pytest.mark.parametrize("kind", IDX_KINDS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_compact_matches_reference(layout, block_size, kind, device, gen):
    lens, heads = ragged_lens(block_size), 2
    pool, table = make_pool(layout, "contig", lens, block_size, heads, 64, torch.bfloat16, gen)
    idx = kept_indices(kind, lens, heads, block_size, gen)
    compact_check(pool.clone(device), table, lens, idx, device)


POOL_PARAMS = [pytest.param(lay, kind, id=f"{lay}-{kind}")
               for lay, kinds in POOL_KINDS.items() for kind in kinds]


# head_dim * element size of 6, 80, 256 bytes: 2-, 16- and 16-byte vectors on CUDA for
# contiguous pools (the misaligned sliced ones take 2-byte vectors).
@pytest.mark.parametrize("dtype,dim", [(torch.float16, 3), (torch.float32, 20),
                                       (torch.bfloat16, 128)],
                         ids=["f16-D3", "f32-D20", "bf16-D128"])
@pytest.mark.parametrize("layout,kind", POOL_PARAMS)
def test_compact_pool_kinds(layout, kind, dtype, dim, device, gen):
    """Strided pools compact like contiguous ones; the other half / tensor and every slot
    no row owns keep their bytes (the whole storage is compared)."""
    lens = ragged_lens(16)
    pool, table = make_pool(layout, kind, lens, 16, 2, dim, dtype, gen)
    compact_check(pool.clone(device), table, lens, kept_indices("streaming", lens, 2, 16, gen),
                  device)


def test_compact_empty_budget_and_batch(device, gen):
    lens = [20, 0]
    pool, table = make_pool("NHD", "contig", lens, 16, 2, 8, torch.float16, gen)
    none_kept = torch.empty(2, 2, 0, dtype=torch.int32)
    assert compact_check(pool.clone(device), table, lens, none_kept, device).tolist() == [0, 0]
    pool = pool.clone(device)
    before = pool.base.clone()
    none_kept = none_kept.to(device)
    no_rows = kp.paged.compact(pool.k, pool.v, table[:0].to(device), int32([], device),
                               none_kept[:0])
    assert no_rows.shape == (0,) and torch.equal(pool.base, before)
    # no KV heads: nothing kept, every sequence's new length 0 (CUDA wrote nothing before)
    pool, table = make_pool("NHD", "contig", lens, 16, 0, 8, torch.float16, gen)
    pool = pool.clone(device)
    no_heads = kp.paged.compact(pool.k, pool.v, table.to(device), int32(lens, device),
                                torch.full((2, 0, 3), -1, dtype=torch.int32, device=device))
    assert no_heads.tolist() == [0, 0]


@pytest.mark.skipif(not HAS_EMULATOR, reason="no CUDA emulator")
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["shift", "later_block", "gap", "streaming"])
def test_compact_overlaps_under_every_schedule(kind, seed, gen):
    """The emulated CUDA kernel gives the reference's bytes under forward, reverse and
    shuffled thread orders (results compared bitwise between schedules)."""
    lens = ragged_lens(16)
    pool, table = make_pool("NHD", "contig", lens, 16, 2, 64, torch.float16, gen)
    idx = kept_indices(kind, lens, 2, 16, gen)
    with kp.testing.emulate_cuda(schedules=kp.testing.SCHEDULES, seed=seed):
        compact_check(pool, table, lens, idx, "cpu")


# Row sizes of 128, 80, 10 and 7 bytes: 16-byte vectors in one group of 32 bytes per CTA
# (waves of 1024 tokens) or in groups with a short last one; 2- and 1-byte vectors (waves of
# 256 tokens).
@pytest.mark.skipif(not HAS_EMULATOR, reason="no CUDA emulator")
@pytest.mark.parametrize("dtype,dim", [(torch.float16, 64), (torch.float16, 40),
                                       (torch.float16, 5), (torch.float8_e4m3fn, 7)],
                         ids=["f16-D64", "f16-D40", "f16-D5", "e4m3-D7"])
@pytest.mark.parametrize("kind", ["shift", "gap", "every_third"])
@pytest.mark.parametrize("host_threads", [1, 4])
def test_compact_long_rows_cross_slabs(kind, dtype, dim, host_threads, gen):
    """Rows of thousands of tokens: the CUDA kernel moves them in slabs of 256 to 1024
    tokens, one CTA each, and sources just past a slab's end are written by the next slab,
    which must wait for this one's reads (with 4 host threads, slabs run side by side)."""
    lens, heads, block_size = [3200, 1100, 0], 2, 16
    pool, table = make_pool("HND", "contig", lens, block_size, heads, dim, dtype, gen)
    if kind == "shift":
        idx = shifted_idx(lens, heads, max(lens), lambda h, n: 1 + h)
    elif kind == "gap":
        idx = gap_idx(lens, heads, max(lens))
    else:  # sources ever further right: 3t + h
        idx = torch.full((len(lens), heads, max(lens) // 3), -1, dtype=torch.int32)
        for b, n in enumerate(lens):
            count = max(0, (n - 1) // 3)
            for h in range(heads):
                idx[b, h, :count] = torch.arange(h, h + 3 * count, 3, dtype=torch.int32)
    with kp.testing.emulate_cuda(schedules=kp.testing.SCHEDULES, seed=0, host_threads=host_threads):
        compact_check(pool, table, lens, idx, "cpu")


@pytest.mark.skipif(not HAS_EMULATOR, reason="no CUDA emulator")
@pytest.mark.parametrize("drop_every", [2, 10])
def test_compact_later_slabs_wait_for_a_slow_one(drop_every, gen):
    """One row of one 32-byte column group, so consecutive CTAs are consecutive slabs of 1024
    tokens: with two host threads, the caller's a slow SM, later slabs overtake earlier ones
    and must not store before those have loaded (every `drop_every`-th token dropped: a slab's
    sources lie in the next slab or further right)."""
    lens, heads, block_size, n = [4600], 1, 16, 4600
    pool, table = make_pool("HND", "contig", lens, block_size, heads, 16, torch.float16, gen)
    keep = [t for t in range(n) if t % drop_every != drop_every - 1]
    idx = torch.full((1, heads, len(keep)), -1, dtype=torch.int32)
    idx[0, 0] = int32(keep)
    with kp.testing.emulate_cuda(host_threads=2, slow_worker=True):
        compact_check(pool, table, lens, idx, "cpu")


# ---------------------------------------------------------------- snapkv

@pytest.mark.parametrize("layout,kind,dtype", [("NHD", "contig", torch.float32),
                                               ("HND", "contig", torch.bfloat16),
                                               ("HND", "sliced", torch.float16)],
                         ids=["NHD-contig-f32", "HND-contig-bf16", "HND-sliced-f16"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("shift", [0, 2])
def test_snapkv_matches_dense(shift, block_size, layout, kind, dtype, device, gen):
    lens, heads, budget, window = ragged_lens(block_size), 2, 20, 8
    pool, table = make_pool(layout, kind, lens, block_size, heads, 64, dtype, gen)
    pool, seq_lens = pool.clone(device), int32(lens, device)
    q = torch.randn(len(lens), heads * 2, WINDOW, 64, generator=gen).to(device, dtype)
    dense_k = ref.paged_to_dense(pool.k, table, seq_lens, layout).to(device)
    dense_v = ref.paged_to_dense(pool.v, table, seq_lens, layout).to(device)
    kw = dict(n_sink=2, window=window, kernel_size=5, pool="avg", gqa="max", pool_shift=shift)
    exp_k, exp_v, exp_idx = kp.snapkv(q, dense_k, dense_v, budget, seq_lens=seq_lens, **kw)
    idx, new_lens = kp.paged.snapkv(q, pool.k, pool.v, table.to(device), seq_lens, budget,
                                    layout=layout, **kw)
    pooled = ref.pool_scores(window_scores_f64(q, dense_k, gqa="max", seq_lens=seq_lens), 5, "avg",
                             window=window, seq_lens=seq_lens, shift=shift)
    check_selection(idx, pooled, budget, n_sink=2, window=window, seq_lens=seq_lens,
                    atol=2 * score_tol(device, dtype) * pooled.amax(dim=-1))
    assert torch.equal(idx.cpu(), exp_idx.cpu())
    assert torch.equal(new_lens.cpu(), int32([min(n, budget) for n in lens]))
    # The first new_len tokens of each row are the dense op's kept K/V.
    for cache, expected in ((pool.k, exp_k), (pool.v, exp_v)):
        kept = ref.paged_to_dense(cache, table, new_lens.cpu(), layout)[:, :, :budget]
        expected = expected.cpu().clone()
        for b, n in enumerate(new_lens.tolist()):
            expected[b, :, n:] = 0
        assert torch.equal(kept, expected)


# ---------------------------------------------------------------- blocks_in_use

@pytest.mark.parametrize("block_size,expected", [(16, [0, 1, 1, 1, 2, 6]),
                                                 (1, [0, 1, 15, 16, 17, 96]),
                                                 (32, [0, 1, 1, 1, 1, 3])])
def test_blocks_in_use(block_size, expected):
    out = kp.paged.blocks_in_use(int32([0, 1, 15, 16, 17, 96]), block_size)
    assert out.dtype == torch.int32 and out.tolist() == expected


@pytest.mark.parametrize("block_size", [0, -16])
def test_blocks_in_use_rejects_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size"):
        kp.paged.blocks_in_use(int32([4]), block_size)


def test_blocks_in_use_after_compaction_frees_blocks(gen):
    lens = ragged_lens(16)
    pool, table = make_pool("NHD", "contig", lens, 16, 2, 16, torch.float32, gen)
    q = torch.randn(len(lens), 2, WINDOW, 16, generator=gen)
    _, new_lens = kp.paged.snapkv(q, pool.k, pool.v, table, int32(lens), BUDGET, window=WINDOW)
    assert kp.paged.blocks_in_use(new_lens, 16).tolist() == [2, 0, 2, 2, 1]


# ---------------------------------------------------------------- bad input (CPU checks)

def bad_inputs():
    """A valid paged problem: q, k/v pools (NHD, bs 4), table, seq_lens, idx."""
    gen = rng(0)
    pool, table = make_pool("NHD", "contig", [6, 3], 4, 2, 8, torch.float32, gen)
    q = torch.randn(2, 4, 2, 8, generator=gen)
    idx = int32([[[0, 2, 5], [1, 2, 3]], [[0, 1, -1], [0, 2, -1]]])
    return dict(q=q, k_cache=pool.k, v_cache=pool.v, block_table=table, seq_lens=int32([6, 3]),
                idx=idx)


def with_block(table, row, col, value):
    table = table.clone()
    table[row, col] = value
    return table


# (change to the valid inputs, message naming the argument); "layout" goes as a keyword.
SCORE_ERRORS = {
    "layout": (lambda a: {"layout": "NDH"}, "layout"),
    "cache-3d": (lambda a: {"k_cache": a["k_cache"][:, 0]}, "k_cache"),
    "cache-last-dim-strided": (lambda a: {"k_cache": a["k_cache"].transpose(2, 3)}, "k_cache"),
    "table-int64": (lambda a: {"block_table": a["block_table"].long()}, "block_table"),
    "table-1d": (lambda a: {"block_table": a["block_table"][0]}, "block_table"),
    "table-batch": (lambda a: {"block_table": a["block_table"][:1],
                               "seq_lens": a["seq_lens"][:1]}, "block_table"),
    "block-negative": (lambda a: {"block_table": with_block(a["block_table"], 0, 1, -1)},
                       "block_table"),
    "block-too-big": (lambda a: {"block_table": with_block(a["block_table"], 1, 0, 1000)},
                      "block_table"),
    "seq-lens-over-capacity": (lambda a: {"seq_lens": int32([6, 10_000])}, "seq_lens"),
    "seq-lens-negative": (lambda a: {"seq_lens": int32([-1, 3])}, "seq_lens"),
    "seq-lens-shape": (lambda a: {"seq_lens": int32([6, 3, 1])}, "seq_lens"),
    "seq-lens-int64": (lambda a: {"seq_lens": a["seq_lens"].long()}, "seq_lens"),
    "q-dtype": (lambda a: {"q": a["q"].half()}, "k_cache must have the dtype"),
    "head-dim": (lambda a: {"q": a["q"][..., :4]}, "head_dim"),
    "q-heads": (lambda a: {"q": a["q"][:, :3]}, "q heads"),
}


@pytest.mark.parametrize("name", list(SCORE_ERRORS))
def test_window_scores_rejects_bad_input(name):
    args = bad_inputs()
    change, match = SCORE_ERRORS[name]
    args.update(change(args))
    with pytest.raises((ValueError, TypeError), match=match):
        kp.paged.window_scores(args["q"], args["k_cache"], args["block_table"], args["seq_lens"],
                               layout=args.get("layout", "NHD"))


def idx_with(idx, where, value):
    idx = idx.clone()
    idx[where] = value
    return idx


COMPACT_ERRORS = {
    "layout": (lambda a: {"layout": "nhd"}, "layout"),
    "cache-3d": (lambda a: {"k_cache": a["k_cache"][:, 0]}, "k_cache"),
    "v-shape": (lambda a: {"v_cache": a["v_cache"][:, :, :1]}, "v_cache"),
    "v-dtype": (lambda a: {"v_cache": a["v_cache"].double()}, "v_cache"),
    "v-aliases-k": (lambda a: {"v_cache": a["k_cache"]}, "v_cache"),
    "table-int64": (lambda a: {"block_table": a["block_table"].long()}, "block_table"),
    "block-out-of-range": (lambda a: {"block_table": with_block(a["block_table"], 0, 0, 99)},
                           "block_table"),
    "seq-lens-over-capacity": (lambda a: {"seq_lens": int32([6, 10_000])}, "seq_lens"),
    "seq-lens-shape": (lambda a: {"seq_lens": a["seq_lens"][:1]}, "seq_lens"),
    "idx-int64": (lambda a: {"idx": a["idx"].long()}, "idx"),
    "idx-shape": (lambda a: {"idx": a["idx"][:, :1]}, "idx"),
    "idx-2d": (lambda a: {"idx": a["idx"][:, 0]}, "idx"),
    "idx-not-ascending": (lambda a: {"idx": idx_with(a["idx"], (0, 0, 1), 0)}, "idx"),
    "idx-beyond-seq-len": (lambda a: {"idx": idx_with(a["idx"], (1, 1, 1), 3)}, "idx"),
    "idx-negative-inside": (lambda a: {"idx": idx_with(a["idx"], (0, 1, 0), -1)}, "idx"),
    "idx-after-padding": (lambda a: {"idx": int32([[[0, 2, 5], [1, 2, 3]],
                                                   [[0, -1, 2], [0, 2, -1]]])}, "idx"),
    "idx-head-counts-differ": (lambda a: {"idx": int32([[[0, 2, 5], [1, 2, 3]],
                                                        [[0, 1, -1], [0, 1, 2]]])}, "idx"),
}


@pytest.mark.parametrize("name", list(COMPACT_ERRORS))
def test_compact_rejects_bad_input_and_writes_nothing(name):
    args = bad_inputs()
    change, match = COMPACT_ERRORS[name]
    args.update(change(args))
    k_before, v_before = args["k_cache"].clone(), args["v_cache"].clone()
    with pytest.raises((ValueError, TypeError), match=match):
        kp.paged.compact(args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"],
                         args["idx"], layout=args.get("layout", "NHD"))
    assert torch.equal(args["k_cache"], k_before) and torch.equal(args["v_cache"], v_before)


def test_snapkv_rejects_bad_budget():
    args = bad_inputs()
    with pytest.raises((ValueError, TypeError), match="budget"):
        kp.paged.snapkv(args["q"], args["k_cache"], args["v_cache"], args["block_table"],
                        args["seq_lens"], 2.5)
