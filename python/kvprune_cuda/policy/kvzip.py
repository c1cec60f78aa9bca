"""``kvzip``: KVzip, query-agnostic, scored by the model's reconstruction of the context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from kvprune_cuda._ops import window_scores
from kvprune_cuda.policy.base import GQA, Policy, check_choice, check_int
from kvprune_cuda.policy.registry import register


@register
@dataclass(frozen=True)
class KVzip(Policy):
    """KVzip (query-agnostic): a key's score is the largest attention probability it gets
    from any query of the model reconstructing the context (``chunk_size`` context tokens per
    forward), the query heads of a KV group combined by ``gqa``; ``softmax``: the keys a
    probability is normalised over ("chunk": the sinks, the chunk and the reconstruction
    tokens, KVzip's own; "all": every key the query sees). Protects only the sinks by
    default (``window=0``), as KVzip does. Only kp.hf.compress_context runs it."""

    name: ClassVar[str] = "kvzip"
    evidence: ClassVar[str] = "reconstruction"
    default_scope: ClassVar[str] = "head"  # 20/20 passkey at 10 % (bench/RESULTS.md)
    window: int = 0
    gqa: str = "max"
    softmax: str = "chunk"
    chunk_size: int = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("gqa", self.gqa, GQA)
        check_choice("softmax", self.softmax, ("chunk", "all"))
        check_int("chunk_size", self.chunk_size, 1)

    def score(self, queries, keys, *, scale=None, seq_lens=None, lse=None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Folds the maxima of ``queries`` (one reconstruction chunk) into ``out`` (fp32
        ``[B, Hkv, M]``, the first M of ``keys``; a new zero buffer if None)."""
        if out is None:
            out = torch.zeros(*keys.shape[:3], dtype=torch.float32, device=keys.device)
        return window_scores(queries, keys, lse=lse, scale=scale, gqa=self.gqa,
                                qreduce="max", out=out)
