"""kp.pool_scores and kp.select_keep against the reference (DESIGN §1 stages 3-4).

Both ops take fp32 scores, so the op and the reference see identical inputs: the
checks are exact (avg pooling up to one fp32 rounding), and selection must match
the reference's tie rule (lower position first) index for index.
"""

from __future__ import annotations

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda import reference as ref

from helpers import POOL_MODES, check_selection, row_lengths, seq_lens_tensor


def random_scores(batch, heads, length, gen, kind="rand"):
    """fp32 [B, H, N] scores: "rand" (uniform, non-negative), "randn" (signed),
    "perm" (distinct values), "coarse" (few distinct values: many ties)."""
    if kind == "rand":
        return torch.rand(batch, heads, length, generator=gen)
    if kind == "randn":
        return torch.randn(batch, heads, length, generator=gen)
    if kind == "perm":
        flat = torch.randperm(batch * heads * length, generator=gen).float() + 1.0
        return flat.reshape(batch, heads, length)
    if kind == "coarse":
        return torch.randint(1, 5, (batch, heads, length), generator=gen).float() / 4
    raise ValueError(kind)


def assert_pool_matches(out, expected, mode):
    assert out.dtype == torch.float32 and out.shape == expected.shape
    out = out.cpu()
    if mode == "max":
        assert torch.equal(out, expected)
    else:
        atol = 1e-7 * expected.abs().max().item()
        torch.testing.assert_close(out, expected, rtol=2e-7, atol=atol)


# ---------------------------------------------------------------- pool_scores

# (N, window, kernel_size): kernel 1 (identity), kernels wider than the prefix,
# window 0 (pool everything), window >= N (pool nothing), prefixes of 1024 / 1025.
POOL_SHAPES = [
    (1, 0, 7), (5, 1, 3), (37, 8, 7), (37, 40, 7), (100, 32, 1), (100, 0, 9),
    (100, 64, 201), (1000, 32, 31), (1056, 32, 7), (1057, 32, 3), (4099, 64, 7), (20000, 8, 5),
]


@pytest.mark.parametrize("kind", ["rand", "randn"])
@pytest.mark.parametrize("mode", POOL_MODES)
@pytest.mark.parametrize("length,window,kernel_size", POOL_SHAPES,
                         ids=[f"N{n}-win{w}-ks{k}" for n, w, k in POOL_SHAPES])
def test_pool_matches_reference(length, window, kernel_size, mode, kind, device, gen):
    # randn: negative scores show whether max pooling lets zero padding win.
    scores = random_scores(2, 3, length, gen, kind)
    expected = ref.pool_scores(scores, kernel_size, mode, window=window)
    out = kp.pool_scores(scores.to(device), kernel_size, mode, window=window)
    assert_pool_matches(out, expected, mode)


@pytest.mark.parametrize("mode", POOL_MODES)
def test_pool_ragged_seq_lens(mode, device, gen):
    lens = [300, 31, 0, 1, 32, 33, 250]  # window 32: n < W, n == 0, n == W, n == W + 1
    scores = random_scores(len(lens), 2, 300, gen)
    seq_lens = seq_lens_tensor(lens, "cpu")
    expected = ref.pool_scores(scores, 7, mode, window=32, seq_lens=seq_lens)
    for b, n in enumerate(lens):  # padding holds garbage; it must be ignored and zeroed
        scores[b, :, n:] = float("nan")
    out = kp.pool_scores(scores.to(device), 7, mode, window=32, seq_lens=seq_lens.to(device))
    assert_pool_matches(out, expected, mode)


def test_pool_defaults_and_input_untouched(device, gen):
    scores = random_scores(1, 2, 500, gen).to(device)
    before = scores.clone()
    out = kp.pool_scores(scores)  # kernel 7, max, window 32
    assert torch.equal(scores, before)
    assert_pool_matches(out, ref.pool_scores(scores.cpu(), 7, "max", window=32), "max")


# (N, window, kernel_size, shift): every shift 0..r of kernels 3 and 7, the default 49 / 16
# and its largest shift, kernels wider than the prefix.
SHIFTED = [(37, 8, 3, 1), (100, 8, 7, 1), (100, 8, 7, 2), (100, 8, 7, 3), (300, 32, 49, 16),
           (300, 32, 49, 24), (40, 8, 101, 50), (5, 1, 3, 1)]


@pytest.mark.parametrize("kind", ["rand", "randn"])
@pytest.mark.parametrize("mode", POOL_MODES)
@pytest.mark.parametrize("length,window,kernel_size,shift", SHIFTED,
                         ids=[f"N{n}-win{w}-ks{k}-s{s}" for n, w, k, s in SHIFTED])
def test_shifted_pool_matches_reference(length, window, kernel_size, shift, mode, kind, device,
                                        gen):
    scores = random_scores(2, 3, length, gen, kind)
    expected = ref.pool_scores(scores, kernel_size, mode, window=window, shift=shift)
    out = kp.pool_scores(scores.to(device), kernel_size, mode, window=window, shift=shift)
    assert_pool_matches(out, expected, mode)


@pytest.mark.parametrize("mode", POOL_MODES)
def test_shifted_pool_by_hand(mode, device):
    """One vote of 1 at position 4 of 12 (window 2: positions 10, 11 copied), kernel 5
    (r = 2), shift 2: position i covers [i - 4, i], so the vote reaches 4..8; max gives 1
    there, avg 1/5. The last prefix position (9) covers 5..9: not the vote."""
    scores = torch.zeros(1, 1, 12)
    scores[0, 0, 4], scores[0, 0, 11] = 1.0, 0.5
    out = kp.pool_scores(scores.to(device), 5, mode, window=2, shift=2)[0, 0].cpu()
    peak = 1.0 if mode == "max" else 0.2
    want = [0.0] * 4 + [peak] * 5 + [0.0, 0.0, 0.5]
    assert out.tolist() == pytest.approx(want)


def test_shifted_pool_ragged_seq_lens(device, gen):
    lens = [300, 31, 0, 1, 32, 33, 57, 250]  # window 32: n < W, n == 0, n == W, n == W + 1
    scores = random_scores(len(lens), 2, 300, gen)
    seq_lens = seq_lens_tensor(lens, "cpu")
    for mode in POOL_MODES:
        expected = ref.pool_scores(scores, 49, mode, window=32, seq_lens=seq_lens, shift=16)
        poisoned = scores.clone()
        for b, n in enumerate(lens):  # padding holds garbage; it must be ignored and zeroed
            poisoned[b, :, n:] = float("nan")
        out = kp.pool_scores(poisoned.to(device), 49, mode, window=32,
                             seq_lens=seq_lens.to(device), shift=16)
        assert_pool_matches(out, expected, mode)


@pytest.mark.parametrize("kernel_size,shift", [(7, 4), (7, -1), (1, 1)])
def test_pool_shift_out_of_range_is_refused(kernel_size, shift, device):
    with pytest.raises(ValueError, match=r"^shift must lie in \[0, kernel_size / 2"):
        kp.pool_scores(torch.rand(1, 1, 50, device=device), kernel_size, shift=shift)


# ---------------------------------------------------------------- select_keep

# (N, budget, n_sink, window); 4132 / 4133: exactly 4096 / 4097 candidates.
SELECT_SHAPES = [
    (1, 1, 0, 0), (5, 3, 1, 1), (37, 12, 4, 8), (37, 36, 4, 8), (37, 37, 4, 8),
    (100, 12, 4, 8), (100, 40, 0, 32), (100, 36, 4, 32), (100, 50, 0, 0), (1000, 150, 4, 32),
    (4099, 615, 4, 64), (4132, 620, 4, 32), (4133, 620, 4, 32), (20000, 3000, 4, 32),
    (1 << 16, 9830, 4, 32),
]


@pytest.mark.parametrize("kind", ["perm", "coarse", "rand"])
@pytest.mark.parametrize("length,budget,n_sink,window", SELECT_SHAPES,
                         ids=[f"N{n}-K{k}-S{s}-win{w}" for n, k, s, w in SELECT_SHAPES])
def test_select_matches_reference(length, budget, n_sink, window, kind, device, gen):
    scores = random_scores(2, 2, length, gen, kind)
    idx = kp.select_keep(scores.to(device), budget, n_sink=n_sink, window=window)
    assert idx.device.type == torch.device(device).type
    check_selection(idx, scores, budget, n_sink=n_sink, window=window)
    assert torch.equal(idx.cpu(), ref.select_keep(scores, budget, n_sink=n_sink, window=window))


@pytest.mark.parametrize("kind", ["perm", "coarse"])
def test_select_ragged_seq_lens(kind, device, gen):
    budget, n_sink, window = 20, 4, 8
    # n < window, n == 0, n == budget, n == budget + 1, n == budget + 2, full, middle
    lens = [5, 0, budget, budget + 1, budget + 2, 400, 137]
    scores = random_scores(len(lens), 3, 400, gen, kind)
    seq_lens = seq_lens_tensor(lens, "cpu")
    expected = ref.select_keep(scores, budget, n_sink=n_sink, window=window, seq_lens=seq_lens)
    for b, n in enumerate(lens):  # scores past n are garbage; huge ones would win if read
        scores[b, :, n:] = 1e30
    idx = kp.select_keep(scores.to(device), budget, n_sink=n_sink, window=window,
                         seq_lens=seq_lens.to(device))
    check_selection(idx, scores, budget, n_sink=n_sink, window=window, seq_lens=seq_lens)
    assert torch.equal(idx.cpu(), expected)


@pytest.mark.parametrize("length", [50, 5000])
def test_select_constant_scores_keep_lowest_positions(length, device):
    budget, n_sink, window = 30, 4, 8
    idx = kp.select_keep(torch.full((2, 2, length), 0.25, device=device), budget,
                         n_sink=n_sink, window=window)
    expected = torch.cat([torch.arange(budget - window), torch.arange(length - window, length)])
    assert torch.equal(idx.cpu(), expected.int().expand(2, 2, budget))


def test_select_lower_position_wins_ties(device):
    """Pairs of equal scores straddling the cut: the earlier of each pair is kept."""
    scores = torch.zeros(1, 1, 40)
    scores[0, 0, [10, 30]] = 5.0
    scores[0, 0, [20, 25]] = 3.0  # one of these two fits
    idx = kp.select_keep(scores.to(device) + 1.0, 2 + 3, n_sink=0, window=2)
    assert idx.cpu().tolist() == [[[10, 20, 30, 38, 39]]]


def test_select_negative_and_tiny_scores(device, gen):
    """Finite scores of any sign and (normal) magnitude, e.g. log-scores, rank by value."""
    scores = random_scores(2, 2, 3000, gen, "randn") * torch.tensor([1e-30, 1e30])[None, :, None]
    idx = kp.select_keep(scores.to(device), 400, n_sink=4, window=32)
    assert torch.equal(idx.cpu(), ref.select_keep(scores, 400, n_sink=4, window=32))


def test_select_budget_equals_sinks_plus_window(device, gen):
    scores = random_scores(1, 2, 100, gen)
    idx = kp.select_keep(scores.to(device), 12, n_sink=4, window=8)
    expected = torch.cat([torch.arange(4), torch.arange(92, 100)]).int()
    assert torch.equal(idx.cpu(), expected.expand(1, 2, 12))


def test_select_row_count_matches_padding(device, gen):
    lens = [0, 3, 16, 17, 64]
    scores = random_scores(len(lens), 2, 64, gen)
    idx = kp.select_keep(scores.to(device), 16, n_sink=2, window=4,
                         seq_lens=seq_lens_tensor(lens, device)).cpu()
    kept = (idx >= 0).sum(dim=-1)
    expected = torch.tensor([min(n, 16) for n in row_lengths(len(lens), 64, torch.tensor(lens))])
    assert torch.equal(kept, expected[:, None].expand(-1, 2))


def test_check_selection_catches_wrong_answers(gen):
    """The tie-tolerant checker used across the suite rejects each kind of wrong answer."""
    scores = random_scores(1, 1, 60, gen, "perm")
    good = ref.select_keep(scores, 20, n_sink=2, window=4)[0, 0].tolist()
    check_selection(torch.tensor([[good]], dtype=torch.int32), scores, 20, n_sink=2, window=4)
    lowest_dropped = min(set(range(2, 56)) - set(good), key=lambda j: scores[0, 0, j].item())
    bad_rows = {
        "low-score-swapped-in": sorted(good[:5] + good[6:] + [lowest_dropped]),
        "duplicate": good[:6] + good[5:-1],
        "padding-in-middle": good[:7] + [-1] + good[8:],
        "sink-dropped": sorted(good[1:] + [lowest_dropped]),
        "descending": good[::-1],
    }
    for name, bad in bad_rows.items():
        with pytest.raises(AssertionError):
            check_selection(torch.tensor([[bad]], dtype=torch.int32), scores, 20, n_sink=2,
                            window=4)
