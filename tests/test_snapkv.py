"""kp.snapkv (fused dual-stage pipeline) against the reference.

The op's scores may differ from the reference's by rounding, so its selection is
checked tie-tolerantly against the reference's pooled scores; inputs built to have
well-separated (or exactly tied) scores must reproduce the reference index for index.
The kept K/V must always be bit-exact copies of the selected rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda import reference as ref

from helpers import (
    DTYPES, assert_gathered, check_selection, dtype_id, lse_f64, poison_beyond, randn_tokens,
    score_tol, seq_lens_tensor,
)


class Case(NamedTuple):
    kv_heads: int
    group: int
    length: int
    q_window: int  # W, observation queries in q
    budget: int
    window: int = 32  # protected recent window (pooling boundary)
    n_sink: int = 4
    kernel_size: int = 7
    pool: str = "max"
    gqa: str = "mean"
    with_lse: bool = False
    layout: str = "contig"
    lens: Optional[tuple] = None  # seq_lens; None = 2 full rows
    head_dim: int = 64

    def id(self) -> str:
        lens = "full" if self.lens is None else "ragged"
        return (f"Hkv{self.kv_heads}-G{self.group}-N{self.length}-W{self.q_window}-K{self.budget}"
                f"-win{self.window}-S{self.n_sink}-{self.pool}{self.kernel_size}-{self.gqa}"
                f"{'-lse' if self.with_lse else ''}-{self.layout}-{lens}-D{self.head_dim}")


CASES = [
    Case(1, 1, 40, 8, 12, window=8),
    Case(2, 4, 100, 8, 40, window=8, pool="avg", gqa="max", with_lse=True, layout="bnhd"),
    Case(2, 7, 37, 32, 36, head_dim=24, layout="sliced"),
    Case(2, 2, 300, 32, 50, window=8, n_sink=1, pool="avg", gqa="sum", layout="bnhd"),
    Case(1, 4, 300, 16, 64, window=16, kernel_size=1, gqa="sum",
         lens=(300, 5, 0, 64, 65, 200)),
    Case(2, 4, 1000, 32, 150, pool="avg", kernel_size=5, with_lse=True, head_dim=128,
         lens=(1000, 31, 151, 777)),
    Case(2, 1, 1000, 64, 150, window=64, n_sink=0, kernel_size=31, head_dim=256, layout="bnhd"),
    Case(1, 4, 4099, 32, 615, gqa="max", head_dim=128, layout="sliced"),
    Case(1, 4, 20000, 32, 3000, with_lse=True, head_dim=128, layout="bnhd"),
]


def make_inputs(case: Case, dtype, device, gen):
    batch = 2 if case.lens is None else len(case.lens)
    q = randn_tokens(batch, case.kv_heads * case.group, case.q_window, case.head_dim,
                     dtype=dtype, device=device, layout=case.layout, gen=gen)
    k = randn_tokens(batch, case.kv_heads, case.length, case.head_dim,
                     dtype=dtype, device=device, layout=case.layout, gen=gen)
    v = randn_tokens(batch, case.kv_heads, case.length, case.head_dim,
                     dtype=dtype, device=device, layout=case.layout, gen=gen)
    seq_lens = seq_lens_tensor(case.lens, device)
    lse = lse_f64(q, k, seq_lens=seq_lens) if case.with_lse else None
    return q, k, v, lse, seq_lens


def run_snapkv(case: Case, q, k, v, lse, seq_lens, **extra) -> kp.KeptKV:
    return kp.snapkv(q, k, v, case.budget, n_sink=case.n_sink, window=case.window,
                     kernel_size=case.kernel_size, pool=case.pool, gqa=case.gqa, lse=lse,
                     seq_lens=seq_lens, **extra)


def reference_pooled(case: Case, q, k, lse, seq_lens, scale=None):
    """(raw scores, pooled scores) of the reference, fp32 on the CPU."""
    scores = ref.window_scores(q, k, lse=lse, scale=scale, gqa=case.gqa, seq_lens=seq_lens)
    pooled = ref.pool_scores(scores, case.kernel_size, case.pool, window=case.window,
                             seq_lens=seq_lens)
    return scores, pooled


def check_against_reference(case, kept, q, k, v, lse, seq_lens, tol, scale=None):
    scores, pooled = reference_pooled(case, q, k, lse, seq_lens, scale)
    # Op and reference scores differ by <= tol * row max, so their pooled ranks may
    # swap only between scores that close: allow twice that.
    atol = 2 * tol * scores.double().abs().amax(dim=-1)
    check_selection(kept.idx, pooled, case.budget, n_sink=case.n_sink, window=case.window,
                    seq_lens=seq_lens, atol=atol)
    assert_gathered(k, v, kept.idx, kept.k, kept.v)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_matches_reference(case, dtype, device, gen):
    q, k, v, lse, seq_lens = make_inputs(case, dtype, device, gen)
    if case.lens is not None:  # cache padding holds garbage; it must never be read
        poison_beyond(k, case.lens)
        poison_beyond(v, case.lens)
    kept = run_snapkv(case, q, k, v, lse, seq_lens)
    assert isinstance(kept, kp.KeptKV)
    if case.lens is not None:  # the reference must not see the NaN padding
        k, v = (torch.nan_to_num(t, nan=0.0) for t in (k, v))
    check_against_reference(case, kept, q, k, v, lse, seq_lens, score_tol(device, dtype))


def test_custom_scale(device, gen):
    case = Case(2, 2, 200, 8, 40, window=8)
    q, k, v, _, _ = make_inputs(case, torch.float32, device, gen)
    kept = run_snapkv(case, q, k, v, None, None, scale=0.02)
    check_against_reference(case, kept, q, k, v, None, None, score_tol(device, torch.float32),
                            scale=0.02)


@pytest.mark.parametrize("pool", ["max", "avg"])
def test_matches_composed_ops(pool, device, gen):
    """snapkv == window_scores -> pool_scores -> select_keep -> gather_kv on one device.
    Max pooling is exact, so the indices must agree exactly; avg pooling may round
    differently when fused, so it is checked tie-tolerantly."""
    case = Case(2, 4, 500, 32, 100, pool=pool)
    q, k, v, _, _ = make_inputs(case, torch.float16, device, gen)
    kept = kp.snapkv(q, k, v, case.budget, pool=pool)  # other arguments: defaults
    scores = kp.window_scores(q, k)
    pooled = kp.pool_scores(scores, 7, pool, window=32)
    composed = kp.select_keep(pooled, case.budget, n_sink=4, window=32)
    if pool == "max":
        assert torch.equal(kept.idx, composed)
    atol = 1e-6 * scores.double().abs().amax(dim=-1).cpu()
    check_selection(kept.idx, pooled, case.budget, n_sink=4, window=32, atol=atol)
    assert_gathered(k, v, kept.idx, kept.k, kept.v)


@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("lens", [None, (0, 1000, 37, 0, 612)], ids=["full", "ragged"])
def test_fused_equals_staged_exactly(lens, with_lse, device, gen):
    """kp.snapkv (one core call, pooling fused into the selection) returns exactly what
    the four public ops return when chained: several heads and batch rows, empty and
    short rows, with and without lse."""
    case = Case(3, 2, 1000, 16, 150, window=16, lens=lens, with_lse=with_lse)
    q, k, v, lse, seq_lens = make_inputs(case, torch.float32, device, gen)
    kept = run_snapkv(case, q, k, v, lse, seq_lens)
    scores = kp.window_scores(q, k, lse=lse, seq_lens=seq_lens)
    pooled = kp.pool_scores(scores, case.kernel_size, case.pool, window=case.window,
                            seq_lens=seq_lens)
    idx = kp.select_keep(pooled, case.budget, n_sink=case.n_sink, window=case.window,
                         seq_lens=seq_lens)
    out_k, out_v = kp.gather_kv(k, v, idx)
    assert torch.equal(kept.idx, idx)
    assert torch.equal(kept.k, out_k) and torch.equal(kept.v, out_v)


# (kernel_size, pool_shift): every shift of kernel 7, the default 49 / 16 and its largest.
SHIFTS = [(7, 0), (7, 1), (7, 2), (7, 3), (49, 16), (49, 24)]


@pytest.mark.parametrize("pool", ["max", "avg"])
@pytest.mark.parametrize("kernel_size,shift", SHIFTS, ids=[f"ks{k}-s{s}" for k, s in SHIFTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_shifted_pool_fused_equals_staged_and_reference(dtype, kernel_size, shift, pool, device,
                                                        gen):
    """kp.snapkv(pool_shift=s) keeps exactly what the staged ops keep (window_scores ->
    pool_scores(shift=s) -> select_keep -> gather_kv), kp.snapkv_select the same positions,
    and tie-tolerantly what the reference's
    shifted pool ranks: a ragged batch (rows shorter than the window, of the sinks plus the
    window, one past the budget, full), sinks 0 and 4, window edges."""
    lens = (300, 20, 0, 61, 100, 101, 207)
    for n_sink, window in ((4, 16), (0, 8)):
        case = Case(2, 3, 300, 16, 100, window=window, n_sink=n_sink, kernel_size=kernel_size,
                    pool=pool, lens=lens, with_lse=n_sink == 0, layout="bnhd")
        q, k, v, lse, seq_lens = make_inputs(case, dtype, device, gen)
        kept = run_snapkv(case, q, k, v, lse, seq_lens, pool_shift=shift)
        scores = kp.window_scores(q, k, lse=lse, seq_lens=seq_lens)
        pooled = kp.pool_scores(scores, kernel_size, pool, window=window, seq_lens=seq_lens,
                                shift=shift)
        idx = kp.select_keep(pooled, case.budget, n_sink=n_sink, window=window,
                             seq_lens=seq_lens)
        assert torch.equal(kept.idx, idx)
        out_k, out_v = kp.gather_kv(k, v, idx)
        assert torch.equal(kept.k, out_k) and torch.equal(kept.v, out_v)
        selected = kp.snapkv_select(q, k, case.budget, n_sink=n_sink, window=window,
                                    kernel_size=kernel_size, pool=pool, lse=lse,
                                    seq_lens=seq_lens, pool_shift=shift)
        assert torch.equal(selected, idx)
        raw = ref.window_scores(q, k, lse=lse, gqa=case.gqa, seq_lens=seq_lens)
        want = ref.pool_scores(raw, kernel_size, pool, window=window, seq_lens=seq_lens,
                               shift=shift)
        atol = 2 * score_tol(device, dtype) * raw.double().abs().amax(dim=-1)
        check_selection(kept.idx, want, case.budget, n_sink=n_sink, window=window,
                        seq_lens=seq_lens, atol=atol)


def test_shifted_pool_keeps_what_follows_the_voted_key(device):
    """By hand: the window's queries vote for key 10 alone (a spike along dim 0); kernel 5,
    shift 2, budget 4 sinks + 5 + window 4. The pool spreads the vote over [10, 14], the
    five picks; centred (shift 0) it covers [8, 12]."""
    n, d = 40, 8
    q = torch.zeros(1, 1, 4, d)
    q[..., 0] = 20.0
    k = torch.zeros(1, 1, n, d)
    k[0, 0, 10, 0] = 1.0
    for shift, first in ((2, 10), (0, 8)):
        kept = kp.snapkv(q.to(device), k.to(device), k.to(device), 13, n_sink=4, window=4,
                         kernel_size=5, pool_shift=shift)
        want = list(range(4)) + list(range(first, first + 5)) + list(range(n - 4, n))
        assert kept.idx[0, 0].tolist() == want


def separated_inputs(kv_heads, group, length, dtype, device, gen, head_dim=64):
    """Inputs whose scores are strictly ordered with ~5 % gaps: every window query is
    the same vector along dim 0 and key j is rank_j * e0 (ranks distinct, exact in
    every dtype for length <= 256), so key j's score grows with rank_j."""
    assert length <= 256
    q = torch.zeros(2, kv_heads * group, 8, head_dim)
    q[..., 0] = 0.05 * math.sqrt(head_dim)
    k = torch.randn(2, kv_heads, length, head_dim, generator=gen)
    k[..., 1:] = 0.0
    k[..., 0] = torch.stack([torch.randperm(length, generator=gen).float()
                             for _ in range(2 * kv_heads)]).reshape(2, kv_heads, length)
    v = torch.randn(2, kv_heads, length, head_dim, generator=gen)
    return (t.to(device=device, dtype=dtype) for t in (q, k, v))


@pytest.mark.parametrize("pool,kernel_size", [("max", 7), ("max", 1), ("avg", 1)])
@pytest.mark.parametrize("gqa", ["mean", "max"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_separated_scores_match_reference_exactly(dtype, gqa, pool, kernel_size, device, gen):
    q, k, v = separated_inputs(2, 4, 200, dtype, device, gen)
    args = dict(n_sink=4, window=16, kernel_size=kernel_size, pool=pool, gqa=gqa)
    kept = kp.snapkv(q, k, v, 60, **args)
    exp_k, exp_v, exp_idx = ref.snapkv(q, k, v, 60, **args)
    assert torch.equal(kept.idx.cpu(), exp_idx)
    assert torch.equal(kept.k.cpu(), exp_k) and torch.equal(kept.v.cpu(), exp_v)


@pytest.mark.parametrize("pool", ["max", "avg"])
@pytest.mark.parametrize("length", [100, 3000])
def test_equal_scores_keep_lowest_positions(length, pool, device, gen):
    """All keys identical -> all prefix scores tie -> the lowest positions win."""
    budget, n_sink, window = 40, 4, 16
    q = randn_tokens(1, 4, 8, 64, device=device, gen=gen)
    k = torch.randn(1, 2, 1, 64, generator=gen).expand(1, 2, length, 64).contiguous().to(device)
    v = randn_tokens(1, 2, length, 64, device=device, gen=gen)
    kept = kp.snapkv(q, k, v, budget, n_sink=n_sink, window=window, pool=pool)
    expected = torch.cat([torch.arange(budget - window), torch.arange(length - window, length)])
    assert torch.equal(kept.idx.cpu(), expected.int().expand(1, 2, budget))
    assert_gathered(k, v, kept.idx, kept.k, kept.v)


def test_short_rows_keep_everything(device, gen):
    """Rows with n <= budget keep 0..n-1, padded with -1 and zero K/V rows."""
    lens = (0, 1, 7, 40)
    case = Case(2, 2, 40, 8, 40, window=8, lens=lens)
    q, k, v, _, seq_lens = make_inputs(case, torch.bfloat16, device, gen)
    kept = run_snapkv(case, q, k, v, None, seq_lens)
    for b, n in enumerate(lens):
        expected = torch.cat([torch.arange(n), torch.full((40 - n,), -1)]).int()
        assert torch.equal(kept.idx[b].cpu(), expected.expand(2, 40))
    assert_gathered(k, v, kept.idx, kept.k, kept.v)


def test_cpu_result_independent_of_thread_count(gen):
    """Deterministic output: the CPU split of work across threads must not matter."""
    case = Case(2, 4, 3000, 32, 400, with_lse=True, lens=(3000, 1234))
    inputs = make_inputs(case, torch.float32, "cpu", gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_snapkv(case, *inputs)
        single_scores = kp.window_scores(inputs[0], inputs[1], seq_lens=inputs[4])
        torch.set_num_threads(max(threads, 2))
        multi = run_snapkv(case, *inputs)
        multi_scores = kp.window_scores(inputs[0], inputs[1], seq_lens=inputs[4])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single_scores, multi_scores)
    for a, b in zip(single, multi):
        assert torch.equal(a, b)


def test_out_tensors_receive_the_kept_kv(device, gen):
    """out_k/out_v (here strided BNHD views of one buffer) get exactly what snapkv returns."""
    case = Case(kv_heads=2, group=2, length=300, q_window=8, budget=40, window=8)
    q = randn_tokens(2, case.kv_heads * case.group, case.q_window, case.head_dim,
                     dtype=torch.bfloat16, device=device, gen=gen)
    k, v = (randn_tokens(2, case.kv_heads, case.length, case.head_dim, dtype=torch.bfloat16,
                         device=device, gen=gen) for _ in range(2))
    want = kp.snapkv(q, k, v, case.budget, window=case.window)
    buf = torch.full((2, 2, case.budget, case.kv_heads, case.head_dim), float("nan"),
                     dtype=torch.bfloat16, device=device)
    out_k, out_v = buf[0].transpose(1, 2), buf[1].transpose(1, 2)  # [B, Hkv, budget, D] views
    got = kp.snapkv(q, k, v, case.budget, window=case.window, out_k=out_k, out_v=out_v)
    assert got.k is out_k and got.v is out_v
    assert torch.equal(got.idx, want.idx)
    assert torch.equal(out_k, want.k) and torch.equal(out_v, want.v)


def test_cpu_workspace_is_cached_and_released(gen):
    q = torch.randn(1, 4, 8, 64, generator=gen)
    k = torch.randn(1, 2, 2000, 64, generator=gen)
    kp.window_scores(q, k)
    assert kp.cpu_workspace_bytes() > 0
    kp.release_cpu_workspace()
    assert kp.cpu_workspace_bytes() == 0
    torch.testing.assert_close(kp.window_scores(q, k), ref.window_scores(q, k), rtol=1e-4, atol=1e-6)
