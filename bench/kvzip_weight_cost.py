#!/usr/bin/env python3
"""What KVzip+'s output weighting costs: ``kp.hf.score_context(policy="kvzip")`` with
``weight="none"`` and ``weight="output"`` on the very same context, interleaved, timed by the
library's own clocks (``prefill_seconds``: the context's forward; ``score_seconds``: the
reconstruction forwards and their scoring). The weights run in ``window_scores``'s kernels
(``query_weight`` / ``key_weight``); the value output norms are torch operations.

Prints the median of each and the ratios output / none; ``--out`` writes the runs as JSON
(``--model``: a model of scripts/fetch_model.py, default the 0.5B)::

    .venv/bin/python bench/kvzip_weight_cost.py --tokens 4096 --repeats 2 --dtype float32 \\
        --out bench/results/context/kvzip_weight_cost.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import kvprune_cuda as kp  # noqa: E402

WEIGHTS = ("none", "output")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="context length (tokens)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per weighting, interleaved")
    ap.add_argument("--dtype", default="float32")
    common.add_model_arg(ap)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.repeats < 1 or args.tokens < 64:
        ap.error("--repeats must be >= 1 and --tokens >= 64")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = common.load_model(args.dtype, args.model)
    ctx, _, novel = common.build_prompt(tok, common.load_novels(), args.tokens, 0.5, 12345,
                                        random.Random(args.seed))
    runs = []
    for r in range(args.repeats):
        for weight in WEIGHTS if r % 2 == 0 else WEIGHTS[::-1]:
            sc = kp.hf.score_context(model, ctx, "kvzip", weight=weight, tokenizer=tok)
            runs.append({"weight": weight, "prefill_s": sc.prefill_seconds, "score_s": sc.score_seconds})
            print(f"run {r} weight={weight}: prefill {sc.prefill_seconds:.1f} s, "
                  f"scoring {sc.score_seconds:.1f} s", flush=True)
            del sc
    med = {w: {k: statistics.median(x[k] for x in runs if x["weight"] == w)
               for k in ("prefill_s", "score_s")} for w in WEIGHTS}
    total = {w: med[w]["prefill_s"] + med[w]["score_s"] for w in WEIGHTS}
    print(f"\n{ctx.shape[1]} tokens of {novel}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    print("| weight | prefill s | scoring s | prefill + scoring s |\n|---|---|---|---|")
    for w in WEIGHTS:
        print(f"| {w} | {med[w]['prefill_s']:.1f} | {med[w]['score_s']:.1f} | {total[w]:.1f} |")
    print(f"output / none: scoring {med['output']['score_s'] / med['none']['score_s']:.3f}x, "
          f"prefill + scoring {total['output'] / total['none']:.3f}x")
    if args.out:
        common.write_json(args.out, {"meta": common.run_meta(), "args": common.args_dict(args),
                                     "tokens": ctx.shape[1], "runs": runs, "median": med})


if __name__ == "__main__":
    main()
