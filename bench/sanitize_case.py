#!/usr/bin/env python3
"""Small CUDA workload for compute-sanitizer (memcheck, racecheck): every prefill op once, and
the paged ops (block-table reads, in-place compaction) on bf16 and fp8 pools.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 bench/sanitize_case.py

Without the caching allocator every tensor is its own cudaMalloc, so an access past a tensor's
end is caught instead of landing in a neighbour inside the same cached segment. Inputs are made
on the CPU and copied over, and the lse comes from a float64 CPU computation, so the only
kernels launched are ours (plus copies and fills). Results are also checked against
kvprune_cuda.reference (loosely: this is a memory check, the tests check numerics).
Exit status 1 if any case raised or mismatched.
"""

from __future__ import annotations

import math
import sys
import zlib

import torch

import kvprune_cuda as kp
from kvprune_cuda import reference as ref


def cpu_lse(q: torch.Tensor, k: torch.Tensor, seq_lens=None) -> torch.Tensor:
    """float64 [B,Hq,W] log-sum-exp over each window query's visible keys (CPU)."""
    batch, q_heads, window, head_dim = q.shape
    group = q_heads // k.shape[1]
    out = torch.zeros(batch, q_heads, window, dtype=torch.float32)
    for b in range(batch):
        n = int(seq_lens[b]) if seq_lens is not None else k.shape[2]
        pos = torch.arange(n - window, n)
        visible = torch.arange(n)[None, :] <= pos[:, None]
        for h in range(q_heads):
            logits = q[b, h].double() @ k[b, h // group, :n].double().T / math.sqrt(head_dim)
            out[b, h] = torch.logsumexp(logits.masked_fill(~visible, -math.inf), -1).float()
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run_case(name: str, dtype: torch.dtype, batch: int, q_heads: int, kv_heads: int, length: int,
             head_dim: int, window: int, budget: int, ragged: bool, strided: bool) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q = torch.randn(batch, q_heads, window, head_dim, generator=gen).to(dtype)
    if strided:  # [B, N, Hkv, D] storage viewed as [B, Hkv, N, D]
        k = torch.randn(batch, length, kv_heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
        v = torch.randn(batch, length, kv_heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    else:
        k = torch.randn(batch, kv_heads, length, head_dim, generator=gen).to(dtype)
        v = torch.randn(batch, kv_heads, length, head_dim, generator=gen).to(dtype)
    seq_lens = None
    if ragged:
        seq_lens = torch.tensor([length] + [max(window + 1, length * 3 // 5 + 7)] * (batch - 1),
                                dtype=torch.int32)
    lse = cpu_lse(q, k, seq_lens)
    qc, lc = q.cuda(), lse.cuda()
    kc = k.cuda() if not strided else k.transpose(1, 2).contiguous().cuda().transpose(1, 2)
    vc = v.cuda() if not strided else v.transpose(1, 2).contiguous().cuda().transpose(1, 2)
    sc = seq_lens.cuda() if seq_lens is not None else None
    tol = 1e-4 if dtype == torch.float32 else 2e-2

    want = ref.window_scores(q, k, seq_lens=seq_lens)
    for gqa in ("mean", "max"):
        want_g = want if gqa == "mean" else ref.window_scores(q, k, gqa=gqa, seq_lens=seq_lens)
        got = kp.window_scores(qc, kc, gqa=gqa, seq_lens=sc)
        got_l = kp.window_scores(qc, kc, lse=lc, gqa=gqa, seq_lens=sc)
        torch.cuda.synchronize()
        for label, g in (("", got), ("+lse", got_l)):
            err = rel_err(g, want_g)
            assert err < tol, f"window_scores gqa={gqa}{label}: rel err {err:.2e}"
    scores = kp.window_scores(qc, kc, seq_lens=sc)
    for mode in ("max", "avg"):
        pooled = kp.pool_scores(scores, 7, mode, window=window, seq_lens=sc)
        err = rel_err(pooled, ref.pool_scores(scores.cpu(), 7, mode, window=window,
                                              seq_lens=seq_lens))
        assert err < 1e-5, f"pool_scores {mode}: rel err {err:.2e}"
    pooled = kp.pool_scores(scores, 7, "max", window=window, seq_lens=sc)
    idx = kp.select_keep(pooled, budget, n_sink=4, window=window, seq_lens=sc)
    out_k, out_v = kp.gather_kv(kc, vc, idx)
    want_k, want_v = ref.gather_kv(k, v, idx.cpu())
    assert torch.equal(out_k.cpu(), want_k) and torch.equal(out_v.cpu(), want_v), "gather_kv"
    for use_lse in (False, True):
        kept = kp.snapkv(qc, kc, vc, budget, n_sink=4, window=window,
                         lse=lc if use_lse else None, seq_lens=sc)
        torch.cuda.synchronize()
        want_k, want_v = ref.gather_kv(k, v, kept.idx.cpu())
        assert torch.equal(kept.k.cpu(), want_k), f"snapkv lse={use_lse}: k vs its idx"
        assert torch.equal(kept.v.cpu(), want_v), f"snapkv lse={use_lse}: v vs its idx"
    kept = kp.streaming(kc, vc, budget, n_sink=4, seq_lens=sc)
    want_idx = ref.streaming_indices(batch, kv_heads, length, budget, n_sink=4, seq_lens=seq_lens)
    assert torch.equal(kept.idx.cpu(), want_idx), "streaming idx"
    torch.cuda.synchronize()


def run_paged_case(name: str, dtype: torch.dtype, block_size: int, lens: list[int], budget: int,
                   head_dim: int = 128, q_heads: int = 8, kv_heads: int = 2, window: int = 16) -> None:
    """kp.paged.window_scores and kp.paged.snapkv (compacting in place) on a pool of shuffled
    blocks (layout NHD); fp8 pools with a per-KV-head k_scale. Checked against the reference
    on CPU copies: scores loosely, compaction byte for byte."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    per_row = -(-max(lens) // block_size)
    blocks = len(lens) * per_row + 3
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    k = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(blocks, generator=gen)[:len(lens) * per_row].int().view(len(lens), per_row)
    seq = torch.tensor(lens, dtype=torch.int32)
    q_dtype = torch.bfloat16 if fp8 else dtype
    q = torch.randn(len(lens), q_heads, window, head_dim, generator=gen).to(q_dtype)
    scale = torch.tensor([0.5, 2.0])[:kv_heads] if fp8 else None
    dense = ref.paged_to_dense(k, table, seq).float()
    if scale is not None:
        dense = dense * scale.view(1, -1, 1, 1)
    want = ref.window_scores(q.float(), dense, seq_lens=seq)
    k_ref, v_ref = k.view(torch.uint8).clone(), v.view(torch.uint8).clone()  # compacted below
    kc, vc, tc, sc = k.cuda(), v.cuda(), table.cuda(), seq.cuda()
    scale_c = scale.cuda() if scale is not None else None
    got = kp.paged.window_scores(q.cuda(), kc, tc, sc, k_scale=scale_c)
    err = rel_err(got[:, :, :want.shape[2]], want)
    assert err < 2e-2, f"paged.window_scores: rel err {err:.2e}"
    idx, new_lens = kp.paged.snapkv(q.cuda(), kc, vc, tc, sc, budget, n_sink=4, window=window,
                                    k_scale=scale_c)
    torch.cuda.synchronize()
    want_lens = ref.paged_compact(k_ref, v_ref, table, seq, idx.cpu())
    assert torch.equal(new_lens.cpu(), want_lens), "paged.snapkv new seq_lens"
    for got_pool, want_pool, label in ((kc, k_ref, "k"), (vc, v_ref, "v")):
        got_dense = ref.paged_to_dense(got_pool.cpu().view(torch.uint8), table, want_lens)
        want_dense = ref.paged_to_dense(want_pool, table, want_lens)
        assert torch.equal(got_dense, want_dense), f"paged compaction {label}"


PAGED_CASES = [
    # name, pool dtype, block_size, seq_lens, budget
    ("paged bf16 bs16", torch.bfloat16, 16, [300, 77], 60),
    ("paged fp8 e4m3 bs32", torch.float8_e4m3fn, 32, [200, 129], 48),
    ("paged fp16 bs1", torch.float16, 1, [90], 30),
]

CASES = [
    # name, dtype, B, Hq, Hkv, N, D, W, budget, ragged, strided
    ("bf16 gqa4 ragged", torch.bfloat16, 2, 8, 2, 1000, 128, 32, 150, True, False),
    ("fp16 gqa8 strided", torch.float16, 1, 8, 1, 777, 128, 16, 100, False, True),
    ("fp32 mha", torch.float32, 1, 2, 2, 513, 64, 8, 64, False, False),
    ("bf16 long row", torch.bfloat16, 1, 4, 1, 20000, 128, 32, 3000, False, False),
]


def main() -> int:
    if not torch.cuda.is_available():
        print("sanitize_case: no GPU")
        return 1
    print(kp.build_info())
    failed = 0
    for run, case in [(run_case, c) for c in CASES] + [(run_paged_case, c) for c in PAGED_CASES]:
        try:
            run(*case)
            print(f"ok    {case[0]}", flush=True)
        except Exception as e:  # noqa: BLE001  (report every case)
            failed += 1
            print(f"FAIL  {case[0]}: {type(e).__name__}: {e}", flush=True)
    torch.cuda.synchronize()
    total = len(CASES) + len(PAGED_CASES)
    print(f"sanitize_case: {total - failed}/{total} cases ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
