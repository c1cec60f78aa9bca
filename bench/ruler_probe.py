#!/usr/bin/env python3
"""Why needle retrieval fails under compression: which needle tokens a policy keeps.

For RULER-style needle samples (``ruler_tasks.py``: niah_multikey_*, niah_multiquery, ...)
the prompt is prefilled once per sample for the query-aware settings (the prompt but its last
token, as ``eval_ruler.py`` does) and once for the query-agnostic ones (the context), then
compressed under every variant at one budget (``ScoredContext.compress``; the variants change
the selection only: pooling kernel and kind, GQA reduction, the policy). Per variant and
sample it records the answer and its score, and, for every layer and KV head, which of the
needles' tokens were kept: the asked needle's value tokens ("value"), its key tokens ("key"),
and the other needles' value tokens ("others"). Kept positions are found by matching the
compressed cache's keys with the full cache's (a kept key is an exact copy), so they are
what the cache holds, whatever produced them.

    .venv/bin/python bench/ruler_probe.py --tokens 4096 --samples 3 --out bench/results/ruler_probe.json
    .venv/bin/python bench/ruler_probe.py --table bench/results/ruler_probe.json

(``--model``: a model of scripts/fetch_model.py, default the 0.5B; the file's args name it.)

Read the table as: "value all" is the fraction of (layer, head) pairs that kept every value
token of the asked needle; a wrong answer with "value all" near 1 means the needle was kept
and the model still failed; near 0 means it was dropped (its score lost to others, or its
digits split by selection: "value mean" well above "value all").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import eval_ruler as er  # noqa: E402
import ruler_tasks as rt  # noqa: E402

import kvprune_cuda as kp  # noqa: E402

TASKS = ["niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "niah_multiquery",
         "niah_single_2"]


@dataclass(frozen=True)
class TrailingSnapKV(kp.policy.SnapKV):
    """SnapKV whose pooling window trails each position: a key's score is the pool of the
    ``kernel_size`` scores ending at it, so the tokens right after an attended token (a
    needle's value after its key) inherit its score; centered pooling gives half of the
    kernel to the tokens before it. Built from the centered op shifted by kernel_size // 2.
    Head scope only: a layer-scope snapkv selection runs the fused ``kp.snapkv`` op, which
    pools centered whatever ``score`` says."""

    def score(self, queries, keys, *, scale=None, seq_lens=None) -> torch.Tensor:
        if seq_lens is not None:
            raise ValueError("seq_lens: the probe's trailing pool takes unpadded rows")
        s = kp.window_scores(queries, keys, scale=scale, gqa=self.gqa)
        centered = kp.pool_scores(s, self.kernel_size, self.pool, window=self.window)
        h, prefix = self.kernel_size // 2, s.shape[-1] - self.window
        out = centered.clone()
        if prefix > h:
            out[..., h:prefix] = centered[..., :prefix - h]
        head = s[..., :min(h, prefix)]  # the first h: the pool of s[0..t], padding excluded
        out[..., :head.shape[-1]] = (head.cummax(-1).values if self.pool == "max"
                                     else head.cumsum(-1) / self.kernel_size)
        return out


def variants(args) -> dict:
    """name -> (prefill group, policy, budget scope). Groups: "aware", the prompt but its last
    token scored, the last token then answers (as eval_ruler.py does); "last", the whole
    prompt scored (the observation window ends with the prompt's last token, as in
    ``kp.hf.compress``'s generate hooks and vLLM: compression after the prompt's prefill), the
    first answer token taken from the uncompressed prefill; "context", the context alone."""
    # The symmetric pools it probed; kvzip keeps its own window and (unpooled) kernel.
    make = lambda name, **kw: kp.policy.make(  # noqa: E731
        name, n_sink=args.n_sink, **{**({} if name == "kvzip" else {
            "window": args.window, "kernel_size": args.kernel_size, "pool_shift": 0}), **kw})
    trailing = lambda **kw: kp.policy.make(TrailingSnapKV(), **{  # noqa: E731
        "n_sink": args.n_sink, "window": args.window, "kernel_size": args.kernel_size, **kw})
    v = {
        "snapkv-aware": ("aware", make("snapkv"), None),
        "snapkv-aware k1": ("aware", make("snapkv", kernel_size=1), None),
        "snapkv-aware k15": ("aware", make("snapkv", kernel_size=15), None),
        "snapkv-aware avgpool": ("aware", make("snapkv", pool="avg"), None),
        "snapkv-aware gqa-max": ("aware", make("snapkv", gqa="max"), None),
        "snapkv-aware head": ("aware", make("snapkv"), "head"),
        "snapkv-aware trailing head": ("aware", trailing(), "head"),
        "snapkv-aware k15 head": ("aware", make("snapkv", kernel_size=15), "head"),
        "snapkv-aware k31": ("aware", make("snapkv", kernel_size=31), None),
        "snapkv-aware k31 head": ("aware", make("snapkv", kernel_size=31), "head"),
        "snapkv-aware trailing15 head": ("aware", trailing(kernel_size=15), "head"),
        "snapkv-aware trailing31 head": ("aware", trailing(kernel_size=31), "head"),
        "snapkv-aware last": ("last", make("snapkv"), None),
        "snapkv-aware last k15": ("last", make("snapkv", kernel_size=15), None),
        "snapkv-aware last k31": ("last", make("snapkv", kernel_size=31), None),
        "snapkv-aware last k31 head": ("last", make("snapkv", kernel_size=31), "head"),
        "h2o-aware": ("aware", make("h2o"), None),
        # (no per-head floor, plain maxima: the selection the recorded probes measured, as
        # eval_ruler's names)
        "kvzip-layer": ("context", make("kvzip", chunk_size=args.chunk_size, head_floor=0.0,
                                        weight="none"), "layer"),
        "kvzip-head": ("context", make("kvzip", chunk_size=args.chunk_size, head_floor=0.0,
                                       weight="none"), "head"),
        "snapkv-agnostic": ("context", make("snapkv"), "layer"),
        "snapkv-agnostic head": ("context", make("snapkv"), "head"),
    }
    return {k: v[k] for k in args.variants} if args.variants else v


def token_spans(tok, text: str, ids: torch.Tensor, spans: dict) -> dict:
    """{name: [token indices]} of the tokens of ``text`` (tokenized to ``ids`` [1, n]) that
    overlap each character span ``spans[name] = [(start, end), ...]``."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc.input_ids) != ids[0].tolist():
        raise ValueError("token_spans: the text does not tokenize to the context ids")
    out = {}
    for name, ranges in spans.items():
        out[name] = [i for i, (a, b) in enumerate(enc.offset_mapping)
                     if any(a < e and b > s for s, e in ranges)]
    return out


def needle_spans(sample, text: str) -> dict:
    """Character spans of the asked needles' values and keys and the other needles' values."""
    m = sample.meta
    spans = {"value": [], "key": [], "others": []}
    # niah_multivalue hides one key with several values: every needle carries that key.
    keys = m["keys"] if len(m["keys"]) == len(m["needles"]) else m["keys"][:1] * len(m["needles"])
    for needle, key, val in zip(m["needles"], keys, m["values"]):
        at = text.index(needle)
        v0 = at + needle.rindex(val)
        span = (v0, v0 + len(val))
        if key in m["asked"] or sample.task == "niah_multivalue":
            spans["value"].append(span)
            k0 = at + needle.index(key)
            spans["key"].append((k0, k0 + len(key)))
        else:
            spans["others"].append(span)
    return spans


def kept_positions(full_keys: torch.Tensor, kept_keys: torch.Tensor) -> torch.Tensor:
    """bool [Hkv, n]: which of ``full_keys`` [1, Hkv, n, D] appear in ``kept_keys``
    [1, Hkv, k, D] (exact copies), matched through a random projection."""
    r = torch.randn(full_keys.shape[-1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pf = full_keys[0].double() @ r   # [Hkv, n]
    pk = kept_keys[0].double() @ r   # [Hkv, k]
    return torch.stack([torch.isin(pf[h], pk[h]) for h in range(pf.shape[0])])


def retention(full, c, positions: dict) -> dict:
    """Per needle group: the fraction of (layer, head) pairs keeping all its tokens, and the
    mean fraction of its tokens kept; ``full``: the uncompressed cache ``c`` was made from."""
    comp = c.cache()
    per = {g: [] for g in positions}
    for i in range(len(full.layers)):
        kept = kept_positions(full.layers[i].keys, comp.layers[i].keys)  # per-head: zero-padded
        for g, pos in positions.items():
            if pos:
                per[g].append(kept[:, pos].float())  # [Hkv, len(pos)]
    out = {}
    for g, xs in per.items():
        if xs:
            x = torch.cat([t.unsqueeze(0) for t in xs])  # [L, Hkv, len]
            out[g] = {"all": float(x.all(-1).float().mean()), "mean": float(x.mean())}
    return out


def with_last_token(model, aware, last: torch.Tensor) -> tuple:
    """The group "last" from the "aware" scoring ``aware`` (a ScoredContext of the prompt but
    its last token ``last`` [B, 1]): (the scoring extended by ``last``, the greedy first answer
    token [B, 1] from the uncompressed cache), so that a compression of the first, continued
    by the second, answers as ``model.generate`` would after compressing on the whole prompt's
    prefill."""
    with torch.no_grad():
        out = model(input_ids=last, past_key_values=aware.compress(policy="full").cache())
    return aware.extend(last), out.logits[:, -1:].argmax(-1)


def probe_sample(model, tok, sample, vs: dict, args) -> dict:
    ctx, qst = rt.prompt_ids(tok, sample)
    pre, _ = rt.template_parts(tok)
    text = pre + sample.context
    pos = token_spans(tok, text, ctx, needle_spans(sample, text))
    prompt = torch.cat([ctx, qst], 1)
    max_new = rt.MAX_NEW_TOKENS.get(sample.task, 128)
    groups = {"aware": (prompt[:, :-1], prompt[:, -1:]), "context": (ctx, qst)}
    rec = {"task": sample.task, "index": sample.index, "refs": sample.refs,
           "needle_tokens": {g: len(p) for g, p in pos.items()}, "variants": {}, "seconds": {}}
    aware = None  # the "aware" group's scoring, extended by the last token for "last"
    for g in ("aware", "last", "context"):
        names = [n for n, (grp, _, _) in vs.items() if grp == g]
        if not names:
            continue
        t0 = time.perf_counter()
        pols = list({vs[n][1].name: vs[n][1] for n, (grp, _, _) in vs.items()
                     if grp in ((g, "last") if g == "aware" else (g,))}.values())
        if g == "last":
            if aware is None:
                aware = kp.hf.score_context(model, prompt[:, :-1], pols, tokenizer=tok)
            sc, question = with_last_token(model, aware, prompt[:, -1:])
        else:
            ids, question = groups[g]
            sc = kp.hf.score_context(model, ids, pols, tokenizer=tok)
            if g == "aware":
                aware = sc
        rec["seconds"][g] = time.perf_counter() - t0
        full = sc.compress(policy="full").cache()
        for n in names:
            _, p, scope = vs[n]
            c = sc.compress(budget=args.budget, budget_scope=scope, policy=p)
            g_ids = c.generate(question, **er._gen_kwargs(tok, sample.refs, max_new))
            cut = 0 if g == "last" else question.shape[1]
            answer = tok.decode(g_ids[0, cut:], skip_special_tokens=True)
            rec["variants"][n] = {"answer": answer, "score": rt.score(answer, sample.refs),
                                  "kept": retention(full, c, pos)}
            print(f"{sample.task}#{sample.index} {n}: {rec['variants'][n]['score']:.2f} "
                  f"{answer[:40]!r} {rec['variants'][n]['kept']}", flush=True)
        del sc, full
    return rec


def table(data: dict) -> str:
    names = list(dict.fromkeys(n for r in data["records"] for n in r["variants"]))
    rows = ["| variant | score | value all | value mean | key all | others mean | samples |",
            "|---|---|---|---|---|---|---|"]
    for n in names:
        rs = [r["variants"][n] for r in data["records"] if n in r["variants"]]
        m = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        k = [x["kept"] for x in rs if x["kept"]]
        f = lambda g, a: m([x[g][a] for x in k if g in x])  # noqa: E731
        cells = [f"{100 * m([x['score'] for x in rs]):.0f}"] + (
            [f"{f('value', 'all'):.2f}", f"{f('value', 'mean'):.2f}", f"{f('key', 'all'):.2f}",
             f"{f('others', 'mean'):.2f}"] if k else ["n/a"] * 4)
        rows.append(f"| {n} | " + " | ".join(cells) + f" | {len(rs)} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--tasks", nargs="+", default=TASKS, choices=[t for t in rt.TASKS if t.startswith("niah")])
    ap.add_argument("--budget", type=float, default=0.16)
    ap.add_argument("--variants", nargs="+", default=None)
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--kernel-size", type=int, default=7)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    common.add_model_arg(ap)
    ap.add_argument("--out", type=Path, default=common.RESULTS / "ruler_probe.json")
    ap.add_argument("--table", type=Path, default=None, help="only print the table of an --out file")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    torch.set_num_threads(args.threads)
    model, tok = common.load_model("float32", args.model)
    vs = variants(args)
    samples = rt.make_samples(args.tasks, args.samples, tok, args.tokens, common.load_novels(), args.seed)
    data = {"meta": common.run_meta(), "args": common.args_dict(args), "records": []}
    for s in samples:
        data["records"].append(probe_sample(model, tok, s, vs, args))
        common.write_json(args.out, data)
    print(table(data))


if __name__ == "__main__":
    main()
