#!/usr/bin/env python3
"""A real prefill under ``kp.hf.compress``: what compression adds to it, per SnapKV setting.

Qwen2.5-Coder-0.5B-Instruct (``--model``: another of scripts/fetch_model.py's) prefills one
passkey prompt of ``--tokens`` tokens (a haystack of Austen's novels) with no compression, then
under ``kp.hf.compress(model, policy=P, budget=--budget)`` for each setting below, the repeats
interleaved round-robin (``common.time_cpu_interleaved``) so that load from other processes
lands on every setting alike. Settings: ``full`` (no hooks); ``default, staged`` (the default
policy as it ran before its pool was fused, commit ``ca1f3fb``: ``kp.window_scores``, the votes
padded with ``pool_shift`` zeros in front, a centred ``kp.pool_scores``, cut back, then
``kp.select_keep`` and ``kp.gather_kv``); ``default, fused`` (the library's default policy: one
``kp.snapkv(..., pool_shift=16)`` call per layer). Reported per setting: median (min) seconds
of the whole prefill, its time over ``full``'s, and the compression's own seconds (every
layer's ``kvprune_cuda.hf.select.compress_layer``, timed inside the prefill, median over the
repeats) as a share of ``full``'s prefill: what compression costs a user.

    .venv/bin/python bench/bench_hf_prefill.py --tokens 4096 --budget 0.16 --repeats 5 --out bench/results/hf_prefill.json
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda.hf import select as hf_select  # noqa: E402


class StagedDefault(kp.policy.SnapKV):
    """The default snapkv as ``ca1f3fb`` ran it: its own ``score`` (so kp.hf ranks it staged),
    the shifted pool built by padding the votes and cutting the centred pool back."""

    def score(self, queries, keys, *, scale=None, seq_lens=None):
        s = kp.window_scores(queries, keys, scale=scale, gqa=self.gqa, seq_lens=seq_lens)
        n, shift = s.shape[-1], self.shift
        lens = None if seq_lens is None else seq_lens + shift
        pooled = kp.pool_scores(F.pad(s, (shift, 0)), self.kernel_size, self.pool,
                                window=self.window, seq_lens=lens)
        return pooled[..., :n].contiguous()


SETTINGS = {"full": None, "default, staged": StagedDefault(), "default, fused": kp.policy.SnapKV()}


class CompressTimer:
    """Seconds spent in kp.hf's per-layer compression (``select.compress_layer``) per run."""

    def __init__(self):
        self.runs: dict[str, list[float]] = {}
        self.current: list[float] = []

    @contextlib.contextmanager
    def installed(self):
        """``select.compress_layer`` timed into ``current[-1]`` within the block."""
        inner = hf_select.compress_layer

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[-1] += time.perf_counter() - t0
        hf_select.compress_layer = timed
        try:
            yield self
        finally:
            hf_select.compress_layer = inner

    def run(self, name: str, fn):
        """``fn`` whose compression seconds are appended to ``runs[name]``."""
        def wrapped():
            self.current.append(0.0)
            fn()
            self.runs.setdefault(name, []).append(self.current.pop())
        return wrapped


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
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed rounds first (0 at 16k-32k, where one prefill takes minutes)")
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                    help="which settings to run; 'full' is always run (the share's denominator)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    common.add_model_arg(ap)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = common.load_model(args.dtype, args.model)
    ctx, qst, _ = common.build_prompt(tok, common.load_novels(), args.tokens, 0.5, 12345,
                                      random.Random(0))
    ids = torch.cat([ctx, qst], 1)
    settings = {name: p for name, p in SETTINGS.items() if name == "full" or name in args.settings}
    timer = CompressTimer()
    runs = [timer.run(name, prefill(model, ids, p, args.budget)) for name, p in settings.items()]
    with timer.installed():
        times = dict(zip(settings, common.time_cpu_interleaved(runs, args.repeats, args.warmup)))
    full = times["full"]["median_ms"] / 1e3
    compress = {name: statistics.median(ts[args.warmup:]) for name, ts in timer.runs.items()}
    print(f"prefill of {ids.shape[1]} tokens, budget {args.budget}, {args.dtype}, "
          f"{args.threads} thread(s), {args.repeats} interleaved repeats after {args.warmup} "
          f"untimed, {args.model}")
    print("| setting | prefill median s (min) | x full | compression s | compression / full prefill |\n"
          "|---|---:|---:|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {t['median_ms'] / 1e3:.2f} ({t['min_ms'] / 1e3:.2f}) | "
              f"{t['median_ms'] / 1e3 / full:.3f} | {compress[name]:.3f} | "
              f"{100 * compress[name] / full:.2f} % |")
    data = {"meta": common.run_meta(), "args": common.args_dict(args), "tokens": ids.shape[1],
            "times": times, "compress_seconds": timer.runs,
            "policies": {n: None if p is None else p.to_config() for n, p in settings.items()}}
    if args.out:
        common.write_json(args.out, data)
    return data


if __name__ == "__main__":
    main()
