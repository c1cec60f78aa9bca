"""KVzip+'s output weighting (the KVzap paper's normalisation of KVzip; kvpress's
``kvzip_plus_normalization``): a reconstruction query's probability for a key, times the
norm of what the key's value writes into the residual stream through the query head's slice
of the output projection, over the norm of the query token's hidden state. Torch operations
(no kernel of its own): the weights per key and query (:func:`value_output_norms`) and the
weighted maxima that :meth:`~kvprune_cuda.policy.KVzip.score` folds
(:func:`weighted_maxima`, the semantics of ``kp.window_scores(qreduce="max")``)."""

from __future__ import annotations

from typing import Optional

import torch

from kvprune_cuda._args import check_scale, check_str
from kvprune_cuda.policy.base import GQA

BLOCK = 1 << 24  # logits held at once per KV head (fp32 elements: 64 MiB)


def value_output_norms(o_weight: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """fp32 [B, Hq, n]: ``||o_weight[:, h*D:(h+1)*D] @ values[b, h // G, t]||`` for every
    query head ``h`` and key ``t``. ``o_weight`` [hidden, Hq * D]: the attention's output
    projection (``o_proj.weight``); ``values`` [B, Hkv, n, D], shared by the G = Hq / Hkv
    query heads of a KV group. Through each head's D x D Gram matrix, so no
    [B, Hq, n, hidden] product is formed."""
    if values.dim() != 4:
        raise ValueError(f"values: expected [B, Hkv, n, D], got shape {tuple(values.shape)}")
    b, hkv, n, d = values.shape
    if o_weight.dim() != 2 or o_weight.shape[1] % (hkv * d):
        raise ValueError(f"o_weight: expected [hidden, Hq * {d}] with Hq a multiple of {hkv}, "
                         f"got shape {tuple(o_weight.shape)}")
    g = o_weight.shape[1] // (hkv * d)
    w = o_weight.float().view(-1, hkv, g, d)
    gram = torch.einsum("jhgd,jhge->hgde", w, w)                   # [Hkv, G, D, D]
    v = values.float()
    sq = torch.einsum("bhtd,hgde,bhte->bhgt", v, gram, v)          # [B, Hkv, G, n]
    return sq.clamp_min(0).sqrt().reshape(b, hkv * g, n)


def weighted_maxima(queries: torch.Tensor, keys: torch.Tensor, key_weight: torch.Tensor,
                    query_weight: torch.Tensor, out: torch.Tensor, *,
                    scale: Optional[float] = None, gqa: str = "max") -> torch.Tensor:
    """Folds ``max(out, new)`` into ``out`` (fp32 [B, Hkv, M], M <= N) and returns it:
    ``new[b, h, t]`` is ``gqa`` over the KV group's query heads ``j`` of the largest
    ``p[b, j, i, t] * key_weight[b, j, t] * query_weight[b, i]`` over the W queries ``i``,
    where ``p`` is the softmax of ``queries`` [B, Hq, W, D] over ``keys`` [B, Hkv, N, D]
    whose last W are the queries' own (query ``i`` sees keys ``0 .. N - W + i``), as
    ``kp.window_scores(..., qreduce="max")`` computes it unweighted. ``key_weight`` fp32
    [B, Hq, M] (>= 0: applied after the largest over the queries), ``query_weight`` fp32
    [B, W]; ``scale`` default 1/sqrt(D)."""
    check_scale(scale)
    check_str("gqa", gqa, GQA)
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError("queries, keys: expected [B, Hq, W, D] and [B, Hkv, N, D], got shapes "
                         f"{tuple(queries.shape)} and {tuple(keys.shape)}")
    b, hq, w, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    if keys.shape[0] != b or keys.shape[3] != d or hq % hkv or w > n:
        raise ValueError(f"keys: shape {tuple(keys.shape)} does not fit queries {tuple(queries.shape)}")
    m = out.shape[-1]
    if out.shape != (b, hkv, m) or out.dtype != torch.float32 or not 1 <= m <= n:
        raise ValueError(f"out: expected fp32 [{b}, {hkv}, M <= {n}], got {out.dtype} {tuple(out.shape)}")
    if key_weight.shape != (b, hq, m):
        raise ValueError(f"key_weight: expected [{b}, {hq}, {m}], got {tuple(key_weight.shape)}")
    if query_weight.shape != (b, w):
        raise ValueError(f"query_weight: expected [{b}, {w}], got {tuple(query_weight.shape)}")
    g = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    rows = max(1, BLOCK // (b * g * n))
    own = torch.arange(n - w, n, device=keys.device)  # the queries' own keys: the only ones a query may not see
    for h in range(hkv):
        q = queries[:, h * g:(h + 1) * g].float() * scale           # [B, G, W, D]
        k = keys[:, h].float()                                      # [B, N, D]
        best = torch.zeros(b, g, m, device=keys.device)
        for i in range(0, w, rows):
            blk = q[:, :, i:i + rows]
            e = torch.einsum("bgwd,bnd->bgwn", blk, k)              # logits, then exp in place
            last = n - w + i + torch.arange(blk.shape[2], device=keys.device)  # each query's last key
            e[..., n - w:].masked_fill_(own[None, :] > last[:, None], float("-inf"))
            e.sub_(e.amax(-1, keepdim=True)).exp_()
            # p * query_weight: each row over its sum divided by the query's weight
            denom = e.sum(-1, keepdim=True) / query_weight[:, None, i:i + blk.shape[2], None].float()
            best = torch.maximum(best, e[..., :m].div_(denom).amax(2))
        best = best * key_weight[:, h * g:(h + 1) * g].float()    # >= 0: max(p * kw) = kw * max(p)
        red = best.amax(1) if gqa == "max" else best.sum(1) if gqa == "sum" else best.mean(1)
        out[:, h] = torch.maximum(out[:, h], red)
    return out
