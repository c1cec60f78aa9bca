#!/usr/bin/env python3
"""Query-agnostic signals that need no reconstruction: do they single out the needles?

For RULER-style needle samples (``ruler_tasks.py``) the context is prefilled once, and two
per-token signals are read off that prefill:

* surprisal: the model's negative log-probability of each context token given the tokens
  before it (a needle's random key and value are unpredictable; prose mostly is not);
* key novelty (KeyDiff): per layer and KV head, minus the cosine between a key and the
  head's mean unit key (``kp.policy.novelty.key_novelty``; a key unlike the others scores high).

Per needle group (the asked needle's value and key tokens, as ``ruler_probe.py`` finds them)
it reports where the group's tokens rank: surprisal's mean percentile (0 = the most
surprising token) and the fraction of the group within the top ``budget`` of the context;
key novelty's mean fraction kept by a top-``budget`` selection per (layer, head) and the
fraction of (layer, head) pairs keeping all of them -- the numbers ``ruler_probe.py``
reports for the policies (kvzip-head at 16 % on niah_multivalue: 0.17 and 0.10).

    .venv/bin/python bench/ruler_signals.py --samples 3 --tasks niah_multivalue niah_multiquery niah_multikey_2 \\
        --out bench/results/ruler_4k/signals.json

(``--model``: a model of scripts/fetch_model.py, default the 0.5B; the file's args name it.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import ruler_probe as rp  # noqa: E402
import ruler_tasks as rt  # noqa: E402

from kvprune_cuda.policy.novelty import key_novelty  # noqa: E402


def surprisal(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fp32 [n]: -log p(ids[t] | ids[:t]) from the prefill's ``logits`` [1, n, V] (0 for the
    first token), computed in slices of 512 positions."""
    n = ids.shape[1]
    out = torch.zeros(n)
    for s in range(0, n - 1, 512):
        e = min(s + 512, n - 1)
        lp = torch.log_softmax(logits[0, s:e].float(), -1)
        out[s + 1:e + 1] = -lp.gather(1, ids[0, s + 1:e + 1, None])[:, 0]
    return out


def sample_signals(model, tok, sample, budget: float) -> dict:
    ctx, _ = rt.prompt_ids(tok, sample)
    pre, _ = rt.template_parts(tok)
    text = pre + sample.context
    pos = rp.token_spans(tok, text, ctx, rp.needle_spans(sample, text))
    with torch.no_grad():
        out = model(input_ids=ctx, use_cache=True)
    n = ctx.shape[1]
    top = max(1, int(round(budget * n)))
    nll = surprisal(out.logits, ctx)
    rank = nll.argsort(descending=True).argsort().float() / n
    novel = []  # per layer, bool [Hkv, n]: the top-budget novelty selection of each head
    for layer in out.past_key_values.layers:
        s = key_novelty(layer.keys)[0]  # keys [1, Hkv, n, D] -> [Hkv, n]
        novel.append(s >= s.topk(top, -1).values[:, -1:])
    novel = torch.stack(novel)  # [L, Hkv, n]
    rec = {"task": sample.task, "index": sample.index, "tokens": n, "groups": {}}
    for g in ("value", "key"):
        p = pos.get(g) or []
        if not p:
            continue
        kept = novel[:, :, p].float()  # [L, Hkv, len]
        rec["groups"][g] = {"tokens": len(p),
                            "surprisal_rank": float(rank[p].mean()),
                            "surprisal_top": float((rank[p] < budget).float().mean()),
                            "novelty_mean": float(kept.mean()),
                            "novelty_all": float(kept.all(-1).float().mean())}
    print(sample.task, sample.index, rec["groups"], flush=True)
    return rec


def table(data: dict) -> str:
    rows = ["| task | group | tokens | surprisal rank | in surprisal top | novelty kept (mean) | "
            "novelty kept (all) | samples |", "|---|---|---|---|---|---|---|---|"]
    tasks = list(dict.fromkeys(r["task"] for r in data["records"]))
    for t in tasks:
        for g in ("value", "key"):
            rs = [r["groups"][g] for r in data["records"] if r["task"] == t and g in r["groups"]]
            if not rs:
                continue
            m = lambda f: sum(x[f] for x in rs) / len(rs)  # noqa: E731
            rows.append(f"| {t} | {g} | {m('tokens'):.0f} | {m('surprisal_rank'):.2f} | "
                        f"{m('surprisal_top'):.2f} | {m('novelty_mean'):.2f} | "
                        f"{m('novelty_all'):.2f} | {len(rs)} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--tasks", nargs="+", default=["niah_multivalue", "niah_multiquery"],
                    choices=[t for t in rt.TASKS if t.startswith("niah")])
    ap.add_argument("--budget", type=float, default=0.16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    common.add_model_arg(ap)
    ap.add_argument("--out", type=Path, default=common.RESULTS / "ruler_signals.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = common.load_model("float32", args.model)
    samples = rt.make_samples(args.tasks, args.samples, tok, args.tokens, common.load_novels(), args.seed)
    data = {"meta": common.run_meta(), "args": common.args_dict(args), "records": []}
    for s in samples:
        data["records"].append(sample_signals(model, tok, s, args.budget))
        common.write_json(args.out, data)
    print(table(data))


if __name__ == "__main__":
    main()
