"""Reservations: a share of every head's budget that goes first to keys chosen by one signal."""

from __future__ import annotations

import torch


def reserve_top(scores: torch.Tensor, by: torch.Tensor, count: int) -> torch.Tensor:
    """``scores`` (fp32 [B, Hkv, n], those not reserved yet <= 1: probabilities) with the
    ``count`` largest of ``by`` ([B, Hkv, n]) in every (row, head) raised by 1, above every key
    not raised, so any selection of at least ``count`` per head takes them first, after the
    sinks and window it always keeps (a new tensor; ``scores`` itself when ``count`` is 0)."""
    count = min(count, scores.shape[-1])
    if count <= 0:
        return scores
    top = by.topk(count, -1).indices
    return scores.scatter_add(-1, top, torch.ones_like(top, dtype=scores.dtype))
