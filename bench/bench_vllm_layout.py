#!/usr/bin/env python3
"""What reading keys out of vLLM's CPU layout costs kvprune_cuda.vllm, against the scoring it feeds.

vLLM's CPU attention (CPU_ATTN, ISA "vec") stores K dim-major inside each block
(``[D, block_size]`` per KV head), which ``kp.paged.window_scores`` does not read. The worker
therefore gathers a request's keys through its blocks into a token-major workspace
(``kvprune_cuda.vllm.cpu_cache.request_keys``: the blocks' K halves gathered, then
transposed to ``[1, Hkv, N, D]``) and scores that with ``kp.window_scores``. A kernel reading the dim-major blocks in place would
skip the gather but read the same bytes and do the same flops, so the gather's share of
gather + score is the most it could save. Rows, for one layer of one request (fp32; the
layer shapes of Qwen2.5-0.5B, Hq=14 Hkv=2 D=64, and Qwen2.5-7B, Hq=28 Hkv=4 D=128;
blocks of 32 at shuffled ids in a larger pool; times interleaved round-robin, median):

* ``gather``: ``request_keys``;
* ``score W=32``: ``kp.window_scores`` of the 32 window queries (prompt compression, snapkv),
  and its time over the FMA roofline (2*Hq*W*N*D flops at bench/roofline.py's fp32 rate,
  measured in this run);
* ``score W=1``: one decode query (the h2o decode rule's per-step accumulation).

    .venv/bin/python bench/bench_vllm_layout.py [--n 1024 4096] [--reps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import roofline  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda.vllm.cpu_cache import request_keys  # noqa: E402

SHAPES = {"Qwen2.5-0.5B": (14, 2, 64), "Qwen2.5-7B": (28, 4, 128)}  # Hq, Hkv, D
BLOCK = 32


def bench_case(model: str, n: int, reps: int, gflops: float, gen: torch.Generator) -> dict:
    hq, hkv, d = SHAPES[model]
    n_blocks = -(-n // BLOCK)
    pool = torch.randn(2 * n_blocks + 1, hkv, BLOCK, 2 * d, generator=gen)  # vLLM CPU cache
    blocks = torch.randperm(pool.shape[0], generator=gen)[:n_blocks].to(torch.int32)
    q32 = torch.randn(1, hq, 32, d, generator=gen)
    q1 = q32[:, :, -1:].contiguous()

    def gather():
        return request_keys(pool, blocks, n)

    k = gather()
    t_gather, t_w32, t_w1 = common.time_cpu_interleaved(
        [gather, lambda: kp.window_scores(q32, k), lambda: kp.window_scores(q1, k)],
        repeats=reps)
    g, s32, s1 = t_gather["median_ms"], t_w32["median_ms"], t_w1["median_ms"]
    roof_ms = 2 * hq * 32 * n * d / (gflops * 1e9) * 1e3
    return {"model": model, "n": n, "gather_ms": g, "score_w32_ms": s32, "score_w1_ms": s1,
            "roofline_w32_ms": roof_ms, "gather_share_w32": g / (g + s32),
            "gather_share_w1": g / (g + s1)}


def table(rows: list[dict]) -> str:
    lines = ["| layer shape | N | gather (ms) | score W=32 (ms) | x FMA roofline | gather share "
             "W=32 | score W=1 (ms) | gather share W=1 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['n']} | {r['gather_ms']:.3f} | "
                     f"{r['score_w32_ms']:.3f} | {r['score_w32_ms'] / r['roofline_w32_ms']:.1f} | "
                     f"{100 * r['gather_share_w32']:.0f} % | {r['score_w1_ms']:.3f} | "
                     f"{100 * r['gather_share_w1']:.0f} % |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(common.threads())
    fma = roofline.measure(torch.get_num_threads())
    print(f"fp32 FMA roofline ({fma['isa']}): {fma['gflops']:.1f} GFLOP/s on {fma['threads']} "
          "threads")
    gen = torch.Generator().manual_seed(0)
    rows = [bench_case(m, n, args.reps, fma["gflops"], gen) for m in SHAPES for n in args.n]
    print(table(rows))
    if args.json:
        common.write_json(args.json, {**common.run_meta(), "fma": fma, "rows": rows})


if __name__ == "__main__":
    main()
