#!/usr/bin/env python3
"""Needle-in-a-haystack heatmap and results table from ``eval_passkey.py``'s JSON.

    .venv/bin/python bench/plot_needle.py bench/results/passkey_results.json -o bench/results/needle_heatmap.png

Heatmap: rows = needle depth, columns = policy@budget, one panel per setting (query-aware,
query-agnostic); colour = hit rate. Prints the markdown table (hits / trials and KV held per
cell, per prompt length) used in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SETTINGS = {"aware": "query-aware (question inside the window)",
            "agnostic": "query-agnostic (context compressed before the question)"}


def configs(records):
    seen = []
    for r in records:
        for c in r["results"]["aware"]:
            if c not in seen:
                seen.append(c)
    return seen


def cells(records, setting, key):
    """{(config, key value): [hits, trials, max kv bytes]}."""
    out = {}
    for r in records:
        for c, (_, hit, nbytes, *_) in r["results"][setting].items():
            cell = out.setdefault((c, r[key]), [0, 0, 0])
            cell[0] += bool(hit)
            cell[1] += 1
            cell[2] = max(cell[2], nbytes)
    return out


def table(data) -> str:
    recs = data["records"]
    cfgs = configs(recs)
    lines = []
    for n in sorted({r["tokens"] for r in recs}):
        rs = [r for r in recs if r["tokens"] == n]
        plen = sorted({r["prompt_tokens"] for r in rs})
        lines.append(f"\nPrompt {n} tokens ({len(rs)} trials, depths "
                     f"{', '.join(f'{d:.0%}' for d in sorted({r['depth'] for r in rs}))}):\n")
        lines.append("| policy @ budget | query-aware hits | KV held (MiB) | query-agnostic hits | KV held (MiB) |")
        lines.append("|---|---:|---:|---:|---:|")
        aw, ag = cells(rs, "aware", "tokens"), cells(rs, "agnostic", "tokens")
        for c in cfgs:
            a, g = aw[(c, n)], ag[(c, n)]
            lines.append(f"| {c} | {a[0]}/{a[1]} | {a[2] / 2**20:.1f} | {g[0]}/{g[1]} | {g[2] / 2**20:.1f} |")
        del plen
    return "\n".join(lines)


def depth_table(data, setting) -> str:
    recs = data["records"]
    cfgs = configs(recs)
    depths = sorted({r["depth"] for r in recs})
    cs = cells(recs, setting, "depth")
    lines = ["| policy @ budget | " + " | ".join(f"{d:.0%}" for d in depths) + " |",
             "|---|" + "---:|" * len(depths)]
    for c in cfgs:
        lines.append(f"| {c} | " + " | ".join(f"{cs[(c, d)][0]}/{cs[(c, d)][1]}" for d in depths) + " |")
    return "\n".join(lines)


def plot(data, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    recs = data["records"]
    cfgs = configs(recs)
    depths = sorted({r["depth"] for r in recs})
    fig, axes = plt.subplots(1, 2, figsize=(1.0 + 0.62 * len(cfgs) * 2, 1.6 + 0.5 * len(depths)),
                             sharey=True)
    for ax, (setting, title) in zip(axes, SETTINGS.items()):
        cs = cells(recs, setting, "depth")
        m = np.array([[cs[(c, d)][0] / cs[(c, d)][1] for c in cfgs] for d in depths])
        im = ax.imshow(m, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, d in enumerate(depths):
            for j, c in enumerate(cfgs):
                h, t, _ = cs[(c, d)]
                ax.text(j, i, f"{h}/{t}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(cfgs)), cfgs, rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("needle depth")
    ns = sorted({r["tokens"] for r in recs})
    fig.suptitle(f"Passkey retrieval, Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), {'/'.join(map(str, ns))}-token "
                 f"prompts: hit rate", fontsize=10)
    fig.colorbar(im, ax=axes, shrink=0.8, label="hit rate")
    fig.savefig(out, dpi=130, bbox_inches="tight")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("-o", "--out", type=Path,
                    default=Path(__file__).resolve().parent / "results" / "needle_heatmap.png")
    args = ap.parse_args()
    data = json.loads(args.results.read_text())
    print(table(data))
    for s, title in SETTINGS.items():
        print(f"\nHits by depth, {title}:\n")
        print(depth_table(data, s))
    plot(data, args.out)


if __name__ == "__main__":
    main()
