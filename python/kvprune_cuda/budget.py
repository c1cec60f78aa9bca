"""Budget allocation across layers: how many tokens each layer keeps under one global budget.

A uniform budget keeps the same number of tokens in every layer. A global one ranks the
scores of all layers together and keeps the top fraction, so layers whose attention is
spread out keep more tokens and layers that attend to a few keys keep fewer (KVzip,
PyramidKV-style allocation). Within a layer every KV head and batch row keeps the same
count, so each layer's compressed K/V stay dense ``[B, Hkv, k_l, D]`` tensors that
really free memory; :func:`kvprune_cuda.select_keep` then picks each head's own top
``k_l``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvprune_cuda._args import check_int


def layer_budgets(scores: Sequence[torch.Tensor], budget: int, *, n_sink: int = 4,
                  window: int = 32) -> list[int]:
    """Tokens each layer keeps when ``len(scores) * budget`` tokens are shared by all layers.

    Args:
        scores: one fp32 ``[B, Hkv, n]`` tensor per layer, all the same shape and device
            (attention-probability scores such as ``window_scores`` returns: they are
            already normalised per query, so they are ranked as they are).
        budget: mean tokens per layer, ``n_sink + window <= budget``.
        n_sink, window: positions ``[0, n_sink)`` and ``[n - window, n)`` are kept in
            every layer and do not compete.

    Returns ``k`` (Python ints, one per layer) with ``n_sink + window <= k[l] <= n`` and
    ``sum(k) == len(scores) * min(budget, n)``. The free positions ``[n_sink, n - window)``
    of every layer, row and KV head are ranked together by score (equal scores prefer the
    lower layer, then the lower row, head and position); the top
    ``L * B * Hkv * (budget - n_sink - window)`` are chosen; layer ``l`` gets
    ``n_sink + window`` plus its chosen count divided by ``B * Hkv``, rounded by largest
    remainder (ties: the lower layer) so the total is exact. One host sync (the counts
    decide tensor shapes).
    """
    n_layers, b, hkv, n = _check(scores, budget, n_sink, window)
    protected = n_sink + window
    if budget >= n or protected >= n:
        return [min(budget, n)] * n_layers
    per_row = b * hkv
    share = _chosen(scores, budget, n_sink, window).sum((1, 2)).double() / per_row  # fractional
    whole = share.floor().long()
    left = n_layers * (budget - protected) - int(whole.sum())
    if left > 0:
        frac = share - whole.double()
        whole[torch.sort(frac, descending=True, stable=True).indices[:left]] += 1
    return [protected + int(x) for x in whole.tolist()]


def head_budgets(scores: Sequence[torch.Tensor], budget: int, *, n_sink: int = 4,
                 window: int = 32) -> torch.Tensor:
    """Tokens each (layer, row, KV head) keeps when all of them share one budget.

    The same ranking as :func:`layer_budgets`, without splitting the counts evenly over a
    layer's rows and heads: int64 ``[L, B, Hkv]`` (on the CPU), ``n_sink + window`` plus
    the number of that head's free positions among the top
    ``L * B * Hkv * (budget - n_sink - window)`` (equal scores prefer the lower layer, row,
    head and position), so ``sum == L * B * Hkv * min(budget, n)``. With ``budget >= n`` or
    ``n_sink + window >= n`` every head keeps ``min(budget, n)``. Heads then hold different
    numbers of tokens: a ragged layout (``kp.hf``'s per-head cache layer) frees the rest.
    """
    n_layers, b, hkv, n = _check(scores, budget, n_sink, window)
    protected = n_sink + window
    if budget >= n or protected >= n:
        return torch.full((n_layers, b, hkv), min(budget, n), dtype=torch.int64)
    return protected + _chosen(scores, budget, n_sink, window).cpu()


def _check(scores: Sequence[torch.Tensor], budget: int, n_sink: int, window: int) -> tuple:
    """(L, B, Hkv, n) of valid arguments; a ValueError / TypeError naming the bad one."""
    check_int("budget", budget)
    check_int("n_sink", n_sink)
    check_int("window", window)
    if len(scores) == 0:
        raise ValueError("scores: expected at least one layer")
    for i, s in enumerate(scores):
        if not isinstance(s, torch.Tensor) or s.dim() != 3 or s.dtype != torch.float32:
            raise ValueError(f"scores[{i}]: expected a fp32 [B, Hkv, n] tensor")
        if i == 0:
            shape, dev = s.shape, s.device
        if s.shape != shape or s.device != dev:
            raise ValueError(f"scores[{i}]: shape {tuple(s.shape)} on {s.device} differs from "
                             f"scores[0] {tuple(shape)} on {dev}")
    if n_sink < 0 or window < 0:
        raise ValueError(f"n_sink, window: must be >= 0, got {n_sink}, {window}")
    if budget < n_sink + window:
        raise ValueError(f"budget: {budget} < n_sink + window = {n_sink + window}")
    return (len(scores), *shape)


def _chosen(scores: Sequence[torch.Tensor], budget: int, n_sink: int, window: int) -> torch.Tensor:
    """int64 [L, B, Hkv]: free positions of each head among the top ``L * B * Hkv * (budget -
    n_sink - window)`` of all layers' free scores (a stable descending sort; needs
    ``n_sink + window < n``)."""
    n_layers, b, hkv, n = len(scores), *scores[0].shape
    free = torch.stack([s[:, :, n_sink:n - window] for s in scores])  # [L, B, Hkv, n - P]
    n_chosen = n_layers * b * hkv * (budget - n_sink - window)
    order = torch.sort(free.reshape(-1), descending=True, stable=True).indices[:n_chosen]
    counts = torch.bincount(order // free.shape[3], minlength=n_layers * b * hkv)
    return counts.view(n_layers, b, hkv)
