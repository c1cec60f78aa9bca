#!/usr/bin/env python3
"""Prefill-time compression benchmark: kvprune_cuda vs the plain-PyTorch peers, side by side.

One config = (N, lse given or not). Rows per config:
  kvpress_style      peer: repeat_kv + full attention weights (bench/peers.py); no-lse rows only
  torch_best         peer: the best eager PyTorch version (bench/peers.py), with lse when given
  torch.mm           second reference: only the score matrix products, torch.mm (not a floor:
                     BLAS reaches a fraction of the FMA peak on some CPUs)
  kvprune.snapkv     ours, the fused dual-stage op
  kvprune.staged     ours, the four public ops chained
  kp.window_scores, kp.pool+select, kp.select_keep, kp.gather_kv   ours, one stage each
Columns: median (and min) time, speedups vs kvpress_style (no-lse rows) and vs torch_best in
the same lse mode (+lse rows: torch_best+lse, like for like), time over the FMA roofline (CPU:
the score products' 2·Hq·W·N·D flops at the fp32 FMA rate bench/roofline.py measures in this
run, for bf16 inputs too: on a CPU with bf16 dot products those run at up to twice that rate,
printed beside it) and over torch.mm, GB/s under the DESIGN.md §5 bytes model and % of the measured device
copy bandwidth (CUDA), peak extra memory and (CPU) the workspace left resident after the call,
overlap of the kept set with torch_best.

    python bench/bench_prefill.py                                        # CPU defaults
    python bench/bench_prefill.py --device cuda --json prefill.json      # GPU defaults
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402
import roofline  # noqa: E402
import common  # noqa: E402

import kvprune_cuda as kp  # noqa: E402

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
TOTAL_GROUPS = ("peer", "ours")


@dataclass
class Config:
    device: str
    dtype: str
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    window: int
    n_sink: int
    kernel_size: int
    length: int
    budget: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def make_inputs(cfg: Config, seed: int = 0) -> dict:
    """Random q [B,Hq,W,D], k, v [B,Hkv,N,D] in the config's dtype (never zeros)."""
    gen = torch.Generator(device=cfg.device).manual_seed(seed)
    kw = dict(dtype=cfg.torch_dtype, device=cfg.device, generator=gen)
    return {
        "q": torch.randn(cfg.batch, cfg.q_heads, cfg.window, cfg.head_dim, **kw),
        "k": torch.randn(cfg.batch, cfg.kv_heads, cfg.length, cfg.head_dim, **kw),
        "v": torch.randn(cfg.batch, cfg.kv_heads, cfg.length, cfg.head_dim, **kw),
    }


@torch.no_grad()
def compute_lse(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """fp32 [B,Hq,W] log-sum-exp of each window query over its visible keys.

    What a flash-attention prefill would hand over; computed here in fp32 one KV head at a
    time (so N = 512k fits) and never timed.
    """
    batch, q_heads, window, head_dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    mask = torch.ones(window, window, dtype=torch.bool, device=q.device).triu_(1).repeat(group, 1)
    lse = torch.empty(batch, q_heads, window, dtype=torch.float32, device=q.device)
    for b in range(batch):
        for g in range(kv_heads):
            qg = q[b, g * group:(g + 1) * group].reshape(group * window, head_dim).float()
            logits = qg @ k[b, g].float().t() / math.sqrt(head_dim)  # [G*W, N]
            logits[:, length - window:].masked_fill_(mask, float("-inf"))
            lse[b, g * group:(g + 1) * group] = torch.logsumexp(logits, dim=-1).view(group, window)
            del logits
    return lse


def stage_inputs(cfg: Config, inp: dict) -> None:
    """Adds each stage's input (scores, pooled, idx), computed by our ops; none if one fails
    (the stage rows are then left out)."""
    try:
        scores = kp.window_scores(inp["q"], inp["k"])
        pooled = kp.pool_scores(scores, cfg.kernel_size, "max", window=cfg.window)
        idx = kp.select_keep(pooled, cfg.budget, n_sink=cfg.n_sink, window=cfg.window)
    except Exception as e:  # noqa: BLE001  (report, time the rest)
        print(f"  ! stage inputs failed, no per-stage rows: {type(e).__name__}: {e}")
        return
    inp.update(scores=scores, pooled=pooled, idx=idx)


# ---------------------------------------------------------------------------------------------
# methods
# ---------------------------------------------------------------------------------------------


@dataclass
class Method:
    name: str
    group: str          # "peer" | "reference" | "ours" | "stage"
    uses_lse: bool
    fn: Callable[[], object]


def build_methods(cfg: Config, inp: dict, with_lse: bool) -> list[Method]:
    """The rows of one config. With lse, only the rows whose work the lse changes."""
    q, k, v = inp["q"], inp["k"], inp["v"]
    lse = inp.get("lse") if with_lse else None
    common = dict(n_sink=cfg.n_sink, window=cfg.window, kernel_size=cfg.kernel_size)
    budget = cfg.budget

    def staged():
        scores = kp.window_scores(q, k, lse=lse)
        pooled = kp.pool_scores(scores, cfg.kernel_size, "max", window=cfg.window)
        idx = kp.select_keep(pooled, budget, n_sink=cfg.n_sink, window=cfg.window)
        out_k, out_v = kp.gather_kv(k, v, idx)
        return kp.KeptKV(out_k, out_v, idx)

    suffix = "+lse" if with_lse else ""
    methods = []
    if not with_lse:
        methods.append(Method("kvpress_style", "peer", False,
                               lambda: peers.kvpress_style(q, k, v, budget, **common)))
    methods.append(Method("torch_best" + suffix, "peer", with_lse,
                          lambda: peers.torch_best(q, k, v, budget, lse=lse, **common)))
    if not with_lse:
        mm_dtype = q.dtype if q.is_cuda else torch.float32
        # [G*W, N], reused across heads; zeroed now so its pages are resident before any
        # timing or memory probe (it is the reference's scratch, not counted)
        mm_out = torch.zeros(cfg.q_heads // cfg.kv_heads * cfg.window, cfg.length,
                             dtype=mm_dtype, device=q.device)
        methods.append(Method("torch.mm", "reference", False,
                              lambda: peers.score_mm(q, k, out=mm_out)))
    methods.append(Method("kvprune.snapkv" + suffix, "ours", with_lse,
                          lambda: kp.snapkv(q, k, v, budget, lse=lse, **common)))
    methods.append(Method("kvprune.staged" + suffix, "ours", with_lse, staged))
    if "scores" in inp:
        methods.append(Method("kp.window_scores" + suffix, "stage", with_lse,
                              lambda: kp.window_scores(q, k, lse=lse)))
        if not with_lse:
            scores, pooled, idx = inp["scores"], inp["pooled"], inp["idx"]
            methods.append(Method("kp.pool+select", "stage", False, lambda: kp.select_keep(
                kp.pool_scores(scores, cfg.kernel_size, "max", window=cfg.window), budget,
                n_sink=cfg.n_sink, window=cfg.window)))
            methods.append(Method("kp.select_keep", "stage", False, lambda: kp.select_keep(
                pooled, budget, n_sink=cfg.n_sink, window=cfg.window)))
            methods.append(Method("kp.gather_kv", "stage", False,
                                  lambda: kp.gather_kv(k, v, idx)))
            # into caller-provided outputs [B,Hkv,budget,D], zeroed once so they are resident
            out_k = torch.zeros(cfg.batch, cfg.kv_heads, budget, cfg.head_dim, dtype=k.dtype,
                                device=k.device)
            out_v = torch.zeros_like(out_k)
            methods.append(Method("kp.gather_kv(out=)", "stage", False,
                                  lambda: kp.gather_kv(k, v, idx, out_k=out_k, out_v=out_v)))
    return methods


def bytes_model(cfg: Config, name: str, with_lse: bool) -> int:
    """Fewest bytes a method's work must move (DESIGN.md §5).

    Whole pipelines: K read once per score pass (1 with lse, 2 without) + kept K and V read and
    written. Stages: window_scores = score passes over K + fp32 scores written; pool+select =
    scores read, pooled written and read, idx written; select_keep = pooled read + idx; gather =
    kept K, V read and written + idx. torch.mm: K read once.
    """
    esize = torch.empty(0, dtype=cfg.torch_dtype).element_size()
    rows = cfg.batch * cfg.kv_heads
    k_bytes = rows * cfg.length * cfg.head_dim * esize
    kept = rows * cfg.budget * cfg.head_dim * esize  # one of K or V
    scores = rows * cfg.length * 4
    idx = rows * cfg.budget * 4
    passes = 1 if with_lse else 2
    base = name.split("+")[0] if not name.startswith("kp.pool+") else name
    if base == "kp.window_scores":
        return passes * k_bytes + scores
    if base == "kp.pool+select":
        return 3 * scores + idx
    if base == "kp.select_keep":
        return scores + idx
    if base in ("kp.gather_kv", "kp.gather_kv(out=)"):
        return 4 * kept + idx
    if base == "torch.mm":
        return k_bytes
    return passes * k_bytes + 4 * kept


def flops_model(cfg: Config, name: str) -> Optional[int]:
    """Multiply-add flops of the score products, 2·B·Hq·W·N·D (DESIGN.md §5): the arithmetic
    every row that scores must do at least once, lse or not (exps, pooling, top-k and the gather
    are not counted). None for the rows that do no products (pool/select, select, gather)."""
    base = name.split("+")[0] if not name.startswith("kp.pool+") else name
    if base in ("kp.pool+select", "kp.select_keep", "kp.gather_kv", "kp.gather_kv(out=)"):
        return None
    return 2 * cfg.batch * cfg.q_heads * cfg.window * cfg.length * cfg.head_dim


def kept_indices(result) -> Optional[torch.Tensor]:
    if result is None:
        return None
    return result[2].long()


def overlap(idx: torch.Tensor, ref: torch.Tensor, length: int) -> float:
    """Mean over rows of |kept ∩ kept_ref| / |kept_ref| (indices -1 ignored)."""
    rows = ref.shape[0] * ref.shape[1]
    idx, ref = idx.reshape(rows, -1), ref.reshape(rows, -1)

    def mask(i):
        m = torch.zeros(rows, length + 1, dtype=torch.bool, device=i.device)
        m.scatter_(1, torch.where(i < 0, length, i), True)
        return m[:, :length]

    a, b = mask(idx), mask(ref)
    return float(((a & b).sum(1).float() / b.sum(1).clamp(min=1).float()).mean())


def reference_scores(cfg: Config, inp: dict) -> torch.Tensor:
    """fp32 [B*Hkv, N] pooled scores of torch_scores, sinks and window set to 0 (the slots
    that are forced, not chosen)."""
    prefix = cfg.length - cfg.window
    scores = peers.torch_scores(inp["q"], inp["k"]).reshape(-1, cfg.length)
    pooled = torch.zeros_like(scores)
    pooled[:, :prefix] = torch.nn.functional.max_pool1d(
        scores[:, None, :prefix], cfg.kernel_size, stride=1, padding=cfg.kernel_size // 2)[:, 0]
    pooled[:, :cfg.n_sink] = 0
    return pooled


def score_recall(idx: torch.Tensor, ref_idx: torch.Tensor, pooled: torch.Tensor) -> float:
    """Tie-aware quality of a kept set: the reference pooled score mass it keeps over the mass
    torch_best keeps (mean over rows). Equal scores count the same whichever position won,
    so 1.0 means as good a choice as the reference; rounding near ties shows as ~1e-6."""
    rows = pooled.shape[0]
    mine = pooled.gather(1, idx.reshape(rows, -1).clamp(min=0)).sum(1)
    ref = pooled.gather(1, ref_idx.reshape(rows, -1)).sum(1)
    return float((mine / ref.clamp(min=1e-30)).mean())


# ---------------------------------------------------------------------------------------------
# CPU peak memory: one fresh process per method
# ---------------------------------------------------------------------------------------------


def mem_child(spec: dict) -> None:
    """Hidden entry point: builds the inputs, then measures one method's peak extra RSS."""
    torch.set_num_threads(spec["threads"])
    cfg = Config(**spec["cfg"])
    name, with_lse = spec["method"], spec["lse"]
    with torch.no_grad():
        # Warm-up on a small problem: loads code, starts the thread pool. Small enough that
        # the workspace it leaves (~2·512·G·W·4 bytes) is negligible next to the measured one.
        small = Config(**{**spec["cfg"], "length": 512,
                          "budget": max(cfg.n_sink + cfg.window + 1, int(0.15 * 512))})
        sinp = make_inputs(small, seed=1)
        if with_lse:
            sinp["lse"] = compute_lse(sinp["q"], sinp["k"])
        if spec.get("stage"):
            stage_inputs(small, sinp)
        [m for m in build_methods(small, sinp, with_lse) if m.name == name][0].fn()
        del sinp
        inp = make_inputs(cfg)
        if with_lse:
            inp["lse"] = compute_lse(inp["q"], inp["k"])
        if spec.get("stage"):
            stage_inputs(cfg, inp)
        method = [m for m in build_methods(cfg, inp, with_lse) if m.name == name][0]
        extra, retained, probe = common.cpu_peak_extra_bytes(method.fn)
    print("MEMRESULT " + json.dumps({"bytes": extra, "retained": retained, "probe": probe}),
          flush=True)


def cpu_peak_extra(cfg: Config, method: Method, threads: int
                   ) -> tuple[Optional[int], Optional[int], str]:
    """(peak extra bytes of the first call at this shape, bytes still resident after it with
    its outputs freed -- the per-thread workspace kvprune keeps -- , probe name)."""
    spec = {"cfg": asdict(cfg), "method": method.name, "lse": method.uses_lse,
            "threads": threads, "stage": method.group == "stage"}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_mem-child",
                               json.dumps(spec)], env=env, capture_output=True, text=True,
                              timeout=600)
    except subprocess.TimeoutExpired:
        return None, None, "timeout"
    for line in proc.stdout.splitlines():
        if line.startswith("MEMRESULT "):
            res = json.loads(line[len("MEMRESULT "):])
            return res["bytes"], res["retained"], res["probe"]
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
    return None, None, f"failed: {tail[0][:120]}"


# ---------------------------------------------------------------------------------------------
# one config
# ---------------------------------------------------------------------------------------------


def run_config(cfg: Config, lse_modes: list[bool], args, copy_bw: Optional[float]) -> list[dict]:
    """Times every method of one N (both lse modes), then probes memory. CPU reps are
    interleaved across methods (round-robin) so that load from other processes hits all of
    them alike; CUDA times one method at a time with events."""
    device = torch.device(cfg.device)
    inp = make_inputs(cfg)
    if True in lse_modes:
        inp["lse"] = compute_lse(inp["q"], inp["k"])
    if not args.no_stages:
        stage_inputs(cfg, inp)
    flush = common.L2Flusher(device) if device.type == "cuda" else None
    with torch.no_grad():  # the kept set every pipeline is compared with, and its scores
        reference_idx = peers.torch_best(inp["q"], inp["k"], inp["v"], cfg.budget,
                                         n_sink=cfg.n_sink, window=cfg.window,
                                         kernel_size=cfg.kernel_size).idx
        reference_pooled = reference_scores(cfg, inp)

    # 1) one call each: errors, overlap of the kept set
    methods, rows = [], []
    for with_lse in lse_modes:
        for m in build_methods(cfg, inp, with_lse):
            if args.methods and not any(s in m.name for s in args.methods):
                continue
            row = {"n": cfg.length, "budget": cfg.budget, "lse": with_lse, "method": m.name,
                   "group": m.group}
            try:
                with torch.no_grad():
                    result = m.fn()
                if device.type == "cuda":  # surface asynchronous kernel errors here
                    torch.cuda.synchronize()
                if m.group in TOTAL_GROUPS:
                    idx = kept_indices(result)
                    row["overlap_vs_torch_best"] = overlap(idx, reference_idx, cfg.length)
                    row["score_recall"] = score_recall(idx, reference_idx, reference_pooled)
                del result
                methods.append((m, row))
            except Exception as e:  # noqa: BLE001  (a failing op is a row, not a crash)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)

    # 2) timing
    with torch.no_grad():
        if device.type == "cuda":
            for m, row in methods:
                try:
                    row.update(common.time_cuda(m.fn, args.repeats, args.warmup, flush))
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            methods = [(m, row) for m, row in methods if "error" not in row]
        else:
            times = common.time_cpu_interleaved([m.fn for m, _ in methods], args.repeats,
                                                args.warmup)
            for (m, row), t in zip(methods, times):
                row.update(t)
    for m, row in methods:
        row["bytes_model"] = bytes_model(cfg, m.name, row["lse"])
        row["gbps"] = row["bytes_model"] / (row["median_ms"] / 1e3) / 1e9
        if copy_bw:
            row["pct_bw"] = 100.0 * row["bytes_model"] / (row["median_ms"] / 1e3) / copy_bw
        if flops_model(cfg, m.name):
            row["flops_model"] = flops_model(cfg, m.name)

    # 3) peak extra memory
    for m, row in methods:
        if args.no_memory:
            break
        if device.type == "cuda":
            with torch.no_grad():
                row["peak_extra_bytes"] = common.cuda_peak_extra_bytes(m.fn)
            row["mem_probe"] = "cuda max_memory_allocated"
        elif m.group in ("peer", "reference", "ours"):
            (row["peak_extra_bytes"], row["resident_after_bytes"],
             row["mem_probe"]) = cpu_peak_extra(cfg, m, args.threads)
    add_ratios(rows)
    return rows


def add_roofline(rows: list[dict], fma_gflops: float) -> None:
    """Time over the roofline: the row's score-product flops at the measured FMA rate."""
    for r in rows:
        if r.get("flops_model") and r.get("median_ms"):
            r["roofline_ms"] = r["flops_model"] / (fma_gflops * 1e9) * 1e3
            r["x_roofline"] = r["median_ms"] / r["roofline_ms"]
            r["pct_fma_peak"] = 100.0 * r["roofline_ms"] / r["median_ms"]


def add_ratios(rows: list[dict]) -> None:
    """Speedups vs kvpress_style (no-lse rows only: the peer computes its own normaliser, so an
    +lse row against it would not be like for like) and vs torch_best in the same lse mode
    (torch_best+lse for +lse rows); ratio to the torch.mm reference for rows that score."""
    by = {(r["method"], r["lse"]): r.get("median_ms") for r in rows}
    kvpress = by.get(("kvpress_style", False))
    mm = by.get(("torch.mm", False))
    for r in rows:
        t = r.get("median_ms")
        if t is None:
            continue
        if mm and r.get("flops_model"):
            r["ratio_to_mm"] = t / mm
        if r["group"] not in TOTAL_GROUPS:
            continue
        best = by.get(("torch_best+lse" if r["lse"] else "torch_best", r["lse"]))
        if kvpress and not r["lse"]:
            r["speedup_vs_kvpress"] = kvpress / t
        if best:
            r["speedup_vs_torch_best"] = best / t


HEADER = (f"{'method':<22}{'lse':>4}{'median_ms':>11}{'min_ms':>10}{'x_kvpress':>10}{'x_best':>8}"
          f"{'/roof':>7}{'%peak':>7}{'/mm':>7}{'GB/s':>8}{'%bw':>6}{'extra_MB':>10}{'resid_MB':>10}"
          f"{'overlap':>9}{'recall':>10}")


def _fmt(value, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if value is not None else f"{'-':>{width}}"


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['method']:<22}{'y' if r['lse'] else 'n':>4}  ERROR {r['error']}", flush=True)
        return
    mib = lambda key: r[key] / 2**20 if r.get(key) is not None else None  # noqa: E731
    print(f"{r['method']:<22}{'y' if r['lse'] else 'n':>4}{_fmt(r['median_ms'], '.3f', 11)}"
          f"{_fmt(r['min_ms'], '.3f', 10)}{_fmt(r.get('speedup_vs_kvpress'), '.2f', 10)}"
          f"{_fmt(r.get('speedup_vs_torch_best'), '.2f', 8)}{_fmt(r.get('x_roofline'), '.2f', 7)}"
          f"{_fmt(r.get('pct_fma_peak'), '.0f', 7)}{_fmt(r.get('ratio_to_mm'), '.2f', 7)}"
          f"{_fmt(r.get('gbps'), '.1f', 8)}{_fmt(r.get('pct_bw'), '.0f', 6)}"
          f"{_fmt(mib('peak_extra_bytes'), '.1f', 10)}{_fmt(mib('resident_after_bytes'), '.1f', 10)}"
          f"{_fmt(r.get('overlap_vs_torch_best'), '.4f', 9)}"
          f"{_fmt(r.get('score_recall'), '.6f', 10)}", flush=True)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--n", nargs="+", type=common.parse_n, default=None,
                   help="cache lengths (e.g. 8192 32k); default CPU 32768, CUDA 8k 32k 128k 512k")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--budget-frac", type=float, default=0.15)
    lse = p.add_mutually_exclusive_group()
    lse.add_argument("--lse", dest="lse_only", action="store_true", help="only the rows with lse")
    lse.add_argument("--no-lse", dest="no_lse", action="store_true", help="only the rows without")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls (CPU 5, CUDA 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (CPU 1, CUDA 3)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--kernel-size", type=int, default=7)
    p.add_argument("--methods", nargs="+", default=None,
                   help="only rows whose name contains one of these strings")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes")
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage rows")
    p.add_argument("--json", type=Path, default=None, help="write all rows here")
    p.add_argument("--_mem-child", dest="mem_child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mem_child is not None:
        mem_child(json.loads(args.mem_child))
        return 0
    info = kp.build_info()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and info.get("cuda") else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_prefill: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    cuda = device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.n = args.n or ([8192, 32768, 131072, 524288] if cuda else [32768])
    args.repeats = args.repeats or (20 if cuda else 5)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    lse_modes = [True] if args.lse_only else [False] if args.no_lse else [False, True]
    if not cuda:
        torch.set_num_threads(args.threads)

    copy_bw = common.cuda_copy_bandwidth() if cuda else None
    fma = None if cuda else roofline.measure(torch.get_num_threads())
    meta = {
        **common.run_meta(), "argv": sys.argv[1:], "device": device,
        "device_name": torch.cuda.get_device_name() if cuda else common.cpu_name(),
        "torch": torch.__version__, "python": platform.python_version(), "build_info": info,
        "threads": torch.get_num_threads() if not cuda else None, "dtype": args.dtype,
        "batch": args.batch, "q_heads": args.q_heads, "kv_heads": args.kv_heads,
        "head_dim": args.head_dim, "window": args.window, "n_sink": args.n_sink,
        "kernel_size": args.kernel_size, "budget_frac": args.budget_frac,
        "repeats": args.repeats, "warmup": args.warmup,
        "copy_bw_gbps": copy_bw / 1e9 if copy_bw else None,
        "loadavg_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "fma_roofline_start": fma,
    }
    print(f"kvprune_cuda {info.get('version')} (cuda compiled: {info.get('cuda')}), "
          f"torch {torch.__version__}, device {meta['device_name']}, dtype {args.dtype}, "
          f"B={args.batch} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} "
          f"W={args.window} S={args.n_sink} budget={args.budget_frac:.0%}"
          + (f", threads {meta['threads']}" if not cuda else "")
          + (f", copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write)" if copy_bw else ""))
    if fma:
        print(f"fp32 FMA roofline at the start (bench/fma_probe.c, {fma['isa']}): "
              f"{fma['gflops_1t']:.1f} GFLOP/s on 1 thread, {fma['gflops']:.1f} GFLOP/s on "
              f"{fma['threads']} threads (measured again at the end; rows use the higher)"
              + (f"; bf16 dot products (vdpbf16ps): {fma['bf16_gflops']:.1f} GFLOP/s"
                 if fma["bf16_gflops"] else ""))

    all_rows: list[dict] = []
    for n in args.n:
        budget = max(args.n_sink + args.window, int(round(args.budget_frac * n)))
        cfg = Config(device, args.dtype, args.batch, args.q_heads, args.kv_heads, args.head_dim,
                     args.window, args.n_sink, args.kernel_size, n, budget)
        print(f"N={n} budget={budget}: timing ...", flush=True)
        all_rows += run_config(cfg, lse_modes, args, copy_bw)
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        meta["torch_best_bmm_out_dtype_fp32"] = peers._BMM_OUT_DTYPE_OK[0]
    meta["loadavg_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if not cuda:
        end = meta["fma_roofline_end"] = roofline.measure(torch.get_num_threads())
        meta["fma_gflops_used"] = peak = max(fma["gflops"], end["gflops"])
        add_roofline(all_rows, peak)
        print(f"fp32 FMA roofline at the end: {end['gflops_1t']:.1f} GFLOP/s on 1 thread, "
              f"{end['gflops']:.1f} GFLOP/s on {end['threads']} threads. Rows use {peak:.1f} "
              f"GFLOP/s: '/roof' = time / (2*B*Hq*W*N*D flops at that rate), '%peak' = its "
              f"inverse in %; '/mm' = time / torch.mm time")
    for n in args.n:
        print(f"\nN={n} budget={next(r['budget'] for r in all_rows if r['n'] == n)}")
        print(HEADER)
        for row in all_rows:
            if row["n"] == n:
                print_row(row)
        print(f"\nhost load average (1 min) at start {meta['loadavg_start']:.1f}, end "
              f"{meta['loadavg_end']:.1f} on {os.cpu_count()} cores: CPU times are only comparable "
              "within one run")
    if args.json:
        common.write_json(args.json, {"meta": meta, "rows": all_rows})
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
