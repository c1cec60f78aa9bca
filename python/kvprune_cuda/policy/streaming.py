"""``streaming``: StreamingLLM, the attention sinks and the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvprune_cuda._ops import streaming
from kvprune_cuda.policy.base import Policy
from kvprune_cuda.policy.registry import register


@register
@dataclass(frozen=True)
class Streaming(Policy):
    """StreamingLLM: the sinks and the most recent tokens; in kp.hf a ring of ``budget``
    slots while decoding (each new token overwrites the oldest non-sink one)."""

    name: ClassVar[str] = "streaming"
    fixed_capacity: ClassVar[bool] = True

    @property
    def min_keep(self) -> int:
        return self.n_sink + self.window + (1 if self.window == 0 else 0)  # a ring slot

    @property
    def ranks(self) -> bool:
        return False

    def score(self, queries, keys, *, scale=None, seq_lens=None) -> torch.Tensor:
        """Recency: the position, so the top scores are the most recent tokens."""
        b, hkv, n = keys.shape[:3]
        return torch.arange(n, dtype=torch.float32, device=keys.device).expand(b, hkv, n).clone()

    def select(self, queries, keys, values, kept, *, seq_lens=None):
        """The fused ``kp.streaming`` (only if ``score`` is this class's)."""
        if type(self).score is not Streaming.score:
            return None
        return streaming(keys, values, kept, n_sink=self.n_sink, seq_lens=seq_lens)
