"""``full``: nothing is evicted (the baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

from kvprune_cuda.policy.base import Policy
from kvprune_cuda.policy.registry import register


@register
@dataclass(frozen=True)
class Full(Policy):
    """Nothing is evicted (the baseline)."""

    name: ClassVar[str] = "full"

    def kept_tokens(self, n: int, budget: Union[int, float, None] = None) -> int:
        return n

    @property
    def ranks(self) -> bool:
        return False
