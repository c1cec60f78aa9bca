#!/usr/bin/env python3
"""Compress a context once, then ask: query-agnostic passkey retrieval, KVzip against the rest.

Same model, text and needles as ``eval_passkey.py``; here the context is always compressed
before the question arrives (a chat or a prefix cache reusing one compressed context), the
setting where SnapKV's voting window holds no question. Three parts:

1. Table: per trial, every policy x budget (fractions of the context's tokens per layer) on the
   very same token ids: ``kp.hf`` full, streaming, snapkv, h2o, kvzip (uniform per layer) and
   kvzip-global (``kp.layer_budgets``), kvzip-head (``kp.head_budgets``: layers and KV heads
   ranked together, a ragged per-head cache), and kvpress 0.5.5's ``SnapKVPress`` (its ``compress`` on
   the recorded layer inputs) and ``KVzipPress`` (its own context manager: prefill, its
   reconstruction, its ``compress_post``; default = global over layers and heads,
   ``-layer`` = ``layerwise=True``). Cost control: the context is prefilled and scored once
   per trial for every policy (``kp.hf.score_context``: snapkv's window queries, h2o's sums,
   kvzip's reconstruction, exactly what ``compress_context`` runs), and kvpress's KVzip scores
   once per trial; each budget then only selects (``ScoredContext.compress``), asks and decodes
   (``CompressedContext.generate``, greedy, stopping once the key is out). kvpress's
   SnapKVPress compresses the same uncompressed context (``compress(policy="full")``) with the
   layer inputs recorded during that prefill, asked through
   ``CompressedContext.from_cache``. Scores do not depend on the budget. kvzip's softmax is KVzip's
   (``softmax="chunk"``, compress_context's default); ``--kvzip-softmax all`` runs the other
   (config names ``kvzip-all...``; ``--table`` gives that name to the kvzip rows of files
   written before the option, which all used it).
2. Timing and peak memory (first ``--time-trials`` trials, no hooks but the method's own):
   plain prefill, ``kp.hf.compress_context`` kvzip (the first of the head / global / layer
   scopes ``--policies`` runs) / snapkv, kvpress ``KVzipPress``. The answer of
   ``compress_context(kvzip)`` + ``kvc.generate`` is checked against part 1's.
3. Three questions from one compression: three labelled pass keys in one context, one
   ``kp.hf.compress_context`` per method, ``kvc.generate`` asked each question in turn.

    MALLOC_MMAP_THRESHOLD_=1048576 .venv/bin/python bench/eval_context.py --tokens 4096 --trials-per-depth 4

(``--model``: another of scripts/fetch_model.py's models; ``--table`` refuses files of two.)

(kvpress's KVzipPress peaks near 20 GB at 4k tokens here; the malloc setting returns freed
buffers to the system at once, so trials do not pile up on a 24 GB machine.)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import kvprune_cuda as kp  # noqa: E402

OURS = [("streaming", "layer"), ("snapkv", "layer"), ("h2o", "layer"), ("kvzip", "layer"),
        ("kvzip", "global"), ("kvzip", "head")]
COLORS = ("red", "green", "blue")
MULTI_METHODS = [("full", "layer"), ("kvzip", "layer"), ("kvzip", "global"), ("kvzip", "head"),
                 ("snapkv", "layer"), ("h2o", "layer")]


SOFTMAX = ("chunk", "all")  # kp.policy.KVzip's softmax choices


def our_policies(args) -> dict:
    """{name: kp.policy object} of the policies kp.hf runs here: --n-sink, --kernel-size,
    --chunk-size, --kvzip-softmax; window --window, kvzip's --kvzip-window."""
    return {name: kp.policy.make(name, n_sink=args.n_sink, kernel_size=args.kernel_size,
                                 chunk_size=args.chunk_size, **kvzip_options(args),
                                 window=args.kvzip_window if name == "kvzip" else args.window)
            for name in ("streaming", "snapkv", "h2o", "kvzip")}


def kvzip_options(args) -> dict:
    """kvzip's options of the run (--kvzip-softmax, --kvzip-head-floor, --kvzip-novelty,
    --kvzip-weight); the other policies have none of them (kp.policy.make ignores them there)."""
    return {"softmax": args.kvzip_softmax, "head_floor": args.kvzip_head_floor,
            "novelty": args.kvzip_novelty, "weight": args.kvzip_weight}


def selected(methods, args):
    """``methods`` ((policy, scope) pairs) that ``--policies`` names; "full" always."""
    return [m for m in methods
            if m[0] == "full" or run_name(args, *m) in args.policies]


def name_of(policy, scope, frac=None, softmax="chunk", novelty=0.0, head_floor=0.0, weight="none"):
    """E.g. "kvzip-head@10%"; kvzip scored with softmax "all" is "kvzip-all...", with
    ``weight="output"`` "kvzip-plus...", with ``novelty=0.5`` "kvzip-nov50...", with
    ``head_floor=0.5`` "kvzip-fl50..."."""
    base = policy + ("-all" if policy == "kvzip" and softmax == "all" else "")
    base += "-plus" if policy == "kvzip" and weight == "output" else ""
    base += f"-fl{int(round(head_floor * 100))}" if policy == "kvzip" and head_floor else ""
    base += f"-nov{int(round(novelty * 100))}" if policy == "kvzip" and novelty else ""
    base += "" if scope == "layer" else f"-{scope}"
    return base if frac is None else f"{base}@{int(round(frac * 100))}%"


def run_name(args, policy, scope, frac=None):
    """:func:`name_of` with the run's kvzip options (:func:`kvzip_options`)."""
    return name_of(policy, scope, frac, args.kvzip_softmax, args.kvzip_novelty,
                   args.kvzip_head_floor, args.kvzip_weight)


def _older_names(part: dict) -> dict:
    """Files written before ``--kvzip-softmax`` scored kvzip with softmax "all": their kvzip
    configs get that name."""
    if "kvzip_softmax" in part["args"]:
        return part
    rename = lambda d: {("kvzip-all" + k[5:] if k.startswith("kvzip") else k): v  # noqa: E731
                        for k, v in d.items()}
    for r in part["records"]:
        r["results"] = rename(r["results"])
    for m in part.get("multi") or []:
        m["methods"] = rename(m["methods"])
    return part


def timed_scope(args):
    """The budget scope of the kvzip that --time-trials times: the first of head, global, layer
    that --policies runs (None: none)."""
    return next((sc for sc in ("head", "global", "layer")
                 if run_name(args, "kvzip", sc) in args.policies), None)


def ratio_for(kb, n):
    """kvpress compression_ratio keeping ``kb`` of ``n`` tokens (its int() floors the pruned count)."""
    return 1.0 - (kb + 0.5) / n


class _KVzipScores:
    """kvpress's KVzipPress, keeping its score tensor so that other budgets reuse one scoring."""

    def __init__(self, kvpress):
        class Keep(kvpress.KVzipPress):
            def compress_post(self, model):
                self.kept_scores = self.score_val.clone()
                super().compress_post(model)

        self.cls, self.kvpress = Keep, kvpress

    def run(self, model, ctx, ratio, n_sink, chunk_size):
        """(scores [L, 1, Hkv, n], seconds, peak extra bytes) of one full KVzipPress prefill."""
        press = self.cls(compression_ratio=ratio, n_sink=n_sink, chunk_size=chunk_size)

        def go():
            cache = common.cache_from([])
            with press(model), torch.no_grad():
                model.model(input_ids=ctx, past_key_values=cache, use_cache=True)
            return cache

        t0 = time.perf_counter()
        peak, _, _ = common.cpu_peak_extra_bytes(go)
        return press.kept_scores, time.perf_counter() - t0, peak

    def apply(self, model, scores, ratio, layerwise, n_sink):
        press = self.kvpress.KVzipPress(compression_ratio=ratio, layerwise=layerwise, n_sink=n_sink)
        press.score_val = scores.clone()
        press.compress_post(model)


def clear_masks(model):
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


def ask(tok, ctx_c, qst, key, steps):
    """Greedy answer of the compressed context ``ctx_c`` (a kp.hf.CompressedContext) to
    ``qst``: at most ``steps`` tokens, stopping once ``key`` is in the text."""
    g = ctx_c.generate(qst, max_new_tokens=steps, do_sample=False, pad_token_id=tok.pad_token_id,
                       stopping_criteria=common.stop_at_key(tok, key))
    toks = g[0, qst.shape[1]:].tolist()
    text = tok.decode(toks)
    return {"text": text, "hit": key in text, "toks": toks}


def run_trial(model, tok, ctx, qst, key, args, kvz):
    """{config: {text, hit, toks, kv_bytes, tokens_per_layer}} of ``args.part``, and kvpress
    KVzip's timing (part "kvpress-kvzip")."""
    n_layers, n = model.config.num_hidden_layers, ctx.shape[1]
    ours = args.part in ("all", "ours")
    methods = selected(OURS, args) if ours else []
    pols = our_policies(args)
    scored_names = [p for p in ("kvzip", "snapkv", "h2o") if any(m[0] == p for m in methods)]
    press_snapkv = ours and kvz is not None and "kvpress-snapkv" in args.policies
    attn = common.attention_modules(model)
    # one prefill (and kvzip reconstruction) for every policy; "full" only prefills
    rec = common.Recorder(model, args.window + 1, first_only=True) if press_snapkv else None
    try:
        scored = kp.hf.score_context(model, ctx, [pols[p] for p in scored_names] or "full",
                                     tokenizer=tok)
    finally:
        if rec is not None:
            rec.remove()
    res, extra = {}, {}

    def record(name, ctx_c, r=None):
        res[name] = {**(r or ask(tok, ctx_c, qst, key, args.gen_steps)),
                     "kv_bytes": ctx_c.nbytes, "tokens_per_layer": ctx_c.tokens_per_layer}

    record("full", scored.compress(policy="full"))
    for frac in args.budgets if ours else ():
        for pol, scope in methods:
            record(run_name(args, pol, scope, frac),
                   scored.compress(frac, scope, policy=pols[pol]))
        if press_snapkv:
            kb = kp.hf.resolve_budget(frac, n)
            press = kvz.kvpress.SnapKVPress(compression_ratio=ratio_for(kb, n),
                                            window_size=args.window,
                                            kernel_size=args.kernel_size or common.KVPRESS_KERNEL)
            cache = common.apply_press(press, scored.compress(policy="full").cache(), rec.data, attn)
            record(f"kvpress-snapkv@{int(round(frac * 100))}%",
                   kp.hf.CompressedContext.from_cache(model, ctx, cache))
    if kvz is not None and args.part in ("all", "kvpress-kvzip"):
        ratio20 = ratio_for(kp.hf.resolve_budget(0.2, n), n)
        scores, secs, peak = kvz.run(model, ctx, ratio20, args.n_sink, args.chunk_size)
        extra["kvpress_kvzip_seconds"], extra["kvpress_kvzip_peak_extra_bytes"] = secs, peak
        clear_masks(model)
        hkv = model.config.num_key_value_heads
        full = scored.compress(policy="full")  # kvpress masks keys, it frees none
        for frac in args.budgets:
            kb = kp.hf.resolve_budget(frac, n)
            for layerwise in (False, True):
                kvz.apply(model, scores, ratio_for(kb, n), layerwise, args.n_sink)
                masked = [int(attn[i].masked_key_indices[0].numel()) for i in range(n_layers)]
                name = "kvpress-kvzip" + ("-layer" if layerwise else "")
                r = ask(tok, full, qst, key, args.gen_steps)
                res[f"{name}@{int(round(frac * 100))}%"] = {
                    **r, "kv_bytes": None,  # masked, not freed (kvpress's fake compression)
                    "tokens_per_layer": [n - p / hkv for p in masked]}
                clear_masks(model)
    return res, extra


def time_ours(model, tok, ctx, qst, key, args):
    """Seconds and peak extra bytes of a plain prefill and of compress_context (kvzip, snapkv)."""
    out = {}

    def plain():
        cache = common.cache_from([])
        with torch.no_grad():
            model.model(input_ids=ctx, past_key_values=cache, use_cache=True)
        return cache

    for name, fn in [("plain_prefill", plain),
                     ("kvzip", lambda: kp.hf.compress_context(model, ctx, "kvzip", 0.2, tokenizer=tok,
                                                              n_sink=args.n_sink, window=args.kvzip_window,
                                                              chunk_size=args.chunk_size,
                                                              budget_scope=timed_scope(args),
                                                              **kvzip_options(args))),
                     ("snapkv", lambda: kp.hf.compress_context(model, ctx, "snapkv", 0.2,
                                                               n_sink=args.n_sink, window=args.window,
                                                               kernel_size=args.kernel_size))]:
        box = {}

        def call(fn=fn, box=box):
            box["v"] = fn()
            return None

        t0 = time.perf_counter()
        peak, _, _ = common.cpu_peak_extra_bytes(call)
        out[f"{name}_seconds"], out[f"{name}_peak_extra_bytes"] = time.perf_counter() - t0, peak
        if name == "kvzip":
            kvc = box["v"]
            out["kvzip_prefill_seconds"], out["kvzip_compress_seconds"] = (kvc.prefill_seconds,
                                                                           kvc.compress_seconds)
            g = kvc.generate(qst, max_new_tokens=args.gen_steps, do_sample=False,
                             pad_token_id=tok.pad_token_id)
            out["kvzip_generate_text"] = tok.decode(g[0, qst.shape[1]:])
            out["kvzip_generate_toks"] = g[0, qst.shape[1]:].tolist()
        box.clear()
    return out


def multi_question(model, tok, novels, rng, args):
    """One context with three labelled keys; each method compresses it once, asked three times."""
    keys = {c: str(rng.randrange(10000, 100000)) for c in COLORS}
    depths = (0.2, 0.5, 0.8)
    needles = [(d, f" The {c} pass key is {keys[c]}. Remember it. {keys[c]} is the {c} pass key. ")
               for d, c in zip(depths, COLORS)]
    ctx, _, novel = common.build_haystack(tok, novels, args.tokens[0], needles, "", rng, "")
    qs = {}
    head = tok.apply_chat_template([{"role": "user", "content": "@@"}], tokenize=False,
                                   add_generation_prompt=True)
    post = head.split("@@")[1]
    for c in COLORS:
        text = (f"\n\nWhat is the {c} pass key mentioned in the text above? Answer with the number "
                f"only.{post}The {c} pass key is")
        qs[c] = torch.tensor([tok(text, add_special_tokens=False).input_ids])
    out = {"keys": keys, "novel": novel, "methods": {}}
    methods = [(p, sc, f) for p, sc in selected(MULTI_METHODS, args)
               for f in ([1.0] if p == "full" else args.multi_budgets)]
    for pol, scope, frac in methods:
        kvc = kp.hf.compress_context(model, ctx, pol, frac,
                                     budget_scope=scope, tokenizer=tok, n_sink=args.n_sink,
                                     window=args.kvzip_window if pol == "kvzip" else args.window,
                                     kernel_size=args.kernel_size, chunk_size=args.chunk_size,
                                     **kvzip_options(args))
        answers = {}
        for c in COLORS:
            g = kvc.generate(qs[c], max_new_tokens=args.gen_steps, do_sample=False,
                             pad_token_id=tok.pad_token_id)
            text = tok.decode(g[0, qs[c].shape[1]:])
            answers[c] = {"text": text, "hit": keys[c] in text}
        out["methods"][run_name(args, pol, scope, None if pol == "full" else frac)] = {
            "answers": answers, "tokens_per_layer": kvc.tokens_per_layer, "kv_bytes": kvc.nbytes,
            "compress_seconds": kvc.compress_seconds, "prefill_seconds": kvc.prefill_seconds}
    return out


def merge(parts: list) -> dict:
    """One result from the --part runs of the same trials (same seed: same prompts and keys).
    Results and three-question methods of later files win; timings of earlier ones (so that a
    later run on another machine does not mix its seconds into the medians)."""
    data = parts[0]
    for i, r in enumerate(data["records"]):
        r.setdefault("trial", i)
    by_trial = {r["trial"]: r for r in data["records"]}
    model = data["args"].get("model", common.DEFAULT_MODEL)  # files without one: the 0.5B's
    for other in parts[1:]:
        if other["args"].get("model", common.DEFAULT_MODEL) != model:
            raise ValueError("--table: the files hold results of different models")
        for i, o in enumerate(other["records"]):
            r = by_trial.get(o.get("trial", i))
            if r is None or r["key"] != o["key"]:
                raise ValueError("--table: the files hold different trials (seeds or arguments differ)")
            if r["results"]["full"]["toks"] != o["results"]["full"]["toks"]:
                raise ValueError(f"--table: trial {r['key']}: the full cache answers differ")
            r["results"].update({k: v for k, v in o["results"].items() if k != "full"})
            if o.get("timing"):
                r["timing"] = {**o["timing"], **(r.get("timing") or {})}  # earlier files win
        multi = other.get("multi") or []
        if data.get("multi") and multi:  # the same contexts (a prefix): later files' methods win
            if any(m["keys"] != o["keys"] for m, o in zip(data["multi"], multi)):
                raise ValueError("--table: the files hold different three-question contexts")
            for m, o in zip(data["multi"], multi):
                m["methods"].update({k: v for k, v in o["methods"].items() if k != "full"})
        data["multi"] = data.get("multi") or multi
        data.setdefault("merged", []).append({"args": other["args"], "commit": other["commit"]})
    return data


def table(data) -> str:
    recs = data["records"]
    rows = ["| config | hits | KV held (MiB, mean) | tokens per layer (min..max) |", "|---|---|---|---|"]
    names = list(dict.fromkeys(nm for r in recs for nm in r["results"]))
    for nm in names:
        got = [r["results"][nm] for r in recs if nm in r["results"]]
        kb = [g["kv_bytes"] for g in got]
        tl = [t for g in got for t in g["tokens_per_layer"]]
        mib = "masked, not freed" if kb[0] is None else f"{sum(kb) / len(kb) / 2**20:.1f}"
        rows.append(f"| {nm} | {sum(g['hit'] for g in got)}/{len(got)} | {mib} | "
                    f"{min(tl):.0f}..{max(tl):.0f} |")
    depths = sorted({r["depth"] for r in recs})
    rows += ["", "| config | " + " | ".join(f"depth {d:.0%}" for d in depths) + " |",
             "|---|" + "---|" * len(depths)]
    for nm in names:
        cells = []
        for d in depths:
            at = [r["results"][nm]["hit"] for r in recs if r["depth"] == d and nm in r["results"]]
            cells.append(f"{sum(at)}/{len(at)}")
        rows.append(f"| {nm} | " + " | ".join(cells) + " |")
    out = "\n".join(rows)
    tm = [r["timing"] for r in recs if r.get("timing")]
    med = lambda k: sorted(t[k] for t in tm if k in t)[len([t for t in tm if k in t]) // 2]  # noqa: E731
    if tm:
        out += "\n\n| method (median of %d trials) | seconds | x plain prefill | peak extra MiB |\n" % len(tm)
        out += "|---|---|---|---|\n"
        base = med("plain_prefill_seconds") if any("plain_prefill_seconds" in t for t in tm) else 1.0
        for k, label in [("plain_prefill", "plain prefill (no compression)"),
                         ("snapkv", "kp.hf.compress_context snapkv"),
                         ("kvzip", "kp.hf.compress_context kvzip (%s budget, softmax %s)" % (
                             tm[0].get("kvzip_scope", "layer"),
                             data["args"].get("kvzip_softmax", "all"))),
                         ("kvpress_kvzip", "kvpress KVzipPress (prefill + scoring)")]:
            if any(f"{k}_seconds" in t for t in tm):
                s = med(f"{k}_seconds")
                out += (f"| {label} | {s:.1f} | {s / base:.2f} | "
                        f"{med(f'{k}_peak_extra_bytes') / 2**20:.0f} |\n")
    if data.get("multi"):
        out += "\n| method (3 questions per compression) | " + " | ".join(COLORS) + " |\n"
        out += "|---|" + "---|" * len(COLORS) + "\n"
        names = dict.fromkeys(nm for t in data["multi"] for nm in t["methods"])
        for nm in names:
            got = [t["methods"][nm]["answers"] for t in data["multi"] if nm in t["methods"]]
            cells = [f"{sum(a[c]['hit'] for a in got)}/{len(got)}" for c in COLORS]
            out += f"| {nm} | " + " | ".join(cells) + " |\n"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_trial_args(ap)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--kvzip-softmax", choices=SOFTMAX, default="chunk",
                    help="keys kvzip's reconstruction softmax covers (compress_context's softmax=)")
    ap.add_argument("--kvzip-window", type=int, default=0,
                    help="recent tokens kvzip protects (compress_context's default: 0, sinks only)")
    ap.add_argument("--kvzip-head-floor", type=float, default=0.0,
                    help="share of each head's budget for its own largest maxima (compress_context's head_floor=; "
                         "0, as the recorded tables ran, unless given; the library's default is 0.25)")
    ap.add_argument("--kvzip-novelty", type=float, default=0.0,
                    help="share of each head's budget for its most novel keys (compress_context's novelty=)")
    ap.add_argument("--kvzip-weight", choices=kp.policy.kvzip.WEIGHTS, default="none",
                    help="kvzip's probabilities as they are, or KVzip+'s output weighting (compress_context's weight=; "
                         "none, as the recorded tables ran, unless given; the library's default is output)")
    ap.add_argument("--time-trials", type=int, default=3, help="trials that also time each method")
    ap.add_argument("--multi-trials", type=int, default=5, help="three-question contexts")
    ap.add_argument("--multi-budgets", type=float, nargs="+", default=[0.2],
                    help="budgets of the three-question test")
    ap.add_argument("--only-trials", type=int, nargs="+",
                    help="run only these trial indices (one process per KVzipPress trial keeps "
                         "its ~20 GB peak off the next one's)")
    ap.add_argument("--part", choices=("all", "ours", "kvpress-kvzip"), default="all",
                    help="kvpress's KVzipPress peaks near 20 GB at 4k tokens: on a 24 GB machine run "
                         "the parts in two processes (same seed, same prompts) and merge with --table")
    ap.add_argument("--policies", nargs="+", default=[name_of(*m) for m in OURS] + ["kvpress-snapkv"],
                    help="our methods (and kvpress's SnapKVPress) to run; the full cache always runs")
    ap.add_argument("--table", type=Path, nargs="+",
                    help="only print the tables of earlier --out files (--part runs merged)")
    ap.add_argument("--out", type=Path, default=common.RESULTS / "context_results.json")
    args = ap.parse_args()
    if args.table:
        print(table(merge([_older_names(json.loads(f.read_text())) for f in args.table])))
        return

    from tqdm import tqdm

    torch.set_num_threads(common.threads())
    model, tok = common.load_model(args.dtype, args.model)
    novels = common.load_novels()
    kvz = None
    if not args.no_kvpress:
        import logging

        import kvpress
        logging.getLogger("kvpress.presses.kvzip_press").setLevel(logging.ERROR)  # a warning per press
        kvz = _KVzipScores(kvpress)
    rng = random.Random(args.seed)
    jobs = [(n, d) for n in args.tokens for d in args.depths for _ in range(args.trials_per_depth)]
    data = {"args": common.args_dict(args), **common.run_meta(), "records": [], "multi": []}
    hits: dict = {}
    bar = tqdm(jobs, desc="query-agnostic passkey", unit="trial")
    for j, (n, depth) in enumerate(bar):
        key = str(rng.randrange(10000, 100000))
        ctx, qst, novel = common.build_prompt(tok, novels, n, depth, key, rng)
        if args.only_trials is not None and j not in args.only_trials:
            continue  # the prompt was still drawn, so later trials get the same ones
        t0 = time.perf_counter()
        res, extra = run_trial(model, tok, ctx, qst, key, args, kvz)
        rec_j = {"trial": j, "tokens": n, "context_tokens": ctx.shape[1],
                 "question_tokens": qst.shape[1], "depth": depth, "key": key, "novel": novel,
                 "results": res, "timing": None}
        if j < args.time_trials and timed_scope(args):
            t = dict(extra)
            if args.part != "kvpress-kvzip":
                t.update(time_ours(model, tok, ctx, qst, key, args))
                t["kvzip_scope"] = timed_scope(args)
                a = t.pop("kvzip_generate_toks")
                b = res[run_name(args, "kvzip", timed_scope(args), 0.2)]["toks"]
                t["kvzip_generate_equals_shared"] = a[:len(b)] == b[:len(a)]
            rec_j["timing"] = t
            tqdm.write(f"timing: { {k: v for k, v in t.items() if 'seconds' in k or 'equals' in k} }")
        rec_j["seconds"] = time.perf_counter() - t0
        gc.collect()
        common.malloc_trim()
        rec_j["rss_after_mib"] = common.rss_mib()
        data["records"].append(rec_j)
        for c, r in res.items():
            hits.setdefault(c, []).append(r["hit"])
        bar.set_postfix({c: f"{sum(hits[c])}/{len(hits[c])}" for c in
                         ("full", "kvzip-head@10%", "kvzip-global@10%", "kvpress-kvzip@10%") if c in hits})
        common.write_json(args.out, data)
    for _ in tqdm(range(args.multi_trials if args.part != "kvpress-kvzip" else 0),
                  desc="three questions", unit="context"):
        data["multi"].append(multi_question(model, tok, novels, rng, args))
        common.write_json(args.out, data)
    print(table(data))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
