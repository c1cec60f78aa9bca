#!/usr/bin/env python3
"""PNG of bench_prefill.py's JSON: time and peak extra memory vs N, ours vs the peers.

    python bench/plot_prefill.py prefill.json -o prefill.png

Needs matplotlib (present on the GPU machine's image; ``pip install matplotlib`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Whole-pipeline rows (and the torch.mm reference), in legend order: (method, colour, line style).
SERIES = [
    ("kvpress_style", "tab:red", "-"),
    ("torch_best", "tab:orange", "-"),
    ("torch_best+lse", "tab:orange", "--"),
    ("kvprune.snapkv", "tab:blue", "-"),
    ("kvprune.snapkv+lse", "tab:blue", "--"),
    ("torch.mm", "tab:gray", ":"),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path, help="output of bench_prefill.py --json")
    p.add_argument("-o", "--out", type=Path, default=None, help="PNG path (default: json's name)")
    args = p.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_prefill: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 2

    data = json.loads(args.json.read_text())
    meta, rows = data["meta"], data["rows"]
    out = args.out or args.json.with_suffix(".png")

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
    plotted = 0
    for method, colour, style in SERIES:
        pts = sorted((r["n"], r) for r in rows if r["method"] == method and "median_ms" in r)
        if not pts:
            continue
        ns = [n for n, _ in pts]
        ax_t.plot(ns, [r["median_ms"] for _, r in pts], style, color=colour, marker="o",
                  label=method)
        mem = [(n, r["peak_extra_bytes"] / 2**20) for n, r in pts
               if r.get("peak_extra_bytes") is not None]
        if mem and method != "torch.mm":  # the reference's buffer is preallocated
            ax_m.plot([n for n, _ in mem], [m for _, m in mem], style, color=colour, marker="o",
                      label=method)
        plotted += 1
    if not plotted:
        print(f"plot_prefill: no whole-pipeline rows with timings in {args.json}", file=sys.stderr)
        return 1

    for ax, ylabel in ((ax_t, "median time per call (ms)"), (ax_m, "peak extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("cached tokens N")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    dev = meta.get("device_name") or meta.get("device")
    shape = (f"B={meta['batch']} Hq={meta['q_heads']} Hkv={meta['kv_heads']} D={meta['head_dim']} "
             f"W={meta['window']} budget={meta['budget_frac']:.0%} {meta['dtype']}")
    extra = f", {meta['threads']} threads" if meta.get("threads") else ""
    fig.suptitle(f"SnapKV + sinks prefill compression: {dev}{extra}\n{shape}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
