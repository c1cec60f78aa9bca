"""Input builders, float64 oracles and checks shared by the kvprune test files.

Conventions:
* Inputs are random (never all zeros) and generated on the CPU from a seeded
  generator, then cast and moved, so a test sees the same values on every device.
* ``reference.py`` is the spec. ``window_scores_f64`` is a vectorised float64
  equivalent used where the reference's Python loops would be too slow (huge N on
  a GPU); ``test_window_scores.py`` checks that the two agree.
* Window-score tolerances are relative to the row maximum of the reference
  (``score_tol``). On the CPU every input dtype is upcast exactly and accumulated
  in fp32, so 1e-5 holds for fp16/bf16 as well as fp32. On CUDA, fp32 runs on
  CUDA cores with ex2.approx (1e-4 allowed) and fp16/bf16 run on tensor cores whose
  accumulation order and fast exp2 round differently (2e-3 allowed).
* Selections are checked tie-tolerantly (``check_selection``) whenever the
  scores that drove them may differ by rounding from the reference's, and
  exactly whenever the op sees the very same fp32 scores as the reference.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import pytest
import torch

import kvprune_cuda as kp

HAS_CUDA = torch.cuda.is_available()
HAS_EMULATOR = bool(kp.build_info()["cuda_emulator"])
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GQA_MODES = ("mean", "max", "sum")
POOL_MODES = ("max", "avg")
# How a [B, H, T, D] token tensor is laid out in memory (the last dim is always contiguous):
#   contig: plain BHTD;  bnhd: a [B, T, H, D] tensor viewed through .transpose(1, 2);
#   sliced: a view into a larger buffer (extra heads, tokens and dims; misaligned start).
LAYOUTS = ("contig", "bnhd", "sliced")


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def on_cuda_path(device) -> bool:
    """Whether ops on `device` run the CUDA kernels (on a GPU, or emulated on CPU tensors)."""
    return torch.device(device).type == "cuda" or kp.testing.emulating_cuda()


def score_tol(device, dtype: torch.dtype) -> float:
    """Allowed |op - reference| of window scores, relative to the row maximum (CUDA
    tolerances also under the emulator, whose exp2 is exact: they are set for the GPU)."""
    if not on_cuda_path(device):
        return 1e-5
    return 1e-4 if dtype == torch.float32 else 2e-3


def randn_tokens(
    batch: int, heads: int, tokens: int, dim: int, *, dtype=torch.float32, device="cpu",
    layout: str = "contig", gen: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Random [batch, heads, tokens, dim] tensor in the given memory layout."""
    if layout == "contig":
        base = torch.randn(batch, heads, tokens, dim, generator=gen)
        return base.to(device=device, dtype=dtype)
    if layout == "bnhd":
        base = torch.randn(batch, tokens, heads, dim, generator=gen)
        return base.to(device=device, dtype=dtype).transpose(1, 2)
    if layout == "sliced":
        base = torch.randn(batch, heads + 1, tokens + 5, dim + 9, generator=gen)
        return base.to(device=device, dtype=dtype)[:, 1:, 3 : tokens + 3, 1 : dim + 1]
    raise ValueError(layout)


def seq_lens_tensor(lens: Optional[Sequence[int]], device) -> Optional[torch.Tensor]:
    return None if lens is None else torch.tensor(list(lens), dtype=torch.int32, device=device)


def row_lengths(batch: int, length: int, seq_lens: Optional[torch.Tensor]) -> list[int]:
    return [length] * batch if seq_lens is None else [int(n) for n in seq_lens.tolist()]


def poison_beyond(x: torch.Tensor, lens: Sequence[int], value=float("nan")) -> torch.Tensor:
    """Writes `value` into every token position >= lens[b] of a [B, H, T, D] tensor (in place)."""
    for b, n in enumerate(lens):
        x[b, :, n:] = value
    return x


def visible_mask(window: int, n: int, device) -> torch.Tensor:
    """[window, n] bool: query i (position n - window + i) sees key j iff j <= n - window + i."""
    positions = torch.arange(n - window, n, device=device)
    return torch.arange(n, device=device)[None, :] <= positions[:, None]


def lse_f64(
    q: torch.Tensor, k: torch.Tensor, *, scale: Optional[float] = None,
    seq_lens: Optional[torch.Tensor] = None, no_keys_value: float = 0.0,
) -> torch.Tensor:
    """Exact fp32 [B, Hq, W] log-sum-exp of every window query over its visible keys.

    Queries at negative positions (row length n < W) see no key; their entry is
    ``no_keys_value`` (an arbitrary finite value, so an op that failed to mask them
    would visibly pick up mass).
    """
    batch, q_heads, window, head_dim = q.shape
    group = q_heads // k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.full((batch, q_heads, window), no_keys_value, dtype=torch.float64, device=q.device)
    for b, n in enumerate(row_lengths(batch, k.shape[2], seq_lens)):
        if n == 0:
            continue
        visible = visible_mask(window, n, q.device)
        kk = k[b, :, :n].double()
        for h in range(q_heads):
            logits = (q[b, h].double() @ kk[h // group].T * scale).masked_fill(~visible, -math.inf)
            lse = torch.logsumexp(logits, dim=-1)
            out[b, h] = torch.where(visible.any(dim=-1), lse, out[b, h])
    return out.float()


def window_scores_f64(
    q: torch.Tensor, k: torch.Tensor, *, lse: Optional[torch.Tensor] = None,
    scale: Optional[float] = None, gqa: str = "mean", seq_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Vectorised float64 window_scores on q's device (same maths as reference.window_scores)."""
    batch, q_heads, window, head_dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(batch, kv_heads, length, dtype=torch.float64, device=q.device)
    for b, n in enumerate(row_lengths(batch, length, seq_lens)):
        if n == 0:
            continue
        visible = visible_mask(window, n, q.device)
        for g in range(kv_heads):
            qg = q[b, g * group : (g + 1) * group].double()  # [G, W, D]
            logits = (qg @ k[b, g, :n].double().T * scale).masked_fill(~visible, -math.inf)
            if lse is None:
                probs = torch.softmax(logits, dim=-1)
            else:
                probs = torch.exp(logits - lse[b, g * group : (g + 1) * group, :, None].double())
            summed = torch.nan_to_num(probs, nan=0.0).sum(dim=1)  # [G, n]
            if gqa == "max":
                out[b, g, :n] = summed.max(dim=0).values
            else:
                out[b, g, :n] = summed.sum(dim=0) / (group if gqa == "mean" else 1)
    return out.float()


def assert_scores_close(out: torch.Tensor, expected: torch.Tensor, tol: float,
                        seq_lens: Optional[torch.Tensor] = None) -> None:
    """fp32 [B, H, N] scores: finite, exact zeros at positions >= n, and within
    ``tol * row max`` of the expected float64-derived values elsewhere."""
    assert out.dtype == torch.float32 and out.shape == expected.shape
    out, expected = out.cpu(), expected.cpu()
    assert torch.isfinite(out).all(), "non-finite scores"
    lens = row_lengths(out.shape[0], out.shape[2], seq_lens)
    for b, n in enumerate(lens):
        tail = out[b, :, n:]
        assert torch.equal(tail, torch.zeros_like(tail)), f"row {b}: scores past n={n} are not 0"
    scale = expected.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    err = ((out - expected).abs() / scale).max().item() if out.numel() else 0.0
    assert err <= tol, f"max error {err:.3g} (relative to row max) exceeds {tol:.1g}"


def check_selection(
    idx: torch.Tensor, pooled: torch.Tensor, budget: int, *, n_sink: int, window: int,
    seq_lens: Optional[torch.Tensor] = None, atol=0.0,
) -> None:
    """Tie-tolerant check of kept indices int32 [B, H, budget] against pooled scores.

    Every row: ascending, unique, inside [0, n); -1 padding only at the end and
    only when n < budget; count = min(n, budget); rows with n <= budget keep
    0..n-1; otherwise sinks and window are kept and every kept candidate's pooled
    score is >= every dropped candidate's minus ``atol`` (a float, or a [B, H]
    tensor of per-row tolerances).
    """
    assert idx.dtype == torch.int32
    batch, heads, length = pooled.shape
    assert idx.shape == (batch, heads, budget)
    idx, pooled = idx.cpu().long(), pooled.cpu().double()
    atol = torch.as_tensor(atol, dtype=torch.float64).expand(batch, heads)
    for b, n in enumerate(row_lengths(batch, length, seq_lens)):
        count = min(n, budget)
        for h in range(heads):
            row = idx[b, h]
            where = f"row (b={b}, h={h}, n={n})"
            assert (row[count:] == -1).all(), f"{where}: padding is not -1 after {count} entries"
            kept = row[:count]
            assert (kept >= 0).all() and (kept < n).all(), f"{where}: index outside [0, n)"
            assert (kept[1:] > kept[:-1]).all(), f"{where}: not strictly ascending"
            if n <= budget:
                assert torch.equal(kept, torch.arange(n)), f"{where}: must keep 0..n-1"
                continue
            is_kept = torch.zeros(n, dtype=torch.bool)
            is_kept[kept] = True
            assert is_kept[:n_sink].all(), f"{where}: a sink was dropped"
            assert is_kept[n - window :].all(), f"{where}: a window position was dropped"
            cand = pooled[b, h, n_sink : n - window]
            cand_kept = is_kept[n_sink : n - window]
            assert int(cand_kept.sum()) == budget - n_sink - window
            if cand_kept.all() or not cand_kept.any():
                continue
            worst_kept = cand[cand_kept].min().item()
            best_dropped = cand[~cand_kept].max().item()
            assert worst_kept >= best_dropped - atol[b, h].item(), (
                f"{where}: kept score {worst_kept!r} < dropped score {best_dropped!r}")


def expected_gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[b, h, idx[b, h, t]] on x's device; indices outside [0, N) give zero rows."""
    valid = (idx >= 0) & (idx < x.shape[2])
    safe = torch.where(valid, idx, 0).long()[..., None].expand(-1, -1, -1, x.shape[3])
    out = torch.gather(x, 2, safe)
    return torch.where(valid[..., None], out, torch.zeros((), dtype=x.dtype, device=x.device))


def assert_gathered(k, v, idx, out_k, out_v) -> None:
    """Kept K/V are bit-exact copies of the indexed rows, zero rows for padding."""
    for name, src, out in (("k", k, out_k), ("v", v, out_v)):
        assert out.dtype == src.dtype and out.device == src.device
        assert out.shape == (*idx.shape, src.shape[3]), f"{name}: shape {tuple(out.shape)}"
        expected = expected_gather(src, idx.to(src.device))
        assert torch.equal(out, expected), f"gathered {name} differs from the indexed rows"


def assert_rejected_untouched(call, x, exc, pattern) -> None:
    """``call(x)`` raises ``exc`` matching ``pattern`` and leaves ``x.out`` as it was."""
    before = x.out.clone()
    with pytest.raises(exc, match=pattern):
        call(x)
    assert torch.equal(x.out, before), "a rejected call modified out"
