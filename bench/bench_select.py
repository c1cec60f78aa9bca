#!/usr/bin/env python3
"""Top-k selection on the GPU: kp.select_keep vs torch.topk + torch.sort on the same rows.

Rows are few and long (B*Hkv = 8 rows of N fp32 scores, N up to 1M): the shape of DESIGN.md §5
where one block per row would leave most SMs idle. Scores are random non-negative fp32
(torch.rand), like real attention mass. Each method returns the kept positions in ascending
order: sinks [0, S) + window [N-W, N) + the budget-S-W best of [S, N-W).

    python bench/bench_select.py [--n 32k 128k 512k 1m] [--budget-frac 0.15] [--json out.json]

CUDA only: without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import kvprune_cuda as kp  # noqa: E402


def torch_select(scores: torch.Tensor, budget: int, n_sink: int, window: int) -> torch.Tensor:
    """topk over [S, N-W) (unsorted), sort the indices, add sinks and window: [B,H,budget]."""
    batch, heads, length = scores.shape
    chosen = scores[..., n_sink:length - window].topk(budget - n_sink - window, dim=-1,
                                                      sorted=False).indices
    chosen = chosen.sort(dim=-1).values + n_sink
    dev = scores.device
    sinks = torch.arange(n_sink, device=dev).expand(batch, heads, n_sink)
    recent = torch.arange(length - window, length, device=dev).expand(batch, heads, window)
    return torch.cat([sinks, chosen, recent], dim=-1)


def torch_pool_select(scores: torch.Tensor, budget: int, n_sink: int, window: int,
                      kernel_size: int) -> torch.Tensor:
    """max_pool1d over the prefix [0, N-W), then ``torch_select``."""
    batch, heads, length = scores.shape
    prefix = length - window
    pooled = F.max_pool1d(scores[..., :prefix], kernel_size, stride=1, padding=kernel_size // 2)
    return torch_select(torch.cat([pooled, scores[..., prefix:]], dim=-1), budget, n_sink, window)


def overlap(a: torch.Tensor, b: torch.Tensor, length: int) -> float:
    """Mean over rows of |a ∩ b| / |b|."""
    rows = a.shape[0] * a.shape[1]
    ma = torch.zeros(rows, length, dtype=torch.bool, device=a.device)
    mb = torch.zeros_like(ma)
    ma.scatter_(1, a.reshape(rows, -1).long(), True)
    mb.scatter_(1, b.reshape(rows, -1).long(), True)
    return float(((ma & mb).sum(1).float() / mb.sum(1).float()).mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", nargs="+", type=common.parse_n, default=[32768, 131072, 524288, 1048576])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--budget-frac", type=float, default=0.15)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--kernel-size", type=int, default=7)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    if not torch.cuda.is_available() or not kp.build_info().get("cuda"):
        print("bench_select: needs a CUDA GPU and a CUDA build of kvprune_cuda "
              f"(torch.cuda.is_available()={torch.cuda.is_available()}, "
              f"build_info cuda={kp.build_info().get('cuda')}); nothing to do")
        return 0

    copy_bw = common.cuda_copy_bandwidth()
    flush = common.L2Flusher(torch.device("cuda"))
    print(f"bench_select: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"rows {args.batch}x{args.heads}, budget {args.budget_frac:.0%}, "
          f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    header = (f"{'N':>9} {'budget':>8}  {'method':<26}{'median_us':>11}{'min_us':>10}"
              f"{'speedup':>9}{'GB/s':>8}{'%bw':>6}{'overlap':>9}")
    print(header)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in args.n:
        budget = max(args.n_sink + args.window + 1, int(round(args.budget_frac * n)))
        scores = torch.rand(args.batch, args.heads, n, device="cuda", generator=gen)
        s, w, ks = args.n_sink, args.window, args.kernel_size
        # (name, fn, peer name, minimal bytes: scores read [+ pooled written and read] + idx)
        n_rows = args.batch * args.heads
        idx_bytes = n_rows * budget * 4
        score_bytes = n_rows * n * 4
        cases = [
            ("torch topk+sort", lambda: torch_select(scores, budget, s, w), None,
             score_bytes + idx_bytes),
            ("kp.select_keep", lambda: kp.select_keep(scores, budget, n_sink=s, window=w),
             "torch topk+sort", score_bytes + idx_bytes),
            ("torch maxpool+topk+sort", lambda: torch_pool_select(scores, budget, s, w, ks), None,
             3 * score_bytes + idx_bytes),
            ("kp.pool_scores+select_keep", lambda: kp.select_keep(
                kp.pool_scores(scores, ks, "max", window=w), budget, n_sink=s, window=w),
             "torch maxpool+topk+sort", 3 * score_bytes + idx_bytes),
        ]
        results, medians = {}, {}
        for name, fn, peer, nbytes in cases:
            row = {"n": n, "budget": budget, "method": name, "bytes_model": nbytes}
            try:
                results[name] = fn()
                row.update(common.time_cuda(fn, args.repeats, args.warmup, flush))
            except Exception as e:  # noqa: BLE001  (report, keep going)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                print(f"{n:>9} {budget:>8}  {name:<26}ERROR {row['error']}", flush=True)
                rows.append(row)
                continue
            medians[name] = row["median_ms"]
            row["gbps"] = nbytes / (row["median_ms"] / 1e3) / 1e9
            row["pct_bw"] = 100 * nbytes / (row["median_ms"] / 1e3) / copy_bw
            if peer in medians:
                row["speedup_vs_torch"] = medians[peer] / row["median_ms"]
            if peer in results:
                row["overlap_vs_torch"] = overlap(results[name], results[peer], n)
            rows.append(row)
            speed = row.get("speedup_vs_torch")
            ov = row.get("overlap_vs_torch")
            print(f"{n:>9} {budget:>8}  {name:<26}{row['median_ms'] * 1e3:>11.1f}"
                  f"{row['min_ms'] * 1e3:>10.1f}"
                  f"{(f'{speed:.2f}' if speed else '-'):>9}{row['gbps']:>8.0f}"
                  f"{row['pct_bw']:>6.0f}{(f'{ov:.4f}' if ov is not None else '-'):>9}",
                  flush=True)
        del scores, results
        torch.cuda.empty_cache()
    if args.json:
        common.write_json(args.json, {"device": torch.cuda.get_device_name(),
                                      "copy_bw_gbps": copy_bw / 1e9, "rows": rows})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
