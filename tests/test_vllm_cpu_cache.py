"""kvprune_cuda.vllm.cpu_cache on hand-made vLLM CPU caches (no vLLM needed): reading a
request's keys out of CPU_ATTN's dim-major K blocks."""

from __future__ import annotations

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda.vllm.cpu_cache import request_keys


def _cache_with(keys: torch.Tensor, block_ids: list[int], num_blocks: int, bs: int):
    """A CPU_ATTN "vec" cache [num_blocks, Hkv, bs, 2 * D] whose request (blocks
    ``block_ids``) holds ``keys`` [Hkv, n, D] (K dim-major per block and head; V zero)."""
    hkv, n, d = keys.shape
    cache = torch.zeros(num_blocks, hkv, bs, 2 * d)
    flat = cache.view(num_blocks, hkv, 2 * bs * d)
    for t in range(n):
        block, slot = block_ids[t // bs], t % bs
        flat[block, :, slot : bs * d : bs] = keys[:, t]  # element (t, d) at d * bs + t
    return cache


@pytest.mark.parametrize("n, bs, blocks", [(100, 128, [2]), (128, 128, [1]), (70, 32, [3, 0, 4])])
def test_request_keys_are_token_major_with_a_contiguous_head_dim(gen, n, bs, blocks):
    # One block used to come back as a view whose head dim had stride block_size, which
    # kvprune's ops refuse: a prompt of at most one block (vLLM's CPU default is 128 tokens)
    # could not be compressed.
    hkv, d = 2, 16
    keys = torch.randn(hkv, n, d, generator=gen)
    cache = _cache_with(keys, blocks, 5, bs)
    got = request_keys(cache, torch.tensor(blocks, dtype=torch.int32), n)
    assert got.shape == (1, hkv, n, d) and got.stride(-1) == 1
    assert torch.equal(got[0], keys)
    q = torch.randn(1, 2 * hkv, 8, d, generator=gen)
    assert kp.window_scores(q, got).shape == (1, hkv, n)
