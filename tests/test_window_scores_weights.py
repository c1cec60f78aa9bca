"""kp.window_scores(qreduce="max", query_weight=..., key_weight=...): KVzip+'s weighted maxima,
against a float64 loop written here (the oracle of the reference's weights) and against
reference.window_scores on every path (CPU, the CUDA kernels emulated, a GPU).

Query head h's score of key j is key_weight[b,h,j] * max_i(query_weight[b,h,i] * p[b,h,i,j]),
then the group's heads combine by gqa; a weight that is not > 0 (NaN included) counts as 0.
"""

from __future__ import annotations

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda import reference as ref

from helpers import (
    DTYPES, GQA_MODES, assert_rejected_untouched, assert_scores_close, dtype_id, lse_f64,
    poison_beyond, randn_tokens, score_tol, seq_lens_tensor,
)


def weights(batch, q_heads, count, device, gen, *, spoilt=True):
    """fp32 [batch, q_heads, count] in [0.25, 3); with `spoilt`, some are 0, negative or NaN."""
    w = torch.rand(batch, q_heads, count, generator=gen) * 2.75 + 0.25
    if spoilt:
        flat = w.view(-1)
        flat[::7] = 0.0
        flat[3::11] = -1.5
        flat[5::13] = float("nan")
    return w.to(device)


def test_float64_loop_by_hand(gen):
    """The reference's weights against a loop over (head, query, key) written here."""
    b, hq, hkv, w, n, d, m = 1, 4, 2, 6, 10, 4, 8
    q, k = torch.randn(b, hq, w, d, generator=gen), torch.randn(b, hkv, n, d, generator=gen)
    qw, kw = weights(b, hq, w, "cpu", gen), weights(b, hq, m, "cpu", gen)
    got = ref.window_scores(q, k, scale=0.7, gqa="max", qreduce="max", out=torch.zeros(b, hkv, m),
                            query_weight=qw, key_weight=kw)
    want = torch.zeros(b, hkv, m, dtype=torch.float64)
    used = lambda x: float(x) if float(x) > 0 else 0.0  # noqa: E731 (NaN > 0 is False)
    for h in range(hq):
        for i in range(w):
            seen = n - w + i + 1  # query i sees itself and every key before it
            p = torch.softmax((k[0, h // 2, :seen].double() @ q[0, h, i].double()) * 0.7, 0)
            for t in range(min(m, seen)):
                v = float(p[t]) * used(qw[0, h, i]) * used(kw[0, h, t])
                want[0, h // 2, t] = max(float(want[0, h // 2, t]), v)
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-9)


def test_unit_weights_change_nothing(device, gen):
    q = randn_tokens(2, 4, 9, 32, device=device, gen=gen)
    k = randn_tokens(2, 2, 40, 32, device=device, gen=gen)
    ones = lambda c: torch.ones(2, 4, c, device=device)  # noqa: E731
    plain = kp.window_scores(q, k, qreduce="max")
    weighted = kp.window_scores(q, k, qreduce="max", query_weight=ones(9), key_weight=ones(40))
    assert torch.equal(plain, weighted)


def test_weights_change_the_scores(device, gen):
    """Each weight alone moves the scores (a test of the plumbing that could not fail otherwise)."""
    q = randn_tokens(1, 2, 6, 16, device=device, gen=gen)
    k = randn_tokens(1, 1, 30, 16, device=device, gen=gen)
    plain = kp.window_scores(q, k, qreduce="max", gqa="max")
    qw, kw = weights(1, 2, 6, device, gen, spoilt=False), weights(1, 2, 30, device, gen, spoilt=False)
    for kwargs in ({"query_weight": qw}, {"key_weight": kw}):
        got = kp.window_scores(q, k, qreduce="max", gqa="max", **kwargs)
        assert not torch.allclose(got, plain)
        want = ref.window_scores(q, k, qreduce="max", gqa="max", **kwargs)
        assert_scores_close(got, want, score_tol(device, torch.float32))


# D 64 runs on tensor cores for fp16/bf16 (CUDA cores for fp32); W = 20 is not a multiple of 16.
@pytest.mark.parametrize("fold", [False, True], ids=["fresh", "fold"])
@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("gqa", GQA_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_reference(gqa, with_lse, fold, dtype, device, gen):
    q = randn_tokens(2, 6, 20, 64, dtype=dtype, device=device, layout="bnhd", gen=gen)
    k = randn_tokens(2, 2, 150, 64, dtype=dtype, device=device, layout="bnhd", gen=gen)
    lse = lse_f64(q, k) if with_lse else None
    m = 110 if fold else 150
    out = (torch.rand(2, 2, m, generator=gen) * 0.1).to(device) if fold else None
    qw, kw = weights(2, 6, 20, device, gen), weights(2, 6, m, device, gen)
    expected = ref.window_scores(q, k, lse=lse, gqa=gqa, qreduce="max", out=out,
                                 query_weight=qw, key_weight=kw)
    got = kp.window_scores(q, k, lse=lse, gqa=gqa, qreduce="max", out=out, query_weight=qw,
                           key_weight=kw)
    assert_scores_close(got, expected, score_tol(device, dtype))


RAGGED_LENS = [150, 0, 5, 30, 50]  # around W = 8 and M = 50: full, empty, n < W, n < M, n == M


@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_ragged_seq_lens(with_lse, dtype, device, gen):
    seq_lens = seq_lens_tensor(RAGGED_LENS, device)
    batch = len(RAGGED_LENS)
    q = randn_tokens(batch, 4, 8, 64, dtype=dtype, device=device, gen=gen)
    k = randn_tokens(batch, 2, 150, 64, dtype=dtype, device=device, gen=gen)
    lse = lse_f64(q, k, seq_lens=seq_lens) if with_lse else None
    out = (torch.rand(batch, 2, 50, generator=gen) * 0.1).to(device)
    qw, kw = weights(batch, 4, 8, device, gen), weights(batch, 4, 50, device, gen)
    expected = ref.window_scores(q, k, lse=lse, seq_lens=seq_lens, qreduce="max", out=out,
                                 query_weight=qw, key_weight=kw)
    poison_beyond(k, RAGGED_LENS)  # padding past each row's length is never read
    got = kp.window_scores(q, k, lse=lse, seq_lens=seq_lens, qreduce="max", out=out,
                           query_weight=qw, key_weight=kw)
    assert_scores_close(got, expected, score_tol(device, dtype))


@pytest.mark.parametrize("head_dim", [24, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_head_dims(dtype, head_dim, device, gen):
    """D 128/256 on tensor cores for fp16/bf16, D 24 on CUDA cores; odd W and N."""
    q = randn_tokens(1, 8, 17, head_dim, dtype=dtype, device=device, gen=gen)
    k = randn_tokens(1, 2, 99, head_dim, dtype=dtype, device=device, gen=gen)
    out = (torch.rand(1, 2, 61, generator=gen) * 0.1).to(device)
    qw, kw = weights(1, 8, 17, device, gen), weights(1, 8, 61, device, gen)
    expected = ref.window_scores(q, k, gqa="max", qreduce="max", out=out, query_weight=qw,
                                 key_weight=kw)
    got = kp.window_scores(q, k, gqa="max", qreduce="max", out=out, query_weight=qw, key_weight=kw)
    assert_scores_close(got, expected, score_tol(device, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_one_query_head_per_kv_head(dtype, device, gen):
    """G = 1 (Hq == Hkv): on tensor cores the CTA's only head is weighted and folded at the
    store itself, no split reduce."""
    q = randn_tokens(2, 2, 24, 64, dtype=dtype, device=device, gen=gen)
    k = randn_tokens(2, 2, 130, 64, dtype=dtype, device=device, gen=gen)
    out = (torch.rand(2, 2, 90, generator=gen) * 0.1).to(device)
    qw, kw = weights(2, 2, 24, device, gen), weights(2, 2, 90, device, gen)
    expected = ref.window_scores(q, k, qreduce="max", out=out, query_weight=qw, key_weight=kw)
    kp.window_scores(q, k, qreduce="max", out=out, query_weight=qw, key_weight=kw)
    assert_scores_close(out, expected, score_tol(device, dtype))


@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
def test_head_split(with_lse, device, gen):
    """D 256, W 200, G 3: the tensor-core path splits the group over CTAs (as it does for
    every G > 1 with key weights) and the split reduce combines them."""
    q = randn_tokens(1, 3, 200, 256, dtype=torch.bfloat16, device=device, gen=gen)
    k = randn_tokens(1, 1, 300, 256, dtype=torch.bfloat16, device=device, gen=gen)
    lse = lse_f64(q, k) if with_lse else None
    out = (torch.rand(1, 1, 250, generator=gen) * 0.1).to(device)
    qw, kw = weights(1, 3, 200, device, gen), weights(1, 3, 250, device, gen)
    expected = ref.window_scores(q, k, lse=lse, gqa="mean", qreduce="max", out=out,
                                 query_weight=qw, key_weight=kw)
    kp.window_scores(q, k, lse=lse, gqa="mean", qreduce="max", out=out, query_weight=qw,
                     key_weight=kw)
    assert_scores_close(out, expected, score_tol(device, torch.bfloat16))


def test_long_window(device, gen):
    """W = 600 queries of G = 2 heads: several CPU row blocks, one straddling the heads."""
    q = randn_tokens(1, 2, 600, 64, device=device, gen=gen)
    k = randn_tokens(1, 1, 800, 64, device=device, gen=gen)
    out = (torch.rand(1, 1, 700, generator=gen) * 0.1).to(device)
    qw, kw = weights(1, 2, 600, device, gen), weights(1, 2, 700, device, gen)
    expected = ref.window_scores(q, k, qreduce="max", out=out, query_weight=qw, key_weight=kw)
    kp.window_scores(q, k, qreduce="max", out=out, query_weight=qw, key_weight=kw)
    assert_scores_close(out, expected, score_tol(device, torch.float32))


VE, TE = ValueError, TypeError
B, HQ, HKV, W, N, D, M = 2, 4, 2, 8, 64, 32, 40
BAD = [
    ("qw-with-sum", lambda x: kp.window_scores(x.q, x.k, query_weight=x.qw), VE, r"qreduce='max'"),
    ("kw-with-sum", lambda x: kp.window_scores(x.q, x.k, key_weight=x.kw_n), VE, r"qreduce='max'"),
    ("qw-shape", lambda x: kp.window_scores(x.q, x.k, qreduce="max", query_weight=x.qw[:, :1]), VE,
     r"query_weight.*shape"),
    ("qw-per-token", lambda x: kp.window_scores(x.q, x.k, qreduce="max", query_weight=x.qw[:, 0]), VE,
     r"query_weight.*shape"),
    ("qw-double", lambda x: kp.window_scores(x.q, x.k, qreduce="max", query_weight=x.qw.double()), TE,
     r"query_weight.*float32"),
    ("qw-strided", lambda x: kp.window_scores(x.q, x.k, qreduce="max",
                                              query_weight=x.qw.transpose(0, 1).contiguous().transpose(0, 1)),
     VE, r"query_weight.*contiguous"),
    ("kw-length-n-with-out", lambda x: kp.window_scores(x.q, x.k, qreduce="max", out=x.out,
                                                        key_weight=x.kw_n), VE, r"key_weight.*shape"),
    ("kw-length-m-fresh", lambda x: kp.window_scores(x.q, x.k, qreduce="max", key_weight=x.kw_m), VE,
     r"key_weight.*shape"),
    ("kw-half", lambda x: kp.window_scores(x.q, x.k, qreduce="max", out=x.out, key_weight=x.kw_m.half()),
     TE, r"key_weight.*float32"),
    ("kw-overlaps-out", lambda x: kp.window_scores(x.q, x.k, qreduce="max", out=x.out,
                                                   key_weight=x.base.view(B, HQ, M)), VE, r"\bout\b"),
    ("qw-overlaps-out", lambda x: kp.window_scores(x.q, x.k, qreduce="max", out=x.out,
                                                   query_weight=x.base[: B * HQ * W].view(B, HQ, W)),
     VE, r"\bout\b"),
    ("weights-on-reference-with-sum", lambda x: ref.window_scores(x.q, x.k, query_weight=x.qw), VE,
     r"qreduce='max'"),
    ("kw-length-n-on-reference-with-out", lambda x: ref.window_scores(x.q, x.k, qreduce="max", out=x.out,
                                                                      key_weight=x.kw_n), VE,
     r"key_weight.*shape"),
]


@pytest.fixture
def x(device, gen):
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(device)  # noqa: E731
    ns = type("Inputs", (), {})()
    ns.q, ns.k = randn(B, HQ, W, D), randn(B, HKV, N, D)
    ns.base = torch.zeros(B * HQ * M, device=device)  # out is its start
    ns.out = ns.base[: B * HKV * M].view(B, HKV, M)
    ns.qw, ns.kw_n, ns.kw_m = randn(B, HQ, W), randn(B, HQ, N), randn(B, HQ, M)
    return ns


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(case, x):
    _, call, exc, pattern = case
    assert_rejected_untouched(call, x, exc, pattern)
