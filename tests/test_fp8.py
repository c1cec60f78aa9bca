"""fp8 KV caches (torch.float8_e4m3fn / float8_e5m2) with an fp32 ``k_scale``.

A cache's real values are ``float(k) * k_scale`` (k_scale [] or [Hkv], None = 1). Every
fp8 value is exact in fp16, bf16 and fp32, so the ops dequantise without rounding and
their scores must match the float64 reference on the dequantised cache
(``dequantised``: ``k.double() * k_scale``, exact) within the tolerance of the non-fp8 op
of the same query dtype, ``helpers.score_tol``: 1e-5 of the row maximum on the CPU
(fp32 accumulation), 1e-4 for fp32 q on CUDA cores and 2e-3 for fp16/bf16 q on tensor
cores (also under the emulator). Copies (gather_kv, snapkv's kept K/V, paged compaction)
move the cache's bytes unchanged and are compared bit for bit on ``uint8`` views
(``torch.equal`` has no fp8 kernel), from random bytes that include every encoding.
Bad fp8 input raises TypeError/ValueError naming the argument.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda import reference as ref

from helpers import (
    DTYPES, HAS_CUDA, HAS_EMULATOR, assert_gathered, assert_scores_close, check_selection,
    dtype_id, lse_f64, poison_beyond, randn_tokens, score_tol, seq_lens_tensor,
)
from test_paged import WINDOW, blank_unspecified, int32, kept_indices, make_pool, ragged_lens

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
U8 = torch.uint8
HKV = 2  # KV heads of every dense case (the per-head scales below have 2 entries)
# k_scale kinds: absent (1), one fp32 scalar (0-d), one per KV head; not powers of two,
# so a scale applied twice, never or to the wrong head shows.
SCALES = {"none": None, "scalar": [0.0371], "per_head": [0.0213, 2.75]}


def fp8_id(fmt: torch.dtype) -> str:
    return "e4m3" if fmt == torch.float8_e4m3fn else "e5m2"


def k_scale_of(kind: str, device) -> Optional[torch.Tensor]:
    """The k_scale tensor of a SCALES kind: None, fp32 [] or fp32 [HKV]."""
    values = SCALES[kind]
    if values is None:
        return None
    scale = torch.tensor(values, dtype=torch.float32, device=device)
    return scale.reshape(()) if len(values) == 1 else scale


def dequantised(k: torch.Tensor, k_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """float64 [B, Hkv, N, D] real values float(k) * k_scale on k's device (exact: a 4- or
    3-bit fp8 mantissa times a 24-bit fp32 scale fits float64's 53 bits)."""
    k = k.double()
    return k if k_scale is None else k * k_scale.double().reshape(1, -1, 1, 1)


def quantised(batch, heads, tokens, dim, fmt, k_scale, gen) -> torch.Tensor:
    """Contiguous fp8 [B, H, T, D] whose dequantised values are ~N(0, 1): randn / k_scale
    rounded to fmt (clamped to its finite range)."""
    x = torch.randn(batch, heads, tokens, dim, generator=gen, dtype=torch.float64)
    if k_scale is not None:
        x = x / k_scale.double().cpu().reshape(1, -1, 1, 1)
    top = torch.finfo(fmt).max
    return x.clamp(-top, top).to(fmt)


def in_layout(x: torch.Tensor, layout: str, device) -> torch.Tensor:
    """x [B, H, T, D] copied into helpers.LAYOUTS memory (contig, bnhd or a sliced view)."""
    batch, heads, tokens, dim = x.shape
    if layout == "contig":
        return x.to(device, copy=True)
    if layout == "bnhd":
        out = torch.zeros(batch, tokens, heads, dim, dtype=x.dtype, device=device).transpose(1, 2)
    else:
        big = torch.zeros(batch, heads + 1, tokens + 5, dim + 9, dtype=x.dtype, device=device)
        out = big[:, 1:, 3 : tokens + 3, 1 : dim + 1]
    return out.copy_(x)


def random_bytes(shape, fmt, gen, layout="contig", device="cpu") -> torch.Tensor:
    """fp8 tensor of uniformly random bytes (NaN and inf encodings included), for copies."""
    raw = torch.randint(0, 256, shape, generator=gen, dtype=U8)
    return in_layout(raw, layout, device).view(fmt)


def launched(fn) -> set:
    """Names of the emulated CUDA kernels `fn()` launches (run under the emulator)."""
    before = dict(kp._C._emulated_launch_counts())
    with kp.testing.emulate_cuda():
        fn()
    return {name for name, n in kp._C._emulated_launch_counts().items()
            if n > before.get(name, 0)}


# ---------------------------------------------------------------- window_scores

class Case(NamedTuple):
    head_dim: int
    group: int  # Hq / Hkv
    gqa: str
    with_lse: bool
    qreduce: str
    layout: str
    lens: Optional[tuple]  # seq_lens (None: full rows of N)

    def id(self) -> str:
        lens = "full" if self.lens is None else "ragged"
        return (f"D{self.head_dim}-G{self.group}-{self.gqa}{'-lse' if self.with_lse else ''}"
                f"-q{self.qreduce}-{self.layout}-{lens}")


N, W = 77, 8  # cache length (not a multiple of any tile), observation queries
RAGGED = (N, 5, 0, N - 13)  # full, shorter than W, empty, mid
# On CUDA, fp16/bf16 q with D 64 / 128 in aligned layouts run the tensor-core kernel; fp32,
# D 40 / 96 and the misaligned sliced view run the SIMT kernel.
CASES = [
    Case(64, 2, "mean", False, "sum", "contig", None),
    Case(128, 3, "max", True, "max", "bnhd", RAGGED),
    Case(40, 1, "sum", True, "sum", "contig", RAGGED),
    Case(96, 2, "mean", False, "max", "sliced", RAGGED),
]


@pytest.mark.parametrize("scale_kind", list(SCALES))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("fmt", FP8, ids=fp8_id)
@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_window_scores_match_dequantised_reference(case, fmt, dtype, scale_kind, device, gen):
    batch = 2 if case.lens is None else len(case.lens)
    seq_lens = seq_lens_tensor(case.lens, device)
    k_scale = k_scale_of(scale_kind, device)
    # q [B, Hq, W, D]; k fp8 [B, Hkv, N, D]
    q = randn_tokens(batch, HKV * case.group, W, case.head_dim, dtype=dtype, device=device,
                     layout=case.layout, gen=gen)
    k = in_layout(quantised(batch, HKV, N, case.head_dim, fmt, k_scale, gen), case.layout, device)
    real_k = dequantised(k, k_scale)
    lse = lse_f64(q, real_k, seq_lens=seq_lens) if case.with_lse else None
    expected = ref.window_scores(q, real_k, lse=lse, gqa=case.gqa, seq_lens=seq_lens,
                                 qreduce=case.qreduce)
    if case.lens is not None:  # padding holds NaN bytes; it must never be read
        poison_beyond(k, case.lens)
    out = kp.window_scores(q, k, lse=lse, gqa=case.gqa, seq_lens=seq_lens, qreduce=case.qreduce,
                           k_scale=k_scale)
    assert out.device == q.device and out.shape == (batch, HKV, N)
    assert_scores_close(out, expected, score_tol(device, dtype), seq_lens)


def extreme_cache(fmt, batch, tokens, dim, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 [B, 2, T, D] and its per-head k_scale [2]. Head 0 holds values up to the largest
    finite (±448 / ±57344, ~20 % of the entries exactly ±max), +0 and -0, scaled by
    2 / max; head 1 holds only subnormals, the first normal binade and ±0, scaled by
    1 / smallest_normal. Both dequantise to values in [-2, 2] (finite softmax)."""
    info = torch.finfo(fmt)
    mantissa_steps = 8 if fmt == torch.float8_e4m3fn else 4  # 2^(mantissa bits)
    big = torch.randn(batch, tokens, dim, generator=gen) * info.max / 4
    pick = torch.randint(0, 10, big.shape, generator=gen)
    specials = torch.tensor([info.max, -info.max, 0.0, -0.0])
    big = torch.where(pick < 4, specials[pick.clamp(max=3)], big.clamp(-info.max, info.max))
    # m * smallest_subnormal for |m| < 2 * 2^mbits: the subnormals and the first binade.
    steps = torch.randint(-2 * mantissa_steps + 1, 2 * mantissa_steps, big.shape, generator=gen)
    tiny = steps * (info.smallest_normal / mantissa_steps)
    tiny = torch.where(torch.rand(big.shape, generator=gen) < 0.1, -0.0, tiny)
    k = torch.stack([big, tiny], dim=1).to(fmt)
    assert (k[:, 0].abs() == info.max).any() and (k[:, 1].view(U8) == 0x80).any()
    k_scale = torch.tensor([2 / info.max, 1 / info.smallest_normal], dtype=torch.float32)
    return k, k_scale


@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("fmt", FP8, ids=fp8_id)
def test_extreme_values(fmt, dtype, head_dim, device, gen):
    """Largest finite values, subnormals, zeros and negative zeros dequantise exactly."""
    lens = (60, 33)
    seq_lens = seq_lens_tensor(lens, device)
    k, k_scale = extreme_cache(fmt, len(lens), 60, head_dim, gen)
    k, k_scale = k.to(device), k_scale.to(device)
    q = randn_tokens(len(lens), 4, W, head_dim, dtype=dtype, device=device, gen=gen)
    real_k = dequantised(k, k_scale)
    lse = lse_f64(q, real_k, seq_lens=seq_lens)
    tol = score_tol(device, dtype)
    for given_lse in (None, lse):
        out = kp.window_scores(q, k, lse=given_lse, seq_lens=seq_lens, k_scale=k_scale)
        expected = ref.window_scores(q, real_k, lse=given_lse, seq_lens=seq_lens)
        assert_scores_close(out, expected, tol, seq_lens)


@pytest.mark.parametrize("qreduce", ["sum", "max"])
@pytest.mark.parametrize("fmt", FP8, ids=fp8_id)
def test_fold_into_out(fmt, qreduce, device, gen):
    """out= folds fp8 scores of keys [0, M) into existing scores like non-fp8 ones."""
    k_scale = k_scale_of("per_head", device)
    q = randn_tokens(2, 4, W, 64, dtype=torch.bfloat16, device=device, gen=gen)
    k = quantised(2, HKV, N, 64, fmt, k_scale, gen).to(device)
    out = (torch.randn(2, HKV, 50, generator=gen) * 0.3).to(device)
    expected = ref.window_scores(q, dequantised(k, k_scale), qreduce=qreduce, out=out)
    assert kp.window_scores(q, k, qreduce=qreduce, out=out, k_scale=k_scale) is out
    assert_scores_close(out, expected, score_tol(device, torch.bfloat16))


def test_k_scale_shapes_agree(device, gen):
    """k_scale [], [1] and [Hkv] of equal entries are the same scale (bit for bit)."""
    q = randn_tokens(1, 4, W, 64, dtype=torch.float16, device=device, gen=gen)
    k = quantised(1, HKV, 40, 64, torch.float8_e4m3fn, None, gen).to(device)
    results = [kp.window_scores(q, k, k_scale=torch.full(shape, 0.3, device=device))
               for shape in ((), (1,), (HKV,))]
    for other in results[1:]:
        assert torch.equal(results[0], other)


@pytest.mark.skipif(not HAS_EMULATOR, reason="no CUDA emulator")
@pytest.mark.parametrize("fmt", FP8, ids=fp8_id)
@pytest.mark.parametrize("dtype,head_dim,layout,kernel", [
    (torch.bfloat16, 64, "contig", "window_scores_mma_kernel<__nv_bfloat16, 64,"),
    (torch.float16, 128, "bnhd", "window_scores_mma_kernel<__half, 128,"),
    (torch.bfloat16, 64, "sliced", "window_scores_simt_kernel<__nv_bfloat16,"),
    (torch.float32, 64, "contig", "window_scores_simt_kernel<float,"),
], ids=["bf16-D64-mma", "f16-D128-mma", "bf16-sliced-simt", "f32-simt"])
def test_kernel_choice(dtype, head_dim, layout, kernel, fmt, gen):
    """Aligned fp16/bf16 q with D 64/128 run the fp8 tensor-core kernel, fp32 q and
    misaligned K the fp8 SIMT kernel (so the device tests above cover both)."""
    q = randn_tokens(2, 4, W, head_dim, dtype=dtype, gen=gen)
    k = in_layout(quantised(2, HKV, N, head_dim, fmt, None, gen), layout, "cpu")
    tag = "kvprune::Fp8E4M3" if fmt == torch.float8_e4m3fn else "kvprune::Fp8E5M2"
    ran = launched(lambda: kp.window_scores(q, k, k_scale=k_scale_of("per_head", "cpu")))
    assert any(kernel in name and tag in name for name in ran), ran


@pytest.mark.parametrize("scale_kind", ["scalar", "per_head"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_k_scale_needs_an_fp8_cache(dtype, scale_kind, device, gen):
    """k_scale dequantises fp8 caches only; with a K of q's dtype it is refused (scale the
    softmax with scale= instead), dense and paged."""
    k_scale = k_scale_of(scale_kind, device)
    q = randn_tokens(2, 4, W, 64, dtype=dtype, device=device, gen=gen)
    k = randn_tokens(2, HKV, N, 64, dtype=dtype, device=device, layout="bnhd", gen=gen)
    with pytest.raises(ValueError, match=r"^k_scale\b.*fp8"):
        kp.window_scores(q, k, k_scale=k_scale)
    with pytest.raises(ValueError, match=r"^k_scale\b.*fp8"):
        kp.snapkv(q, k, k, 16, n_sink=2, window=8, k_scale=k_scale)


# ---------------------------------------------------------------- snapkv

SNAP = dict(n_sink=2, window=8, kernel_size=5, pool="avg", gqa="max")
BUDGET = 24


@pytest.mark.parametrize("scale_kind,shift", [("none", 0), ("per_head", 0), ("per_head", 2)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("fmt", FP8, ids=fp8_id)
def test_snapkv(fmt, dtype, scale_kind, shift, device, gen):
    """Selection from the dequantised cache (tie-tolerant vs float64), kept K/V the cache's
    bytes; out_k/out_v (strided views into NaN-byte buffers) give the same."""
    lens = (90, 20, 0, 61)
    seq_lens, k_scale = seq_lens_tensor(lens, device), k_scale_of(scale_kind, device)
    q = randn_tokens(len(lens), 2 * HKV, W, 64, dtype=dtype, device=device, gen=gen)
    k = in_layout(quantised(len(lens), HKV, 90, 64, fmt, k_scale, gen), "bnhd", device)
    v = random_bytes((len(lens), HKV, 90, 64), fmt, gen, device=device)
    real_k = dequantised(k, k_scale)
    lse = lse_f64(q, real_k, seq_lens=seq_lens)
    scores = ref.window_scores(q, real_k, lse=lse, gqa="max", seq_lens=seq_lens)
    pooled = ref.pool_scores(scores, 5, "avg", window=8, seq_lens=seq_lens, shift=shift)
    poison_beyond(k, lens)
    kept = kp.snapkv(q, k, v, BUDGET, lse=lse, seq_lens=seq_lens, k_scale=k_scale,
                     pool_shift=shift, **SNAP)
    assert kept.k.dtype == kept.v.dtype == fmt
    # Op and reference scores differ by <= tol * row max: ranks may swap within twice that.
    atol = 2 * score_tol(device, dtype) * scores.double().abs().amax(dim=-1)
    check_selection(kept.idx, pooled, BUDGET, n_sink=2, window=8, seq_lens=seq_lens, atol=atol)
    assert_gathered(k.view(U8), v.view(U8), kept.idx, kept.k.view(U8), kept.v.view(U8))
    assert torch.equal(kp.snapkv_select(q, k, BUDGET, lse=lse, seq_lens=seq_lens,
                                        k_scale=k_scale, pool_shift=shift, **SNAP), kept.idx)

    bigs = [torch.full((len(lens), BUDGET + 2, HKV, 64), 0x7F, dtype=U8, device=device).view(fmt)
            for _ in range(2)]
    out_k, out_v = (big[:, 1 : BUDGET + 1].transpose(1, 2) for big in bigs)
    again = kp.snapkv(q, k, v, BUDGET, lse=lse, seq_lens=seq_lens, k_scale=k_scale,
                      out_k=out_k, out_v=out_v, pool_shift=shift, **SNAP)
    assert again.k is out_k and again.v is out_v and torch.equal(again.idx, kept.idx)
    assert torch.equal(out_k.view(U8), kept.k.view(U8))
    assert torch.equal(out_v.view(U8), kept.v.view(U8))
    for big in bigs:  # rows outside the views keep their bytes
        assert (big.view(U8)[:, [0, BUDGET + 1]] == 0x7F).all()


# ---------------------------------------------------------------- gather_kv

# (N, budget, D): 1-byte rows, odd D with budget > N (padding), 128-byte rows.
GATHER_SHAPES = [(37, 12, 1), (5, 8, 7), (100, 40, 128)]


@pytest.mark.parametrize("out_kind", ["alloc", "strided"])
@pytest.mark.parametrize("layout", ["contig", "bnhd", "sliced"])
@pytest.mark.parametrize("fmt", FP8, ids=fp8_id)
@pytest.mark.parametrize("length,budget,dim", GATHER_SHAPES,
                         ids=[f"N{n}-K{k}-D{d}" for n, k, d in GATHER_SHAPES])
def test_gather_kv_copies_bytes(length, budget, dim, fmt, layout, out_kind, device, gen):
    lens = (length, max(1, length // 4))  # the second row pads with -1
    shape = (len(lens), 3, length, dim)
    k, v = (random_bytes(shape, fmt, gen, layout, device) for _ in range(2))
    scores = torch.rand(len(lens), 3, length, generator=gen).to(device)
    idx = kp.select_keep(scores, budget, n_sink=1, window=1, seq_lens=seq_lens_tensor(lens, device))
    if out_kind == "alloc":
        out_k, out_v = kp.gather_kv(k, v, idx)
    else:
        bigs = [random_bytes((len(lens), budget + 2, 3, dim), fmt, gen, device=device)
                for _ in range(2)]
        untouched = [big.view(U8)[:, [0, budget + 1]].clone() for big in bigs]
        views = [big[:, 1 : budget + 1].transpose(1, 2) for big in bigs]
        out_k, out_v = kp.gather_kv(k, v, idx, out_k=views[0], out_v=views[1])
        assert out_k is views[0] and out_v is views[1]
        for big, before in zip(bigs, untouched):
            assert torch.equal(big.view(U8)[:, [0, budget + 1]], before)
    assert out_k.dtype == out_v.dtype == fmt
    assert_gathered(k.view(U8), v.view(U8), idx, out_k.view(U8), out_v.view(U8))
    padding = (idx == -1)[..., None].expand(out_k.shape)
    assert padding.any()
    assert (out_k.view(U8)[padding] == 0).all() and (out_v.view(U8)[padding] == 0).all()


@pytest.mark.parametrize("fmt", FP8, ids=fp8_id)
def test_streaming_copies_bytes(fmt, device, gen):
    lens = [50, 3, 0]
    k, v = (random_bytes((3, 2, 50, 24), fmt, gen, "bnhd", device) for _ in range(2))
    kept = kp.streaming(k, v, 16, n_sink=2, seq_lens=seq_lens_tensor(lens, device))
    assert torch.equal(kept.idx.cpu(), ref.streaming_indices(3, 2, 50, 16, n_sink=2,
                                                             seq_lens=int32(lens)))
    assert_gathered(k.view(U8), v.view(U8), kept.idx, kept.k.view(U8), kept.v.view(U8))


# ---------------------------------------------------------------- paged

def fp8_pool(layout, kind, lens, block_size, dim, fmt, gen, device):
    """test_paged.make_pool (garbage-filled, shuffled table) in fp8 on `device`: the rows'
    tokens are unit-variance values rounded to fmt (e4m3 garbage saturates at ±448)."""
    pool, table = make_pool(layout, kind, lens, block_size, HKV, dim, fmt, gen)
    return pool.clone(device), table


def as_bytes(pool):
    """A uint8 copy of the pool, for reference.paged_compact (no fp8 arithmetic needed)."""
    return pool._replace(base=pool.base.view(U8).cpu().clone())


@pytest.mark.parametrize("scale_kind", ["scalar", "per_head"])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128),
                                            (torch.float32, 64), (torch.bfloat16, 40)],
                         ids=["bf16-D64", "f16-D128", "f32-D64", "bf16-D40"])
@pytest.mark.parametrize("fmt", FP8, ids=fp8_id)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_window_scores(layout, fmt, dtype, head_dim, scale_kind, device, gen):
    """An fp8 pool scores as the dense op on the same tokens and as the float64 reference."""
    lens = ragged_lens(16)
    pool, table = fp8_pool(layout, "contig", lens, 16, head_dim, fmt, gen, device)
    seq_lens, k_scale = int32(lens, device), k_scale_of(scale_kind, device)
    q = randn_tokens(len(lens), 2 * HKV, WINDOW, head_dim, dtype=dtype, device=device, gen=gen)
    dense_k = ref.paged_to_dense(pool.k, table, seq_lens, layout).to(device)  # fp8 [B, Hkv, 80, D]
    real_k = dequantised(dense_k, k_scale)
    lse = lse_f64(q, real_k, seq_lens=seq_lens)
    out = kp.paged.window_scores(q, pool.k, table.to(device), seq_lens, lse=lse, gqa="sum",
                                 layout=layout, k_scale=k_scale)
    tol = score_tol(device, dtype)
    assert_scores_close(out, ref.window_scores(q, real_k, lse=lse, gqa="sum", seq_lens=seq_lens),
                        tol, seq_lens)
    dense = kp.window_scores(q, dense_k, lse=lse, gqa="sum", seq_lens=seq_lens, k_scale=k_scale)
    assert_scores_close(out, dense, tol, seq_lens)


@pytest.mark.skipif(not HAS_EMULATOR, reason="no CUDA emulator")
@pytest.mark.parametrize("fmt", FP8, ids=fp8_id)
def test_paged_kernel_choice(fmt, gen):
    lens = ragged_lens(16)
    pool, table = fp8_pool("NHD", "contig", lens, 16, 64, fmt, gen, "cpu")
    q = randn_tokens(len(lens), 4, WINDOW, 64, dtype=torch.bfloat16, gen=gen)
    ran = launched(lambda: kp.paged.window_scores(q, pool.k, table, int32(lens)))
    tag = "kvprune::Fp8E4M3" if fmt == torch.float8_e4m3fn else "kvprune::Fp8E5M2"
    assert any("window_scores_mma_kernel<__nv_bfloat16, 64," in name and tag in name
               for name in ran), ran


@pytest.mark.parametrize("kind", ["streaming", "gap", "later_block"])
@pytest.mark.parametrize("dim", [7, 128])
@pytest.mark.parametrize("fmt", FP8, ids=fp8_id)
@pytest.mark.parametrize("layout,pool_kind", [("NHD", "contig"), ("NHD", "sliced"),
                                              ("HND", "vllm_cpu")],
                         ids=["NHD-contig", "NHD-sliced", "HND-vllm_cpu"])
def test_paged_compact_copies_bytes(layout, pool_kind, fmt, dim, kind, device, gen):
    """The whole storage after compaction equals reference.paged_compact on a uint8 copy
    (slots [new_len, old_len) of each row, left open by the spec, zeroed on both sides)."""
    lens = ragged_lens(16)
    pool, table = fp8_pool(layout, pool_kind, lens, 16, dim, fmt, gen, device)
    # Every byte random (NaN encodings too): a copy through floats would show.
    pool.base.view(U8).copy_(torch.randint(0, 256, pool.base.shape, generator=gen, dtype=U8))
    idx, seq_lens = kept_indices(kind, lens, HKV, 16, gen), int32(lens)
    expected = as_bytes(pool)
    exp_lens = ref.paged_compact(expected.k, expected.v, table, seq_lens, idx, layout)
    new_lens = kp.paged.compact(pool.k, pool.v, table.to(device), seq_lens.to(device),
                                idx.to(device), layout=layout)
    assert torch.equal(new_lens.cpu(), exp_lens)
    result = as_bytes(pool)
    for p in (result, expected):
        blank_unspecified(p, table, seq_lens, exp_lens)
    assert torch.equal(result.base, expected.base), "compacted fp8 pool differs from the reference"


@pytest.mark.parametrize("fmt", FP8, ids=fp8_id)
@pytest.mark.parametrize("layout,shift", [("NHD", 0), ("HND", 0), ("HND", 2)])
def test_paged_snapkv(layout, shift, fmt, device, gen):
    """Same kept positions as dense snapkv on the same fp8 tokens (and tie-tolerantly the
    float64 selection), unshifted and shifted pools; the pool is compacted byte for byte as
    reference.paged_compact."""
    lens = ragged_lens(16)
    pool, table = fp8_pool(layout, "contig", lens, 16, 64, fmt, gen, device)
    seq_lens, k_scale = int32(lens, device), k_scale_of("per_head", device)
    q = randn_tokens(len(lens), 2 * HKV, WINDOW, 64, dtype=torch.bfloat16, device=device, gen=gen)
    dense_k, dense_v = (ref.paged_to_dense(c, table, seq_lens, layout).to(device)
                        for c in (pool.k, pool.v))
    exp_idx = kp.snapkv(q, dense_k, dense_v, 20, seq_lens=seq_lens, k_scale=k_scale,
                        pool_shift=shift, **SNAP).idx
    expected = as_bytes(pool)
    idx, new_lens = kp.paged.snapkv(q, pool.k, pool.v, table.to(device), seq_lens, 20,
                                    layout=layout, k_scale=k_scale, pool_shift=shift, **SNAP)
    assert torch.equal(idx.cpu(), exp_idx.cpu())
    scores = ref.window_scores(q, dequantised(dense_k, k_scale), gqa="max", seq_lens=seq_lens)
    pooled = ref.pool_scores(scores, 5, "avg", window=8, seq_lens=seq_lens, shift=shift)
    atol = 2 * score_tol(device, torch.bfloat16) * scores.double().abs().amax(dim=-1)
    check_selection(idx, pooled, 20, n_sink=2, window=8, seq_lens=seq_lens, atol=atol)
    exp_lens = ref.paged_compact(expected.k, expected.v, table, int32(lens), idx.cpu(), layout)
    assert torch.equal(new_lens.cpu(), exp_lens)
    result = as_bytes(pool)
    for p in (result, expected):
        blank_unspecified(p, table, int32(lens), exp_lens)
    assert torch.equal(result.base, expected.base)


# ---------------------------------------------------------------- bad input

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def x(device, gen):
    """Valid inputs: q fp32 [2, 4, W, 16], k/v e4m3 [2, Hkv, 32, 16], idx [2, Hkv, 8],
    a decode cache of e4m3 [1, Hkv, 8, 16], and k_scale [Hkv]."""
    q = torch.randn(2, 4, W, 16, generator=gen).to(device)
    k, v = (quantised(2, HKV, 32, 16, E4M3, None, gen).to(device) for _ in range(2))
    cache = kp.DecodeCache.empty(1, HKV, 8, 16, dtype=E4M3, device=device, h2o=True)
    return dict(q=q, k=k, v=v, idx=torch.zeros(2, HKV, 8, dtype=torch.int32, device=device),
                cache=cache, tok=torch.zeros(1, HKV, 1, 16, dtype=E4M3, device=device),
                scale=torch.ones(HKV, device=device))


def ws(a, **change):
    """kp.window_scores on the valid inputs with some arguments replaced."""
    args = {"q": a["q"], "k": a["k"], "k_scale": a["scale"], **change}
    return kp.window_scores(args.pop("q"), args.pop("k"), **args)


def bf16_cache(a):
    return kp.DecodeCache.empty(1, HKV, 8, 16, dtype=torch.bfloat16, device=a["q"].device)


VE, TE = ValueError, TypeError
# (id, call on the valid inputs that breaks one thing, exception, regex: the message starts
# with the argument's name)
BAD = [
    ("q-fp8", lambda a: ws(a, q=a["q"].to(E4M3)), TE, r"^q\b"),
    ("q-fp8-e5m2", lambda a: ws(a, q=a["q"].to(torch.float8_e5m2)), TE, r"^q\b"),
    ("k-other-dtype", lambda a: ws(a, k=a["k"].half()), TE, r"^k\b"),
    ("k-bf16-q-f16", lambda a: ws(a, q=a["q"].half(), k=a["k"].bfloat16()), TE, r"^k\b"),
    ("scale-float64", lambda a: ws(a, k_scale=a["scale"].double()), TE, r"^k_scale\b"),
    ("scale-bf16", lambda a: ws(a, k_scale=a["scale"].bfloat16()), TE, r"^k_scale\b"),
    ("scale-int32", lambda a: ws(a, k_scale=a["scale"].int()), TE, r"^k_scale\b"),
    ("scale-shape-3", lambda a: ws(a, k_scale=torch.ones(3, device=a["q"].device)), VE,
     r"^k_scale\b"),
    ("scale-2d", lambda a: ws(a, k_scale=a["scale"][:, None]), VE, r"^k_scale\b"),
    ("scale-strided", lambda a: ws(a, k_scale=torch.ones(2 * HKV, device=a["q"].device)[::2]),
     VE, r"^k_scale\b"),
    ("ws-out-scale", lambda a: kp.window_scores(
        a["q"], a["k"], out=torch.zeros(2, HKV, 32, device=a["q"].device),
        k_scale=a["scale"].double()), TE, r"^k_scale\b"),
    ("snapkv-v-other-fp8", lambda a: kp.snapkv(a["q"], a["k"], a["v"].to(torch.float8_e5m2),
                                               16, window=W), TE, r"^v\b"),
    ("snapkv-v-fp32", lambda a: kp.snapkv(a["q"], a["k"], a["v"].float(), 16, window=W), TE,
     r"^v\b"),
    ("snapkv-scale-shape", lambda a: kp.snapkv(a["q"], a["k"], a["v"], 16, window=W,
                                               k_scale=a["scale"][:1].expand(3).contiguous()),
     VE, r"^k_scale\b"),
    ("paged-scale-dtype", lambda a: kp.paged.window_scores(
        a["q"], a["k"].transpose(1, 2).contiguous().view(16, 4, HKV, 16),
        torch.arange(16, dtype=torch.int32, device=a["q"].device).view(2, 8),
        torch.tensor([32, 20], dtype=torch.int32, device=a["q"].device),
        k_scale=a["scale"].half()), TE, r"^k_scale\b"),
    ("gather-rope", lambda a: kp.gather_kv(a["k"], a["v"], a["idx"], rope=kp.Rope()), TE,
     r"^k\b"),
    ("gather-v-other-dtype", lambda a: kp.gather_kv(a["k"], a["v"].bfloat16(), a["idx"]), TE,
     r"^v\b"),
    ("append-fp8-cache", lambda a: kp.streaming_append(
        a["cache"].k, a["cache"].v, a["cache"].slot_pos, a["cache"].seq_lens, a["tok"], a["tok"]),
     TE, r"^k_cache\b"),
    ("append-fp8-tokens", lambda a: kp.streaming_append(
        *bf16_cache(a)[:4], a["tok"], a["tok"]), TE, r"^k_new\b"),
    ("decode-fp8-cache", lambda a: kp.decode_scores(
        a["q"][:1, :, :1], a["cache"].k, a["cache"].slot_pos, a["cache"].seq_lens,
        a["cache"].h2o_scores), TE, r"^k_cache\b"),
    ("decode-fp8-q", lambda a: kp.decode_scores(
        a["tok"], bf16_cache(a).k, a["cache"].slot_pos, a["cache"].seq_lens), TE, r"^q\b"),
    ("rerotate-fp8", lambda a: kp.rerotate_keys(a["cache"].k, a["cache"].slot_pos,
                                                a["cache"].slot_pos), TE, r"^k\b"),
    ("h2o-fp8-scores", lambda a: kp.h2o_evict(a["cache"].h2o_scores.to(E4M3),
                                              a["cache"].slot_pos, a["cache"].seq_lens,
                                              n_sink=1, recent=1), TE, r"^h2o_scores\b"),
]


@pytest.mark.parametrize("name,call,exc,match", BAD, ids=[case[0] for case in BAD])
def test_bad_input_names_the_argument(name, call, exc, match, x):
    with pytest.raises(exc, match=match):
        call(x)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_k_scale_on_another_device(gen):
    """A CPU k_scale with CUDA q/k is refused (not read through a host pointer)."""
    q = torch.randn(1, 2, W, 64, generator=gen).cuda()
    k = quantised(1, HKV, 16, 64, E4M3, None, gen).cuda()
    with pytest.raises(ValueError, match=r"^k_scale\b"):
        kp.window_scores(q, k, k_scale=torch.ones(HKV))
