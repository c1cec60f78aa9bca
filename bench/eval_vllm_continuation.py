#!/usr/bin/env python3
"""Long greedy continuations inside vLLM under each decode-time rule, against the full cache.

Runs in the vLLM environment (``bash scripts/setup_vllm_env.sh``)::

    .venv-vllm/bin/python bench/eval_vllm_continuation.py      # table + bench/results/vllm_continuation.json

Each prompt is ``--tokens`` tokens of a Jane Austen novel (random offsets, seeded; plain text,
no chat template); vLLM (its defaults, fp32, Qwen2.5-Coder-0.5B-Instruct or ``--model``) continues it
greedily (or sampled at ``--temperature``, prompt i from seed ``--seed + i`` in every setting)
for ``--gen`` tokens with EOS ignored, once with the full cache
(``kp.vllm.engine_args("full")``) and once per decode-time rule and ``--max-held``
(``engine_args("full", decode=POLICY, max_held=M, interval=--interval)``: the prompt stays
whole, the cache is compressed back to M tokens every ``interval`` generated tokens). All
prompts of a setting run in one engine. Reported per setting, averaged over the prompts:

* agreement: generated tokens equal to the full cache's before the first difference;
* repeated 4-grams: the fraction of the continuation's 4-grams that already occurred earlier
  in it (a degenerate loop drives it towards 1; the full cache's own rate is the yardstick).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
from pathlib import Path

for _k, _v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_HOST_IP", "127.0.0.1"),
               ("HF_HUB_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "4")):
    os.environ.setdefault(_k, _v)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens of ``a`` equal to ``b``'s before the first difference."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def repeated_ngrams(tokens: list[int], n: int = 4) -> float:
    """The fraction of the n-grams of ``tokens`` that occurred earlier in it."""
    seen, repeated = set(), 0
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated / max(len(grams), 1)


def make_prompts(tok, count: int, n_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    novels = common.load_novels()
    prompts = []
    for _ in range(count):
        text = novels[sorted(novels)[rng.randrange(len(novels))]]
        start = rng.randrange(0, len(text) - 8 * n_tokens)
        ids = tok(" ".join(text[start : start + 8 * n_tokens].split()),
                  add_special_tokens=False).input_ids
        prompts.append(ids[:n_tokens])
    return prompts


def generate(model_dir: str, prompts, engine_kwargs, args) -> list[list[int]]:
    import vllm

    llm = vllm.LLM(model_dir, dtype=args.dtype, max_model_len=args.tokens + args.gen + 64,
                   enforce_eager=True, block_size=32, seed=0, **engine_kwargs)
    params = [vllm.SamplingParams(temperature=args.temperature, max_tokens=args.gen,
                                  ignore_eos=True, seed=args.seed + i)
              for i in range(len(prompts))]  # sampled: prompt i from seed + i in every setting
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs]


def table(rows: list[dict], meta: dict) -> str:
    lines = [f"Machine: {meta['machine']}; vLLM {meta['vllm']}; {meta['dtype']}; commit "
             f"{meta['commit']}; {meta['prompts']} prompts of {meta['tokens']} tokens, "
             f"{meta['gen']} generated each ({'greedy' if not meta['temperature'] else 'temperature ' + str(meta['temperature'])}, "
             f"EOS ignored), interval {meta['interval']}",
             "",
             "| setting | agreement with full (tokens, mean / min) | repeated 4-grams |",
             "|---|---|---|"]
    for r in rows:
        agree = r["agreement"]
        lines.append(f"| {r['setting']} | {sum(agree) / len(agree):.0f} / {min(agree)} | "
                     f"{sum(r['repeated']) / len(r['repeated']):.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=1024, help="generated tokens per prompt")
    ap.add_argument("--policies", nargs="+", default=["streaming", "snapkv", "h2o"],
                    choices=["streaming", "snapkv", "h2o"])
    ap.add_argument("--max-held", type=int, nargs="+", default=[512])
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    common.add_model_arg(ap)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (the default); > 0: sampled, no top-p / top-k")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=common.RESULTS / "vllm_continuation.json")
    args = ap.parse_args()

    import torch
    import vllm
    from transformers import AutoTokenizer

    import kvprune_cuda as kp

    torch.set_num_threads(common.threads())
    model_dir = str(common.model_dir(args.model))
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), args.prompts, args.tokens,
                           args.seed)
    full = generate(model_dir, prompts, kp.vllm.engine_args("full"), args)
    rows = [{"setting": "full", "agreement": [len(f) for f in full],
             "repeated": [repeated_ngrams(f) for f in full], "tokens": full}]
    for policy in args.policies:
        for m in args.max_held:
            got = generate(model_dir, prompts,
                           kp.vllm.engine_args("full", decode=policy, max_held=m,
                                               interval=args.interval), args)
            rows.append({"setting": f"{policy} held {m}",
                         "agreement": [agreement(g, f) for g, f in zip(got, full)],
                         "repeated": [repeated_ngrams(g) for g in got], "tokens": got})
            print(rows[-1]["setting"], rows[-1]["agreement"], flush=True)
    meta = {**common.run_meta(), "vllm": vllm.__version__, "model": args.model,
            "prompts": args.prompts,
            "tokens": args.tokens, "gen": args.gen, "interval": args.interval,
            "dtype": args.dtype, "temperature": args.temperature}
    print(table(rows, meta))
    common.write_json(args.out, {"meta": meta, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
