"""Bad input raises a clear Python error that names the argument (DESIGN §6).

Each case is (id, call, exception type, regex the message must match). A call
receives a namespace of valid inputs on the test device and breaks one thing.
None of them may crash the process or write out of bounds.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvprune_cuda as kp

from helpers import HAS_CUDA

B, HQ, HKV, W, N, D, BUDGET = 2, 4, 2, 8, 64, 32, 40


@pytest.fixture
def x(device, gen) -> SimpleNamespace:
    """Valid inputs: q [B,Hq,W,D], k/v [B,Hkv,N,D], scores, idx, out buffers, lse, seq_lens."""
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(device)
    k = randn(B, HKV, N, D)
    scores = torch.rand(B, HKV, N, generator=gen).to(device)
    return SimpleNamespace(
        device=device, q=randn(B, HQ, W, D), k=k, v=randn(B, HKV, N, D), scores=scores,
        idx=kp.select_keep(scores, BUDGET, window=W),
        out=randn(B, HKV, BUDGET, D), out2=randn(B, HKV, BUDGET, D),
        lse=randn(B, HQ, W), lens=torch.tensor([N, 5], dtype=torch.int32, device=device),
        i32=lambda *values: torch.tensor(values, dtype=torch.int32, device=device),
    )


def last_dim_strided(t: torch.Tensor) -> torch.Tensor:
    """Same shape as t, last-dim stride != 1."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


VE, TE = ValueError, TypeError
CASES = [
    # ---- window_scores: shapes
    ("ws-q-rank3", lambda x: kp.window_scores(x.q[0], x.k), VE, r"\bq\b.*4-D"),
    ("ws-k-rank5", lambda x: kp.window_scores(x.q, x.k[None]), VE, r"\bk\b.*4-D"),
    ("ws-batch-mismatch", lambda x: kp.window_scores(x.q[:1], x.k), VE, r"batch"),
    ("ws-head-dim-mismatch", lambda x: kp.window_scores(x.q[..., :16], x.k), VE, r"head_dim"),
    ("ws-hq-not-multiple", lambda x: kp.window_scores(x.q[:, :3], x.k), VE, r"heads"),
    ("ws-hkv-gt-hq", lambda x: kp.window_scores(x.q[:, :1], x.k), VE, r"heads"),
    ("ws-zero-kv-heads", lambda x: kp.window_scores(x.q, x.k[:, :0]), VE, r"heads"),
    ("ws-zero-head-dim", lambda x: kp.window_scores(x.q[..., :0], x.k[..., :0]), VE, r"head_dim"),
    ("ws-zero-window", lambda x: kp.window_scores(x.q[:, :, :0], x.k), VE, r"\bq\b.*window"),
    ("ws-window-gt-length", lambda x: kp.window_scores(x.q, x.k[:, :, :W - 1]), VE,
     r"window.*length"),
    ("ws-q-last-dim-strided", lambda x: kp.window_scores(last_dim_strided(x.q), x.k), VE,
     r"\bq\b.*contiguous last dim"),
    ("ws-k-last-dim-strided", lambda x: kp.window_scores(x.q, last_dim_strided(x.k)), VE,
     r"\bk\b.*contiguous last dim"),
    # ---- window_scores: dtypes and options
    ("ws-float64", lambda x: kp.window_scores(x.q.double(), x.k.double()), TE, r"\bq\b.*float32"),
    ("ws-int32", lambda x: kp.window_scores(x.q.int(), x.k.int()), TE, r"\bq\b.*float32"),
    ("ws-dtype-mismatch", lambda x: kp.window_scores(x.q.half(), x.k), TE, r"\bk\b.*dtype"),
    ("ws-gqa-bad", lambda x: kp.window_scores(x.q, x.k, gqa="MEAN"), VE, r"gqa"),
    ("ws-scale-nan", lambda x: kp.window_scores(x.q, x.k, scale=float("nan")), VE, r"scale"),
    ("ws-scale-inf", lambda x: kp.window_scores(x.q, x.k, scale=float("inf")), VE, r"scale"),
    ("ws-lse-shape", lambda x: kp.window_scores(x.q, x.k, lse=x.lse[:, :, :-1]), VE, r"lse.*shape"),
    ("ws-lse-rank", lambda x: kp.window_scores(x.q, x.k, lse=x.lse[0]), VE, r"lse.*shape"),
    ("ws-lse-float64", lambda x: kp.window_scores(x.q, x.k, lse=x.lse.double()), TE,
     r"lse.*float32"),
    ("ws-lse-half", lambda x: kp.window_scores(x.q, x.k, lse=x.lse.half()), TE, r"lse.*float32"),
    ("ws-lse-strided", lambda x: kp.window_scores(x.q, x.k, lse=last_dim_strided(x.lse)), VE,
     r"lse.*contiguous"),
    ("ws-seq-lens-int64", lambda x: kp.window_scores(x.q, x.k, seq_lens=x.lens.long()), TE,
     r"seq_lens.*int32"),
    ("ws-seq-lens-float", lambda x: kp.window_scores(x.q, x.k, seq_lens=x.lens.float()), TE,
     r"seq_lens.*int32"),
    ("ws-seq-lens-shape", lambda x: kp.window_scores(x.q, x.k, seq_lens=x.i32(1, 2, 3)), VE,
     r"seq_lens.*shape"),
    ("ws-seq-lens-2d", lambda x: kp.window_scores(x.q, x.k, seq_lens=x.lens[None]), VE,
     r"seq_lens.*shape"),
    ("ws-seq-lens-strided", lambda x: kp.window_scores(x.q, x.k, seq_lens=x.i32(N, 0, 5, 0)[::2]),
     VE, r"seq_lens.*contiguous"),
    # ---- pool_scores
    ("pool-rank2", lambda x: kp.pool_scores(x.scores[0]), VE, r"scores.*3-D"),
    ("pool-half", lambda x: kp.pool_scores(x.scores.half()), TE, r"scores.*float32"),
    ("pool-strided", lambda x: kp.pool_scores(x.scores.transpose(0, 1)), VE, r"scores.*contiguous"),
    ("pool-even-kernel", lambda x: kp.pool_scores(x.scores, 6), VE, r"kernel_size"),
    ("pool-zero-kernel", lambda x: kp.pool_scores(x.scores, 0), VE, r"kernel_size"),
    ("pool-negative-kernel", lambda x: kp.pool_scores(x.scores, -3), VE, r"kernel_size"),
    ("pool-mode-bad", lambda x: kp.pool_scores(x.scores, 7, "mean"), VE, r"mode"),
    ("pool-negative-window", lambda x: kp.pool_scores(x.scores, window=-1), VE, r"window"),
    ("pool-seq-lens-int64", lambda x: kp.pool_scores(x.scores, seq_lens=x.lens.long()), TE,
     r"seq_lens"),
    # ---- select_keep
    ("select-budget-lt-sink-window", lambda x: kp.select_keep(x.scores, 11, n_sink=4, window=8),
     VE, r"budget"),
    ("select-budget-zero", lambda x: kp.select_keep(x.scores, 0, n_sink=0, window=0), VE,
     r"budget"),
    ("select-negative-sink", lambda x: kp.select_keep(x.scores, 10, n_sink=-1), VE, r"n_sink"),
    ("select-negative-window", lambda x: kp.select_keep(x.scores, 10, window=-1), VE, r"window"),
    ("select-float64", lambda x: kp.select_keep(x.scores.double(), BUDGET), TE, r"scores.*float32"),
    ("select-rank4", lambda x: kp.select_keep(x.scores[None], BUDGET), VE, r"scores.*3-D"),
    ("select-seq-lens-shape", lambda x: kp.select_keep(x.scores, BUDGET, seq_lens=x.lens[:1]), VE,
     r"seq_lens.*shape"),
    # ---- gather_kv
    ("gather-idx-int64", lambda x: kp.gather_kv(x.k, x.v, x.idx.long()), TE, r"idx.*int32"),
    ("gather-idx-batch", lambda x: kp.gather_kv(x.k, x.v, x.idx[:1]), VE, r"idx.*shape"),
    ("gather-idx-rank", lambda x: kp.gather_kv(x.k, x.v, x.idx[0]), VE, r"idx.*shape"),
    ("gather-idx-strided", lambda x: kp.gather_kv(x.k, x.v, x.idx.transpose(0, 1)), VE, r"idx"),
    ("gather-v-shape", lambda x: kp.gather_kv(x.k, x.v[:, :, :10], x.idx), VE, r"\bv\b.*shape"),
    ("gather-v-dtype", lambda x: kp.gather_kv(x.k, x.v.half(), x.idx), TE, r"\bv\b.*dtype"),
    ("gather-k-float64", lambda x: kp.gather_kv(x.k.double(), x.v.double(), x.idx), TE,
     r"\bk\b.*float32"),
    ("gather-k-strided", lambda x: kp.gather_kv(last_dim_strided(x.k), x.v, x.idx), VE,
     r"\bk\b.*contiguous last dim"),
    ("gather-only-out-k", lambda x: kp.gather_kv(x.k, x.v, x.idx, out_k=x.out), VE,
     r"out_k.*out_v"),
    ("gather-only-out-v", lambda x: kp.gather_kv(x.k, x.v, x.idx, out_v=x.out), VE,
     r"out_k.*out_v"),
    ("gather-out-k-shape", lambda x: kp.gather_kv(x.k, x.v, x.idx, out_k=x.out[:, :, 1:],
                                                  out_v=x.out2), VE, r"out_k.*shape"),
    ("gather-out-v-head-dim", lambda x: kp.gather_kv(x.k, x.v, x.idx, out_k=x.out,
                                                     out_v=x.out2[..., 1:]), VE, r"out_v.*shape"),
    ("gather-out-k-dtype", lambda x: kp.gather_kv(x.k, x.v, x.idx, out_k=x.out.half(),
                                                  out_v=x.out2), TE, r"out_k.*dtype"),
    ("gather-out-k-rank", lambda x: kp.gather_kv(x.k, x.v, x.idx, out_k=x.out[0], out_v=x.out2), VE,
     r"out_k.*4-D"),
    ("gather-out-v-strided", lambda x: kp.gather_kv(x.k, x.v, x.idx, out_k=x.out,
                                                    out_v=last_dim_strided(x.out2)), VE,
     r"out_v.*contiguous last dim"),
    # Writes through overlapping memory race and silently lose rows.
    ("gather-out-k-overlapping", lambda x: kp.gather_kv(
        x.k, x.v, x.idx, out_k=x.out[:, :, :1].expand(-1, -1, BUDGET, -1), out_v=x.out2), VE,
     r"out_k"),
    ("gather-out-k-is-out-v", lambda x: kp.gather_kv(x.k, x.v, x.idx, out_k=x.out, out_v=x.out),
     VE, r"out_k|out_v"),
    # ---- snapkv
    ("snapkv-budget-lt-sink-window", lambda x: kp.snapkv(x.q, x.k, x.v, 11, window=8), VE,
     r"budget"),
    ("snapkv-even-kernel", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W, kernel_size=4), VE,
     r"kernel_size"),
    ("snapkv-zero-kernel", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W, kernel_size=0), VE,
     r"kernel_size"),
    ("snapkv-pool-bad", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W, pool="min"), VE,
     r"pool"),
    ("snapkv-shift-gt-radius", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W,
                                                   pool_shift=4), VE, r"^pool_shift must lie"),
    ("snapkv-shift-negative", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W,
                                                  pool_shift=-1), VE, r"^pool_shift must lie"),
    ("select-fused-shift-gt-radius", lambda x: kp.snapkv_select(x.q, x.k, BUDGET, window=W,
                                                                pool_shift=4), VE,
     r"^pool_shift must lie"),
    ("select-fused-budget-lt-sink-window", lambda x: kp.snapkv_select(x.q, x.k, 11, window=8),
     VE, r"budget"),
    ("select-fused-hq-not-multiple", lambda x: kp.snapkv_select(x.q[:, :3], x.k, BUDGET,
                                                                window=W), VE, r"heads"),
    ("pool-shift-gt-radius", lambda x: kp.pool_scores(x.scores, 7, window=W, shift=4), VE,
     r"^shift must lie"),
    ("snapkv-gqa-bad", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W, gqa="median"), VE,
     r"gqa"),
    ("scores-qreduce-bad", lambda x: kp.window_scores(x.q, x.k, qreduce="min"), VE, r"qreduce"),
    ("pool-mode-bad", lambda x: kp.pool_scores(kp.window_scores(x.q, x.k), mode="median"), VE,
     r"mode"),
    ("snapkv-v-shape", lambda x: kp.snapkv(x.q, x.k, x.v[:, :, :5], BUDGET, window=W), VE,
     r"\bv\b.*shape"),
    ("snapkv-v-dtype", lambda x: kp.snapkv(x.q, x.k, x.v.bfloat16(), BUDGET, window=W), TE,
     r"\bv\b.*dtype"),
    ("snapkv-hq-not-multiple", lambda x: kp.snapkv(x.q[:, :3], x.k, x.v, BUDGET, window=W), VE,
     r"heads"),
    ("snapkv-window-gt-length", lambda x: kp.snapkv(x.q, x.k[:, :, :7], x.v[:, :, :7], 12,
                                                    window=4), VE, r"window.*length"),
    ("snapkv-lse-shape", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W, lse=x.lse[:1]), VE,
     r"lse"),
    ("snapkv-float64", lambda x: kp.snapkv(x.q.double(), x.k.double(), x.v.double(), BUDGET,
                                           window=W), TE, r"float32"),
    ("snapkv-seq-lens-int64", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W,
                                                  seq_lens=x.lens.long()), TE, r"seq_lens"),
    ("snapkv-only-out-k", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W, out_k=x.out), VE,
     r"out_k.*out_v"),
    ("snapkv-out-v-shape", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W, out_k=x.out,
                                               out_v=x.out2[:, :, 1:]), VE, r"out_v.*shape"),
    ("snapkv-out-k-dtype", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W, out_k=x.out.half(),
                                               out_v=x.out2), TE, r"out_k.*dtype"),
    ("snapkv-out-k-is-k", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W,
                                              out_k=x.k[:, :, :BUDGET], out_v=x.out2), VE, r"out_k"),
    # ---- streaming
    ("streaming-budget-lt-sink", lambda x: kp.streaming(x.k, x.v, 3, n_sink=4), VE, r"budget"),
    ("streaming-budget-zero", lambda x: kp.streaming(x.k, x.v, 0, n_sink=0), VE, r"budget"),
    ("streaming-negative-sink", lambda x: kp.streaming(x.k, x.v, 8, n_sink=-1), VE, r"n_sink"),
    ("streaming-k-rank3", lambda x: kp.streaming(x.k[0], x.v[0], 8), VE, r"\bk\b.*4-D"),
    ("streaming-int", lambda x: kp.streaming(x.k.int(), x.v.int(), 8), TE, r"\bk\b.*float32"),
    ("streaming-seq-lens-shape", lambda x: kp.streaming(x.k, x.v, 8, seq_lens=x.i32(3)), VE,
     r"seq_lens.*shape"),
    # wrongly typed scalars
    ("snapkv-budget-float", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET + 0.5, window=W), TE,
     r"budget"),
    ("snapkv-scale-str", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W, scale="0.1"), TE,
     r"scale"),
    ("snapkv-pool-none", lambda x: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W, pool=None), TE,
     r"pool"),
    ("pool-kernel-float", lambda x: kp.pool_scores(x.scores, 7.0), TE, r"kernel_size"),
    ("pool-shift-float", lambda x: kp.pool_scores(x.scores, 7, shift=1.0), TE, r"shift"),
    ("select-fused-shift-float", lambda x: kp.snapkv_select(x.q, x.k, BUDGET, window=W,
                                                            pool_shift=1.0), TE, r"pool_shift"),
    ("select-budget-bool", lambda x: kp.select_keep(x.scores, True, window=W), TE, r"budget"),
    ("streaming-sink-str", lambda x: kp.streaming(x.k, x.v, 8, n_sink="4"), TE, r"n_sink"),
    ("ws-gqa-none", lambda x: kp.window_scores(x.q, x.k, gqa=None), TE, r"gqa"),
    ("ws-qreduce-int", lambda x: kp.window_scores(x.q, x.k, qreduce=1), TE, r"qreduce"),
]


# Cases the library does not handle as specified yet: strict xfail, so a fix turns them red
# (XPASS) until they move to CASES. None at the moment.
XFAIL_CASES: list = []


def as_params(cases, marks=()):
    return [pytest.param(*values, id=name, marks=marks) for name, *values in cases]


@pytest.mark.parametrize("call,exc,match", as_params(CASES) + as_params(
    XFAIL_CASES, pytest.mark.xfail(strict=True, reason="not rejected as specified yet")))
def test_bad_input_raises(call, exc, match, x):
    with pytest.raises(exc, match=match):
        call(x)


# seq_lens values are only validated where the host can read them without a sync.
SEQ_LENS_VALUE_CASES = [
    ("window_scores", lambda x, lens: kp.window_scores(x.q, x.k, seq_lens=lens)),
    ("pool_scores", lambda x, lens: kp.pool_scores(x.scores, seq_lens=lens)),
    ("select_keep", lambda x, lens: kp.select_keep(x.scores, BUDGET, window=W, seq_lens=lens)),
    ("snapkv", lambda x, lens: kp.snapkv(x.q, x.k, x.v, BUDGET, window=W, seq_lens=lens)),
    ("streaming", lambda x, lens: kp.streaming(x.k, x.v, 8, seq_lens=lens)),
]


@pytest.mark.parametrize("values", [(-1, 5), (N + 1, 5), (5, -(2**31))], ids=["neg", "gt-N", "min"])
@pytest.mark.parametrize("call", [c[1] for c in SEQ_LENS_VALUE_CASES],
                         ids=[c[0] for c in SEQ_LENS_VALUE_CASES])
@pytest.mark.parametrize("device", ["cpu"])
def test_seq_lens_out_of_range_cpu(call, values, x):
    with pytest.raises(ValueError, match=r"seq_lens"):
        call(x, x.i32(*values))


MIXED_DEVICE_CASES = [
    ("ws-k-on-cpu", lambda x: kp.window_scores(x.q, x.k.cpu()), r"\bk\b.*device"),
    ("ws-lse-on-cpu", lambda x: kp.window_scores(x.q, x.k, lse=x.lse.cpu()), r"lse.*device"),
    ("ws-seq-lens-on-cpu", lambda x: kp.window_scores(x.q, x.k, seq_lens=x.lens.cpu()),
     r"seq_lens.*device"),
    ("pool-seq-lens-on-cpu", lambda x: kp.pool_scores(x.scores, seq_lens=x.lens.cpu()),
     r"seq_lens.*device"),
    ("select-seq-lens-on-cpu", lambda x: kp.select_keep(x.scores, BUDGET, seq_lens=x.lens.cpu()),
     r"seq_lens.*device"),
    ("gather-v-on-cpu", lambda x: kp.gather_kv(x.k, x.v.cpu(), x.idx), r"\bv\b.*device"),
    ("gather-idx-on-cpu", lambda x: kp.gather_kv(x.k, x.v, x.idx.cpu()), r"idx.*device"),
    ("gather-out-k-on-cpu", lambda x: kp.gather_kv(x.k, x.v, x.idx, out_k=x.out.cpu(),
                                                   out_v=x.out2), r"out_k.*device"),
    ("snapkv-q-on-cpu", lambda x: kp.snapkv(x.q.cpu(), x.k, x.v, BUDGET, window=W), r"device"),
    ("snapkv-v-on-cpu", lambda x: kp.snapkv(x.q, x.k, x.v.cpu(), BUDGET, window=W),
     r"\bv\b.*device"),
    ("streaming-v-on-cpu", lambda x: kp.streaming(x.k, x.v.cpu(), 8), r"\bv\b.*device"),
]


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("call,match", [c[1:] for c in MIXED_DEVICE_CASES],
                         ids=[c[0] for c in MIXED_DEVICE_CASES])
@pytest.mark.parametrize("device", ["cuda"])
def test_mixed_devices_raise(call, match, x):
    with pytest.raises((ValueError, RuntimeError), match=match):
        call(x)
