#!/usr/bin/env python3
"""Passkey retrieval with a real model (Qwen2.5-Coder-0.5B-Instruct) on real text (Jane Austen).

(``--model``: another of scripts/fetch_model.py's models; the result file's args name it.)

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

Through the public ``kp.hf`` API: per trial and setting, ``kp.hf.score_context`` prefills what
is compressed (query-aware: context + question; query-agnostic: the context) once with full
attention, recording every layer's snapkv window queries and h2o sums (and, beside it,
kvpress's layer inputs); each policy then compresses it (``ScoredContext.compress``; kvpress:
its ``compress`` on the uncompressed cache, wrapped by ``CompressedContext.from_cache``) and
answers greedily with ``CompressedContext.generate``, stopping once the key is out: query-aware
from the prompt's first answer token (the prefill's logits), query-agnostic from the question.
(Compression happens after each layer's prefill anyway, so prefill activations are identical
for every policy.)

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
from common import Recorder, add_trial_args, apply_press, build_prompt, stop_at_key  # noqa: E402

import kvprune_cuda as kp  # noqa: E402


class LastLogits:
    """Within the block, keeps the next-token logits [B, 1, V] of the last position of each
    forward of ``model``'s base model (kp.hf.score_context runs the base model: no LM head)."""

    def __init__(self, model):
        self.model, self.logits, self._handle = model, None, None

    def _hook(self, module, args, output):
        self.logits = self.model.get_output_embeddings()(output[0][:, -1:])

    def __enter__(self):
        self._handle = self.model.base_model.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()


def run_trial(model, tok, ctx, qst, key, budgets, presses, args):
    """{setting: {config: (answer text, hit, bytes the compressed context holds, answer ids)}}."""
    attn = common.attention_modules(model)
    pols = {p: kp.policy.make(p, n_sink=args.n_sink, window=args.window,
                              kernel_size=args.kernel_size) for p in ("streaming", "snapkv", "h2o")}
    res = {"aware": {}, "agnostic": {}}
    configs = [("full", None)] + [(p, b) for p in ("streaming", "snapkv", "h2o") for b in budgets]
    configs += [(p, b) for p in presses for b in budgets]
    for setting in ("aware", "agnostic"):
        ids = torch.cat([ctx, qst], 1) if setting == "aware" else ctx
        n = ids.shape[1]
        rec = Recorder(model, args.window + 1) if presses else None
        try:
            with torch.no_grad(), LastLogits(model) as last:
                scored = kp.hf.score_context(model, ids, (pols["snapkv"], pols["h2o"]))
        finally:
            if rec is not None:
                rec.remove()
        # query-aware: the prefill's answer token, then decoding; query-agnostic: the question
        follow = last.logits.argmax(-1) if setting == "aware" else qst
        lead = 1 if setting == "aware" else 0
        for pol, frac in configs:
            name = pol if frac is None else f"{pol}@{int(round(frac * 100))}%"
            if pol in presses:
                kb = kp.hf.resolve_budget(frac, n)
                cache = apply_press(presses[pol](compression_ratio=1.0 - (kb + 0.5) / n),
                                    scored.compress(policy="full").cache(), rec.data, attn)
                c = kp.hf.CompressedContext.from_cache(model, ids, cache)
            elif pol == "full":
                c = scored.compress(policy="full")
            else:
                c = scored.compress(frac, "layer", policy=pols[pol])
            g = c.generate(follow, max_new_tokens=max(1, args.gen_steps - lead), do_sample=False,
                           pad_token_id=tok.pad_token_id, stopping_criteria=stop_at_key(tok, key, lead))
            toks = g[0, follow.shape[1] - lead:].tolist()
            text = tok.decode(toks)
            res[setting][name] = (text, key in text, c.nbytes, toks)
        del scored
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
    model, tok = common.load_model(args.dtype, args.model)
    novels = common.load_novels()
    presses = {}
    if not args.no_kvpress:
        import kvpress
        w, ks = args.window, args.kernel_size or common.KVPRESS_KERNEL
        presses = {"kvpress-snapkv": lambda compression_ratio: kvpress.SnapKVPress(
                       compression_ratio=compression_ratio, window_size=w, kernel_size=ks),
                   "kvpress-streaming": lambda compression_ratio: kvpress.StreamingLLMPress(
                       compression_ratio=compression_ratio, n_sink=args.n_sink)}
    rng = random.Random(args.seed)
    jobs = [(n, d) for n in args.tokens for d in args.depths for _ in range(args.trials_per_depth)]
    records, checks = [], []
    bar = tqdm(jobs, desc="passkey", unit="trial")
    hits = {}
    for j, (n, depth) in enumerate(bar):
        key = str(rng.randrange(10000, 100000))
        ctx, qst, novel = build_prompt(tok, novels, n, depth, key, rng)
        t0 = time.perf_counter()
        res = run_trial(model, tok, ctx, qst, key, args.budgets, presses, args)
        records.append({"tokens": n, "prompt_tokens": ctx.shape[1] + qst.shape[1], "depth": depth,
                        "key": key, "novel": novel, "seconds": time.perf_counter() - t0,
                        "results": res})
        for s in res:
            for c, (_, hit, *_) in res[s].items():
                hits.setdefault((s, c), []).append(hit)
        bar.set_postfix({k: f"{sum(hits[('aware', k)])}/{len(hits[('aware', k)])}"
                         for k in ("full", "streaming@20%", "snapkv@20%")})
        if j < args.check_generate:
            checks.append(check_generate(model, tok, ctx, qst, res, args))
            tqdm.write(f"check: {checks[-1]}")
        common.write_json(args.out, {"args": common.args_dict(args), "checks": checks,
                                     "records": records})
    print(f"wrote {args.out}")


def check_generate(model, tok, ctx, qst, res, args):
    """Plain generate vs policy "full", and kp.hf.compress(snapkv@20%) + generate vs the shared path."""
    ids = torch.cat([ctx, qst], 1)
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
    return out


if __name__ == "__main__":
    main()
