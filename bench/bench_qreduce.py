"""CPU time and peak extra memory of window_scores(qreduce="max") on a KVzip-size chunk.

Shape (default): B=1, Hq=14, Hkv=2 (G=7), W=2048 reconstruction queries, D=64, N=6000
keys, all scored. Peer: the best plain-PyTorch version we could write, per KV head (no
repeated K): the [G*W, N] fp32 logits, causal mask, softmax, max over each head's rows,
mean over the group. "+lse" rows are both given each query's log-sum-exp (what the
model's attention call returns; kp.hf's kvzip scoring gets it from PyTorch's CPU flash
kernel): one pass over the keys, exp(logit - lse) instead of a softmax. Each method runs
in a fresh subprocess; "peak extra" is the growth of its peak RSS over the inputs alone.

    python bench/bench_qreduce.py [--dtype float32|bfloat16] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

B, HQ, HKV, W, D, N = 1, 14, 2, 2048, 64, 6000


def inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, W, D, generator=gen).to(dtype)
    k = torch.randn(B, HKV, N, D, generator=gen).to(dtype)
    return q, k


def lse_of(q, k, rows=64):
    """fp32 [B, Hq, W] log-sum-exp of each query over its visible keys (an input of +lse),
    ``rows`` queries at a time so that building it leaves no high RSS mark of its own."""
    kk = k.float().repeat_interleave(HQ // HKV, 1).transpose(-1, -2)
    out = torch.empty(B, HQ, W)
    for i in range(0, W, rows):
        visible = torch.arange(N)[None, :] <= torch.arange(N - W + i, N - W + min(i + rows, W))[:, None]
        logits = (q[:, :, i:i + rows].float() @ kk) / math.sqrt(D)
        out[:, :, i:i + rows] = torch.logsumexp(logits.masked_fill_(~visible, float("-inf")), -1)
    return out


def peer(q, k, lse=None):
    """Plain PyTorch, per KV head: materialised fp32 softmax (or exp(logit - lse)), max over rows."""
    group = HQ // HKV
    visible = torch.arange(N)[None, :] <= torch.arange(N - W, N)[:, None]  # [W, N]
    out = torch.empty(B, HKV, N)
    for b in range(B):
        for g in range(HKV):
            qg = q[b, g * group:(g + 1) * group].float().reshape(group * W, D)
            logits = (qg @ k[b, g].float().T / math.sqrt(D)).view(group, W, N)
            logits.masked_fill_(~visible, float("-inf"))
            if lse is None:
                probs = torch.softmax(logits, dim=-1)
            else:
                probs = logits.sub_(lse[b, g * group:(g + 1) * group, :, None]).exp_()
            out[b, g] = probs.amax(dim=1).mean(dim=0)
    return out


def ours(q, k, lse=None):
    import kvprune_cuda as kp
    return kp.window_scores(q, k, lse=lse, qreduce="max")


METHODS = ("kvprune", "peer", "kvprune+lse", "peer+lse")


def run_one(method: str, dtype: str, reps: int) -> dict:
    q, k = inputs(getattr(torch, dtype))
    lse = lse_of(q, k) if method.endswith("+lse") else None
    fn = (lambda q, k: (ours if method.startswith("kvprune") else peer)(q, k, lse))  # noqa: E731
    if method.startswith("kvprune"):
        import kvprune_cuda  # noqa: F401  (load the library before the baseline RSS)
    base = common.peak_rss_mib()
    result = fn(q, k)  # warm-up (and the peak)
    peak = common.peak_rss_mib()
    t = common.time_cpu(lambda: fn(q, k), repeats=reps, warmup=0)
    return {"method": method, "dtype": dtype, "ms": t["min_ms"],
            "peak_extra_mb": peak - base, "checksum": float(result.double().sum())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.method:
        print(json.dumps(run_one(args.method, args.dtype, args.reps)))
        return
    rows = []
    for method in METHODS:
        out = subprocess.run([sys.executable, __file__, "--method", method, "--dtype", args.dtype,
                              "--reps", str(args.reps)], check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout))
    print(f"B={B} Hq={HQ} Hkv={HKV} W={W} D={D} N={N} {args.dtype}, threads={torch.get_num_threads()}")
    for r in rows:
        print(f"  {r['method']:8s} {r['ms']:9.1f} ms   peak extra {r['peak_extra_mb']:8.1f} MB"
              f"   (checksum {r['checksum']:.4f})")
    for ours_row, peer_row in ((rows[0], rows[1]), (rows[2], rows[3])):
        memory = (f"{peer_row['peak_extra_mb'] / ours_row['peak_extra_mb']:.0f}x less"
                  if ours_row["peak_extra_mb"] >= 1.0 else
                  "ours below the RSS high-water mark the inputs left (ru_maxrss sees no less)")
        print(f"  {ours_row['method']}: speedup {peer_row['ms'] / ours_row['ms']:.2f}x over "
              f"{peer_row['method']}, memory {memory}")


if __name__ == "__main__":
    main()
