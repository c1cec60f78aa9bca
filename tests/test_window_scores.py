"""kp.window_scores against reference.window_scores (DESIGN §1 stage 2)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda import reference as ref

from helpers import (
    DTYPES, GQA_MODES, assert_scores_close, dtype_id, lse_f64, poison_beyond, randn_tokens, rng,
    score_tol, seq_lens_tensor, window_scores_f64,
)


class Case(NamedTuple):
    batch: int
    kv_heads: int
    group: int  # G = Hq / Hkv
    length: int  # N
    window: int  # W, queries in q
    head_dim: int
    gqa: str = "mean"
    with_lse: bool = False
    layout: str = "contig"

    def id(self) -> str:
        return (f"B{self.batch}-Hkv{self.kv_heads}-G{self.group}-N{self.length}-W{self.window}"
                f"-D{self.head_dim}-{self.gqa}{'-lse' if self.with_lse else ''}-{self.layout}")


# Tiny, odd, non-power-of-two and long N; W in {1, 8, 32, 64}; G in {1, 4, 7};
# D in {24, 64, 128, 256}; every layout. Long rows have few heads (the reference is slow).
CASES = [
    Case(1, 1, 1, 1, 1, 64),
    Case(2, 2, 4, 5, 5, 24, "mean", True),
    Case(2, 1, 7, 37, 8, 64, "max", False, "bnhd"),
    Case(1, 2, 4, 100, 32, 128, "sum", True, "bnhd"),
    Case(2, 2, 1, 100, 64, 256, "mean", False, "sliced"),
    Case(1, 2, 7, 1000, 32, 128, "max", True),
    Case(1, 1, 4, 1000, 1, 256, "sum", False, "bnhd"),
    Case(1, 1, 4, 4099, 64, 64, "mean", True, "sliced"),
    Case(1, 1, 4, 4099, 8, 24, "sum", False, "bnhd"),
    Case(1, 1, 1, 20000, 8, 64),
    Case(1, 1, 2, 20000, 32, 128, "max", True, "bnhd"),
]


def make_inputs(case: Case, dtype, device, gen, seq_lens=None):
    """q [B, Hq, W, D], k [B, Hkv, N, D] and (if the case wants it) the exact lse."""
    q = randn_tokens(case.batch, case.kv_heads * case.group, case.window, case.head_dim,
                     dtype=dtype, device=device, layout=case.layout, gen=gen)
    k = randn_tokens(case.batch, case.kv_heads, case.length, case.head_dim,
                     dtype=dtype, device=device, layout=case.layout, gen=gen)
    lse = lse_f64(q, k, seq_lens=seq_lens) if case.with_lse else None
    return q, k, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_matches_reference(case, dtype, device, gen):
    q, k, lse = make_inputs(case, dtype, device, gen)
    out = kp.window_scores(q, k, lse=lse, gqa=case.gqa)
    assert out.device == q.device and out.shape == (case.batch, case.kv_heads, case.length)
    expected = ref.window_scores(q, k, lse=lse, gqa=case.gqa)
    assert_scores_close(out, expected, score_tol(device, dtype))


@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("gqa", GQA_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gqa_modes(gqa, with_lse, dtype, device, gen):
    case = Case(2, 2, 4, 300, 16, 64, gqa, with_lse)
    q, k, lse = make_inputs(case, dtype, device, gen)
    out = kp.window_scores(q, k, lse=lse, gqa=gqa)
    assert_scores_close(out, ref.window_scores(q, k, lse=lse, gqa=gqa), score_tol(device, dtype))


# Key counts around the CPU chunk (192 keys) and the CUDA key tiles (256 keys for
# D <= 128, 128 for D = 256) and per-CTA chunks (up to 64 tiles).
BOUNDARY_LENGTHS = [191, 192, 193, 255, 256, 257, 385, 16385]


@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("length", BOUNDARY_LENGTHS)
def test_block_boundaries(length, head_dim, with_lse, device, gen):
    case = Case(1, 1, 2, length, 8, head_dim, "mean", with_lse)
    q, k, lse = make_inputs(case, torch.bfloat16, device, gen)
    out = kp.window_scores(q, k, lse=lse)
    assert_scores_close(out, ref.window_scores(q, k, lse=lse), score_tol(device, torch.bfloat16))


@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("magnitude", [8.0, 30.0])
def test_large_logits_stay_finite(magnitude, with_lse, device, gen):
    """Sharp attention (logits up to ~150) must neither overflow exp nor lose mass.
    An fp32 logit of magnitude L is only known to ~L * 2^-24, and exp turns that
    absolute error into a relative one, so the tolerance grows with the magnitude."""
    case = Case(2, 2, 2, 500, 16, 64)
    q, k, _ = make_inputs(case, torch.float32, device, gen)
    q = q * magnitude
    lse = lse_f64(q, k) if with_lse else None
    out = kp.window_scores(q, k, lse=lse)
    tol = score_tol(device, torch.float32) * max(1.0, magnitude / 8)
    assert_scores_close(out, ref.window_scores(q, k, lse=lse), tol)


# Row lengths around the window W=8: full, n < W, n == 0, n == 1, n == W, and a middle one.
RAGGED_LENS = [300, 5, 0, 1, 8, 283]


@pytest.mark.parametrize("layout", ["contig", "bnhd"])
@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_ragged_seq_lens(dtype, with_lse, layout, device, gen):
    case = Case(len(RAGGED_LENS), 2, 4, 300, 8, 64, "mean", False, layout)
    seq_lens = seq_lens_tensor(RAGGED_LENS, device)
    q, k, _ = make_inputs(case, dtype, device, gen)
    lse = lse_f64(q, k, seq_lens=seq_lens) if with_lse else None
    expected = ref.window_scores(q, k, lse=lse, seq_lens=seq_lens)
    # Padding past each row's length must never be read: fill it with NaN.
    poison_beyond(k, RAGGED_LENS)
    out = kp.window_scores(q, k, lse=lse, seq_lens=seq_lens)
    assert_scores_close(out, expected, score_tol(device, dtype), seq_lens)


@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
def test_queries_before_row_start_are_ignored(with_lse, device, gen):
    """A row shorter than W has queries at negative positions; whatever they hold
    (here NaN) contributes nothing."""
    lens = [3, 0, 12]
    case = Case(len(lens), 1, 2, 12, 8, 64)
    seq_lens = seq_lens_tensor(lens, device)
    q, k, _ = make_inputs(case, torch.float32, device, gen)
    lse = lse_f64(q, k, seq_lens=seq_lens) if with_lse else None
    expected = ref.window_scores(q, k, lse=lse, seq_lens=seq_lens)
    for b, n in enumerate(lens):
        q[b, :, : max(case.window - n, 0)] = float("nan")
    out = kp.window_scores(q, k, lse=lse, seq_lens=seq_lens)
    assert_scores_close(out, expected, score_tol(device, torch.float32), seq_lens)


def test_window_equal_to_max_length_with_seq_lens(device, gen):
    """With seq_lens, q's W may exceed every row's length (all rows shorter than W)."""
    lens = [4, 7]
    case = Case(2, 1, 1, 7, 16, 24)
    seq_lens = seq_lens_tensor(lens, device)
    q, k, _ = make_inputs(case, torch.float32, device, gen)
    out = kp.window_scores(q, k, seq_lens=seq_lens)
    expected = ref.window_scores(q, k, seq_lens=seq_lens)
    assert_scores_close(out, expected, score_tol(device, torch.float32), seq_lens)


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_custom_scale(scale, device, gen):
    case = Case(1, 2, 2, 200, 8, 64)
    q, k, _ = make_inputs(case, torch.float32, device, gen)
    lse = lse_f64(q, k, scale=scale)
    expected = ref.window_scores(q, k, scale=scale)
    tol = score_tol(device, torch.float32)
    assert_scores_close(kp.window_scores(q, k, scale=scale), expected, tol)
    assert_scores_close(kp.window_scores(q, k, lse=lse, scale=scale), expected, tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_probability_mass(dtype, device, gen):
    """Each visible query's probabilities sum to 1: the scores of a KV head sum to
    G*W (gqa="sum") or W (gqa="mean")."""
    case = Case(1, 2, 4, 3000, 32, 128)
    q, k, _ = make_inputs(case, dtype, device, gen)
    rtol = max(1e-4, score_tol(device, dtype))
    for gqa, expected in (("sum", 4.0 * 32), ("mean", 32.0)):
        total = kp.window_scores(q, k, gqa=gqa).double().sum(dim=-1).cpu()
        torch.testing.assert_close(total, torch.full((1, 2), expected, dtype=torch.float64),
                                   rtol=rtol, atol=0)


def test_inputs_not_modified(device, gen):
    case = Case(2, 2, 2, 64, 8, 64, with_lse=True, layout="bnhd")
    q, k, lse = make_inputs(case, torch.float16, device, gen)
    before = [t.clone() for t in (q, k, lse)]
    kp.window_scores(q, k, lse=lse)
    for t, b in zip((q, k, lse), before):
        assert torch.equal(t, b)


def test_empty_batch_and_zero_length(device, gen):
    q, k, _ = make_inputs(Case(2, 1, 2, 16, 8, 64), torch.float32, device, gen)
    assert kp.window_scores(q[:0], k[:0]).shape == (0, 1, 16)
    zeros = torch.zeros(2, dtype=torch.int32, device=device)
    out = kp.window_scores(q, k[:, :, :0], seq_lens=zeros)
    assert out.shape == (2, 1, 0)


@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("gqa", GQA_MODES)
def test_fast_oracle_matches_reference(gqa, with_lse):
    """helpers.window_scores_f64 (used for huge N on GPU) is the reference's maths."""
    lens = [40, 6, 0]
    case = Case(3, 2, 3, 40, 8, 24, gqa, with_lse)
    seq_lens = seq_lens_tensor(lens, "cpu")
    q, k, _ = make_inputs(case, torch.float32, "cpu", rng(0))
    lse = lse_f64(q, k, seq_lens=seq_lens) if with_lse else None
    torch.testing.assert_close(
        window_scores_f64(q, k, lse=lse, gqa=gqa, seq_lens=seq_lens),
        ref.window_scores(q, k, lse=lse, gqa=gqa, seq_lens=seq_lens), rtol=1e-6, atol=0)
