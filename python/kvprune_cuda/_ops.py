"""Public API: thin, typed wrappers over torch.ops.kvprune.* (checks live in C++)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

from kvprune_cuda import _C  # noqa: F401  (loads the library that registers the ops)
from kvprune_cuda._args import check_int, check_scale, check_str

if TYPE_CHECKING:
    from kvprune_cuda.decode import Rope

_ops = torch.ops.kvprune


class KeptKV(NamedTuple):
    """Compressed cache: k and v [B, Hkv, budget, D], idx int32 [B, Hkv, budget] (ascending, -1 = padding)."""

    k: torch.Tensor
    v: torch.Tensor
    idx: torch.Tensor


def release_cpu_workspace() -> None:
    """Frees the scratch buffer CPU ops keep per calling thread between calls (page faults of a
    fresh multi-MB buffer cost as much as the arithmetic, so it is cached); see
    :func:`cpu_workspace_bytes`. The next CPU call allocates again. CUDA scratch comes from
    PyTorch's caching allocator instead (``torch.cuda.empty_cache``)."""
    _C.release_cpu_workspace()


def cpu_workspace_bytes() -> int:
    """Bytes of the calling thread's cached CPU workspace (0 after :func:`release_cpu_workspace`)."""
    return int(_C.cpu_workspace_bytes())


def build_info() -> dict:
    """Version, whether CUDA kernels are compiled in (``cuda``), their archs and the build's torch."""
    return dict(_C.build_info())


def window_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    lse: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    gqa: str = "mean",
    seq_lens: Optional[torch.Tensor] = None,
    qreduce: str = "sum",
    out: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    query_weight: Optional[torch.Tensor] = None,
    key_weight: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention mass each cached key receives from the last W queries (SnapKV voting).

    Args:
        q: [B, Hq, W] + [D] post-RoPE queries of each row's last W positions.
        k: [B, Hkv, N, D] keys (or a [B, N, Hkv, D] tensor viewed with strides); Hq % Hkv == 0.
            q's dtype, or an fp8 cache (torch.float8_e4m3fn / float8_e5m2) whose values are
            ``float(k) * k_scale``: dequantised exactly in registers, q stays fp32/fp16/bf16.
        lse: optional fp32 [B, Hq, W] log-sum-exp of each query over its visible keys
            (as returned by flash attention); skips the normalisation pass.
        scale: softmax scale, default 1/sqrt(D).
        gqa: how the G = Hq/Hkv query heads of a KV head combine: "mean", "max" or "sum".
        seq_lens: optional int32 [B] valid lengths n (right padding).
        qreduce: how each query head combines its W queries' probabilities per key:
            "sum" (SnapKV) or "max" (KVzip-style; masked pairs count as 0). "max"
            keeps extra memory bounded independently of W * N (thousands of queries).
        out: optional existing fp32 contiguous [B, Hkv, M] scores, 1 <= M <= N. Only
            keys [0, M) are scored (the softmax still covers all visible keys [0, n))
            and folded into ``out`` in place: ``max(out, new)`` for qreduce "max",
            ``out + new`` for "sum", where ``new`` is what the call returns without
            ``out`` (0 at positions >= n, so there "sum" leaves out unchanged and "max"
            gives max(out, 0)). Chunks of queries fold one after another into one out.
        k_scale: optional fp32 tensor of shape [] or [Hkv] (per KV head): an fp8 K's
            dequantisation scale, as vLLM and TensorRT-LLM store fp8 caches (default 1).
        query_weight, key_weight: optional fp32 contiguous [B, Hq, W] and [B, Hq, M] (M:
            out's last dim, else N), qreduce "max" only: query head h's score of key j is
            ``key_weight[b,h,j] * max_i(query_weight[b,h,i] * p[b,h,i,j])`` before the GQA
            reduction (KVzip+'s output weighting; a missing weight is 1). Weights must be
            finite; one that is not > 0 (NaN included) counts as 0.

    Returns:
        fp32 [B, Hkv, N] (positions >= seq_lens[b] are 0), or ``out`` when given.
    """
    check_scale(scale)
    check_str("gqa", gqa, ("mean", "max", "sum"))
    check_str("qreduce", qreduce, ("sum", "max"))
    if out is None:
        return _ops.window_scores(q, k, lse, scale, gqa, seq_lens, qreduce, k_scale,
                                  query_weight, key_weight)
    _ops.window_scores_out(q, k, lse, scale, gqa, seq_lens, qreduce, out, k_scale,
                           query_weight, key_weight)
    return out


def pool_scores(
    scores: torch.Tensor,
    kernel_size: int = 7,
    mode: str = "max",
    *,
    window: int = 32,
    seq_lens: Optional[torch.Tensor] = None,
    shift: int = 0,
) -> torch.Tensor:
    """Stride-1 1-D pooling of each row's prefix [0, n - window) of fp32 [B, H, N] scores.

    Position i pools the prefix's scores at ``[i - r - shift, i + r - shift]`` (``r =
    kernel_size // 2``; ``0 <= shift <= r``, 0: centred), so with a shift a high score
    reaches the ``r + shift`` positions after it and the ``r - shift`` before it.
    ``mode="max"`` ignores padding; ``"avg"`` counts padding as zeros (divides by
    kernel_size). Window positions are copied, positions >= n are 0.
    """
    check_int("kernel_size", kernel_size)
    check_str("mode", mode, ("max", "avg"))
    check_int("window", window)
    check_int("shift", shift)
    return _ops.pool_scores(scores, kernel_size, mode, window, seq_lens, shift)


def select_keep(
    scores: torch.Tensor,
    budget: int,
    *,
    n_sink: int = 4,
    window: int = 32,
    seq_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Indices to keep per (batch, head) row: int32 [B, H, budget], ascending.

    Sinks [0, n_sink) and the window [n - window, n) are always kept; the other
    budget - n_sink - window slots take the highest scores (ties: lower position).
    Rows with n <= budget keep all n positions and pad with -1.
    """
    for name, value in (("budget", budget), ("n_sink", n_sink), ("window", window)):
        check_int(name, value)
    return _ops.select_keep(scores, budget, n_sink, window, seq_lens)


def gather_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    *,
    out_k: Optional[torch.Tensor] = None,
    out_v: Optional[torch.Tensor] = None,
    rope: Optional["Rope"] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compacts K and V to the kept positions: [B, H, budget, D] each (-1 -> zero row).

    ``out_k``/``out_v`` (both or neither) let the caller compact into its own
    buffers, which may be strided views (e.g. slices of a [B, N, H, D] cache).
    ``rope`` (a :class:`kvprune_cuda.Rope`) also re-rotates each kept post-RoPE key
    from its position ``idx[b,h,t]`` to its position ``t`` in the compacted cache, in
    the same pass (StreamingLLM-style positions inside the cache); V is not rotated.
    """
    if (out_k is None) != (out_v is None):
        raise ValueError("gather_kv: pass both out_k and out_v, or neither")
    if rope is not None:
        theta, rotary_dim, layout, inv_freq = rope.resolved(k.shape[-1])
        if out_k is None:
            return _ops.gather_kv_rope(k, v, idx, theta, rotary_dim, layout, inv_freq)
        _ops.gather_kv_rope_out(k, v, idx, out_k, out_v, theta, rotary_dim, layout, inv_freq)
        return out_k, out_v
    if out_k is None:
        return _ops.gather_kv(k, v, idx)
    _ops.gather_kv_out(k, v, idx, out_k, out_v)
    return out_k, out_v


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
    scale: Optional[float] = None,
    seq_lens: Optional[torch.Tensor] = None,
    out_k: Optional[torch.Tensor] = None,
    out_v: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    pool_shift: int = 0,
) -> KeptKV:
    """Dual-stage compression in one call: sinks + SnapKV voting, pooling, top-k, gather.

    ``window`` is the protected recent window (and pooling boundary); the
    observation queries are q's W positions. ``kernel_size``, ``pool``, ``pool_shift``:
    the pool, as :func:`pool_scores`'s ``kernel_size``, ``mode`` and ``shift``. ``out_k``/``out_v`` (both or neither,
    [B, Hkv, budget, D], any strides with a contiguous last dim, not overlapping the
    inputs) receive the kept K/V instead of new tensors. fp8 K/V caches: scores
    dequantise K with ``k_scale`` (as :func:`window_scores`), the kept K/V are the cache's
    bytes, unchanged (the cache's scales stay valid). Returns KeptKV(k, v, idx).
    """
    _check_snapkv_options(budget, n_sink, window, kernel_size, pool_shift, pool, gqa, scale)
    if (out_k is None) != (out_v is None):
        raise ValueError("snapkv: pass both out_k and out_v, or neither")
    if out_k is not None:
        idx = _ops.snapkv_out(q, k, v, budget, n_sink, window, kernel_size, pool, gqa, lse, scale,
                              seq_lens, out_k, out_v, k_scale, pool_shift)
        return KeptKV(out_k, out_v, idx)
    out_k, out_v, idx = _ops.snapkv(q, k, v, budget, n_sink, window, kernel_size, pool, gqa, lse,
                                    scale, seq_lens, k_scale, pool_shift)
    return KeptKV(out_k, out_v, idx)


def snapkv_select(
    q: torch.Tensor,
    k: torch.Tensor,
    budget: int,
    *,
    n_sink: int = 4,
    window: int = 32,
    kernel_size: int = 7,
    pool: str = "max",
    gqa: str = "mean",
    lse: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    seq_lens: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    pool_shift: int = 0,
) -> torch.Tensor:
    """:func:`snapkv` without the gather, in one call: the kept positions int32 [B, Hkv,
    budget] (ascending, -1 = padding) of ``k`` [B, Hkv, N, D] by ``q``'s votes, for an engine
    that compacts its own cache in place (e.g. :func:`kvprune_cuda.paged.compact`). Arguments
    as :func:`snapkv`'s; ``snapkv(...).idx`` equals it."""
    _check_snapkv_options(budget, n_sink, window, kernel_size, pool_shift, pool, gqa, scale)
    return _ops.snapkv_select(q, k, budget, n_sink, window, kernel_size, pool, gqa, lse, scale,
                              seq_lens, k_scale, pool_shift)


def _check_snapkv_options(budget, n_sink, window, kernel_size, pool_shift, pool, gqa,
                          scale) -> None:
    for name, value in (("budget", budget), ("n_sink", n_sink), ("window", window),
                        ("kernel_size", kernel_size), ("pool_shift", pool_shift)):
        check_int(name, value)
    check_str("pool", pool, ("max", "avg"))
    check_str("gqa", gqa, ("mean", "max", "sum"))
    check_scale(scale)


def streaming(
    k: torch.Tensor,
    v: torch.Tensor,
    budget: int,
    *,
    n_sink: int = 4,
    seq_lens: Optional[torch.Tensor] = None,
) -> KeptKV:
    """StreamingLLM compression: sinks [0, n_sink) + the last budget - n_sink positions."""
    check_int("budget", budget)
    check_int("n_sink", n_sink)
    out_k, out_v, idx = _ops.streaming(k, v, budget, n_sink, seq_lens)
    return KeptKV(out_k, out_v, idx)
