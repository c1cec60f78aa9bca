"""``kvzip``: KVzip, query-agnostic, scored by the model's reconstruction of the context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from kvprune_cuda._ops import pool_scores, window_scores
from kvprune_cuda._args import check_fraction, check_int, check_str
from kvprune_cuda.policy.base import GQA, Policy, check_shift
from kvprune_cuda.policy.novelty import reserve_novel
from kvprune_cuda.policy.reserve import reserve_top
from kvprune_cuda.policy.registry import register


WEIGHTS = ("none", "output")  # KVzip.weight: plain probabilities, KVzip+'s output weighting


@register
@dataclass(frozen=True)
class KVzip(Policy):
    """KVzip (query-agnostic): a key's score is the largest attention probability it gets
    from any query of the model reconstructing the context (``chunk_size`` context tokens per
    forward), the query heads of a KV group combined by ``gqa``; ``softmax``: the keys a
    probability is normalised over ("chunk": the sinks, the chunk and the reconstruction
    tokens, KVzip's own; "all": every key the query sees). Protects only the sinks by
    default (``window=0``), as KVzip does. ``kernel_size`` > 1 pools the maxima before they
    are ranked, as SnapKV pools its votes (``pool``, ``pool_shift``:
    :func:`kvprune_cuda.pool_scores`); 1, the default, ranks them as they
    are. ``head_floor``: the share of each head's budget that goes first to its own largest
    maxima, whatever the other heads score (AdaKV's safeguard: under a budget shared across
    heads, "head" or "global" scope, no head falls below it; alone, with one count per head
    and layer, it changes nothing). ``novelty``: the share that goes first to the head's most novel
    keys (KeyDiff: the keys least like the head's mean key,
    :func:`~kvprune_cuda.policy.novelty.key_novelty`). The rest of the budget goes by the
    maxima. ``weight``: "output" (KVzip+, the default) multiplies each probability by the
    key's value output norm over the query's hidden-state norm before the maxima
    (:func:`~kvprune_cuda.policy.output_weight.value_output_norms`); "none" takes the plain
    probabilities, KVzip's own. Only kp.hf.compress_context runs it."""

    name: ClassVar[str] = "kvzip"
    evidence: ClassVar[str] = "reconstruction"
    default_scope: ClassVar[str] = "head"  # 20/20 passkey at 10 % (bench/RESULTS.md)
    recorded_with: ClassVar[tuple] = ("gqa", "softmax", "chunk_size", "weight", "n_sink")
    window: int = 0
    gqa: str = "max"
    softmax: str = "chunk"
    chunk_size: int = 2048
    kernel_size: int = 1
    pool: str = "max"
    pool_shift: int = 0
    head_floor: float = 0.25  # bench/notes/2026-12-05-ruler-defaults.md, "A per-head floor"
    novelty: float = 0.0
    weight: str = "output"  # bench/notes/2026-12-05-ruler-defaults.md, "KVzip+ in the kernels"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_str("gqa", self.gqa, GQA)
        check_str("softmax", self.softmax, ("chunk", "all"))
        check_int("chunk_size", self.chunk_size, 1)
        check_int("kernel_size", self.kernel_size, 1)
        check_str("pool", self.pool, ("max", "avg"))
        check_shift(self.pool_shift, self.kernel_size)
        check_fraction("head_floor", self.head_floor)
        check_fraction("novelty", self.novelty)
        check_str("weight", self.weight, WEIGHTS)

    def rank_recorded(self, recorded: torch.Tensor,
                      keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        s = recorded
        if self.kernel_size > 1:
            s = pool_scores(recorded, self.kernel_size, self.pool, window=self.window,
                            shift=self.pool_shift)
        kept = self.kept_tokens(recorded.shape[-1])
        s = reserve_top(s, s, int(self.head_floor * kept))
        if self.novelty == 0.0:
            return s
        if keys is None:
            raise ValueError(f"keys: kvzip with novelty = {self.novelty} ranks the keys too")
        return reserve_novel(s, keys, int(self.novelty * kept))

    def score(self, queries, keys, *, scale=None, seq_lens=None, lse=None,
              out: Optional[torch.Tensor] = None,
              weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """Folds the maxima of ``queries`` (one reconstruction chunk) into ``out`` (fp32
        ``[B, Hkv, M]``, the first M of ``keys``; a new zero buffer if None). ``weights``
        (with ``weight="output"``, and only then): fp32 ``[B, Hq, M]`` per query head and
        key, fp32 ``[B, Hq, W]`` per query (``kp.window_scores``'s key_weight and
        query_weight)."""
        if out is None:
            out = torch.zeros(*keys.shape[:3], dtype=torch.float32, device=keys.device)
        if (weights is not None) != (self.weight == "output"):
            raise ValueError(f"weights: kvzip with weight={self.weight!r} "
                             f"{'needs' if weights is None else 'takes no'} output weights")
        key_weight, query_weight = (None, None) if weights is None else weights
        return window_scores(queries, keys, lse=lse, scale=scale, gqa=self.gqa, qreduce="max",
                             out=out, query_weight=query_weight, key_weight=key_weight)
