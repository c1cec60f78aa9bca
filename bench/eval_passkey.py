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
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _hf_common as common  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda import hf  # noqa: E402

PREAMBLE = "Below is a long text. Read it carefully; a question about it follows.\n\n"
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key mentioned in the text above? Answer with the number only."
ANSWER_PREFIX = "The pass key is"


def build_prompt(tok, novels, n_tokens, depth, key, rng):
    """(context ids, question ids): chat-formatted, haystack of ~n_tokens with the needle at depth."""
    return build_haystack(tok, novels, n_tokens, [(depth, NEEDLE.format(key=key))], QUESTION, rng)


def build_haystack(tok, novels, n_tokens, needles, question, rng, answer_prefix=ANSWER_PREFIX):
    """(context ids [1, n], question ids [1, q], novel): ``needles`` [(depth, text)] hidden in a
    random stretch of a novel; the prompt totals ~n_tokens (template, question included)."""
    head = tok.apply_chat_template([{"role": "user", "content": "@@"}], tokenize=False,
                                   add_generation_prompt=True)
    pre, post = head.split("@@")
    ids = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    name = rng.choice(sorted(novels))
    text = novels[name]
    start = rng.randrange(0, len(text) - 8 * n_tokens)
    hay = ids(" ".join(text[start: start + 6 * n_tokens].split()))
    p_ids, q_ids = ids(pre + PREAMBLE), ids(question + post + answer_prefix)
    pieces = sorted((d, ids(t)) for d, t in needles)
    hay = hay[:n_tokens - len(p_ids) - len(q_ids) - sum(len(t) for _, t in pieces)]
    ctx, last = list(p_ids), 0
    for depth, needle in pieces:
        cut = int(round(depth * len(hay)))
        ctx += hay[last:cut] + needle
        last = cut
    ctx += hay[last:]
    return torch.tensor([ctx]), torch.tensor([q_ids]), name


class Recorder:
    """Keeps, per layer, the last ``n`` layer inputs and RoPE cos/sin (what kvpress.compress reads)."""

    def __init__(self, model, n):
        self.n, self.data, self.handles = n, {}, []
        for m in hf.KVCompressor(model, "full").attn:
            self.handles.append(m.register_forward_hook(self._hook, with_kwargs=True))

    def _hook(self, mod, args, kwargs, out):
        hs = kwargs["hidden_states"][:, -self.n:]
        cos, sin = (t[:, -self.n:] for t in kwargs["position_embeddings"])
        old = self.data.get(mod.layer_idx)
        if old is not None:
            hs, cos, sin = (torch.cat([a, b], 1)[:, -self.n:] for a, b in zip(old, (hs, cos, sin)))
        self.data[mod.layer_idx] = (hs, cos, sin)

    def remove(self):
        for h in self.handles:
            h.remove()


def cache_from(layers_kv):
    from transformers import DynamicCache

    c = DynamicCache()
    for i, (k, v) in enumerate(layers_kv):
        c.update(k, v, i)
    return c


def layers_of(cache, n_layers):
    return [hf.cache_kv(cache, i) for i in range(n_layers)]


def apply_press(press, kvc, cache, recorded, attn) -> None:
    """A kvpress press's ``compress`` on every layer of ``cache`` with the recorded layer inputs;
    the hooks are told every kept slot is valid and not to evict while decoding (kvpress
    compresses the prefill only)."""
    for i in range(len(attn)):
        hs, cos, sin = recorded[i]
        k, v = hf.cache_kv(cache, i)
        k2, v2 = press.compress(attn[i], hs, k, v, None, {"position_embeddings": (cos, sin)})
        hf.set_cache_kv(cache, i, k2.contiguous(), v2.contiguous())
        kvc.layers[i].valid = torch.ones(k2.shape[:3], dtype=torch.bool)
        kvc.layers[i].h2o = None
    kvc.policy = "snapkv"


@torch.no_grad()
def decode(model, cache, first_token, steps, tok=None, key=None):
    """Greedy decode; stops early once ``key`` appears in the text."""
    out = [first_token]
    for _ in range(steps - 1):
        if key is not None and key in tok.decode(out):
            break
        lg = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True).logits
        out.append(int(lg[0, -1].argmax()))
    return out


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


def add_trial_args(ap: argparse.ArgumentParser) -> None:
    """The passkey options eval_passkey.py and eval_context.py share."""
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096], help="prompt lengths")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--trials-per-depth", type=int, default=4)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--kernel-size", type=int, default=7)
    ap.add_argument("--gen-steps", type=int, default=7)
    ap.add_argument("--no-kvpress", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", help="model and KV dtype (bf16: AMX on the CPU)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trial_args(ap)
    ap.add_argument("--check-generate", type=int, default=1,
                    help="trials on which plain model.generate and kp.hf.compress(...) + generate "
                         "are also run and compared with the shared-prefill answers")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "passkey_results.json")
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
        args.out.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                 for k, v in vars(args).items()},
                                        "machine": common.machine(), "commit": common.commit(),
                                        "checks": checks, "records": records}, indent=1))
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
