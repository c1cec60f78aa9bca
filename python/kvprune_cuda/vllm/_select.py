"""Which prompt tokens a layer keeps: kvprune ops on the prefill's own post-RoPE q and K."""

from __future__ import annotations

import torch

import kvprune_cuda as kp
from kvprune_cuda import policy as policies


def kept_indices(policy: "policies.Policy", query: torch.Tensor, key: torch.Tensor, kept: int,
                 scale: float) -> torch.Tensor:
    """int32 [1, Hkv, kept]: ascending positions of the prompt to keep, per KV head.

    Args:
        query: [M, Hq, D] the prompt's last post-RoPE queries (what the attention layer got;
            at least the policy's observation window).
        key: [1, Hkv, N, D] the prompt's post-RoPE keys (what vLLM wrote into its cache;
            last dim contiguous).
        kept: tokens to keep (< N).
        scale: the layer's softmax scale.
    """
    n, m = key.shape[2], query.shape[0]
    w = policy.observed_queries(n)
    if m < w:
        raise ValueError(f"query: {m} queries, the policy observes the last {w}")
    q_win = query[m - w :].transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, W, D]
    scores = policy.score(q_win, key, scale=scale)
    return kp.select_keep(scores, kept, n_sink=policy.n_sink, window=policy.window)
