"""The 1-D pool that spreads a voted key's score to its neighbours (SnapKV; KVzip optionally)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kvprune_cuda._ops import pool_scores


def shifted_pool(scores: torch.Tensor, kernel_size: int, pool: str, shift: int, window: int,
                 seq_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 [B, H, n]: position ``i`` of ``scores`` (fp32 [B, H, n], rows valid up to
    ``seq_lens``) pooled (``pool``: "max" | "avg") over ``[i - r - shift, i + r - shift]``
    (``r = kernel_size // 2``, ``0 <= shift <= r``), so a high score reaches the ``r + shift``
    tokens after it; the last ``window`` of each row are copied, not pooled. Built on
    ``kp.pool_scores``: the scores move ``shift`` later (zeros in front), the centred pool of
    the longer rows is cut back to ``n``."""
    n = scores.shape[-1]
    if shift:
        scores = F.pad(scores, (shift, 0))
        seq_lens = None if seq_lens is None else seq_lens + shift
    pooled = pool_scores(scores, kernel_size, pool, window=window, seq_lens=seq_lens)
    return pooled[..., :n].contiguous() if shift else pooled
