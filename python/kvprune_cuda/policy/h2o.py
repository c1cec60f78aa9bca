"""``h2o``: heavy hitters, attention accumulated over every observed query."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvprune_cuda._ops import window_scores
from kvprune_cuda._args import check_str
from kvprune_cuda.policy.base import GQA, Policy
from kvprune_cuda.policy.registry import register


@register
@dataclass(frozen=True)
class H2O(Policy):
    """Heavy hitters: every query's attention probabilities accumulate into each key's score
    (summed over forwards by the integration); in kp.hf a fixed cache of ``budget`` slots
    while decoding, each new token replacing the lowest-scored one outside sinks and window."""

    name: ClassVar[str] = "h2o"
    evidence: ClassVar[str] = "attention"
    fixed_capacity: ClassVar[bool] = True
    recorded_with: ClassVar[tuple] = ("gqa",)  # the sums are recorded reduced over the group
    gqa: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_str("gqa", self.gqa, GQA)

    @property
    def min_keep(self) -> int:
        return self.n_sink + self.window + 1  # a free slot for the next token

    def score(self, queries, keys, *, scale=None, seq_lens=None) -> torch.Tensor:
        return window_scores(queries, keys, scale=scale, gqa=self.gqa, seq_lens=seq_lens)
