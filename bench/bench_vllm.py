#!/usr/bin/env python3
"""More requests in the same KV memory, inside vLLM: a burst of passkey requests through one
fixed KV pool, dense and with kvprune_cuda.vllm's snapkv at several budgets.

Runs in the vLLM environment (``bash scripts/setup_vllm_env.sh``)::

    .venv-vllm/bin/python bench/bench_vllm.py            # table + bench/results/vllm_concurrency.{json,png}
    .venv-vllm/bin/python bench/bench_vllm.py --decode snapkv --tokens 512 --gen 2048 \
        --max-held 256 512 1024 --out bench/results/vllm_decode.json   # long generations

Every setting serves the same requests (Qwen2.5-Coder-0.5B-Instruct or ``--model``, bf16; ~``--tokens``-token
prompts from Jane Austen with a 5-digit pass key at a random depth and the question at the
end; greedy, ``--gen`` tokens each with EOS ignored, so each request holds its memory for a
fixed number of decode steps) through a pool of ``--pool-requests`` dense requests' worth of
blocks (``num_gpu_blocks_override``), with vLLM's defaults for chunked prefill and prefix
caching (both on) and for the step's token budget. All requests arrive at t = 0; the loop drives
``LLMEngine.step()`` and reads vLLM's own scheduler state after each step (running and
waiting queues, KV-cache usage). "dense" is kvprune's policy "full" (same worker, same
CPU_ATTN "vec" layout, nothing evicted); "vllm" (``--plain``) is vLLM untouched.
Reported per setting: peak and time-weighted mean of running requests (over the whole burst,
and over the steps that started with requests waiting: what the pool sustains under load), generated tokens per
second over the whole burst, time to first token (includes queueing; p50 / p99), time per
output token after the first (p50 / p99 over requests), pass-key accuracy.

``--decode POLICY``: long generations instead: the prompt stays whole (policy "full") and the
decode-time rule compresses each request back to ``--max-held`` tokens every ``--interval``
generated tokens (one setting per value), beside dense.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

for _k, _v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_HOST_IP", "127.0.0.1"),
               ("HF_HUB_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "4")):
    os.environ.setdefault(_k, _v)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BLOCK = 32


def make_requests(tok, n_requests, n_tokens, seed):
    rng = random.Random(seed)
    novels = common.load_novels()
    reqs = []
    for _ in range(n_requests):
        key = str(rng.randrange(10000, 100000))
        depth = rng.uniform(0.1, 0.9)
        ctx, qst, _ = common.build_prompt(tok, novels, n_tokens, depth, key, rng)
        reqs.append((ctx[0].tolist() + qst[0].tolist(), key))
    return reqs


def run_setting(name, engine_kwargs, model_dir, reqs, args):
    import vllm
    from tqdm import tqdm

    prompt_blocks = -(-(max(len(p) for p, _ in reqs) + args.gen) // BLOCK)
    llm = vllm.LLM(model_dir, dtype=args.dtype, max_model_len=args.tokens + args.gen + 64,
                   enforce_eager=True, block_size=BLOCK, seed=0, max_num_seqs=args.max_num_seqs,
                   num_gpu_blocks_override=args.pool_requests * prompt_blocks + 1,
                   kv_cache_dtype=args.kv_cache_dtype,
                   tensor_parallel_size=args.tensor_parallel_size, **engine_kwargs)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    preemptions = []  # one entry per preemption (vLLM recomputes the request later)
    preempt = scheduler._preempt_request
    scheduler._preempt_request = lambda *a, **kw: (preemptions.append(1), preempt(*a, **kw))[1]
    params = vllm.SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    t0 = time.perf_counter()
    for i, (ids, _) in enumerate(reqs):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    first, done, end, timeline = {}, {}, {}, []
    bar = tqdm(total=len(reqs), desc=name, unit="req")
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - t0
        timeline.append((now, len(scheduler.running), len(scheduler.waiting),
                         scheduler.kv_cache_manager.usage))
        if len(timeline) % 256 == 0:
            bar.set_postfix_str(f"step {len(timeline)}, {now / len(timeline):.2f} s/step, "
                                f"{len(scheduler.running)} running", refresh=True)
        for o in outs:
            if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                done[o.request_id] = o.outputs[0].text
                end[o.request_id] = now
                bar.update(1)
    bar.close()
    makespan = time.perf_counter() - t0
    freed = getattr(scheduler, "kvprune_freed_blocks", None)
    pool = scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    del llm, engine, scheduler
    gc.collect()
    hits = [key in done[str(i)][:40] for i, (_, key) in enumerate(reqs)]
    ttft = [first[str(i)] for i in range(len(reqs))]
    tpot = [(end[str(i)] - first[str(i)]) / max(args.gen - 1, 1) for i in range(len(reqs))]
    return {
        "setting": name, "pool_blocks": pool, "freed_blocks": freed,
        "preemptions": len(preemptions),
        "peak_running": max(r for _, r, _, _ in timeline),
        "mean_running": mean_running(timeline),
        "mean_running_queued": mean_running_queued(timeline),
        "makespan_s": makespan, "gen_tok_per_s": len(reqs) * args.gen / makespan,
        "ttft_mean_s": sum(ttft) / len(ttft), "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99), "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "hits": sum(hits), "n": len(reqs), "timeline": timeline,
        "answers": [done[str(i)][:40] for i in range(len(reqs))],
    }


def mean_running(timeline):
    """Time-weighted mean of the running requests over the burst (each step weighted by its
    duration, with the count it started from)."""
    weighted = sum((t1 - t0) * run for (t0, run, _, _), (t1, _, _, _)
                   in zip([(0.0, 0, 0, 0.0)] + timeline[:-1], timeline))
    return weighted / timeline[-1][0]


def mean_running_queued(timeline):
    """Time-weighted mean of the running requests over the steps that left requests waiting
    (each with the count it ended with): the concurrency the pool sustains while demand
    exceeds it. None when no step left a request waiting."""
    total = weighted = 0.0
    for (t0, _, _, _), (t1, run, wait, _) in zip([(0.0, 0, 0, 0.0)] + timeline[:-1], timeline):
        if wait > 0:
            total += t1 - t0
            weighted += (t1 - t0) * run
    return weighted / total if total else None


def percentile(values, q):
    """The q-th percentile (linear interpolation between the closest ranks)."""
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in results:
        t = [0.0] + [p[0] for p in r["timeline"]]
        run = [0] + [p[1] for p in r["timeline"]]
        use = [0.0] + [100 * p[3] for p in r["timeline"]]
        ax1.step(t, run, where="post", label=r["setting"])
        ax2.step(t, use, where="post", label=r["setting"])
    ax1.set(xlabel="time since the burst arrived (s)", ylabel="running requests",
            title="requests running in one KV pool")
    ax2.set(xlabel="time since the burst arrived (s)", ylabel="KV pool in use (%)",
            title="vLLM KV-cache usage")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results, meta):
    dense = next((r for r in results if r["setting"] == "dense"), None)
    ratio = lambda a, b: "-" if dense is None or a is None or not b else f"{a / b:.2f}"  # noqa: E731
    lines = [f"Machine: {meta['machine']}; vLLM {meta['vllm']} (chunked prefill and prefix "
             f"caching on); {meta['dtype']}, KV cache "
             f"{meta.get('kv_cache_dtype', 'auto')}, TP={meta.get('tensor_parallel_size', 1)}; "
             f"commit {meta['commit']}",
             f"{meta['n']} requests of {meta['prompt_tokens']} prompt tokens + {meta['gen']} "
             f"generated; pool {results[0]['pool_blocks']} blocks of {BLOCK} "
             f"(= {meta['pool_requests']} dense requests)", "",
             "| setting | peak running | mean running | mean running while queued | "
             "x dense (queued) | x dense (peak) | gen tok/s | "
             "x dense | TTFT p50 / p99 (s) | TPOT p50 / p99 (s) | makespan (s) | blocks freed "
             "| preemptions | pass key |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        r.setdefault("mean_running_queued", mean_running_queued(r["timeline"]))
    for r in results:
        lines.append(
            f"| {r['setting']} | {r['peak_running']} | {r['mean_running']:.1f} | "
            f"{'-' if r['mean_running_queued'] is None else round(r['mean_running_queued'], 1)} | "
            f"{ratio(r['mean_running_queued'], dense and dense['mean_running_queued'])} | "
            f"{ratio(r['peak_running'], dense and dense['peak_running'])} | "
            f"{r['gen_tok_per_s']:.2f} | "
            f"{ratio(r['gen_tok_per_s'], dense and dense['gen_tok_per_s'])} | "
            f"{r['ttft_p50_s']:.0f} / {r['ttft_p99_s']:.0f} | {r['tpot_p50_s']:.2f} / "
            f"{r['tpot_p99_s']:.2f} | {r['makespan_s']:.0f} | {r['freed_blocks'] or 0} | "
            f"{r['preemptions']} | {r['hits']}/{r['n']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=72)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens per request")
    ap.add_argument("--gen", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--pool-requests", type=int, default=12,
                    help="KV pool size, in dense requests (prompt + gen)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.16, 0.2])
    ap.add_argument("--max-num-seqs", type=int, default=96)
    ap.add_argument("--decode", choices=["streaming", "snapkv", "h2o"],
                    help="benchmark decode-time compression (long generations) instead")
    ap.add_argument("--max-held", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--dtype", default="float32",
                    help="model and KV dtype (float32: bf16 runs ~6x slower on CPUs without "
                         "AVX-512 BF16)")
    common.add_model_arg(ap)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                    help="vLLM's kv_cache_dtype for every setting (fp8 on the CPU backend needs "
                         "AVX-512 or AMX)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="vLLM ranks (CPU: one core each, VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--plain", action="store_true", help="also run vLLM without kvprune")
    ap.add_argument("--no-dense", action="store_true",
                    help="skip the dense run (the x dense columns then read '-')")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=common.RESULTS / "vllm_concurrency" / "main.json")
    ap.add_argument("--table", type=Path, metavar="FILE",
                    help="only print the table of an earlier --out file")
    args = ap.parse_args()
    if args.table:
        saved = json.loads(args.table.read_text())
        print(table(saved["results"], saved["meta"]))
        return

    import torch
    import vllm
    from transformers import AutoTokenizer

    import kvprune_cuda as kp

    torch.set_num_threads(common.threads())
    model_dir = str(common.model_dir(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    reqs = make_requests(tok, args.requests, args.tokens, args.seed)
    settings = [("vllm", {})] if args.plain else []
    if not args.no_dense:
        settings += [("dense", kp.vllm.engine_args("full"))]
    if args.decode:
        settings += [(f"{args.decode} held {m}",
                      kp.vllm.engine_args("full", decode=args.decode, max_held=m,
                                          interval=args.interval)) for m in args.max_held]
    else:
        settings += [(f"snapkv {round(b * 100)} %", kp.vllm.engine_args("snapkv", b))
                     for b in args.budgets]
    results = [run_setting(name, kw, model_dir, reqs, args) for name, kw in settings]
    meta = {**common.run_meta(), "vllm": vllm.__version__, "model": args.model,
            "n": len(reqs), "prompt_tokens": round(sum(len(p) for p, _ in reqs) / len(reqs)),
            "gen": args.gen, "pool_requests": args.pool_requests, "dtype": args.dtype,
            "kv_cache_dtype": args.kv_cache_dtype,
            "tensor_parallel_size": args.tensor_parallel_size}
    text = table(results, meta)
    print(text)
    common.write_json(args.out, {"meta": meta, "results": results})
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
