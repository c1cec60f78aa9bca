#!/usr/bin/env python3
"""A real prefill under ``kp.hf.compress``: what compression adds to it, per SnapKV setting.

Qwen2.5-Coder-0.5B-Instruct prefills one passkey prompt of ``--tokens`` tokens (a haystack of
Austen's novels) with no compression, then under ``kp.hf.compress(model, policy=P,
budget=--budget)`` for each setting below, the repeats interleaved round-robin
(``common.time_cpu_interleaved``) so that load from other processes lands on every setting
alike. Settings: ``full`` (no hooks), ``snapkv k7`` (kernel 7, no shift: the default before
``pool_shift``, the fused ``kp.snapkv``), ``snapkv default`` (the library's default policy:
window scores, the shifted pool, ``kp.select_keep``, ``kp.gather_kv``). Reported: median
(min) seconds, and each setting's time over ``snapkv k7``'s and over ``full``'s.

    .venv/bin/python bench/bench_hf_prefill.py --tokens 4096 --budget 0.16 --repeats 5 --out bench/results/hf_prefill.json
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import kvprune_cuda as kp  # noqa: E402

SETTINGS = {"full": None,
            "snapkv k7": kp.policy.SnapKV(kernel_size=7, pool_shift=0),
            "snapkv default": kp.policy.SnapKV()}


def prefill(model, ids: torch.Tensor, policy, budget: float):
    """One prefill of ``ids`` [1, n] under ``policy`` (None: no hooks)."""
    def run():
        with torch.no_grad():
            if policy is None:
                model(input_ids=ids, use_cache=True)
                return
            with kp.hf.compress(model, policy=policy, budget=budget):
                model(input_ids=ids, use_cache=True)
    return run


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=0.16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = common.load_model(args.dtype)
    ctx, qst, _ = common.build_prompt(tok, common.load_novels(), args.tokens, 0.5, 12345,
                                      random.Random(0))
    ids = torch.cat([ctx, qst], 1)
    runs = [prefill(model, ids, p, args.budget) for p in SETTINGS.values()]
    times = dict(zip(SETTINGS, common.time_cpu_interleaved(runs, args.repeats, warmup=1)))
    base, full = times["snapkv k7"]["median_ms"], times["full"]["median_ms"]
    print(f"prefill of {ids.shape[1]} tokens, budget {args.budget}, {args.dtype}, "
          f"{args.threads} thread(s), {args.repeats} interleaved repeats")
    print("| setting | median s (min) | x snapkv k7 | x full |\n|---|---:|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {t['median_ms'] / 1e3:.2f} ({t['min_ms'] / 1e3:.2f}) | "
              f"{t['median_ms'] / base:.3f} | {t['median_ms'] / full:.3f} |")
    data = {"meta": common.run_meta(), "args": common.args_dict(args), "tokens": ids.shape[1],
            "times": times, "policies": {n: None if p is None else p.to_config()
                                         for n, p in SETTINGS.items()}}
    if args.out:
        common.write_json(args.out, data)
    return data


if __name__ == "__main__":
    main()
