"""Ops on engine-native paged KV caches (block tables), so compression hands whole blocks back.

A layer's K (and V) cache is a pool of fixed-size blocks shared by all sequences; each
sequence lists its blocks in a row of ``block_table``:

=============== ================================== =========================================
tensor          shape / dtype                      meaning
=============== ================================== =========================================
k_cache,        ``[num_blocks, block_size, Hkv,    the block pool: ``layout="NHD"`` (vLLM's
v_cache         D]`` or ``[num_blocks, Hkv,        GPU layout) or ``"HND"``; any strides,
                block_size, D]``; fp32/fp16/bf16,  last dim contiguous (e.g. the K half of
                or fp8 (scores take ``k_scale``)   vLLM's CPU cache ``[nb, Hkv, 2*bs, D]``)
block_table     int32 ``[B, max_blocks]``          token t of row b is slot ``t % block_size``
                                                   of block ``block_table[b, t // block_size]``
seq_lens        int32 ``[B]``                      tokens per row (<= max_blocks * block_size)
=============== ================================== =========================================

After :func:`snapkv` (or :func:`compact` with any kept indices) row b's kept tokens fill
its first ``ceil(new_seq_lens[b] / block_size)`` blocks; the engine returns the rest of
the row's blocks to its pool. Kept tokens keep their RoPE rotation (decode continues at
the original positions, ``seq_lens`` before compaction). Nothing synchronises with the
host; on the CPU, block ids and ``seq_lens`` are checked, CUDA trusts them. Blocks being
compacted must belong to their sequence alone (not a prefix shared with another one).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kvprune_cuda import _C  # noqa: F401  (loads the library that registers the ops)
from kvprune_cuda import _ops as dense_ops
from kvprune_cuda._args import check_int, check_scale, check_str

_ops = torch.ops.kvprune

LAYOUTS = ("NHD", "HND")


class Compacted(NamedTuple):
    """Kept positions int32 [B, Hkv, budget] (ascending, -1 = padding) and the new seq_lens int32 [B]."""

    idx: torch.Tensor
    seq_lens: torch.Tensor


def window_scores(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, *, lse: Optional[torch.Tensor] = None,
                  scale: Optional[float] = None, gqa: str = "mean", layout: str = "NHD",
                  k_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`kvprune_cuda.window_scores` read through the block table.

    Args:
        q: [B, Hq, W, D] post-RoPE queries of each row's last W positions
            (``seq_lens[b] - W + i``), dtype of the cache.
        k_cache, block_table, seq_lens, layout: the paged K cache (module doc).
        lse, scale, gqa, k_scale: as in :func:`kvprune_cuda.window_scores` (fp8 caches:
            ``k_scale`` fp32 [] or [Hkv]).

    Returns:
        fp32 [B, Hkv, max_blocks * block_size]: row b's scores at its positions,
        0 from ``seq_lens[b]`` on (the length needs no host sync).
    """
    check_scale(scale)
    check_str("gqa", gqa, ("mean", "max", "sum"))
    check_str("layout", layout, LAYOUTS)
    return _ops.paged_window_scores(q, k_cache, block_table, seq_lens, lse, scale, gqa, layout,
                                    k_scale)


def compact(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, idx: torch.Tensor, *, layout: str = "NHD") -> torch.Tensor:
    """Moves each row's kept tokens to its first positions, in place; returns the new seq_lens.

    For every row b and KV head h, token t becomes the token at position ``idx[b, h, t]``
    (K and V), for the valid indices. ``idx`` int32 [B, Hkv, budget] holds ascending
    positions below ``seq_lens[b]`` followed by -1 padding, every head of a row the same
    count (what :func:`kvprune_cuda.select_keep` and :func:`kvprune_cuda.streaming` give);
    the CPU checks it, CUDA trusts it. Copies run in ascending t, so every overlap of
    source and destination slots is safe (a token is read before it is overwritten).

    Returns:
        int32 [B]: kept tokens per row; blocks from ``ceil(new / block_size)`` on are free.
    """
    check_str("layout", layout, LAYOUTS)
    return _ops.paged_compact(k_cache, v_cache, block_table, seq_lens, idx, layout)


def snapkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_table: torch.Tensor, seq_lens: torch.Tensor, budget: int, *, n_sink: int = 4,
           window: int = 32, kernel_size: int = 7, pool: str = "max", gqa: str = "mean",
           lse: Optional[torch.Tensor] = None, scale: Optional[float] = None,
           layout: str = "NHD", k_scale: Optional[torch.Tensor] = None,
           pool_shift: int = 0) -> Compacted:
    """SnapKV on a paged cache, compacted in place: :func:`window_scores`, pooling
    (``kernel_size``, ``pool``, ``pool_shift`` as in :func:`kvprune_cuda.snapkv`) and
    :func:`kvprune_cuda.select_keep` (as :func:`kvprune_cuda.snapkv`), then :func:`compact`.

    Rows of at most ``budget`` tokens keep everything. Returns ``(idx, seq_lens)``:
    the kept original positions int32 [B, Hkv, budget] and the new lengths int32 [B].
    """
    check_int("budget", budget)
    scores = window_scores(q, k_cache, block_table, seq_lens, lse=lse, scale=scale, gqa=gqa,
                           layout=layout, k_scale=k_scale)
    pooled = dense_ops.pool_scores(scores, kernel_size, pool, window=window, seq_lens=seq_lens,
                                   shift=pool_shift)
    idx = dense_ops.select_keep(pooled, budget, n_sink=n_sink, window=window, seq_lens=seq_lens)
    return Compacted(idx, compact(k_cache, v_cache, block_table, seq_lens, idx, layout=layout))


def blocks_in_use(seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """int32 [B]: blocks each row needs for ``seq_lens`` tokens (``ceil(n / block_size)``)."""
    check_int("block_size", block_size)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return torch.div(seq_lens + (block_size - 1), block_size, rounding_mode="floor").to(torch.int32)
