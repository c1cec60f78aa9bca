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
    n_layers, (b, hkv, n) = len(scores), shape
    if n_sink < 0 or window < 0:
        raise ValueError(f"n_sink, window: must be >= 0, got {n_sink}, {window}")
    protected = n_sink + window
    if budget < protected:
        raise ValueError(f"budget: {budget} < n_sink + window = {protected}")
    if budget >= n or protected >= n:
        return [min(budget, n)] * n_layers
    free = torch.stack([s[:, :, n_sink:n - window] for s in scores])  # [L, B, Hkv, n - P]
    per_row = b * hkv
    n_chosen = n_layers * per_row * (budget - protected)
    order = torch.sort(free.reshape(-1), descending=True, stable=True).indices[:n_chosen]
    counts = torch.bincount(order // (per_row * free.shape[3]), minlength=n_layers)
    share = counts.double() / per_row                                # tokens per layer, fractional
    whole = share.floor().long()
    left = n_layers * (budget - protected) - int(whole.sum())
    if left > 0:
        frac = share - whole.double()
        whole[torch.sort(frac, descending=True, stable=True).indices[:left]] += 1
    return [protected + int(x) for x in whole.tolist()]
