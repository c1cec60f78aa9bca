"""``snapkv``: SnapKV, the last window queries vote, 1-D pooled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvprune_cuda._ops import pool_scores, window_scores
from kvprune_cuda.policy.base import GQA, Policy, check_choice, check_int
from kvprune_cuda.policy.registry import register


@register
@dataclass(frozen=True)
class SnapKV(Policy):
    """SnapKV: the last ``window`` queries vote (attention probabilities, the query heads of
    a KV group combined by ``gqa``), 1-D pooled over ``kernel_size`` positions."""

    name: ClassVar[str] = "snapkv"
    evidence: ClassVar[str] = "window_queries"
    kernel_size: int = 7
    pool: str = "max"
    gqa: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError("window: snapkv votes with the last window queries; needs >= 1")
        check_int("kernel_size", self.kernel_size, 1)
        check_choice("pool", self.pool, ("max", "avg"))
        check_choice("gqa", self.gqa, GQA)

    def score(self, queries, keys, *, scale=None, seq_lens=None) -> torch.Tensor:
        s = window_scores(queries, keys, scale=scale, gqa=self.gqa, seq_lens=seq_lens)
        return pool_scores(s, self.kernel_size, self.pool, window=self.window, seq_lens=seq_lens)
