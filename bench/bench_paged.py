#!/usr/bin/env python3
"""Ops on a paged (block-table) KV cache against the dense ops on the same tokens, same run.

One layer of Qwen2.5-7B's shape (Hq=28, Hkv=4, D=128), one sequence of N tokens in a pool of
blocks (shuffled block ids, layout "NHD" = vLLM's), W=32 window queries, budget 20 % of N.
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

    python bench/bench_paged.py [--n 4096 32768] [--dtype bfloat16] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
import timing  # noqa: E402

import kvprune_cuda as kp  # noqa: E402

HQ, HKV, D, W, N_SINK, KERNEL = 28, 4, 128, 32, 4, 7


def paged_sequence(n: int, block_size: int, dtype, gen):
    """A pool holding one n-token sequence in shuffled blocks (+ as many spare blocks), its
    block table [1, blocks] and the same K/V as dense [1, Hkv, n, D] tensors."""
    blocks = -(-n // block_size)
    pool = torch.randn(2 * blocks, block_size, HKV, D, generator=gen).to(dtype)
    pool_v = torch.randn(2 * blocks, block_size, HKV, D, generator=gen).to(dtype)
    table = torch.randperm(2 * blocks, generator=gen)[:blocks].int()[None]
    dense = [to_dense(p, table, n) for p in (pool, pool_v)]
    return pool, pool_v, table, dense


def to_dense(pool: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """[1, Hkv, n, D] from the pool (the peer's gather): blocks in table order, then transpose."""
    return pool[table[0].long()].flatten(0, 1)[:n].transpose(0, 1)[None]


def scatter_back(pool: torch.Tensor, table: torch.Tensor, kept: torch.Tensor) -> None:
    """The peer's write-back: kept [1, Hkv, k, D] into the first ceil(k / bs) blocks."""
    bs, k = pool.shape[1], kept.shape[2]
    used = -(-k // bs)
    flat = torch.zeros(used * bs, HKV, D, dtype=pool.dtype)
    flat[:k] = kept[0].transpose(0, 1)
    pool[table[0, :used].long()] = flat.view(used, bs, HKV, D)


def bench_n(n: int, dtype, reps: int, fma_gflops: float) -> list[dict]:
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(1, HQ, W, D, generator=gen).to(dtype)
    budget = int(0.2 * n)
    lens = torch.tensor([n], dtype=torch.int32)
    rows = []
    flops = 2.0 * HQ * W * n * D
    roof_ms = flops / (fma_gflops * 1e9) * 1e3
    seqs = {bs: paged_sequence(n, bs, dtype, gen) for bs in (16, 128)}
    dk, dv = seqs[16][3]  # same tokens in every pool, dense
    for bs, (pk, pv, table, dense) in seqs.items():
        torch.testing.assert_close(kp.paged.window_scores(q, pk, table, lens),
                                   kp.window_scores(q, dense[0]), rtol=1e-5, atol=1e-6)
    fns = {"dense": lambda: kp.window_scores(q, dk),
           "paged bs16": lambda: kp.paged.window_scores(q, seqs[16][0], seqs[16][2], lens),
           "paged bs128": lambda: kp.paged.window_scores(q, seqs[128][0], seqs[128][2], lens),
           "peer gather+dense bs16": lambda: kp.window_scores(q, to_dense(seqs[16][0], seqs[16][2], n))}
    for name, t in zip(fns, timing.time_cpu_interleaved(list(fns.values()), repeats=reps)):
        rows.append({"op": "window_scores", "n": n, "method": name, **t, "roofline_ms": roof_ms})

    pk, pv, table, _ = seqs[16]
    calls = reps + 1  # time_cpu_interleaved: one warmup call, then the timed ones

    def fresh_pools():
        """An untouched copy of the pool per call of an in-place method (made before timing)."""
        copies = iter([(pk.clone(), pv.clone()) for _ in range(calls)])
        return lambda: next(copies)

    def paged_snapkv(pools):
        k, v = pools()
        return kp.paged.snapkv(q, k, v, table, lens, budget, n_sink=N_SINK, window=W,
                               kernel_size=KERNEL)

    def peer_snapkv(pools):
        k, v = pools()
        kk, vv, idx = kp.snapkv(q, to_dense(k, table, n), to_dense(v, table, n), budget,
                                n_sink=N_SINK, window=W, kernel_size=KERNEL)
        scatter_back(k, table, kk)
        scatter_back(v, table, vv)
        return idx

    def paged_compact(pools):
        k, v = pools()
        return kp.paged.compact(k, v, table, lens, idx_dense)

    idx_dense = kp.snapkv(q, dk, dv, budget, n_sink=N_SINK, window=W, kernel_size=KERNEL).idx
    one = lambda: (pk.clone(), pv.clone())  # noqa: E731
    assert torch.equal(paged_snapkv(one).idx, idx_dense) and torch.equal(peer_snapkv(one), idx_dense)
    cases = [("snapkv", "dense kp.snapkv", lambda: kp.snapkv(q, dk, dv, budget, n_sink=N_SINK,
                                                             window=W, kernel_size=KERNEL)),
             ("snapkv", "kp.paged.snapkv (in place)", lambda p=fresh_pools(): paged_snapkv(p)),
             ("snapkv", "peer: gather + kp.snapkv + scatter back",
              lambda p=fresh_pools(): peer_snapkv(p)),
             ("compact", "dense kp.gather_kv", lambda: kp.gather_kv(dk, dv, idx_dense)),
             ("compact", "kp.paged.compact (in place)", lambda p=fresh_pools(): paged_compact(p))]
    t = timing.time_cpu_interleaved([c[2] for c in cases], repeats=reps)
    for (op, name, _), r in zip(cases, t):
        rows.append({"op": op, "n": n, "method": name, **r})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    fma = roofline.measure(torch.get_num_threads())
    print(f"fp32 FMA roofline ({fma['isa']}): {fma['gflops']:.1f} GFLOP/s on {fma['threads']} threads")
    rows = []
    for n in args.n:
        rows += bench_n(n, dtype, args.reps, fma["gflops"])
    print("| op | N | method | median ms | x dense | x roofline |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        base = next(x["median_ms"] for x in rows if x["op"] == r["op"] and x["n"] == r["n"])
        roof = f"{r['median_ms'] / r['roofline_ms']:.2f}" if "roofline_ms" in r else ""
        print(f"| {r['op']} | {r['n']} | {r['method']} | {r['median_ms']:.2f} | "
              f"{r['median_ms'] / base:.2f} | {roof} |")
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "fma": fma, "rows": rows,
                                         "threads": torch.get_num_threads()}, indent=1))


if __name__ == "__main__":
    main()
