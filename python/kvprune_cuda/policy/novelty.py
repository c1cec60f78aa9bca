"""Key novelty (KeyDiff's query-agnostic signal): how unlike the rest of its head a key is."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def key_novelty(keys: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, Hkv, n]``: minus the cosine between each of ``keys`` [B, Hkv, n, D] and the
    direction of its head's mean unit key; a key pointing away from the others scores high
    (up to 1), one along them low (down to -1)."""
    unit = F.normalize(keys.float(), dim=-1)
    anchor = F.normalize(unit.mean(2, keepdim=True), dim=-1)  # [B, Hkv, 1, D]
    return -(unit * anchor).sum(-1)


def reserve_novel(scores: torch.Tensor, keys: torch.Tensor, count: int) -> torch.Tensor:
    """``scores`` (fp32 [B, Hkv, n], each <= 1: probabilities) with the ``count`` most novel
    keys of every (row, head) of ``keys`` [B, Hkv, n, D] raised by 1, above every other key,
    so any selection of at least ``count`` per head takes them first (a new tensor; ``scores``
    itself when ``count`` is 0)."""
    count = min(count, scores.shape[-1])
    if count <= 0:
        return scores
    top = key_novelty(keys).topk(count, -1).indices
    return scores.scatter_add(-1, top, torch.ones_like(top, dtype=scores.dtype))
