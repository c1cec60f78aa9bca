#!/usr/bin/env python3
"""Perplexity on long real text (Jane Austen) with a full cache vs a bounded one.

The model (Qwen2.5-Coder-0.5B-Instruct, or ``--model``) reads N tokens of a novel. "full" is one forward over
all N tokens. The bounded policies read the text in chunks of ``--chunk`` tokens under
``kp.hf.compress``: after each chunk every layer is cut back to the budget (``streaming``:
the ``n_sink`` sinks + the most recent tokens, as StreamingLLM; ``h2o``: sinks + recent window
+ the keys with the highest accumulated attention), so a token attends to at most
``budget + chunk`` cached entries. Tokens keep their original RoPE positions. Reported: the
perplexity over tokens ``[--skip, N)`` (the first tokens are identical for every policy) and the
KV bytes held (largest after a forward that reads tokens of that range).

``--decode``: the periodic decode-time rule instead (``kp.hf.compress(model, "full",
decode=POLICY, max_held=BUDGET, interval=--interval)``, the rule kp.vllm runs): the first
``--prompt`` tokens are the prompt (kept whole), then the text continues ``--interval``
tokens per forward (teacher-forced generated tokens), and after each forward every layer
holding more than ``max_held`` tokens is compressed back to ``max_held`` (streaming: sinks +
most recent; snapkv: voting by the last ``window`` queries; h2o: attention summed over every
forward since the prompt). A token then sees at most ``max_held + interval`` entries.

``--context``: compress once, then read on (the query-agnostic setting of
``kp.hf.compress_context``): the first ``--prompt`` tokens are a context, scored once
(``kp.hf.score_context``) and compressed to each budget (tokens per layer) under each policy
with its defaults (``kvzip``: the library's, KVzip+ maxima, per-head budgets with a floor;
``kvzip-plain``: plain maxima and no floor, the default before ``6b135ee``; ``kvzip-w32``: the
default with the context's last 32 tokens always kept, as snapkv keeps its window; ``snapkv``: the
context's last ``window`` queries vote); the rest of the text is then
read in one teacher-forced forward after it (``CompressedContext.forward``). The perplexity is
over tokens ``[--prompt + 1, N)`` for every row, full included (the compressed context returns
no logits for its own last token); "KV held": what the compressed context holds (``nbytes``).
Every row also records its NLL per run of 128 tokens of that range (``nll_buckets``: where in the
text a policy costs).

    .venv/bin/python bench/eval_ppl.py --tokens 4096 --budgets 256 512 1024
    .venv/bin/python bench/eval_ppl.py --decode --policies streaming snapkv h2o --dtype float32
    .venv/bin/python bench/eval_ppl.py --context --prompt 3072 --budgets 307 492 768 \
        --policies kvzip kvzip-plain snapkv --dtype float32
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda import hf  # noqa: E402


@torch.no_grad()
def nll_full(model, ids):
    logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")


@torch.no_grad()
def nll_bounded(model, ids, chunk, bar, first, skip, **options):
    """Per-token NLL reading ``ids`` in forwards of ``first`` then ``chunk`` tokens under
    ``kp.hf.compress(model, **options)``, and the largest KV bytes held after a forward that
    reads scored tokens (past ``skip``)."""
    from transformers import DynamicCache

    cache, out, held = DynamicCache(), [], 0
    starts = [0, *range(first, ids.shape[1], chunk)]
    with kp.hf.compress(model, **options):
        for s, e in zip(starts, starts[1:] + [ids.shape[1]]):
            part = ids[:, s: e]
            logits = model(input_ids=part, past_key_values=cache, use_cache=True).logits[0].float()
            held = max(held, hf.kv_bytes(cache)) if e > skip else held
            out.append(logits)
            bar.update(1)
    logits = torch.cat(out)[:-1]
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none"), held


BUCKET = 128  # every row also records its per-token NLL as means over runs of this many tokens

# --context: name -> (policy, its options: the library's defaults but what the name changes);
# streaming and h2o hold fixed-capacity caches that cannot read a continuation in one forward
CONTEXT_POLICIES = {"kvzip": ("kvzip", {}), "kvzip-plain": ("kvzip", {"weight": "none", "head_floor": 0.0}),
                    "kvzip-w32": ("kvzip", {"window": 32}), "snapkv": ("snapkv", {})}


def scoring_groups(policies) -> list:
    """``policies`` split so that one context scoring records each group's evidence: a policy
    joins the first group whose policy of the same evidence records it with the same options
    (kvzip-plain's plain maxima need a scoring beside KVzip+'s)."""
    groups: list = []
    for p in policies:
        for g in groups:
            if all(p.evidence_mismatch(o) is None for o in g if o.evidence == p.evidence):
                g.append(p)
                break
        else:
            groups.append([p])
    return groups


def bucket_means(nll: torch.Tensor, width: int) -> list:
    """The mean of ``nll`` (per-token, fp32 [m]) over each run of ``width`` tokens (the last
    run may be shorter): where in the text a policy costs."""
    return [float(part.mean()) for part in nll.split(width)]


def nll_fields(nll: torch.Tensor) -> dict:
    """A row's NLL fields from its scored per-token NLL (fp32 [m]): the mean and the means per
    run of ``BUCKET`` tokens."""
    return {"nll": float(nll.mean()), "nll_buckets": bucket_means(nll, BUCKET)}


@torch.no_grad()
def nll_context(model, tok, ids, prompt, names, budgets, bar, n_sink, window) -> dict:
    """{(name, budget): (per-token NLL of ``ids[:, prompt + 1:]``, bytes held)}: the first
    ``prompt`` tokens compressed once per policy and budget (one ``kp.hf.score_context`` per
    scoring group), then the rest read after them in one forward (``CompressedContext.forward``)."""
    ctx, rest = ids[:, :prompt], ids[:, prompt:]
    made = {n: kp.policy.make(CONTEXT_POLICIES[n][0], n_sink=n_sink,
                              **{"window": None if CONTEXT_POLICIES[n][0] == "kvzip" else window,
                                 **CONTEXT_POLICIES[n][1]}) for n in names}
    out = {}
    for group in scoring_groups(list(made.values())):
        sc = kp.hf.score_context(model, ctx, group, tokenizer=tok)
        for name in [n for n, p in made.items() if any(p is g for g in group)]:
            for b in budgets:
                c = sc.compress(budget=b, policy=made[name])
                logits = c.forward(rest).logits[0, :-1].float()
                nll = torch.nn.functional.cross_entropy(logits, rest[0, 1:], reduction="none")
                out[name, b] = (nll, c.nbytes)
                bar.update(1)
                del c
        del sc
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--texts", type=int, default=2, help="number of text excerpts")
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--policies", nargs="+", default=["streaming", "h2o"])
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--skip", type=int, default=1024, help="tokens excluded from the perplexity")
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", help="model and KV dtype (bf16: AMX on the CPU)")
    common.add_model_arg(ap)
    ap.add_argument("--decode", action="store_true",
                    help="the periodic decode-time rule (policies: streaming snapkv h2o; "
                         "budgets: max_held)")
    ap.add_argument("--context", action="store_true",
                    help="compress the first --prompt tokens once, then read on (policies: "
                         f"{' '.join(CONTEXT_POLICIES)}; budgets: tokens per layer)")
    ap.add_argument("--prompt", type=int, default=512, help="--decode / --context: prompt tokens")
    ap.add_argument("--interval", type=int, default=64, help="--decode: tokens per forward")
    ap.add_argument("--out", type=Path, default=common.RESULTS / "ppl_results.json")
    args = ap.parse_args()
    if args.context and args.decode:
        ap.error("--context, --decode: one mode at a time")
    if args.context:
        unknown = [p for p in args.policies if p not in CONTEXT_POLICIES]
        if unknown:
            ap.error(f"--policies: {unknown} not among --context's {list(CONTEXT_POLICIES)}")
        if not 0 < args.prompt < args.tokens - 1:
            ap.error(f"--prompt {args.prompt}: needs 0 < prompt < --tokens - 1")
        args.skip = args.prompt + 1  # the compressed context has no logits for its last token

    from tqdm import tqdm

    torch.set_num_threads(common.threads())
    model, tok = common.load_model(args.dtype, args.model)
    novels = common.load_novels()
    rng = random.Random(args.seed)
    per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * \
        (model.config.hidden_size // model.config.num_attention_heads) * model.dtype.itemsize
    rows = []
    step = args.interval if args.decode else args.chunk
    first = args.prompt if args.decode else args.chunk
    n_chunks = 1 if args.context else 1 + math.ceil((args.tokens - first) / step)
    total = args.texts * (1 + len(args.policies) * len(args.budgets) * n_chunks)
    bar = tqdm(total=total, desc="ppl", unit="fwd")
    for t in range(args.texts):
        name = sorted(novels)[rng.randrange(len(novels))]
        text = novels[name]
        start = rng.randrange(0, len(text) - 8 * args.tokens)
        ids = tok(" ".join(text[start: start + 8 * args.tokens].split()),
                  add_special_tokens=False, return_tensors="pt").input_ids[:, : args.tokens]
        nll = nll_full(model, ids)
        bar.update(1)
        full = {"text": t, "novel": name, "policy": "full", "budget": args.tokens,
                **nll_fields(nll[args.skip - 1:]), "kv_bytes": per_token * args.tokens}
        rows.append(full)
        if args.context:
            for (pol, b), (nll, held) in nll_context(model, tok, ids, args.prompt, args.policies,
                                                     args.budgets, bar, args.n_sink,
                                                     args.window).items():
                rows.append({"text": t, "novel": name, "policy": f"context {pol}", "budget": b,
                             **nll_fields(nll), "kv_bytes": held})
                tqdm.write(f"{name} context {pol}@{b}: ppl {math.exp(rows[-1]['nll']):.3f} "
                           f"(full {math.exp(full['nll']):.3f})")
            common.write_json(args.out, {"args": common.args_dict(args), "rows": rows})
            continue
        for pol in args.policies:
            for b in args.budgets:
                options = (dict(policy="full", decode=pol, max_held=b, interval=args.interval)
                           if args.decode else dict(policy=pol, budget=b))
                nll, held = nll_bounded(model, ids, step, bar, first, args.skip,
                                        n_sink=args.n_sink, window=args.window, **options)
                label = f"decode {pol}" if args.decode else pol
                rows.append({"text": t, "novel": name, "policy": label, "budget": b,
                             **nll_fields(nll[args.skip - 1:]), "kv_bytes": held})
                tqdm.write(f"{name} {label}@{b}: ppl {math.exp(rows[-1]['nll']):.3f} "
                           f"(full {math.exp(full['nll']):.3f})")
        common.write_json(args.out, {"args": common.args_dict(args), "rows": rows})
    bar.close()
    print(table(rows, args))


def table(rows, args) -> str:
    """Markdown: mean NLL over texts -> perplexity, per policy and budget."""
    groups = {}
    for r in rows:
        groups.setdefault((r["policy"], r["budget"]), []).append(r)
    full = sum(r["nll"] for r in groups[("full", args.tokens)]) / len(groups[("full", args.tokens)])
    lines = ["| policy | KV budget (tokens) | KV held (MiB) | perplexity | vs full |",
             "|---|---:|---:|---:|---:|"]
    for (pol, b), rs in groups.items():
        nll = sum(r["nll"] for r in rs) / len(rs)
        mib = max(r["kv_bytes"] for r in rs) / 2**20
        lines.append(f"| {pol} | {b} | {mib:.1f} | {math.exp(nll):.3f} | "
                     f"{math.exp(nll) / math.exp(full):.3f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
