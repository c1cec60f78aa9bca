"""kp.window_scores(qreduce=..., out=...) against reference.window_scores (float64).

qreduce="max" takes each query head's maximum probability per key over its window
queries; out= folds the scores of keys [0, M) into an existing [B, Hkv, M] tensor
(max for qreduce "max", + for "sum"), so query chunks combine in one buffer.
"""

from __future__ import annotations

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda import reference as ref

from helpers import (
    DTYPES, GQA_MODES, HAS_CUDA, assert_rejected_untouched, assert_scores_close, dtype_id, lse_f64,
    poison_beyond, randn_tokens, score_tol, seq_lens_tensor,
)

QREDUCE = ("max", "sum")


def inputs(batch, kv_heads, group, length, window, head_dim, dtype, device, gen, layout="contig"):
    q = randn_tokens(batch, kv_heads * group, window, head_dim, dtype=dtype, device=device,
                     layout=layout, gen=gen)
    k = randn_tokens(batch, kv_heads, length, head_dim, dtype=dtype, device=device, layout=layout,
                     gen=gen)
    return q, k


def initial_out(batch, kv_heads, m, device, gen):
    """Existing scores to fold into: random, some negative (max(out, 0) shows past n)."""
    return (torch.randn(batch, kv_heads, m, generator=gen) * 0.3).to(device)


# D 64 runs on tensor cores for fp16/bf16 (CUDA cores for fp32); W = 20 is not a multiple of 16.
@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("gqa", GQA_MODES)
@pytest.mark.parametrize("qreduce", QREDUCE)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_reference(qreduce, gqa, with_lse, dtype, device, gen):
    q, k = inputs(2, 2, 3, 150, 20, 64, dtype, device, gen, layout="bnhd")
    lse = lse_f64(q, k) if with_lse else None
    out = kp.window_scores(q, k, lse=lse, gqa=gqa, qreduce=qreduce)
    assert out.shape == (2, 2, 150)
    expected = ref.window_scores(q, k, lse=lse, gqa=gqa, qreduce=qreduce)
    assert_scores_close(out, expected, score_tol(device, dtype))


def test_max_differs_from_sum(device, gen):
    """The two reductions really differ (a test of qreduce that could not fail otherwise)."""
    q, k = inputs(1, 1, 2, 64, 16, 24, torch.float32, device, gen)
    top = kp.window_scores(q, k, qreduce="max")
    total = kp.window_scores(q, k, qreduce="sum")
    assert (top <= total + 1e-6).all() and not torch.allclose(top, total)
    assert (top <= 1 + 1e-6).all()


@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("gqa", GQA_MODES)
@pytest.mark.parametrize("qreduce", QREDUCE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_fold_two_chunks(qreduce, gqa, with_lse, dtype, device, gen):
    """Chunk 1: 24 queries ending at position 119 (keys [0, 120)); chunk 2: 13 queries
    ending at 199. Both fold into one out of M = 90 context keys."""
    q1, k = inputs(2, 2, 2, 200, 24, 64, dtype, device, gen)
    q2, _ = inputs(2, 2, 2, 1, 13, 64, dtype, device, gen)
    k1 = k[:, :, :120]
    lse1 = lse_f64(q1, k1) if with_lse else None
    lse2 = lse_f64(q2, k) if with_lse else None
    out = initial_out(2, 2, 90, device, gen)
    expected = ref.window_scores(q1, k1, lse=lse1, gqa=gqa, qreduce=qreduce, out=out)
    expected = ref.window_scores(q2, k, lse=lse2, gqa=gqa, qreduce=qreduce, out=expected)
    ptr = out.data_ptr()
    assert kp.window_scores(q1, k1, lse=lse1, gqa=gqa, qreduce=qreduce, out=out) is out
    assert kp.window_scores(q2, k, lse=lse2, gqa=gqa, qreduce=qreduce, out=out) is out
    assert out.data_ptr() == ptr and out.shape == (2, 2, 90)
    assert_scores_close(out, expected, score_tol(device, dtype))


# Row lengths around W = 8 and M = 50: full, empty, n < W, n < M, n == M.
RAGGED_LENS = [150, 0, 5, 30, 50]


@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("fold", [False, True], ids=["fresh", "fold"])
@pytest.mark.parametrize("qreduce", QREDUCE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_ragged_seq_lens(qreduce, fold, with_lse, dtype, device, gen):
    """Positions >= n are 0 (fresh) or fold a 0: unchanged for sum, max(out, 0) for max."""
    seq_lens = seq_lens_tensor(RAGGED_LENS, device)
    q, k = inputs(len(RAGGED_LENS), 2, 2, 150, 8, 64, dtype, device, gen)
    lse = lse_f64(q, k, seq_lens=seq_lens) if with_lse else None
    out = initial_out(len(RAGGED_LENS), 2, 50, device, gen) if fold else None
    expected = ref.window_scores(q, k, lse=lse, gqa="mean", seq_lens=seq_lens, qreduce=qreduce,
                                 out=out)
    poison_beyond(k, RAGGED_LENS)  # padding past each row's length is never read
    got = kp.window_scores(q, k, lse=lse, seq_lens=seq_lens, qreduce=qreduce, out=out)
    assert_scores_close(got, expected, score_tol(device, dtype), None if fold else seq_lens)


# D 128 and 256 (tensor cores for fp16/bf16 when 16-byte aligned; the sliced layout is
# misaligned and takes the CUDA cores) and D 24 (CUDA cores), odd W and N.
@pytest.mark.parametrize("layout", ["contig", "sliced"])
@pytest.mark.parametrize("head_dim", [24, 128, 256])
@pytest.mark.parametrize("fold", [False, True], ids=["fresh", "fold"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_head_dims(dtype, fold, head_dim, layout, device, gen):
    q, k = inputs(1, 2, 4, 99, 17, head_dim, dtype, device, gen, layout=layout)
    out = initial_out(1, 2, 61, device, gen) if fold else None
    expected = ref.window_scores(q, k, gqa="max", qreduce="max", out=out)
    got = kp.window_scores(q, k, gqa="max", qreduce="max", out=out)
    assert_scores_close(got, expected, score_tol(device, dtype))


@pytest.mark.parametrize("qreduce", QREDUCE)
@pytest.mark.parametrize("gqa", ["mean", "max"])
def test_head_split(gqa, qreduce, device, gen):
    """D 256, W 200: one query head's rows fill a CTA's shared memory, so the CUDA
    tensor-core path splits the group over CTAs and the split reduce folds."""
    q, k = inputs(1, 1, 3, 300, 200, 256, torch.bfloat16, device, gen)
    out = initial_out(1, 1, 250, device, gen)
    expected = ref.window_scores(q, k, gqa=gqa, qreduce=qreduce, out=out)
    kp.window_scores(q, k, gqa=gqa, qreduce=qreduce, out=out)
    assert_scores_close(out, expected, score_tol(device, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_long_window(dtype, device, gen):
    """W = 600 reconstruction queries of G = 2 heads (1200 rows: several CPU row
    blocks, one straddling the two heads) against N = 800, folded into M = 700."""
    q, k = inputs(1, 1, 2, 800, 600, 64, dtype, device, gen)
    out = initial_out(1, 1, 700, device, gen)
    expected = ref.window_scores(q, k, gqa="mean", qreduce="max", out=out)
    kp.window_scores(q, k, gqa="mean", qreduce="max", out=out)
    assert_scores_close(out, expected, score_tol(device, dtype))


VE, TE = ValueError, TypeError
B, HQ, HKV, W, N, D = 2, 4, 2, 8, 64, 32
BAD = [
    ("qreduce-bad", lambda x: kp.window_scores(x.q, x.k, qreduce="MAX"), VE, r"qreduce"),
    ("qreduce-mean", lambda x: kp.window_scores(x.q, x.k, qreduce="mean", out=x.out), VE, r"qreduce"),
    ("out-float64", lambda x: kp.window_scores(x.q, x.k, out=x.out.double()), TE, r"\bout\b.*float32"),
    ("out-half", lambda x: kp.window_scores(x.q, x.k, out=x.out.half()), TE, r"\bout\b.*float32"),
    ("out-rank2", lambda x: kp.window_scores(x.q, x.k, out=x.out[0]), VE, r"\bout\b.*shape"),
    ("out-batch", lambda x: kp.window_scores(x.q, x.k, out=x.out[:1]), VE, r"\bout\b.*shape"),
    ("out-heads", lambda x: kp.window_scores(x.q, x.k, out=x.out[:, :1]), VE, r"\bout\b.*shape"),
    ("out-m-gt-n", lambda x: kp.window_scores(x.q, x.k, out=x.zeros(B, HKV, N + 1)), VE,
     r"\bout\b.*M"),
    ("out-m-zero", lambda x: kp.window_scores(x.q, x.k, out=x.zeros(B, HKV, 0)), VE, r"\bout\b.*M"),
    ("out-strided", lambda x: kp.window_scores(x.q, x.k, out=x.zeros(B, HKV, 2 * N)[..., ::2]), VE,
     r"\bout\b.*contiguous"),
    ("out-overlaps-q", lambda x: kp.window_scores(x.q, x.k, out=x.q.view(-1)[: B * HKV * N].view(B, HKV, N)),
     VE, r"\bout\b"),
]


@pytest.fixture
def x(device, gen):
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(device)
    ns = type("Inputs", (), {})()
    ns.q, ns.k, ns.out = randn(B, HQ, W, D), randn(B, HKV, N, D), randn(B, HKV, N)
    ns.zeros = lambda *shape: torch.zeros(*shape, device=device)
    return ns


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(case, x):
    _, call, exc, pattern = case
    assert_rejected_untouched(call, x, exc, pattern)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_out_on_other_device(gen):
    q, k = torch.randn(B, HQ, W, D, device="cuda"), torch.randn(B, HKV, N, D, device="cuda")
    with pytest.raises(ValueError, match=r"\bout\b"):
        kp.window_scores(q, k, out=torch.zeros(B, HKV, N))
