#!/usr/bin/env python3
"""Ops on a paged (block-table) KV cache against the dense ops on the same tokens, same run.

One layer of Qwen2.5-7B's shape (Hq=28, Hkv=4, D=128, bf16 queries), one sequence of N tokens
in a pool of blocks (shuffled block ids, layout "NHD" = vLLM's), W=32 window queries, budget
20 % of N. Two caches with the same tokens: bf16, and fp8 e4m3 with a per-KV-head scale (the
bf16 cache is its exact dequantisation).
Rows (time interleaved round-robin, median):

* ``window_scores``: dense ``kp.window_scores`` / ``kp.paged.window_scores`` (block sizes 16
  and 128) / the peer an engine without paged reads would run: gather the sequence's blocks
  into a dense tensor (PyTorch indexing), then ``kp.window_scores``. Also the time over the
  FMA roofline (the logits' 2*Hq*W*N*D flops at bench/roofline.py's fp32 FMA rate, measured
  at the start of this run).
* ``snapkv``: dense ``kp.snapkv`` (returns new dense K/V) / ``kp.paged.snapkv`` (compacts the
  pool in place: blocks handed back) / the peer: gather to dense, ``kp.snapkv``, scatter the
  kept tokens back into the sequence's first blocks (PyTorch indexing).
* ``compact``: ``kp.paged.compact`` of the kept indices / dense ``kp.gather_kv`` of the same.

In-place methods get an untouched copy of the pool per call, made before the timing.

    python bench/bench_paged.py [--n 4096 32768] [--reps 5] [--device cpu|cuda] [--json out.json]

On CUDA each row is timed alone with CUDA events (3 warmup calls, L2 not flushed), no roofline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
import common  # noqa: E402

import kvprune_cuda as kp  # noqa: E402

HQ, HKV, D, W, N_SINK, KERNEL = 28, 4, 128, 32, 4, 7
WARMUP_CUDA = 3


def pool_from(dense: torch.Tensor, block_size: int, gen):
    """A pool holding the n tokens of dense [1, Hkv, n, D] in shuffled blocks (as many spare
    blocks, random), and its block table [1, blocks]."""
    n = dense.shape[2]
    blocks = -(-n // block_size)
    pool = torch.randn(2 * blocks, block_size, HKV, D, generator=gen).to(dense.dtype)
    table = torch.randperm(2 * blocks, generator=gen)[:blocks].int()[None]
    flat = torch.zeros(blocks * block_size, HKV, D, dtype=dense.dtype)
    flat[:n] = dense[0].transpose(0, 1)
    pool[table[0].long()] = flat.view(blocks, block_size, HKV, D)
    return pool, table


def to_dense(pool: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """[1, Hkv, n, D] from the pool (the peer's gather): blocks in table order, then transpose."""
    return pool[table[0].long()].flatten(0, 1)[:n].transpose(0, 1)[None]


def scatter_back(pool: torch.Tensor, table: torch.Tensor, kept: torch.Tensor) -> None:
    """The peer's write-back: kept [1, Hkv, k, D] into the first ceil(k / bs) blocks."""
    bs, k = pool.shape[1], kept.shape[2]
    used = -(-k // bs)
    flat = torch.zeros(used * bs, HKV, D, dtype=pool.dtype, device=pool.device)
    flat[:k] = kept[0].transpose(0, 1)
    pool[table[0, :used].long()] = flat.view(used, bs, HKV, D)


def caches(n: int, gen):
    """K/V [1, Hkv, n, D] per cache type: bf16, and e4m3 fp8 with a power-of-two scale per KV
    head whose dequantised values are exactly the bf16 caches' (same tokens)."""
    scale = torch.tensor([0.25, 0.5, 1.0, 2.0])[:HKV]
    k8, v8 = ((torch.randn(1, HKV, n, D, generator=gen) * 2).to(torch.float8_e4m3fn) for _ in range(2))
    dequant = lambda x: (x.float() * scale.view(1, HKV, 1, 1)).bfloat16()  # noqa: E731
    return {"bf16": (dequant(k8), dequant(v8), None), "fp8 e4m3": (k8, v8, scale)}


def bench_cache(n, name, k, v, k_scale, q, reps, roof_ms, gen, device) -> list[dict]:
    budget = int(0.2 * n)
    pools = {bs: tuple(x.to(device) for x in (*pool_from(k, bs, gen), pool_from(v, bs, gen)[0]))
             for bs in (16, 128)}  # pk, table, pv
    k, v, q = k.to(device), v.to(device), q.to(device)
    k_scale = None if k_scale is None else k_scale.to(device)
    lens = torch.tensor([n], dtype=torch.int32, device=device)
    for pk, table, _ in pools.values():
        torch.testing.assert_close(kp.paged.window_scores(q, pk, table, lens, k_scale=k_scale),
                                   kp.window_scores(q, k, k_scale=k_scale), rtol=1e-5, atol=1e-6)
    pk, table, pv = pools[16]
    cuda = device == "cuda"
    calls = reps + (WARMUP_CUDA if cuda else 1)  # the timer's warmup calls, then the timed ones

    def fresh_pools():
        """An untouched copy of the pool per call of an in-place method (made before timing)."""
        copies = iter([(pk.clone(), pv.clone()) for _ in range(calls)])
        return lambda: next(copies)

    def paged_snapkv(pools):
        kc, vc = pools()
        return kp.paged.snapkv(q, kc, vc, table, lens, budget, n_sink=N_SINK, window=W,
                               kernel_size=KERNEL, k_scale=k_scale)

    def peer_snapkv(pools):
        kc, vc = pools()
        kk, vv, idx = kp.snapkv(q, to_dense(kc, table, n), to_dense(vc, table, n), budget,
                                n_sink=N_SINK, window=W, kernel_size=KERNEL, k_scale=k_scale)
        scatter_back(kc, table, kk)
        scatter_back(vc, table, vv)
        return idx

    def paged_compact(pools):
        kc, vc = pools()
        return kp.paged.compact(kc, vc, table, lens, idx)

    idx = kp.snapkv(q, k, v, budget, n_sink=N_SINK, window=W, kernel_size=KERNEL, k_scale=k_scale).idx
    one = lambda: (pk.clone(), pv.clone())  # noqa: E731
    assert torch.equal(paged_snapkv(one).idx, idx) and torch.equal(peer_snapkv(one), idx)
    cases = [("window_scores", "dense", lambda: kp.window_scores(q, k, k_scale=k_scale)),
             ("window_scores", "paged, blocks of 16",
              lambda: kp.paged.window_scores(q, pk, table, lens, k_scale=k_scale)),
             ("window_scores", "paged, blocks of 128",
              lambda: kp.paged.window_scores(q, pools[128][0], pools[128][1], lens, k_scale=k_scale)),
             ("window_scores", "peer: gather the blocks to dense + dense op",
              lambda: kp.window_scores(q, to_dense(pk, table, n), k_scale=k_scale)),
             *([("window_scores", "peer: dequantise K to bf16 (PyTorch) + dense op",
                 lambda: kp.window_scores(q, (k.float() * k_scale.view(1, -1, 1, 1)).bfloat16()))]
               if k_scale is not None else []),
             ("snapkv", "dense kp.snapkv", lambda: kp.snapkv(q, k, v, budget, n_sink=N_SINK, window=W,
                                                             kernel_size=KERNEL, k_scale=k_scale)),
             ("snapkv", "kp.paged.snapkv (in place)", lambda p=fresh_pools(): paged_snapkv(p)),
             ("snapkv", "peer: gather + kp.snapkv + scatter back",
              lambda p=fresh_pools(): peer_snapkv(p)),
             ("compact", "dense kp.gather_kv", lambda: kp.gather_kv(k, v, idx)),
             ("compact", "kp.paged.compact (in place)", lambda p=fresh_pools(): paged_compact(p))]
    if cuda:
        t = [common.time_cuda(c[2], repeats=reps, warmup=WARMUP_CUDA) for c in cases]
    else:
        t = common.time_cpu_interleaved([c[2] for c in cases], repeats=reps)
    return [{"op": op, "n": n, "cache": name, "method": method, **r,
             **({"roofline_ms": roof_ms} if op == "window_scores" and not cuda else {})}
            for (op, method, _), r in zip(cases, t)]


def bench_n(n: int, reps: int, fma_gflops: float, device: str) -> list[dict]:
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(1, HQ, W, D, generator=gen).bfloat16()
    roof_ms = 2.0 * HQ * W * n * D / (fma_gflops * 1e9) * 1e3
    rows = []
    for name, (k, v, k_scale) in caches(n, gen).items():
        rows += bench_cache(n, name, k, v, k_scale, q, reps, roof_ms, gen, device)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.device == "cuda":
        fma = None  # no CPU roofline for GPU rows
    else:
        fma = roofline.measure(torch.get_num_threads())
        print(f"fp32 FMA roofline ({fma['isa']}): {fma['gflops']:.1f} GFLOP/s on {fma['threads']} threads")
    rows = []
    for n in args.n:
        rows += bench_n(n, args.reps, fma["gflops"] if fma else float("nan"), args.device)
    print(table(rows))
    if args.json:
        common.write_json(args.json, {"device": args.device, "fma": fma, "rows": rows,
                                      "threads": torch.get_num_threads()})


def table(rows: list[dict]) -> str:
    """Markdown; "x dense" = time over the dense bf16 op on the same tokens, same run."""
    out = ["| op | N | cache | method | median ms | x dense bf16 | x roofline |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(x["median_ms"] for x in rows if (x["op"], x["n"], x["cache"]) ==
                    (r["op"], r["n"], "bf16") and x["method"].startswith("dense"))
        roof = f"{r['median_ms'] / r['roofline_ms']:.2f}" if "roofline_ms" in r else ""
        out.append(f"| {r['op']} | {r['n']} | {r['cache']} | {r['method']} | {r['median_ms']:.2f} | "
                   f"{r['median_ms'] / base:.2f} | {roof} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
