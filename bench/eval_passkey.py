#!/usr/bin/env python3
"""Passkey retrieval with a real model (Qwen2.5-Coder-0.5B-Instruct) on real text (Jane Austen).

A random 5-digit key ("The pass key is 71432. Remember it. 71432 is the pass key.") is hidden
at a depth (10 %..90 %) of N tokens of novel text; the question comes at the end. Each trial is
scored under every policy x budget, in two settings, on the same token ids:

* query-aware: the whole prompt (context + question) is prefilled, then compressed; the
  question lies inside the observation window (SnapKV's own setting). The first answer token
  comes from the full prefill, the rest is decoded on the compressed cache.
* query-agnostic: the context is compressed before the question arrives (a chat reusing a
  compressed cache across turns); the question is then prefilled on the compressed cache.

Policies: full, streaming, snapkv (dual stage, ``kp.snapkv``), h2o (accumulated attention of
every query, ``kp.window_scores`` + ``kp.select_keep``), all through ``kvprune_cuda.hf``; and
side by side kvpress 0.5.5 ``SnapKVPress`` / ``StreamingLLMPress`` (their ``compress`` on the
very same layer inputs, keys and values, with the same token budget).

Cost control: per trial the prompt is prefilled once (context, then question) with full
attention while the hooks record every layer's window queries, H2O scores and kvpress inputs;
each policy then compresses a copy of that cache and decodes. (Compression happens after
each layer's prefill anyway, so prefill activations are identical for every policy.)

    .venv/bin/python bench/eval_passkey.py --tokens 4096 --trials-per-depth 4
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import (Recorder, add_trial_args, apply_press, build_prompt,  # noqa: E402,F401
                    cache_from, decode, layers_of)

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda import hf  # noqa: E402

def run_trial(model, tok, kvc, rec, ctx, qst, key, budgets, presses, gen_steps):
    """{setting: {config: (answer text, hit, kv bytes held after the prompt)}}."""
    n_layers = len(kvc.attn)
    attn = {m.layer_idx: m for m in kvc.attn}
    res = {"aware": {}, "agnostic": {}}
    cache = cache_from([])
    with torch.no_grad():
        model(input_ids=ctx, past_key_values=cache, use_cache=True)
        snap_ctx, kv_ctx = kvc.snapshot(), layers_of(cache, n_layers)
        rec_ctx = dict(rec.data)
        lg = model(input_ids=qst, past_key_values=cache, use_cache=True).logits
        snap_all, kv_all = kvc.snapshot(), layers_of(cache, n_layers)
        rec_all = dict(rec.data)
    first = int(lg[0, -1].argmax())
    n_ctx, n_all = ctx.shape[1], ctx.shape[1] + qst.shape[1]

    def score(setting, name, toks, nbytes):
        text = tok.decode(toks)
        res[setting][name] = (text, key in text, nbytes, toks)

    configs = [("full", None)] + [(p, b) for p in ("streaming", "snapkv", "h2o") for b in budgets]
    configs += [(p, b) for p in presses for b in budgets]
    for setting in ("aware", "agnostic"):
        snap, kv, recd, n = ((snap_all, kv_all, rec_all, n_all) if setting == "aware"
                             else (snap_ctx, kv_ctx, rec_ctx, n_ctx))
        for pol, frac in configs:
            kvc.restore(snap)
            c = cache_from(kv)
            name = pol if frac is None else f"{pol}@{int(round(frac * 100))}%"
            kb = n if frac is None else hf.resolve_budget(frac, n)
            if pol in presses:
                apply_press(presses[pol](compression_ratio=1.0 - (kb + 0.5) / n), kvc, c, recd, attn)
            elif pol != "full":
                kvc.policy = pol
                kvc.compress_cache(c, pol, kb)
            else:
                kvc.policy = "full"
            with torch.no_grad():
                if setting == "aware":
                    t0 = first
                else:
                    t0 = int(model(input_ids=qst, past_key_values=c, use_cache=True).logits[0, -1].argmax())
                held = hf.kv_bytes(c)
                toks = decode(model, c, t0, gen_steps, tok, key)
            score(setting, name, toks, held)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trial_args(ap)
    ap.add_argument("--check-generate", type=int, default=1,
                    help="trials on which plain model.generate and kp.hf.compress(...) + generate "
                         "are also run and compared with the shared-prefill answers")
    ap.add_argument("--out", type=Path, default=common.RESULTS / "passkey_results.json")
    args = ap.parse_args()

    from tqdm import tqdm

    torch.set_num_threads(common.threads())
    model, tok = common.load_model(args.dtype)
    novels = common.load_novels()
    presses = {}
    if not args.no_kvpress:
        import kvpress
        w, ks = args.window, args.kernel_size
        presses = {"kvpress-snapkv": lambda compression_ratio: kvpress.SnapKVPress(
                       compression_ratio=compression_ratio, window_size=w, kernel_size=ks),
                   "kvpress-streaming": lambda compression_ratio: kvpress.StreamingLLMPress(
                       compression_ratio=compression_ratio, n_sink=args.n_sink)}
    kvc = hf.KVCompressor(model, "full", 1.0, n_sink=args.n_sink, window=args.window,
                          kernel_size=args.kernel_size, compress_on_prefill=False,
                          track_h2o=True).attach()
    rec = Recorder(model, args.window + 1)
    rng = random.Random(args.seed)
    jobs = [(n, d) for n in args.tokens for d in args.depths for _ in range(args.trials_per_depth)]
    records, checks = [], []
    bar = tqdm(jobs, desc="passkey", unit="trial")
    hits = {}
    for j, (n, depth) in enumerate(bar):
        key = str(rng.randrange(10000, 100000))
        ctx, qst, novel = build_prompt(tok, novels, n, depth, key, rng)
        t0 = time.perf_counter()
        res = run_trial(model, tok, kvc, rec, ctx, qst, key, args.budgets, presses, args.gen_steps)
        records.append({"tokens": n, "prompt_tokens": ctx.shape[1] + qst.shape[1], "depth": depth,
                        "key": key, "novel": novel, "seconds": time.perf_counter() - t0,
                        "results": res})
        for s in res:
            for c, (_, hit, *_) in res[s].items():
                hits.setdefault((s, c), []).append(hit)
        bar.set_postfix({k: f"{sum(hits[('aware', k)])}/{len(hits[('aware', k)])}"
                         for k in ("full", "streaming@20%", "snapkv@20%")})
        if j < args.check_generate:
            checks.append(check_generate(model, tok, kvc, rec, ctx, qst, res, args))
            tqdm.write(f"check: {checks[-1]}")
        common.write_json(args.out, {"args": common.args_dict(args), "checks": checks,
                                     "records": records})
    print(f"wrote {args.out}")


def check_generate(model, tok, kvc, rec, ctx, qst, res, args):
    """Plain generate vs policy "full", and kp.hf.compress(snapkv@20%) + generate vs the shared path."""
    ids = torch.cat([ctx, qst], 1)
    kvc.detach()
    rec.remove()
    out = {}
    with torch.no_grad():
        g = model.generate(input_ids=ids, max_new_tokens=args.gen_steps, do_sample=False,
                           min_new_tokens=args.gen_steps, pad_token_id=tok.pad_token_id)
        same = lambda a, b: a[: min(len(a), len(b))] == b[: min(len(a), len(b))]  # noqa: E731
        out["plain_generate"] = tok.decode(g[0, ids.shape[1]:])
        out["full_equals_plain_generate"] = same(g[0, ids.shape[1]:].tolist(), res["aware"]["full"][3])
        with kp.hf.compress(model, policy="snapkv", budget=0.2, n_sink=args.n_sink,
                            window=args.window, kernel_size=args.kernel_size):
            g = model.generate(input_ids=ids, max_new_tokens=args.gen_steps, do_sample=False,
                               min_new_tokens=args.gen_steps, pad_token_id=tok.pad_token_id)
        out["hf_compress_snapkv20"] = tok.decode(g[0, ids.shape[1]:])
        out["snapkv20_equals_shared_path"] = same(g[0, ids.shape[1]:].tolist(),
                                                  res["aware"]["snapkv@20%"][3])
    kvc.attach()
    rec.__init__(model, args.window + 1)
    return out


if __name__ == "__main__":
    main()
