#!/usr/bin/env python3
"""Markdown tables of a bench/eval_passkey.py result file, as bench/RESULTS.md quotes them.

    python bench/passkey_table.py bench/results/passkey_results.json

1) hits and mean KV held per policy@budget, query-aware and query-agnostic; 2) hits by needle
depth for each setting. Counts only what the JSON's records hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def main(path: str) -> int:
    d = json.load(open(path))
    recs = d["records"]
    settings = ["aware", "agnostic"]
    cells = list(recs[0]["results"]["aware"])
    depths = sorted({r["depth"] for r in recs})
    hits = defaultdict(int)
    kv = defaultdict(list)
    by_depth = defaultdict(int)
    n_depth = defaultdict(int)
    for r in recs:
        n_depth[r["depth"]] += 1
        for s in settings:
            for c, (_, hit, nbytes, _) in r["results"][s].items():
                hits[s, c] += bool(hit)
                kv[s, c].append(nbytes)
                by_depth[s, c, r["depth"]] += bool(hit)
    n = len(recs)
    print(f"{n} trials ({', '.join(f'{n_depth[x]} at {x:.0%}' for x in depths)}), "
          f"{recs[0]['tokens']}-token prompts; machine: {d['machine']}; commit `{d['commit']}` "
          f"(at the last write); {sum(r['seconds'] for r in recs) / 60:.0f} min of trials.")
    if d.get("checks"):
        c = d["checks"][0]
        print(f"Check on trial 1: full_equals_plain_generate: {c['full_equals_plain_generate']}, "
              f"snapkv20_equals_shared_path: {c['snapkv20_equals_shared_path']}.")
    print()
    print("| policy @ budget | query-aware hits | KV held (MiB) | query-agnostic hits | KV held (MiB) |")
    print("|---|---:|---:|---:|---:|")
    mean_mib = lambda s, c: sum(kv[s, c]) / len(kv[s, c]) / 2**20  # noqa: E731
    for c in cells:
        print(f"| {c} | {hits['aware', c]}/{n} | {mean_mib('aware', c):.1f} | "
              f"{hits['agnostic', c]}/{n} | {mean_mib('agnostic', c):.1f} |")
    for s, title in (("aware", "query-aware"), ("agnostic", "query-agnostic")):
        print(f"\nHits by depth, {title}:\n")
        print("| policy @ budget | " + " | ".join(f"{x:.0%}" for x in depths) + " |")
        print("|---|" + "---:|" * len(depths))
        for c in cells:
            print(f"| {c} | " + " | ".join(f"{by_depth[s, c, x]}/{n_depth[x]}" for x in depths) + " |")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a bench/eval_passkey.py result file")
    sys.exit(main(ap.parse_args().json))
