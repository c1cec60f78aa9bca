"""Key novelty (KeyDiff's query-agnostic signal): how unlike the rest of its head a key is."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvprune_cuda.policy.reserve import reserve_top


def key_novelty(keys: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, Hkv, n]``: minus the cosine between each of ``keys`` [B, Hkv, n, D] and the
    direction of its head's mean unit key; a key pointing away from the others scores high
    (up to 1), one along them low (down to -1)."""
    unit = F.normalize(keys.float(), dim=-1)
    anchor = F.normalize(unit.mean(2, keepdim=True), dim=-1)  # [B, Hkv, 1, D]
    return -(unit * anchor).sum(-1)


def reserve_novel(scores: torch.Tensor, keys: torch.Tensor, count: int) -> torch.Tensor:
    """``scores`` (fp32 [B, Hkv, n]) with the ``count`` most novel keys of every (row, head) of
    ``keys`` [B, Hkv, n, D] raised by 1 (:func:`reserve_top`)."""
    if count <= 0:
        return scores
    return reserve_top(scores, key_novelty(keys), count)
