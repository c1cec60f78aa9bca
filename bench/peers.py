"""Plain-PyTorch pipelines a user would run instead of kvprune_cuda (the benchmark peers).

All three take the shapes of DESIGN.md §1:
    q     [B, Hq, W, D]   post-RoPE queries of the last W positions
    k, v  [B, Hkv, N, D]  the cache (contiguous)
and return a ``Kept(k, v, idx)``: k, v [B, Hkv, budget, D], idx int64 [B, Hkv, budget] ascending.

* ``kvpress_style``: how kvpress / the SnapKV reference code does it: repeat K to the Hq query
  heads, materialise the [B, Hq, W, N] attention weights, fp32 softmax, then pool, top-k and
  gather. Written here from that description (no code copied).
* ``torch_best``: the best eager PyTorch version we could write: GQA-native (no repeated K), the
  G*W queries of a KV head as one matrix, fp32 scores, softmax normalisers folded into one
  matrix-vector product, heads processed in memory-bounded chunks, top-k on the prefix only,
  index_select gather.
* ``score_mm``: only the score matrix products (each KV head's G*W queries times its K) with
  torch.mm: a second reference next to the FMA roofline (bench/roofline.py). Not a floor: on
  some CPUs BLAS reaches only a fraction of the FMA peak. Returns None.

Semantics match kvprune_cuda.reference.snapkv (sum over window queries, GQA "mean", max pooling
over the prefix [0, N-W)), up to tie-breaking: torch.topk does not promise the lower position on
equal scores.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


class Kept(NamedTuple):
    k: torch.Tensor    # [B, Hkv, budget, D]
    v: torch.Tensor    # [B, Hkv, budget, D]
    idx: torch.Tensor  # int64 [B, Hkv, budget], ascending


def _check(q: torch.Tensor, k: torch.Tensor, budget: int, n_sink: int, window: int) -> None:
    if q.shape[2] != window:
        raise ValueError(f"q has {q.shape[2]} window queries, window={window}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hq={q.shape[1]} is not a multiple of Hkv={k.shape[1]}")
    if not n_sink + window <= budget < k.shape[2]:
        raise ValueError(f"need n_sink + window <= budget < N, got {n_sink}+{window}, {budget}, "
                         f"{k.shape[2]}")


def _causal_mask(window: int, device: torch.device) -> torch.Tensor:
    """bool [W, W]: True where window query i must not see window key c (c > i)."""
    return torch.ones(window, window, dtype=torch.bool, device=device).triu_(1)


# ---------------------------------------------------------------------------------------------
# a) kvpress / SnapKV reference style
# ---------------------------------------------------------------------------------------------
def kvpress_style(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, budget: int, *,
                  n_sink: int = 4, window: int = 32, kernel_size: int = 7) -> Kept:
    """repeat_kv, full [B,Hq,W,N] attention, fp32 softmax, pool, topk, sort, torch.gather."""
    _check(q, k, budget, n_sink, window)
    batch, q_heads, _, head_dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    # repeat_kv: [B, Hkv, N, D] -> [B, Hq, N, D] (a real copy, as in the HF/kvpress helper).
    k_rep = k[:, :, None].expand(batch, kv_heads, group, length, head_dim)
    k_rep = k_rep.reshape(batch, q_heads, length, head_dim)
    attn = torch.matmul(q, k_rep.transpose(2, 3)) / math.sqrt(head_dim)  # [B,Hq,W,N], input dtype
    attn[..., length - window:].masked_fill_(_causal_mask(window, q.device), float("-inf"))
    attn = torch.softmax(attn, dim=-1, dtype=torch.float32)  # [B,Hq,W,N] fp32
    scores = attn.sum(dim=2)  # [B,Hq,N]: vote of the window queries
    scores = scores.view(batch, kv_heads, group, length).mean(dim=2)  # [B,Hkv,N]
    prefix = length - window
    pooled = F.max_pool1d(scores[..., :prefix], kernel_size, stride=1, padding=kernel_size // 2)
    scores = torch.cat([pooled, scores[..., prefix:]], dim=-1)
    scores[..., prefix:] = float("inf")  # the window is always kept
    scores[..., :n_sink] = float("inf")  # so are the sinks
    idx = scores.topk(budget, dim=-1).indices  # [B,Hkv,budget] int64
    idx = idx.sort(dim=-1).values
    gather_idx = idx[..., None].expand(batch, kv_heads, budget, head_dim)
    return Kept(torch.gather(k, 2, gather_idx), torch.gather(v, 2, gather_idx), idx)


# ---------------------------------------------------------------------------------------------
# b) the best eager PyTorch version
# ---------------------------------------------------------------------------------------------
_BMM_OUT_DTYPE_OK = [True]  # cleared the first time bmm(..., out_dtype=float32) fails


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 [H, M, N] = a [H, M, D] @ b [H, D, N], accumulating in fp32 whatever the dtype.

    fp32 inputs: plain bmm. Half inputs on CUDA: bmm with out_dtype=float32 (tensor cores, no
    rounding of the logits to bf16) where this torch has it, else bmm in the input dtype then
    upcast (as kvpress does); on CPU: upcast the chunk.
    """
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.device.type == "cuda":
        if _BMM_OUT_DTYPE_OK[0]:
            try:
                return torch.bmm(a, b, out_dtype=torch.float32)
            except (TypeError, RuntimeError, NotImplementedError):
                _BMM_OUT_DTYPE_OK[0] = False
        return torch.bmm(a, b).float()
    return torch.bmm(a.float(), b.float())


def torch_scores(q: torch.Tensor, k: torch.Tensor, *, lse: Optional[torch.Tensor] = None,
                 chunk_bytes: Optional[int] = None) -> torch.Tensor:
    """fp32 [B, Hkv, N] window scores (sum over queries, mean over the group), GQA-native.

    Rows (b, KV head) are processed in chunks whose fp32 logits fit in ``chunk_bytes`` (default
    256 MiB on CUDA, where fewer larger launches pay; 32 MiB on CPU, where they don't). Per
    chunk: logits [c, G*W, N] = (queries * scale) @ K^T, causal mask on the last W keys, then
    with ``lse`` [B,Hq,W]: p = exp(logits - lse); without: p = exp(logits - rowmax) and the
    row sums give the normalisers. The sum over rows weighted by 1/(G * normaliser) is one
    batched matrix-vector product.
    """
    batch, q_heads, window, head_dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    rows_per_head = group * window
    n_rows = batch * kv_heads
    scale = 1.0 / math.sqrt(head_dim)
    # [B,Hq,W,D] = [B,Hkv,G,W,D] -> [B*Hkv, G*W, D]; query row r of a head is query r % W.
    qs = (q.reshape(n_rows, rows_per_head, head_dim) * scale).to(q.dtype)
    ks = k.reshape(n_rows, length, head_dim)
    mask = _causal_mask(window, q.device).repeat(group, 1)  # [G*W, W]
    lse_rows = None if lse is None else lse.reshape(n_rows, rows_per_head, 1).float()
    out = torch.empty(n_rows, length, dtype=torch.float32, device=q.device)
    if chunk_bytes is None:
        chunk_bytes = (256 << 20) if q.device.type == "cuda" else (32 << 20)
    chunk = max(1, min(n_rows, chunk_bytes // (rows_per_head * length * 4)))
    for start in range(0, n_rows, chunk):
        stop = min(n_rows, start + chunk)
        logits = _bmm_fp32(qs[start:stop], ks[start:stop].transpose(1, 2))  # [c, G*W, N]
        logits[:, :, length - window:].masked_fill_(mask, float("-inf"))
        if lse_rows is not None:
            logits.sub_(lse_rows[start:stop]).exp_()
            weight = torch.full((stop - start, 1, rows_per_head), 1.0 / group,
                                dtype=torch.float32, device=q.device)
        else:
            logits.sub_(logits.amax(dim=2, keepdim=True)).exp_()
            weight = logits.sum(dim=2, keepdim=True).mul_(group).reciprocal_().transpose(1, 2)
        torch.bmm(weight, logits, out=out[start:stop].unsqueeze(1))  # [c, 1, N]
    return out.view(batch, kv_heads, length)


def torch_best(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, budget: int, *,
               n_sink: int = 4, window: int = 32, kernel_size: int = 7,
               lse: Optional[torch.Tensor] = None, chunk_bytes: Optional[int] = None) -> Kept:
    """GQA-native scores, pooled prefix, top-(budget-S-W) on [S, N-W), sinks/window concatenated."""
    _check(q, k, budget, n_sink, window)
    batch, kv_heads, length, head_dim = k.shape
    n_rows = batch * kv_heads
    prefix = length - window
    scores = torch_scores(q, k, lse=lse, chunk_bytes=chunk_bytes).view(n_rows, length)
    pooled = F.max_pool1d(scores[:, None, :prefix], kernel_size, stride=1,
                          padding=kernel_size // 2)[:, 0]  # [rows, N-W]
    chosen = pooled[:, n_sink:].topk(budget - n_sink - window, dim=-1, sorted=False).indices
    chosen = chosen.sort(dim=-1).values + n_sink
    device = q.device
    sinks = torch.arange(n_sink, device=device).expand(n_rows, n_sink)
    recent = torch.arange(prefix, length, device=device).expand(n_rows, window)
    idx = torch.cat([sinks, chosen, recent], dim=1)  # [rows, budget], ascending
    flat = (idx + torch.arange(n_rows, device=device)[:, None] * length).view(-1)
    out_k = k.reshape(n_rows * length, head_dim).index_select(0, flat)
    out_v = v.reshape(n_rows * length, head_dim).index_select(0, flat)
    shape = (batch, kv_heads, budget, head_dim)
    return Kept(out_k.view(shape), out_v.view(shape), idx.view(batch, kv_heads, budget))


# ---------------------------------------------------------------------------------------------
# c) the score products alone, with torch.mm (a reference, not a floor)
# ---------------------------------------------------------------------------------------------
def score_mm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor = None, budget: int = 0, *,
                 n_sink: int = 4, window: int = 32, kernel_size: int = 7,
                 out: Optional[torch.Tensor] = None) -> None:
    """Only the score products: per KV head, [G*W, D] @ [D, N] with torch.mm.

    fp32 on CPU (half inputs upcast per head), the input dtype on CUDA (tensor cores). ``out``
    [G*W, N] is reused across heads; pass one to keep the allocation out of the timing.
    """
    batch, q_heads, window_q, head_dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    rows = q_heads // kv_heads * window_q
    qs = q.reshape(batch, kv_heads, rows, head_dim)
    cuda = q.device.type == "cuda"
    dtype = q.dtype if cuda else torch.float32
    if out is None:
        out = torch.empty(rows, length, dtype=dtype, device=q.device)
    for b in range(batch):
        for g in range(kv_heads):
            qg, kg = qs[b, g], k[b, g]
            if not cuda and kg.dtype != torch.float32:
                qg, kg = qg.float(), kg.float()
            torch.mm(qg, kg.t(), out=out)
    return None
