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


def reserve_novel(scores: torch.Tensor, keys: torch.Tensor, count: int, first: int = 0,
                  last: int = 0) -> torch.Tensor:
    """``scores`` (fp32 [B, Hkv, n]) with the ``count`` most novel keys of every (row, head) of
    ``keys`` [B, Hkv, n, D] raised by 1 (:func:`reserve_top`), none of the first ``first`` or
    the last ``last`` positions (a selection keeps those anyway; ``count`` is capped at the
    others)."""
    if count <= 0:
        return scores
    novel = key_novelty(keys)
    n = novel.shape[-1]
    novel[..., :first] = novel[..., max(first, n - last):] = float("-inf")
    return reserve_top(scores, novel, min(count, n - first - last))
