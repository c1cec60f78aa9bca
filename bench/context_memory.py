"""What a compressed context reports holding against what it holds, and what compressing costs.

For each policy and budget scope, ``kp.hf.compress_context`` on a real model and text (a
``--tokens``-token excerpt of a novel, Qwen2.5-Coder-0.5B-Instruct from scripts/fetch_model.py or
the ``--model`` named):
``ctx.nbytes`` (reported), ``kp.hf.memory.reachable_bytes(ctx)`` (every tensor storage the
object keeps alive, found by walking it), the dense K/V of the same context, the prefill and
compression seconds and the process's peak resident memory during the call above what it held
before. Usage::

    python bench/context_memory.py --novel emma --tokens 2000 --out bench/results/context/memory.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import common

import kvprune_cuda as kp
from kvprune_cuda.hf.memory import reachable_bytes

CONFIGS = [("kvzip", "head"), ("kvzip", "global"), ("kvzip", "layer"), ("snapkv", "head"),
           ("snapkv", "global"), ("snapkv", "layer"), ("h2o", "head"), ("h2o", "global"),
           ("h2o", "layer"), ("streaming", "layer"), ("full", "layer")]


def excerpt(tok, text: str, n: int) -> torch.Tensor:
    """[1, n] token ids of the chat-templated user turn holding the first words of ``text``."""
    words = text.split()
    ids = tok.apply_chat_template([{"role": "user", "content": " ".join(words[: n])}],
                                  tokenize=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    return ids[:, :n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--novel", default="emma")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--dtype", default="bfloat16")
    common.add_model_arg(ap)
    ap.add_argument("--out", type=Path, default=common.RESULTS / "context" / "memory.json")
    args = ap.parse_args()
    torch.set_num_threads(common.threads())
    model, tok = common.load_model(args.dtype, args.model)
    ctx = excerpt(tok, common.load_novels()[args.novel], args.tokens)
    dense = kp.hf.compress_context(model, ctx, "full", 1.0)
    rows = [{"policy": "dense K/V", "scope": "", "reported": kp.hf.kv_bytes(dense.cache()),
             "reachable": None}]
    for policy, scope in CONFIGS:
        t0 = time.perf_counter()
        out = {}
        peak, _, probe = common.cpu_peak_extra_bytes(lambda: out.setdefault(
            "ctx", kp.hf.compress_context(model, ctx, policy, args.budget, budget_scope=scope,
                                          tokenizer=tok)))
        c = out["ctx"]
        rows.append({"policy": policy, "scope": scope, "reported": c.nbytes,
                     "reachable": reachable_bytes(c), "prefill_s": c.prefill_seconds,
                     "compress_s": c.compress_seconds, "wall_s": time.perf_counter() - t0,
                     "peak_extra": peak, "probe": probe})
        del c, out
    print(f"{ctx.shape[1]} tokens of {args.novel}, budget {args.budget}, {args.dtype}; "
          f"{common.machine()}, commit {common.commit()}")
    print("| policy | scope | reported MiB | reachable MiB | prefill s | compress s | peak extra MiB |")
    print("|---|---|---|---|---|---|---|")
    mib = lambda b: "" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    for r in rows:
        print(f"| {r['policy']} | {r['scope']} | {mib(r['reported'])} | {mib(r['reachable'])} | "
              f"{r.get('prefill_s', 0):.2f} | {r.get('compress_s', 0):.2f} | "
              f"{mib(r.get('peak_extra'))} |")
    common.write_json(args.out, {"args": common.args_dict(args), "tokens": ctx.shape[1],
                                 "rows": rows})


if __name__ == "__main__":
    main()
