#!/usr/bin/env python3
"""Free (sampled) generation under the decode-time rules: does a long answer loop once the
text it wrote has left the cache? (issue 39, item 5)

Each prompt is ``--tokens`` tokens of a Jane Austen novel (``eval_vllm_continuation``'s
prompts: random offsets, seeded). The model (Qwen2.5-Coder-0.5B-Instruct or ``--model``, fp32) samples
``--gen`` tokens with vLLM's default sampling (temperature 1, no top-p / top-k; EOS ignored),
once with the full cache and once per decode-time rule and ``--max-held``
(``kp.hf.compress(model, "full", decode=POLICY, max_held=M, interval=--interval)``, the rule
kp.vllm runs: the prompt stays whole, the cache is compressed back to M tokens every
``interval`` generated tokens). Every setting samples a prompt from the same seed, so the
settings share their tokens until the first compression changes the logits. Reported per
setting, averaged over the prompts:

* distinct 4-grams: unique 4-grams / 4-grams of the generated text (a loop drives it to 0);
* back-references: the fraction of generated 4-grams that first occurred more than
  ``max_held`` tokens earlier in the prompt + generation, i.e. in text the bounded cache no
  longer holds (for ``full``: measured with the smallest ``--max-held``);
* looped: per prompt, where the generation locks into a loop (:func:`loop_onset`), if it does;
* full ppl: the full model's perplexity of the generated tokens (one teacher-forced forward
  over prompt + generation with the full cache): how plausible the text is to the model
  that was not compressed (a loop reads as very likely, so read it beside distinct 4-grams).

    .venv/bin/python bench/eval_free_generation.py --prompts 3 --tokens 300 --gen 700 --max-held 256 --interval 32
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from eval_vllm_continuation import make_prompts  # noqa: E402

import kvprune_cuda as kp  # noqa: E402


def distinct_ngrams(tokens: list[int], n: int = 4) -> float:
    """Unique n-grams / n-grams of ``tokens``."""
    grams = [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / max(len(grams), 1)


def back_references(context: list[int], generated: list[int], held: int, n: int = 4) -> float:
    """The fraction of ``generated``'s n-grams whose first occurrence in ``context +
    generated`` starts more than ``held`` tokens before them."""
    text = context + generated
    first: dict = {}
    hits = total = 0
    for i in range(len(text) - n + 1):
        g = tuple(text[i: i + n])
        if i >= len(context):
            total += 1
            hits += g in first and i - first[g] > held
        first.setdefault(g, i)
    return hits / max(total, 1)


def loop_onset(tokens: list[int], n: int = 4, span: int = 128, within: int = 200,
               share: float = 0.9, step: int = 16) -> Optional[int]:
    """Where ``tokens`` lock into a loop: the first position p (a multiple of ``step``) such
    that at least ``share`` of the n-grams starting in ``[p, p + span)`` occurred within the
    ``within`` tokens before them; None if they never do."""
    last: dict = {}
    repeat = []
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i: i + n])
        repeat.append(g in last and i - last[g] <= within)
        last[g] = i
    for p in range(0, len(repeat) - span + 1, step):
        if sum(repeat[p: p + span]) >= share * span:
            return p
    return None


def sample(model, prompt: list[int], gen: int, seed: int) -> tuple[list[int], int]:
    """(the ``gen`` sampled tokens, tokens layer 0 of the cache holds at the end)."""
    ids = torch.tensor([prompt])
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                         temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=gen,
                         min_new_tokens=gen, pad_token_id=0, return_dict_in_generate=True)
    held = kp.hf.cache_kv(out.past_key_values, 0)[0].shape[2]
    return out.sequences[0, len(prompt):].tolist(), held


@torch.no_grad()
def full_ppl(model, prompt: list[int], generated: list[int]) -> float:
    ids = torch.tensor([prompt + generated])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(generated))
    return math.exp(float(nll))


def table(rows: list[dict], meta: dict) -> str:
    lines = [f"Machine: {meta['machine']}; commit {meta['commit']}; {meta['dtype']}; "
             f"{meta['prompts']} prompts of {meta['tokens']} tokens, {meta['gen']} sampled "
             f"each (temperature 1, EOS ignored), interval {meta['interval']}", "",
             "| setting | distinct 4-grams | back-references | full ppl | KV held at the end (tokens) "
             "| looped (onset, generated tokens) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        m = lambda k: sum(r[k]) / len(r[k])  # noqa: E731
        onsets = [loop_onset(t) for t in r["tokens"]]
        looped = f"{sum(o is not None for o in onsets)}/{len(onsets)} (" + ", ".join(
            "-" if o is None else str(o) for o in onsets) + ")"
        lines.append(f"| {r['setting']} | {m('distinct'):.3f} | {m('back'):.3f} | "
                     f"{m('ppl'):.2f} | {m('held'):.0f} | {looped} |")
    return "\n".join(lines) + (
        "\n\nlooped: the prompts whose generation locks into a loop, and where: the first "
        "position p (a multiple of 16) from which 90 % of the 4-grams of the next 128 tokens "
        "repeat one of the 200 tokens before them (loop_onset).")


SAME_RUN = ("prompts", "tokens", "gen", "interval", "dtype", "model", "seed")


def _resumed(args) -> list:
    """The rows ``args.out`` holds from a run with the same :data:`SAME_RUN` arguments
    (none if there is no such file); ValueError naming the first that differs."""
    if not args.out.exists():
        return []
    old = json.loads(args.out.read_text())
    for key in SAME_RUN:
        if old["meta"].get(key) != getattr(args, key):
            raise ValueError(f"--resume: {args.out} was run with {key}="
                             f"{old['meta'].get(key)!r}, this run has {getattr(args, key)!r}")
    return old["rows"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=300, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=700, help="sampled tokens per prompt")
    ap.add_argument("--policies", nargs="+", default=["streaming", "snapkv", "h2o"],
                    choices=list(kp.policy.DECODE_POLICIES))
    ap.add_argument("--max-held", type=int, nargs="+", default=[256])
    ap.add_argument("--interval", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    common.add_model_arg(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=common.RESULTS / "free_generation.json")
    ap.add_argument("--resume", action="store_true",
                    help="keep the settings --out already holds from a run of the same "
                         "prompts, model and interval; run the others (the file is rewritten "
                         "after every setting)")
    ap.add_argument("--table", type=Path, default=None,
                    help="only print the table of this result file")
    args = ap.parse_args(argv)
    if args.table:
        saved = json.loads(args.table.read_text())
        print(table(saved["rows"], saved["meta"]))
        return saved
    torch.set_num_threads(args.threads or common.threads())
    model, tok = common.load_model(args.dtype, args.model)
    prompts = make_prompts(tok, args.prompts, args.tokens, args.seed)
    settings = [("full", None, min(args.max_held))]
    settings += [(p, p, m) for p in args.policies for m in args.max_held]
    meta = {**common.run_meta(), **common.args_dict(args)}
    rows = _resumed(args) if args.resume else []
    for name, decode, held in settings:
        label = name if decode is None else f"{decode} held {held}"
        if any(r["setting"] == label for r in rows):
            continue
        row = {"setting": label, "distinct": [],
               "back": [], "ppl": [], "held": [], "seconds": [], "tokens": []}
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            if decode is None:
                got, kept = sample(model, prompt, args.gen, args.seed + i)
            else:
                with kp.hf.compress(model, "full", decode=decode, max_held=held,
                                    interval=args.interval):
                    got, kept = sample(model, prompt, args.gen, args.seed + i)
            row["seconds"].append(time.perf_counter() - t0)
            row["distinct"].append(distinct_ngrams(got))
            row["back"].append(back_references(prompt, got, held))
            row["ppl"].append(full_ppl(model, prompt, got))
            row["held"].append(kept)
            row["tokens"].append(got)
        rows.append(row)
        print(row["setting"], [round(x, 3) for x in row["distinct"]], flush=True)
        common.write_json(args.out, {"meta": meta, "rows": rows})
    print(table(rows, meta))
    common.write_json(args.out, {"meta": meta, "rows": rows})
    print(f"wrote {args.out}")
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
