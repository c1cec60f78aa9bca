"""Which prompt tokens a layer keeps: kvprune ops on the prefill's own post-RoPE q and K."""

from __future__ import annotations

import torch

import kvprune_cuda as kp
from kvprune_cuda.vllm._policy import Policy


def kept_indices(policy: Policy, query: torch.Tensor, key: torch.Tensor, kept: int,
                 scale: float) -> torch.Tensor:
    """int32 [1, Hkv, kept]: ascending positions of the prompt to keep, per KV head.

    Args:
        query: [N, Hq, D] the prompt's post-RoPE queries (what the attention layer got).
        key: [N, Hkv, D] the prompt's post-RoPE keys (what vLLM wrote into its cache).
        kept: tokens to keep (< N).
        scale: the layer's softmax scale.
    """
    n, hkv = key.shape[0], key.shape[1]
    if policy.policy == "streaming":
        recent = torch.arange(n - (kept - policy.n_sink), n, dtype=torch.int32)
        pos = torch.cat([torch.arange(policy.n_sink, dtype=torch.int32), recent])
        return pos.expand(1, hkv, kept).contiguous()
    w = min(policy.window, n)
    q_win = query[n - w :].transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, W, D]
    k = key.transpose(0, 1).unsqueeze(0).contiguous()                # [1, Hkv, N, D]
    scores = kp.window_scores(q_win, k, scale=scale, gqa=policy.gqa)
    pooled = kp.pool_scores(scores, policy.kernel_size, policy.pool, window=policy.window)
    return kp.select_keep(pooled, kept, n_sink=policy.n_sink, window=policy.window)
