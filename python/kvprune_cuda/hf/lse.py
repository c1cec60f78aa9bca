"""The log-sum-exp of every query, from the attention call the model makes anyway.

kvzip scoring needs each reconstruction query's softmax normaliser over all its visible keys.
``kp.window_scores`` computes it in a first pass over the keys unless it is given; the model's
own attention computes it too. Within :func:`attention_lse`, the model's SDPA attention on CPU
runs PyTorch's CPU flash-attention kernel (the kernel SDPA itself picks there; same output),
which also returns the lse, and each layer's ``(query [B,Hq,q,D], lse fp32 [B,Hq,q])`` lands
in ``found[layer_idx]``. Other devices and implementations run unchanged (no entry: the
caller computes the lse itself).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _additive_mask(mask, q_len: int, k_len: int, like: torch.Tensor) -> torch.Tensor:
    """[B|1, 1|H, q, L] additive mask in ``like``'s dtype (None: causal, queries at the end)."""
    if mask is None:
        i = torch.arange(q_len, device=like.device)[:, None]
        mask = torch.arange(k_len, device=like.device)[None, :] <= k_len - q_len + i
        mask = mask[None, None]
    if mask.dtype == torch.bool:
        out = torch.zeros(mask.shape, dtype=like.dtype, device=like.device)
        return out.masked_fill_(~mask, float("-inf"))
    return mask[..., :k_len].to(like.dtype)


@contextlib.contextmanager
def attention_lse(model, found: dict) -> Iterator[None]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation
    original = ALL_ATTENTION_FUNCTIONS.get(impl) if impl == "sdpa" else None
    if original is None:
        yield
        return

    def with_lse(module, query, key, value, attention_mask, *args, scaling=None, dropout=0.0,
                 **kwargs):
        if (query.device.type != "cpu" or args or dropout or kwargs.get("sliding_window")
                or query.dtype not in (torch.float32, torch.float16, torch.bfloat16)):
            return original(module, query, key, value, attention_mask, *args, scaling=scaling,
                            dropout=dropout, **kwargs)
        g = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(g, 1) if g > 1 else key
        v = value.repeat_interleave(g, 1) if g > 1 else value
        mask = _additive_mask(attention_mask, query.shape[2], k.shape[2], query)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, k, v, 0.0, False, attn_mask=mask, scale=scaling)
        found[module.layer_idx] = (query, lse.contiguous())
        return out.transpose(1, 2).contiguous(), None

    local = getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", {})
    had_local = impl in local
    ALL_ATTENTION_FUNCTIONS[impl] = with_lse
    try:
        yield
    finally:
        if had_local or not hasattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping"):
            ALL_ATTENTION_FUNCTIONS[impl] = original
        else:
            del ALL_ATTENTION_FUNCTIONS[impl]
