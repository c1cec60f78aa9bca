"""``snapkv``: SnapKV, the last window queries vote, 1-D pooled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from kvprune_cuda._ops import pool_scores, snapkv, snapkv_select, window_scores
from kvprune_cuda._args import check_int, check_str
from kvprune_cuda.policy.base import GQA, Policy, check_shift
from kvprune_cuda.policy.registry import register

DEFAULT_KERNEL = 49  # the pool's width and shift by default: a pool over [i - 40, i + 8]
DEFAULT_SHIFT = 16   # (bench/RESULTS.md, "RULER-style tasks")


@register
@dataclass(frozen=True)
class SnapKV(Policy):
    """SnapKV: the last ``window`` queries vote (attention probabilities, the query heads of
    a KV group combined by ``gqa``), 1-D pooled over ``kernel_size`` positions (``pool``:
    "max" or "avg"). ``pool_shift``: the pool of position ``i`` covers the votes of
    ``[i - r - pool_shift, i + r - pool_shift]`` (``r = kernel_size // 2``; 0 <= pool_shift <=
    r), so a voted token's score reaches the ``r + pool_shift`` tokens after it and the
    ``r - pool_shift`` before it: a retrieval answer follows the key the question names. None:
    the measured default's shift, :data:`DEFAULT_SHIFT`, with the default kernel
    :data:`DEFAULT_KERNEL`, else 0 (a centred pool, as every kernel was before the shift)
    (docs/policy.md, "Defaults"). Only the votes before the window (the last ``window``
    tokens, always kept) are pooled."""

    name: ClassVar[str] = "snapkv"
    evidence: ClassVar[str] = "window_queries"
    kernel_size: int = DEFAULT_KERNEL
    pool: str = "max"
    gqa: str = "mean"
    pool_shift: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError("window: snapkv votes with the last window queries; needs >= 1")
        check_int("kernel_size", self.kernel_size, 1)
        check_str("pool", self.pool, ("max", "avg"))
        check_str("gqa", self.gqa, GQA)
        if self.pool_shift is not None:
            check_shift(self.pool_shift, self.kernel_size)

    @property
    def shift(self) -> int:
        """The pool's shift: ``pool_shift``; None: :data:`DEFAULT_SHIFT` with the default
        kernel, else 0."""
        if self.pool_shift is not None:
            return self.pool_shift
        return DEFAULT_SHIFT if self.kernel_size == DEFAULT_KERNEL else 0

    def score(self, queries, keys, *, scale=None, seq_lens=None) -> torch.Tensor:
        s = window_scores(queries, keys, scale=scale, gqa=self.gqa, seq_lens=seq_lens)
        return pool_scores(s, self.kernel_size, self.pool, window=self.window, seq_lens=seq_lens,
                           shift=self.shift)

    def select(self, queries, keys, values, kept, *, seq_lens=None):
        """The fused ``kp.snapkv`` (every kernel and shift), unless a subclass overrides
        ``score``: then None, and the integration ranks that ``score``."""
        fused = self._fused_options()
        return None if fused is None else snapkv(queries, keys, values, kept,
                                                 seq_lens=seq_lens, **fused)

    def select_indices(self, queries, keys, kept, *, scale=None, seq_lens=None):
        """The fused ``kp.snapkv_select``, when :meth:`select` is fused."""
        fused = self._fused_options()
        return None if fused is None else snapkv_select(queries, keys, kept, scale=scale,
                                                        seq_lens=seq_lens, **fused)

    def _fused_options(self) -> Optional[dict]:
        """The fused ops' keyword arguments for this policy; None when a subclass overrides
        ``score`` (which they would not compute)."""
        if type(self).score is not SnapKV.score:
            return None
        return dict(n_sink=self.n_sink, window=self.window, kernel_size=self.kernel_size,
                    pool=self.pool, gqa=self.gqa, pool_shift=self.shift)
