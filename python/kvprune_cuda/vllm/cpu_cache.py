"""In-place compaction of one request's tokens in vLLM's CPU KV cache, with kp.paged.compact.

vLLM's CPU attention (backend CPU_ATTN, ISA "vec"/"vec16") keeps one layer's cache as
``[num_blocks, Hkv, block_size, 2 * D]``; inside each (block, KV head) the first
``block_size * D`` elements are K stored dim-major (element (t, d) at ``d * block_size + t``)
and the next ``block_size * D`` are V stored token-major (``t * D + d``). K is therefore
not a pool of D-vectors, but each KV head's K (and V) is a pool of D one-element "heads":
pseudo-head d of token t sits at ``d * block_size + t`` (K) or ``t * D + d`` (V), both
affine in (d, t), so :func:`kvprune_cuda.paged.compact` moves it with layout "HND" and the
head's kept indices repeated over the D pseudo-heads. (ISA "amx" interleaves token pairs
in V, which no strided view describes; :mod:`kvprune_cuda.vllm.worker` selects "vec".)

An fp8 cache (``kv_cache_dtype`` "fp8" / "fp8_e4m3" / "fp8_e5m2") has the same layout with
one-byte elements, each ``k / k_scale`` (``v / v_scale``) rounded to fp8; vLLM allocates it
as uint8, and the worker views it as its fp8 dtype (:data:`FP8_CACHE_DTYPES`) before using
these functions. Compaction moves the bytes unchanged, so the layer's scales stay valid.
"""

from __future__ import annotations

import torch

from kvprune_cuda import paged

# vLLM's fp8 ``kv_cache_dtype`` names (those CPU_ATTN supports) -> the element dtype they store
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                    "fp8_e5m2": torch.float8_e5m2}


def head_views(kv_cache: torch.Tensor, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of KV head ``head`` as ``[num_blocks, D, block_size, 1]`` pools (layout HND).

    Args:
        kv_cache: one layer's vLLM CPU cache ``[num_blocks, Hkv, block_size, 2 * D]``,
            contiguous.
    """
    if kv_cache.dim() != 4 or not kv_cache.is_contiguous() or kv_cache.shape[3] % 2:
        raise ValueError("kv_cache: expected vLLM's contiguous CPU cache [num_blocks, Hkv, "
                         f"block_size, 2 * D], got shape {tuple(kv_cache.shape)}")
    num_blocks, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    block = hkv * bs * two_d
    base = kv_cache.storage_offset() + head * bs * two_d
    k = kv_cache.as_strided((num_blocks, d, bs, 1), (block, bs, 1, 1), base)
    v = kv_cache.as_strided((num_blocks, d, bs, 1), (block, 1, d, 1), base + bs * d)
    return k, v


def compact_request(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int,
                    idx: torch.Tensor) -> None:
    """Moves token ``idx[0, h, t]`` of every KV head h to position t of the request, in place.

    Args:
        kv_cache: one layer's cache ``[num_blocks, Hkv, block_size, 2 * D]`` (module doc).
        block_ids: int32 [1, n_blocks], the request's blocks in token order.
        num_tokens: tokens the request holds now.
        idx: int32 [1, Hkv, kept], ascending kept positions (kp.select_keep's output).
    """
    hkv, d = kv_cache.shape[1], kv_cache.shape[3] // 2
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    for h in range(hkv):
        k, v = head_views(kv_cache, h)
        per_dim = idx[:, h : h + 1].expand(1, d, idx.shape[2]).contiguous()
        paged.compact(k, v, block_ids, seq_lens, per_dim, layout="HND")


def request_keys(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int,
                 dtype: torch.dtype = torch.float32, k_scale: float = 1.0) -> torch.Tensor:
    """[1, Hkv, num_tokens, D]: the request's keys, token-major per KV head, read through its
    blocks (a copy: the blocks' K halves gathered, then transposed; a view of that, last dim
    contiguous, as kvprune's dense ops take it). An fp8 cache's keys are dequantised as
    vLLM's attention reads them, ``float(k) * k_scale``, into ``dtype`` (exact in fp32;
    rounded once more in bf16 / fp16).

    Args:
        kv_cache: one layer's cache ``[num_blocks, Hkv, block_size, 2 * D]`` (module doc;
            fp8 viewed as its fp8 dtype).
        block_ids: int [n_blocks], the request's blocks in token order (covering num_tokens).
        dtype: the keys' dtype out of an fp8 cache (the queries'); others keep theirs.
        k_scale: the layer's fp8 K scale (vLLM's ``layer._k_scale_float``).
    """
    num_blocks, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    per_head = kv_cache.view(num_blocks, hkv, bs * two_d)
    k = per_head[block_ids.long(), :, : bs * d]                   # K only: dim-major [D, bs]
    k = k.view(-1, hkv, d, bs).permute(1, 0, 3, 2)                # [Hkv, nb, bs, D] (a view)
    k = k.reshape(1, hkv, -1, d)[:, :, :num_tokens]  # one block: a view, D strided
    if k.stride(-1) != 1:
        k = k.contiguous()
    if kv_cache.dtype not in FP8_CACHE_DTYPES.values():
        return k
    k = k.to(dtype)
    return k.mul_(k_scale) if k_scale != 1.0 else k
