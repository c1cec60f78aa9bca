#!/usr/bin/env python3
"""Markdown table of a bench_prefill.py --json file, as bench/RESULTS.md and README.md quote it.

    python bench/prefill_table.py bench/results/prefill_cpu.json

Prints the run's machine, commit, command, host load and FMA roofline, then one row per method
(times in ms, ratios, memory in MiB). Nothing is computed here that the JSON does not hold.
"""

from __future__ import annotations

import argparse
import json
import sys


def fmt(v, spec):
    return "–" if v is None else format(v, spec)


def main(path: str) -> int:
    data = json.load(open(path))
    m, rows = data["meta"], data["rows"]
    fma = m.get("fma_roofline_start") or {}
    end = m.get("fma_roofline_end") or {}
    print(f"Machine: {m['device_name']}, {m.get('threads')} threads, torch {m['torch']}, "
          f"commit `{m['commit']}`, {m['date']}. Command: `bench/bench_prefill.py "
          f"{' '.join(m['argv'])}`. Host load average (1 min): {m['loadavg_start']:.1f} at the "
          f"start, {m['loadavg_end']:.1f} at the end.")
    if fma:
        print(f"FMA roofline (bench/fma_probe.c, {fma['isa']}): {fma['gflops_1t']:.1f} / "
              f"{end.get('gflops_1t', float('nan')):.1f} GFLOP/s on 1 thread and "
              f"{fma['gflops']:.1f} / {end.get('gflops', float('nan')):.1f} GFLOP/s on "
              f"{fma['threads']} threads (start / end); rows use {m['fma_gflops_used']:.1f}.")
    print()
    print("| method | lse | median ms | min ms | × kvpress | × torch_best | / roofline | % FMA peak "
          "| / torch.mm | peak extra MiB | resident after MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mib = lambda r, k: None if r.get(k) is None else r[k] / 2**20  # noqa: E731
    for r in rows:
        if "error" in r:
            print(f"| {r['method']} | {'y' if r['lse'] else 'n'} | error: {r['error']} |")
            continue
        bold = r["method"].startswith("kvprune.snapkv")
        name = f"**{r['method']}**" if bold else r["method"]
        print(f"| {name} | {'y' if r['lse'] else 'n'} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | "
              f"{fmt(r.get('speedup_vs_kvpress'), '.2f')} | {fmt(r.get('speedup_vs_torch_best'), '.2f')} | "
              f"{fmt(r.get('x_roofline'), '.2f')} | {fmt(r.get('pct_fma_peak'), '.0f')} | "
              f"{fmt(r.get('ratio_to_mm'), '.2f')} | {fmt(mib(r, 'peak_extra_bytes'), '.1f')} | "
              f"{fmt(mib(r, 'resident_after_bytes'), '.1f')} |")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a bench/bench_prefill.py result file")
    sys.exit(main(ap.parse_args().json))
