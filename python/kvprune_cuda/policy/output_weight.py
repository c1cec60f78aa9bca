"""KVzip+'s output weighting (the KVzap paper's normalisation of KVzip; kvpress's
``kvzip_plus_normalization``): a reconstruction query's probability for a key, times the
norm of what the key's value writes into the residual stream through the query head's slice
of the output projection, over the norm of the query token's hidden state. The key weights
(:func:`value_output_norms`, torch operations); ``kp.window_scores(qreduce="max",
query_weight=..., key_weight=...)`` folds the weighted maxima
(:meth:`~kvprune_cuda.policy.KVzip.score`)."""

from __future__ import annotations

import torch


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
