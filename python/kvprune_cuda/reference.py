"""The specification of every kvprune op, in plain PyTorch.

Written for clarity, not speed: loops over batch rows, float64 arithmetic where
rounding matters. Tests compare the compiled CPU and CUDA ops against these
functions. See DESIGN.md §1 for the maths.

Shapes: batch B, query heads Hq, KV heads Hkv (G = Hq // Hkv query heads share a
KV head), cache length N, head dim D, observation window W.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

GQA_REDUCTIONS = ("mean", "max", "sum")
POOL_MODES = ("max", "avg")


def _row_lengths(batch: int, length: int, seq_lens: Optional[torch.Tensor]) -> list[int]:
    """Valid length of every batch row (right padding)."""
    if seq_lens is None:
        return [length] * batch
    return [int(n) for n in seq_lens.tolist()]


def window_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    lse: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    gqa: str = "mean",
    seq_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention mass each key receives from the last W queries, per KV head.

    q [B,Hq,W,D] holds the queries of positions n-W .. n-1 of each row (n its valid
    length); k [B,Hkv,N,D]. Query i sees keys j <= n-W+i. Without lse the softmax is
    normalised over the visible keys; with lse [B,Hq,W] the probabilities are
    exp(q.k*scale - lse). Queries at negative positions (n < W) contribute nothing.
    Returns fp32 [B,Hkv,N]; positions >= n are 0.
    """
    batch, q_heads, window, head_dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(batch, kv_heads, length, dtype=torch.float64)
    for b, n in enumerate(_row_lengths(batch, length, seq_lens)):
        positions = torch.arange(n - window, n)  # position of each window query
        visible = torch.arange(n)[None, :] <= positions[:, None]  # [W, n]
        for h in range(q_heads):
            logits = q[b, h].double().cpu() @ k[b, h // group, :n].double().cpu().T * scale
            logits = logits.masked_fill(~visible, float("-inf"))
            if lse is None:
                probs = torch.softmax(logits, dim=-1)
            else:
                probs = torch.exp(logits - lse[b, h].double().cpu()[:, None])
            probs = torch.nan_to_num(probs, nan=0.0)  # fully masked rows (n < W)
            summed = probs.sum(dim=0)  # [n]
            g = h // group
            first = h % group == 0
            if gqa == "max":
                out[b, g, :n] = summed if first else torch.maximum(out[b, g, :n], summed)
            else:
                out[b, g, :n] += summed / (group if gqa == "mean" else 1)
    return out.float()


def pool_scores(
    scores: torch.Tensor,
    kernel_size: int = 7,
    mode: str = "max",
    *,
    window: int = 32,
    seq_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Stride-1 1-D pooling of each row's prefix [0, n-window).

    Padding is kernel_size//2 on both sides of the prefix: max pooling never picks
    padding, avg pooling counts it as zeros (always divides by kernel_size).
    Window positions [n-window, n) are copied, positions >= n become 0.
    """
    batch, heads, length = scores.shape
    out = torch.zeros(batch, heads, length, dtype=torch.float32)
    for b, n in enumerate(_row_lengths(batch, length, seq_lens)):
        prefix = max(n - window, 0)
        out[b, :, prefix:n] = scores[b, :, prefix:n].float().cpu()
        if prefix == 0:
            continue
        row = scores[b, :, :prefix].double().cpu()[:, None, :]  # [heads, 1, prefix]
        pad = kernel_size // 2
        if mode == "max":
            pooled = F.max_pool1d(row, kernel_size, stride=1, padding=pad)
        else:
            pooled = F.avg_pool1d(row, kernel_size, stride=1, padding=pad, count_include_pad=True)
        out[b, :, :prefix] = pooled[:, 0, :].float()
    return out


def select_keep(
    scores: torch.Tensor,
    budget: int,
    *,
    n_sink: int = 4,
    window: int = 32,
    seq_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Indices kept per (batch, head) row: int32 [B,H,budget], ascending.

    Kept = sinks [0,n_sink) + window [n-window,n) + the budget-n_sink-window highest
    scores in [n_sink, n-window); equal scores prefer the lower position. Rows with
    n <= budget keep 0..n-1 and pad with -1.
    """
    batch, heads, length = scores.shape
    out = torch.full((batch, heads, budget), -1, dtype=torch.int32)
    for b, n in enumerate(_row_lengths(batch, length, seq_lens)):
        if n <= budget:
            out[b, :, :n] = torch.arange(n, dtype=torch.int32)
            continue
        middle = torch.arange(n_sink, n - window)
        fixed = torch.cat([torch.arange(n_sink), torch.arange(n - window, n)])
        for h in range(heads):
            candidates = scores[b, h, n_sink : n - window].float().cpu()
            # Stable sort on descending score keeps ascending positions among ties.
            order = torch.sort(-candidates, stable=True).indices
            chosen = middle[order[: budget - n_sink - window]]
            out[b, h] = torch.sort(torch.cat([fixed, chosen])).values.int()
    return out


def gather_kv(
    k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out[b,h,t] = k[b,h,idx[b,h,t]] (same for v); indices outside [0,N) give zero rows."""
    batch, heads, length, head_dim = k.shape
    budget = idx.shape[2]
    out_k = torch.zeros(batch, heads, budget, head_dim, dtype=k.dtype)
    out_v = torch.zeros(batch, heads, budget, v.shape[3], dtype=v.dtype)
    for b in range(batch):
        for h in range(heads):
            for t, j in enumerate(idx[b, h].tolist()):
                if 0 <= j < length:
                    out_k[b, h, t] = k[b, h, j].cpu()
                    out_v[b, h, t] = v[b, h, j].cpu()
    return out_k, out_v


def streaming_indices(
    batch: int, heads: int, length: int, budget: int, *, n_sink: int = 4,
    seq_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """StreamingLLM kept indices: [0,n_sink) + the last budget-n_sink positions."""
    out = torch.full((batch, heads, budget), -1, dtype=torch.int32)
    for b, n in enumerate(_row_lengths(batch, length, seq_lens)):
        if n <= budget:
            keep = torch.arange(n)
        else:
            keep = torch.cat([torch.arange(n_sink), torch.arange(n - (budget - n_sink), n)])
        out[b, :, : keep.numel()] = keep.int()
    return out


def snapkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    budget: int,
    *,
    n_sink: int = 4,
    window: int = 32,
    kernel_size: int = 7,
    pool: str = "max",
    gqa: str = "mean",
    lse: Optional[torch.Tensor] = None,
    seq_lens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dual-stage compression: sinks + SnapKV voting, pooling, top-k, gather."""
    scores = window_scores(q, k, lse=lse, gqa=gqa, seq_lens=seq_lens)
    pooled = pool_scores(scores, kernel_size, pool, window=window, seq_lens=seq_lens)
    idx = select_keep(pooled, budget, n_sink=n_sink, window=window, seq_lens=seq_lens)
    out_k, out_v = gather_kv(k, v, idx)
    return out_k, out_v, idx


def streaming(
    k: torch.Tensor,
    v: torch.Tensor,
    budget: int,
    *,
    n_sink: int = 4,
    seq_lens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """StreamingLLM compression: sinks + the most recent tokens."""
    batch, heads, length, _ = k.shape
    idx = streaming_indices(batch, heads, length, budget, n_sink=n_sink, seq_lens=seq_lens)
    out_k, out_v = gather_kv(k, v, idx)
    return out_k, out_v, idx
