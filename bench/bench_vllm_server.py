#!/usr/bin/env python3
"""vLLM's OpenAI server as operators run it, dense and with kvprune_cuda.vllm, over HTTP.

Runs in the vLLM environment (``bash scripts/setup_vllm_env.sh``)::

    .venv-vllm/bin/python bench/bench_vllm_server.py      # table + bench/results/vllm_server.json

For each ``--modes`` entry ("compile": vLLM's default torch.compile; "eager":
``--enforce-eager``) and each ``--settings`` entry ("dense": vLLM's server untouched; "snapkv":
the same server with ``kp.vllm.server_args("snapkv", --budget)``; "snapkv-bounded": with the
bounded-peak prefill too, ``prefill_max_held`` = ``--prefill-held`` x the budget's tokens of
a ``--tokens`` prompt), one server
(``python -m vllm.entrypoints.openai.api_server``, its engine core and worker in processes of
their own, chunked prefill and prefix caching on) with a KV pool of ``--pool-requests`` dense
requests' worth of blocks serves the same passkey requests (bench_vllm.py's: Qwen2.5-Coder-0.5B-
Instruct or ``--model``, ~``--tokens`` prompt tokens, greedy, ``--gen`` tokens each, EOS ignored), sent as
streamed ``/v1/completions`` by one client thread per request, in two workloads: a burst (all
at t = 0) and Poisson arrivals at ``--rate`` requests/s (seeded). Reported per run:
requests/s and output tokens/s over the run, TTFT and TPOT (p50 / p99), peak and
time-weighted mean of ``vllm:num_requests_running`` polled from ``/metrics`` every 0.2 s,
preemptions (``vllm:num_preemptions_total`` over the run), and pass keys right (per request,
with each needle's depth in the result file). Before the runs, each server answers one short
warm-up request of its own (not one of the measured prompts: a measured prompt would then be
a prefix-cache hit on the dense server, and costs a whole prefill at long prompts).

``--workloads abort`` (kvprune settings): a burst whose first clients close their connection
mid-prefill (after two bounded compressions; snapkv-bounded only), right after the first token
and mid-decode (``server_client.py``); reported: each abort's phase, the compressions the server
made for it before and after, the pass keys of the requests that stayed, and the pool after the
last request (the scheduler's idle line: every block free, or blocks lost).

``--pool-requests`` may be a fraction (a pool smaller than one dense request: prompts longer
than the pool, which only a bounded prefill with a decode-time rule, ``--decode``, serves).
Per kvprune run, the blocks each request held over time, from the server's own kvprune lines
(one per compression: the blocks before and after it; :func:`block_trace`), go into the
result file; ``--trace LOG`` plots such a trace from a server log
(``<out>_<mode>_<setting>.log``) to ``LOG``'s name with ``.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import server_client  # noqa: E402
from bench_vllm import BLOCK, make_requests, percentile  # noqa: E402


def metric(server, name: str) -> float:
    """The value of vLLM's metric ``name`` (a gauge, or a counter's ``_total``), from the
    server's ``/metrics`` (KeyError if it has none)."""
    with urllib.request.urlopen(server.url("/metrics"), timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} is not in {server.url('/metrics')}")


def workload(server, reqs, gen, arrivals, tag):
    """Sends ``reqs`` at ``arrivals`` (s after the start), request i as ``X-Request-Id``
    ``<tag><i>``; polls the running count meanwhile."""
    t0 = time.perf_counter()
    records = [dict() for _ in reqs]
    polls, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            polls.append((time.perf_counter() - t0, metric(server, "vllm:num_requests_running")))
            time.sleep(0.2)

    preempted = metric(server, "vllm:num_preemptions_total")

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    threads = []
    for i, ((ids, _), at, rec) in enumerate(zip(reqs, arrivals, records)):
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=server_client.streamed_request,
                              args=(server, ids, gen, f"{tag}{i}", t0, rec))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    makespan = time.perf_counter() - t0
    stop.set()
    poller.join()
    preempted = metric(server, "vllm:num_preemptions_total") - preempted
    hit = [key in r["text"][:40] for (_, key), r in zip(reqs, records)]
    ttft = [r["first"] - r["arrival"] for r in records]
    tpot = [(r["last"] - r["first"]) / max(gen - 1, 1) for r in records]
    weighted = sum((t1 - t0_) * run for (t0_, run), (t1, _) in zip(polls, polls[1:]))
    return {"makespan_s": makespan, "req_per_s": len(reqs) / makespan,
            "out_tok_per_s": len(reqs) * gen / makespan,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            "peak_running": max(run for _, run in polls),
            "mean_running": weighted / max(polls[-1][0] - polls[0][0], 1e-9),
            "preemptions": int(preempted),
            "hit": hit, "hits": sum(hit),
            "n": len(reqs)}


TRACE_LINE = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d) \[scheduler\.py:\d+\] kvprune_cuda: request "
                        r"(\S+) keeps (\d+) of (\d+) tokens, (\d+) blocks freed")


def block_trace(log_text: str) -> dict:
    """Per request (vLLM's id), from the server log's kvprune lines: [seconds since the first
    line, blocks held before the compression, after it, tokens kept, positions computed]."""
    trace: dict = {}
    t0 = None
    for stamp, req, kept, positions, freed in TRACE_LINE.findall(log_text):
        t = time.mktime(time.strptime("2000-" + stamp, "%Y-%m-%d %H:%M:%S"))
        t0 = t if t0 is None else t0
        after = -(-int(kept) // BLOCK)
        trace.setdefault(req, []).append([t - t0, after + int(freed), after, int(kept),
                                          int(positions)])
    return trace


STEP_LINE = re.compile(r"kvprune_cuda: step \d+ compressed \d+ request\(s\): kvprune ([\d.]+) ms "
                       r"of the step's ([\d.]+) ms forward")
IDLE_SECONDS = re.compile(r"kvprune's own work took ([\d.]+) s of ([\d.]+) s of forwards")


def compression_cost(log_text: str) -> dict:
    """What kvprune's own work (scoring, selecting, compacting) cost the server's forwards,
    from the worker's timing in the server log: per compressing step, its share of that
    step's forward (p50, p99, and summed over those steps); over whole busy periods (every
    step, the decode steps between compressions too), the idle lines' totals."""
    steps = [(float(own), float(fwd)) for own, fwd in STEP_LINE.findall(log_text)]
    busy = [(float(own), float(fwd)) for own, fwd in IDLE_SECONDS.findall(log_text)]
    shares = [100 * own / fwd for own, fwd in steps if fwd > 0]
    own_ms, fwd_ms = sum(s[0] for s in steps), sum(s[1] for s in steps)
    own_s, fwd_s = sum(b[0] for b in busy), sum(b[1] for b in busy)
    return {"compressing_steps": len(steps),
            "step_share_p50_pct": percentile(shares, 50) if shares else None,
            "step_share_p99_pct": percentile(shares, 99) if shares else None,
            "compressing_steps_share_pct": 100 * own_ms / fwd_ms if fwd_ms else None,
            "busy_kvprune_s": own_s, "busy_forward_s": fwd_s,
            "busy_share_pct": 100 * own_s / fwd_s if fwd_s else None}


def plot_trace(trace: dict, path: Path, title: str) -> None:
    """Blocks held per request against time (a step line through before / after each
    compression)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for points in trace.values():
        xs, ys = [], []
        for t, before, after, _, _ in points:
            xs += [t, t]
            ys += [before, after]
        ax.plot(xs, ys, lw=1)
    ax.set_xlabel("seconds (server log clock)")
    ax.set_ylabel("blocks held (before / after each compression)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows, meta):
    lines = [f"Machine: {meta['machine']}; vLLM {meta['vllm']} OpenAI server (engine core and "
             f"worker in their own processes; chunked prefill, prefix caching on); "
             f"{meta['dtype']}; commit {meta['commit']}",
             f"{meta['n']} requests of {meta['prompt_tokens']} prompt tokens + {meta['gen']} "
             f"generated; pool {meta['pool_blocks']} blocks of {BLOCK} (= "
             f"{meta['pool_requests']} dense requests); Poisson rate {meta['rate']}/s"]
    if any(r["workload"] != "abort" for r in rows):
        lines += ["", "| mode | setting | workload | peak running | x dense | mean running | "
                  "req/s | out tok/s | x dense | TTFT p50 / p99 (s) | TPOT p50 / p99 (s) | "
                  "preemptions | pass key |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    dense = {(r["mode"], r["workload"]): r for r in rows if r["setting"] == "dense"}
    for r in rows:
        if r["workload"] == "abort":
            continue
        d = dense.get((r["mode"], r["workload"]))
        x = lambda k: f"{r[k] / d[k]:.2f}" if d and d[k] else "-"  # noqa: E731
        lines.append(
            f"| {r['mode']} | {r['setting']} | {r['workload']} | {r['peak_running']:.0f} | "
            f"{x('peak_running')} | {r['mean_running']:.1f} | {r['req_per_s']:.3f} | "
            f"{r['out_tok_per_s']:.2f} | {x('out_tok_per_s')} | {r['ttft_p50_s']:.1f} / "
            f"{r['ttft_p99_s']:.1f} | {r['tpot_p50_s']:.3f} / {r['tpot_p99_s']:.3f} | "
            f"{r.get('preemptions', '-')} | {r['hits']}/{r['n']} |")
    for r in rows:
        c = r.get("compression_cost")
        if c and c["compressing_steps"] and c["busy_share_pct"] is not None:
            lines.append(
                f"\n{r['mode']} {r['setting']} {r['workload']}: kvprune's own work (worker "
                f"timing) {c['busy_share_pct']:.2f} % of {c['busy_forward_s']:.1f} s of "
                f"forwards; per compressing step ({c['compressing_steps']}) p50 "
                f"{c['step_share_p50_pct']:.2f} %, p99 {c['step_share_p99_pct']:.2f} %")
    for r in rows:
        if r["workload"] == "abort":
            left = "; ".join(f"{a['aborted']} (after {a['compressions_at_abort']} "
                             f"compression(s) and {a['tokens']} token(s); "
                             f"{a['compressions_after_abort']} after)" for a in r["aborts"])
            lines.append(f"\n{r['mode']} {r['setting']} abort: clients left at {left}; "
                         f"{r['hits']}/{r['stayed']} pass keys of those that stayed; pool after: "
                         f"{r['pool']['free_blocks']} of {r['pool']['usable_blocks']} blocks "
                         f"free ({'whole' if r['pool']['whole'] else 'BLOCKS LOST'})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=36)
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--gen", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--pool-requests", type=float, default=4,
                    help="the KV pool in dense requests (a fraction: smaller than one)")
    ap.add_argument("--budget", type=float, default=0.16)
    ap.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second")
    ap.add_argument("--modes", nargs="+", default=["compile", "eager"],
                    choices=["compile", "eager"])
    ap.add_argument("--workloads", nargs="+", default=["burst", "poisson"],
                    choices=["burst", "poisson", "abort"],
                    help="abort (kvprune settings): a burst whose first clients leave mid-"
                         "prefill, after the first token and mid-decode (server_client.py)")
    ap.add_argument("--settings", nargs="+", default=["dense", "snapkv"],
                    choices=["dense", "snapkv", "snapkv-bounded"])
    ap.add_argument("--prefill-held", type=float, default=2.0,
                    help="snapkv-bounded: prefill_max_held as a multiple of the budget's tokens")
    ap.add_argument("--decode", default=None, help="decode-time rule of the kvprune settings")
    ap.add_argument("--max-held", type=int, default=None)
    ap.add_argument("--interval", type=int, default=None)
    ap.add_argument("--trace", type=Path, default=None,
                    help="only plot the block trace of this server log")
    ap.add_argument("--dtype", default="float32")
    common.add_model_arg(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=common.RESULTS / "vllm_server.json")
    args = ap.parse_args()
    if args.trace:
        trace = block_trace(args.trace.read_text())
        plot_trace(trace, args.trace.with_suffix(".png"), args.trace.name)
        common.write_json(args.trace.with_suffix(".trace.json"), trace)
        print(f"{len(trace)} requests; peak blocks per request "
              f"{max(p[1] for ps in trace.values() for p in ps)}; wrote "
              f"{args.trace.with_suffix('.png')}")
        return
    common.run_meta()  # the machine line (threads) as the run starts, before vLLM loads

    import vllm
    from transformers import AutoTokenizer

    import kvprune_cuda as kp
    from kvprune_cuda.vllm.serve import ServerProcess

    model_dir = str(common.model_dir(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    reqs = make_requests(tok, args.requests, args.tokens, args.seed)
    warmup = make_requests(tok, 1, min(args.tokens, 512), args.seed + 1)
    texts = [tok.decode(ids) for ids, _ in reqs]
    depths = [round(text.find(key) / len(text), 3) for text, (_, key) in zip(texts, reqs)]
    rng = random.Random(args.seed)
    poisson, t = [], 0.0
    for _ in reqs:
        poisson.append(t)
        t += rng.expovariate(args.rate)
    arrivals = {"burst": [0.0] * len(reqs), "poisson": poisson}
    prompt_blocks = -(-(max(len(p) for p, _ in reqs) + args.gen) // BLOCK)
    pool = int(args.pool_requests * prompt_blocks) + 1
    common_flags = ["--served-model-name", "m", "--dtype", args.dtype, "--block-size", str(BLOCK), "--seed", "0",
                    "--max-model-len", str(args.tokens + args.gen + 64),
                    "--num-gpu-blocks-override", str(pool), "--max-num-seqs", "96"]
    bound = int(args.prefill_held * kp.policy.resolve_budget(args.budget, args.tokens))
    rule = dict(decode=args.decode, max_held=args.max_held, interval=args.interval)
    settings = {"dense": [], "snapkv": kp.vllm.server_args("snapkv", args.budget, **rule),
                "snapkv-bounded": kp.vllm.server_args("snapkv", args.budget,
                                                      prefill_max_held=bound, **rule)}
    settings = {name: settings[name] for name in args.settings}
    rows = []
    for mode in args.modes:
        for name, flags in settings.items():
            log = args.out.with_name(f"{args.out.stem}_{mode}_{name}.log")
            server = ServerProcess(model_dir, common_flags + flags
                                   + (["--enforce-eager"] if mode == "eager" else []), log,
                                   env={"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1"})
            try:
                server.wait_ready(900)
                # one warm-up request (compilation of new shapes is not measured)
                workload(server, warmup, 4, [0.0], "warmup-")
                for wl in args.workloads:
                    seen = len(server.text())  # the log of this workload's requests only
                    if wl == "abort" and not flags:
                        print(f"{mode} {name}: no abort workload (the pool is read off "
                              "kvprune's idle line)", flush=True)
                        continue
                    if wl == "abort":
                        phases = [p for p in server_client.PHASES
                                  if p != "prefill" or name == "snapkv-bounded"]
                        rows.append({"mode": mode, "setting": name, "workload": wl,
                                     "phases": phases, **server_client.abort_workload(
                                         server, reqs, args.gen, phases, f"{mode}-{name}-")})
                        print(json.dumps(rows[-1]), flush=True)
                        continue
                    result = workload(server, reqs, args.gen, arrivals[wl], f"{mode}-{name}-{wl}-")
                    rows.append({"mode": mode, "setting": name, "workload": wl, **result})
                    if flags:
                        rows[-1]["block_trace"] = block_trace(server.text()[seen:])
                        rows[-1]["compression_cost"] = compression_cost(server.text()[seen:])
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                server.stop()
    meta = {**common.run_meta(), "vllm": vllm.__version__, "model": args.model, "n": len(reqs),
            "prompt_tokens": args.tokens, "gen": args.gen, "pool_blocks": pool,
            "pool_requests": args.pool_requests, "rate": args.rate, "dtype": args.dtype,
            "prefill_max_held": bound if "snapkv-bounded" in settings else None,
            "decode": rule,
            "needle_depths": depths}
    print(table(rows, meta))
    common.write_json(args.out, {"meta": meta, "args": common.args_dict(args), "rows": rows})


if __name__ == "__main__":
    main()
