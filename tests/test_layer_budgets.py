"""kp.layer_budgets / kp.head_budgets: tokens per layer (per KV head) under one budget shared
by all layers.

Checked against a brute-force pure-Python implementation of the documented rule (rank every
free position of every layer, row and KV head together, keep the top ones; layer_budgets
then splits the counts by largest remainder), on scores with and without ties, and on small
hand-built cases.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvprune_cuda as kp


def _brute_chosen(scores, budget, n_sink, window):
    """The chosen free positions of the docstrings, one Python tuple per free position:
    (-score, layer, row, head, position), ascending = descending score, then lower index."""
    b, hkv, n = scores[0].shape
    items = []
    for layer, s in enumerate(scores):
        for row in range(b):
            for head in range(hkv):
                for j in range(n_sink, n - window):
                    items.append((-float(s[row, head, j]), layer, row, head, j))
    items.sort()
    return items[:len(scores) * b * hkv * (budget - n_sink - window)]


def _brute_head_budgets(scores, budget, n_sink, window):
    """The docstring of kp.head_budgets: nested lists [L][B][Hkv]."""
    b, hkv, n = scores[0].shape
    protected = n_sink + window
    if budget >= n or protected >= n:
        return [[[min(budget, n)] * hkv for _ in range(b)] for _ in scores]
    out = [[[protected] * hkv for _ in range(b)] for _ in scores]
    for _, layer, row, head, _ in _brute_chosen(scores, budget, n_sink, window):
        out[layer][row][head] += 1
    return out


def _brute_budgets(scores, budget, n_sink, window):
    """The docstring of kp.layer_budgets."""
    n_layers = len(scores)
    b, hkv, n = scores[0].shape
    protected = n_sink + window
    if budget >= n or protected >= n:
        return [min(budget, n)] * n_layers
    counts = [0] * n_layers
    for item in _brute_chosen(scores, budget, n_sink, window):
        counts[item[1]] += 1
    per_row = b * hkv
    whole = [c // per_row for c in counts]
    remainder = [c % per_row for c in counts]  # exact: every share has the same denominator
    left = n_layers * (budget - protected) - sum(whole)
    for layer in sorted(range(n_layers), key=lambda i: (-remainder[i], i))[:left]:
        whole[layer] += 1
    return [protected + w for w in whole]


def _scores(gen, n_layers, b, hkv, n, ties):
    """Random fp32 scores; with ``ties`` only 4 distinct values, so most comparisons are ties."""
    if ties:
        return [torch.randint(0, 4, (b, hkv, n), generator=gen).float() / 4
                for _ in range(n_layers)]
    # per-layer scale: layers differ in how spread out their scores are
    return [torch.rand(b, hkv, n, generator=gen) ** (1 + 3 * i) for i in range(n_layers)]


# (L, B, Hkv, n, budget, n_sink, window)
CASES = [
    (3, 1, 2, 40, 12, 2, 4),
    (4, 2, 2, 33, 10, 1, 3),
    (5, 1, 3, 29, 9, 4, 2),
    (2, 3, 1, 50, 31, 0, 5),
    (1, 2, 2, 24, 10, 2, 2),     # one layer: its budget is the budget
    (3, 2, 2, 20, 6, 2, 4),      # budget == n_sink + window: nothing free is chosen
    (3, 1, 2, 20, 19, 2, 4),     # budget == n - 1
    (3, 1, 2, 20, 20, 2, 4),     # budget == n
    (3, 2, 1, 16, 40, 4, 4),     # budget > n
    (2, 1, 2, 12, 20, 8, 8),     # n_sink + window > n
    (3, 1, 1, 10, 0, 0, 0),      # nothing protected, nothing kept
]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "L{}B{}H{}n{}k{}s{}w{}".format(*c))
def test_matches_brute_force(device, gen, case, ties):
    n_layers, b, hkv, n, budget, n_sink, window = case
    scores = _scores(gen, n_layers, b, hkv, n, ties)
    want = _brute_budgets(scores, budget, n_sink, window)
    got = kp.layer_budgets([s.to(device) for s in scores], budget, n_sink=n_sink, window=window)
    assert got == want
    assert all(type(k) is int for k in got)
    assert sum(got) == n_layers * min(budget, n)
    assert all(min(n_sink + window, n) <= k <= n for k in got)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "L{}B{}H{}n{}k{}s{}w{}".format(*c))
def test_head_budgets_match_brute_force(device, gen, case, ties):
    n_layers, b, hkv, n, budget, n_sink, window = case
    scores = _scores(gen, n_layers, b, hkv, n, ties)
    got = kp.head_budgets([s.to(device) for s in scores], budget, n_sink=n_sink, window=window)
    assert got.dtype == torch.int64 and got.device.type == "cpu"
    assert got.tolist() == _brute_head_budgets(scores, budget, n_sink, window)
    assert int(got.sum()) == n_layers * b * hkv * min(budget, n)
    assert bool((got >= min(n_sink + window, n)).all() and (got <= n).all())


def test_head_budgets_differ_between_heads_of_a_layer():
    """Head 0 of layer 0 attends broadly, head 1 to nothing: head 0 takes the free slots of
    both heads; layer_budgets of the same scores gives both heads the layer's mean."""
    n_sink, window = 1, 1
    scores = _layers([[0.9] * 6, [0.0] * 6], [[0.5, 0.5, 0, 0, 0, 0], [0.5, 0.5, 0, 0, 0, 0]])
    assert kp.head_budgets(scores, 4, n_sink=n_sink, window=window).tolist() == \
        [[[8, 2]], [[4, 2]]]  # 8 free slots: six 0.9 of layer 0 head 0, then two 0.5 (lower head)
    assert kp.layer_budgets(scores, 4, n_sink=n_sink, window=window) == [5, 3]


def test_budgets_differ_between_layers(gen):
    """Not a uniform split: a layer whose free scores are all higher than another's takes every
    free slot it has room for (random scores, 6 layers)."""
    scores = _scores(gen, 6, 2, 2, 64, ties=False)
    got = kp.layer_budgets(scores, 20, n_sink=4, window=8)
    assert got == _brute_budgets(scores, 20, 4, 8)
    assert len(set(got)) > 2 and got[0] > got[-1]  # layer 0 is the flattest (largest scores)


def _layers(*free_rows, n_sink=1, window=1):
    """Scores [1, Hkv, n] per layer from the free positions of each head (sinks / window 0)."""
    out = []
    for heads in free_rows:
        t = torch.tensor(heads, dtype=torch.float32)
        pad = lambda w: torch.zeros(t.shape[0], w)  # noqa: E731
        out.append(torch.cat([pad(n_sink), t, pad(window)], 1)[None])
    return out


def test_dominant_layer_takes_the_budget():
    n_sink, window = 4, 4
    hi = torch.full((1, 2, 20), 0.9)
    lo = torch.full((1, 2, 20), 0.1)
    assert kp.layer_budgets([hi, lo], 12, n_sink=n_sink, window=window) == [16, 8]
    assert kp.layer_budgets([lo, hi], 12, n_sink=n_sink, window=window) == [8, 16]
    # sinks and window do not compete: huge scores there change nothing
    lo_loud = lo.clone()
    lo_loud[..., :n_sink] = 100.0
    lo_loud[..., -window:] = 100.0
    assert kp.layer_budgets([hi, lo_loud], 12, n_sink=n_sink, window=window) == [16, 8]


def test_equal_scores_prefer_the_lower_layer():
    s = torch.full((1, 2, 20), 0.5)
    # 3 x 2 x 6 = 36 free slots chosen: all 24 of layer 0, then 12 of layer 1 (6 per head)
    assert kp.layer_budgets([s, s.clone(), s.clone()], 14, n_sink=4, window=4) == [20, 14, 8]


def test_largest_remainder_and_its_ties():
    # 3 layers, 2 heads, budget - P = 1 -> 6 free slots chosen. Layer 2: 4 of them (share 2);
    # layers 0 and 1: one each (share 0.5). One slot is left for two equal remainders: layer 0.
    scores = _layers([[0.9, 0, 0], [0, 0, 0]],
                     [[0, 0, 0], [0, 0.9, 0]],
                     [[1, 1, 1], [1, 0, 0]])
    assert kp.layer_budgets(scores, 3, n_sink=1, window=1) == [3, 2, 4]
    # 2 layers, 2 rows x 2 heads: counts 1 and 7 -> shares 0.25 and 1.75; the larger
    # remainder (layer 1) wins the slot left although layer 0 is lower.
    a = torch.zeros(2, 2, 4)
    a[0, 0, 1] = 0.5
    b = torch.zeros(2, 2, 4)
    b[:, :, 1:3] = 1.0
    b[1, 1, 2] = 0.0
    assert kp.layer_budgets([a, b], 3, n_sink=1, window=1) == [2, 4]


def test_integer_like_budgets_are_accepted(gen):
    scores = _scores(gen, 2, 1, 2, 30, ties=False)
    assert kp.layer_budgets(scores, np.int64(12), n_sink=np.int32(2), window=4) == \
        kp.layer_budgets(scores, 12, n_sink=2, window=4)


@pytest.mark.parametrize("fn", [kp.layer_budgets, kp.head_budgets], ids=["layer", "head"])
def test_bad_input(fn):
    s = torch.rand(1, 2, 30)
    with pytest.raises(ValueError, match="scores"):
        fn([], 12)
    with pytest.raises(ValueError, match=r"scores\[1\]"):
        fn([s, s.half()], 12, n_sink=2, window=4)
    with pytest.raises(ValueError, match=r"scores\[0\]"):
        fn([s.double()], 12, n_sink=2, window=4)
    with pytest.raises(ValueError, match=r"scores\[0\]"):
        fn([s[0]], 12, n_sink=2, window=4)
    with pytest.raises(ValueError, match=r"scores\[0\]"):
        fn([s.numpy()], 12, n_sink=2, window=4)
    with pytest.raises(ValueError, match=r"scores\[1\]"):
        fn([s, torch.rand(1, 2, 31)], 12, n_sink=2, window=4)
    with pytest.raises(ValueError, match=r"scores\[2\]"):
        fn([s, s, torch.rand(2, 1, 30)], 12, n_sink=2, window=4)
    with pytest.raises(ValueError, match="budget"):
        fn([s], 5, n_sink=2, window=4)
    with pytest.raises(ValueError, match="budget"):
        fn([s], 35)  # defaults n_sink=4, window=32
    with pytest.raises(ValueError, match="n_sink"):
        fn([s], 12, n_sink=-1, window=4)
    for bad in (True, 12.0, "12", None):
        with pytest.raises(TypeError, match="budget"):
            fn([s], bad, n_sink=2, window=4)
    with pytest.raises(TypeError, match="n_sink"):
        fn([s], 12, n_sink=2.0, window=4)
    with pytest.raises(TypeError, match="window"):
        fn([s], 12, n_sink=2, window=False)
