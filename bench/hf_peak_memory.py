#!/usr/bin/env python3
"""Peak memory of one real prefill under ``kp.hf``: full cache against compressed, per length.

``kp.hf.compress`` compresses each layer right after that layer's prefill forward, so its KV
high-water mark should be one layer's full K/V plus the compressed rest; this measures what the
whole process reaches. For each ``--tokens`` length and each ``--settings`` entry, ONE prefill
of a passkey prompt (``common.build_prompt``, as bench_hf_prefill.py builds it) runs in a FRESH
subprocess (peak RSS is a per-process high-water mark), under ``torch.no_grad``:

* ``full``: ``model(input_ids=ids, use_cache=True, logits_to_keep=1)``, no hooks;
* ``snapkv``: the same inside ``kp.hf.compress(model, "snapkv", --budget)`` (the library's
  default policy and options);
* ``snapkv-bounded``: ``snapkv`` with the bounded-peak prefill,
  ``prefill_max_held`` = ``BOUND_FACTOR`` x the budget's tokens, ``prefill_chunk`` =
  ``BOUND_CHUNK`` (the prompt prefilled in chunks, each layer compressed back to the bound after
  every chunk that leaves more);
* ``snapkv-bounded-recon``: ``snapkv-bounded`` ranking the held tokens by a repetition of each
  chunk (``prefill_signal="reconstruct"``, the tokenizer's repeat prompt): the compression
  waits for the repetition, so every layer holds the bound, the chunk and its repetition;
* ``kvzip``: ``kp.hf.compress_context(model, ids, "kvzip", --budget)`` (the query-agnostic
  path: prefill, reconstruction forwards on the uncompressed cache, then compression);
* ``full+logits`` / ``snapkv+logits``: ``full`` / ``snapkv`` without ``logits_to_keep``, i.e.
  every position's logits, as bench_hf_prefill.py's ``model(input_ids=ids, use_cache=True)``
  computes them. ``generate`` passes ``logits_to_keep=1`` to its prefill (transformers'
  ``_supports_logits_to_keep``), and ``compress_context`` runs the base model (no LM head),
  which is why the plain rows keep only the last position's logits;
* ``full+modules``: ``full`` with a peak per module: hooks around every layer's ``self_attn``
  and ``mlp`` reset VmHWM on entry and read it on exit (the module's peak above the resident
  size it started from, its output included; the maximum over layers), the whole prefill's
  peak kept as the maximum of the readings taken before each reset.

Per row: the prefill's peak resident bytes above the resident size just before it
(``common.cpu_peak_extra_bytes``: VmHWM reset through /proc/self/clear_refs, the child run with
``MALLOC_MMAP_THRESHOLD_`` so freed buffers leave the RSS), the bytes still resident once the
call's output is freed but its cache kept, the bytes the cache holds (``kp.hf.kv_bytes``, plus
the compressor's own state ``comp.nbytes``; kvzip: ``CompressedContext.nbytes``), the dense K/V
by hand (``layers * 2 * kv_heads * n * head_dim * bytes``), the analytic KV high-water mark of
a layer-by-layer compression (one layer's full K/V + the other layers compressed), the prefill
seconds, the model's weight bytes and the child's lifetime peak RSS (``wait4``'s ru_maxrss, load
included), the resident anonymous and file-backed bytes before and after, and kvprune's cached
per-thread CPU workspace (``kp.cpu_workspace_bytes``). A short warm-up prefill (same setting,
``--warmup`` tokens) first touches every weight and loads the kernels, so neither counts in the
peak; then the file-backed mappings are locked (``mlock2(MLOCK_ONFAULT)``: the libraries' pages
stay resident, anonymous memory is left alone), or the kernel, short of memory, may drop
library pages mid-prefill and lower the RSS the peak is read from.

Rows are appended to ``--out`` after each one; rows already there (same model, tokens, setting,
budget, dtype, threads) are skipped, so an interrupted run resumes. Usage::

    .venv/bin/python bench/hf_peak_memory.py                       # 8k 16k 32k x full snapkv
    .venv/bin/python bench/hf_peak_memory.py --settings kvzip full+logits --tokens 8192
    .venv/bin/python bench/hf_peak_memory.py --table               # the table of --out
    .venv/bin/python bench/hf_peak_memory.py --plot                # --out -> peak.png
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

OUT = common.RESULTS / "hf_peak_memory" / "peak.json"
SETTINGS = ("full", "snapkv", "snapkv-bounded", "snapkv-bounded-recon", "kvzip", "full+logits",
            "snapkv+logits", "full+modules")
BOUND_FACTOR, BOUND_CHUNK = 2, 2048  # snapkv-bounded: prefill_max_held = 2 x the budget
DEFAULT_MODEL = getattr(common, "DEFAULT_MODEL", "qwen2.5-coder-0.5b-instruct")
TINY = "tiny"  # eval_ruler.tiny_model: a random 2-layer Qwen2, random ids (tests; no download)
MMAP_THRESHOLD = str(64 * 1024)  # glibc: allocations from 64 KiB get their own mapping
KEY = ("model", "tokens_requested", "setting", "budget", "dtype", "threads")
MiB = 2 ** 20


# ---------------------------------------------------------------------------------------------
# the child: one prefill
# ---------------------------------------------------------------------------------------------


def load_model_kw() -> bool:
    """Whether ``common.load_model`` takes ``model=`` (a model other than the 0.5B)."""
    return "model" in inspect.signature(common.load_model).parameters


def load(spec: dict):
    """(model, tokenizer or None, ids [1, n]) of a row's spec."""
    n = spec["tokens_requested"]
    if spec["model"] == TINY:
        import eval_ruler

        model = eval_ruler.tiny_model().to(getattr(torch, spec["dtype"]))
        gen = torch.Generator().manual_seed(n)
        return model, None, torch.randint(3, model.config.vocab_size, (1, n), generator=gen)
    kw = {"model": spec["model"]} if load_model_kw() else {}
    model, tok = common.load_model(spec["dtype"], **kw)
    ctx, qst, _ = common.build_prompt(tok, common.load_novels(), n, 0.5, 12345, random.Random(0))
    return model, tok, torch.cat([ctx, qst], 1)


def model_shape(model) -> dict:
    c = model.config
    hq = c.num_attention_heads
    return {"layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads, "q_heads": hq,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // hq,
            "hidden": c.hidden_size, "intermediate": c.intermediate_size, "vocab": c.vocab_size}


def weight_bytes(model) -> int:
    """Bytes of the model's distinct parameter and buffer storages (tied weights once)."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def prefill(model, tok, ids: torch.Tensor, setting: str, budget: float) -> dict:
    """Runs one prefill of ``ids`` under ``setting``; returns what it keeps: the cache (and the
    compressor or context holding it), its byte counts, seconds."""
    import kvprune_cuda as kp

    policy = setting.split("+")[0]
    kw = {} if setting.endswith("+logits") else {"logits_to_keep": 1}
    probe = ModulePeaks(model) if setting.endswith("+modules") else None
    t0 = time.perf_counter()
    with torch.no_grad():
        if policy == "kvzip":
            ctx = kp.hf.compress_context(model, ids, "kvzip", budget, tokenizer=tok)
            cache = ctx.cache()
            return {"keep": ctx, "seconds": time.perf_counter() - t0,
                    "prefill_s": ctx.prefill_seconds, "compress_s": ctx.compress_seconds,
                    "kv_bytes": kp.hf.kv_bytes(cache), "state_bytes": ctx.nbytes - kp.hf.kv_bytes(cache),
                    "held_tokens": sum(ctx.tokens_per_layer) / len(ctx.tokens_per_layer)}
        if policy == "full":
            try:
                out = model(input_ids=ids, use_cache=True, **kw)
            finally:
                probe and probe.remove()
            keep = out.past_key_values
            comp_bytes, held = 0, keep.get_seq_length()
            peak_held = held
        else:
            with kp.hf.compress(model, "snapkv", budget,
                                **bounded(ids.shape[1], policy, budget, tok)) as comp:
                out = model(input_ids=ids, use_cache=True, **kw)
            keep, comp_bytes, held = (out.past_key_values, comp), comp.nbytes, comp.compressed_len
            peak_held = comp.peak_held
        seconds = time.perf_counter() - t0
        cache = out.past_key_values
        logits = out.logits.untyped_storage().nbytes()
        del out
    mods = {} if probe is None else {"module_peaks": probe.peaks, "hwm_kb": probe.hwm_kb}
    return {"keep": keep, "seconds": seconds, "kv_bytes": kp.hf.kv_bytes(cache),
            "state_bytes": comp_bytes, "held_tokens": held, "peak_held": peak_held,
            "logits_bytes": logits, **mods}


def bounded(n: int, policy: str, budget: float, tok=None) -> dict:
    """kp.hf.compress's bounded-prefill options for ``policy`` ("snapkv-bounded",
    "snapkv-bounded-recon" with ``tok``'s repeat prompt; none else)."""
    import kvprune_cuda as kp

    if not policy.startswith("snapkv-bounded"):
        return {}
    kept = kp.policy.make("snapkv", budget=budget).kept_tokens(n)
    kw = {"prefill_max_held": BOUND_FACTOR * kept, "prefill_chunk": BOUND_CHUNK}
    if policy == "snapkv-bounded-recon":
        kw.update(prefill_signal="reconstruct", tokenizer=tok)
    return kw


class ModulePeaks:
    """Forward hooks on every decoder layer's ``self_attn`` and ``mlp``: each call's peak
    resident bytes above the resident size at its entry (VmHWM reset on entry, read on exit),
    the maximum over layers per module name in :attr:`peaks`; :attr:`hwm_kb` the highest VmHWM
    read (before each reset too), so the whole forward's high-water mark survives the resets."""

    NAMES = ("self_attn", "mlp")

    def __init__(self, model):
        self.peaks = dict.fromkeys(self.NAMES, 0)
        self.hwm_kb, self._rss_kb, self.handles = 0, 0, []
        base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
        for layer in base.layers:
            for name in self.NAMES:
                m = getattr(layer, name)
                self.handles.append(m.register_forward_pre_hook(lambda *a: self._enter()))
                self.handles.append(m.register_forward_hook(lambda *a, _n=name: self._exit(_n)))

    def _enter(self):
        self.hwm_kb = max(self.hwm_kb, common.proc_status_kb("VmHWM"))
        common.reset_hwm()
        self._rss_kb = common.proc_status_kb("VmRSS")

    def _exit(self, name: str):
        hwm = common.proc_status_kb("VmHWM")
        self.hwm_kb = max(self.hwm_kb, hwm)
        self.peaks[name] = max(self.peaks[name], (hwm - self._rss_kb) * 1024)

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()


def analytic(shape: dict, n: int, setting: str, budget: float, bpe: int, repeat: int = 0) -> dict:
    """Bytes by hand: dense K/V, one layer's, a compressed layer's, the layer-by-layer high-water
    mark, and the per-layer activations that scale with ``n`` (``repeat``: the repeat prompt's
    tokens beyond a chunk, "snapkv-bounded-recon")."""
    import kvprune_cuda as kp

    L, hkv, d = shape["layers"], shape["kv_heads"], shape["head_dim"]
    layer = 2 * hkv * n * d * bpe
    policy = setting.split("+")[0]
    kept = n if policy == "full" else kp.policy.make(policy.split("-")[0],
                                                     budget=budget).kept_tokens(n)
    comp_layer = 2 * hkv * min(kept, n) * d * bpe
    if policy.startswith("snapkv-bounded") and n > BOUND_CHUNK:
        token = 2 * hkv * d * bpe
        bound = bounded(n, policy, budget)["prefill_max_held"]
        # every layer at the bound, the one compressing a chunk more; with the repetition, every
        # layer the bound, a chunk and its repetition (compressed once the repetition is done)
        high = (L * bound + BOUND_CHUNK if policy == "snapkv-bounded"
                else L * (bound + 2 * BOUND_CHUNK + repeat))
        return {"dense_kv_hand": L * layer, "layer_kv": layer, "kept_tokens_hand": min(kept, n),
                "compressed_kv_hand": L * comp_layer,
                "one_layer_plus_rest": layer + (L - 1) * comp_layer,
                "kv_high_water": high * token,
                "mlp_intermediate": BOUND_CHUNK * shape["intermediate"] * bpe,
                "hidden_state": BOUND_CHUNK * shape["hidden"] * bpe,
                "all_logits": BOUND_CHUNK * shape["vocab"] * bpe}
    return {"dense_kv_hand": L * layer, "layer_kv": layer, "kept_tokens_hand": min(kept, n),
            "compressed_kv_hand": L * comp_layer,
            # the KV high-water mark: while the last layer compresses, its full K/V and the
            # other layers' compressed K/V are held ("one layer's full KV + compressed rest")
            "one_layer_plus_rest": layer + (L - 1) * comp_layer,
            # what the prefill's KV reaches by construction: snapkv the line above; kvzip scores
            # on the uncompressed cache (then compresses); full holds it all
            "kv_high_water": layer + (L - 1) * comp_layer if policy == "snapkv" else L * layer,
            "mlp_intermediate": n * shape["intermediate"] * bpe,  # one [n, I] tensor
            "hidden_state": n * shape["hidden"] * bpe,
            "all_logits": n * shape["vocab"] * bpe}


def lock_file_pages() -> bool:
    """``mlock2(MLOCK_ONFAULT)`` on every file-backed mapping (the libraries' code and data):
    their pages resident now, and those faulted in later, stay resident; nothing is faulted in
    and anonymous memory (the heap, tensors) is left alone, so freeing still returns it.
    Without it the kernel may drop the libraries' file pages during a long prefill on a machine
    short of memory (seen: 111 of 472 MiB), which lowers the RSS the peak is read from by as
    much. Returns whether every mapping was locked."""
    import ctypes

    MLOCK_ONFAULT = 1
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.mlock2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        with open("/proc/self/maps") as f:
            maps = [ln.split(maxsplit=5) for ln in f]
    except (OSError, AttributeError):
        return False
    ok = True
    for m in maps:
        if len(m) == 6 and m[5].startswith("/"):
            lo, hi = (int(x, 16) for x in m[0].split("-"))
            ok &= libc.mlock2(lo, hi - lo, MLOCK_ONFAULT) == 0
    return ok


def rss_split() -> dict:
    """Resident bytes now by kind: anonymous (heap, tensors) and file-backed (mapped code)."""
    return {"rss_anon": (common.proc_status_kb("RssAnon") or 0) * 1024,
            "rss_file": (common.proc_status_kb("RssFile") or 0) * 1024}


def child(spec: dict) -> dict:
    """One row: loads, warms up, measures one prefill (run in a fresh process)."""
    torch.set_num_threads(spec["threads"])
    model, tok, ids = load(spec)
    n = ids.shape[1]
    bpe = torch.empty((), dtype=getattr(torch, spec["dtype"])).element_size()
    import kvprune_cuda as kp

    repeat = (kp.hf.RepeatPrompt.from_tokenizer(tok).extra_tokens()
              if spec["setting"] == "snapkv-bounded-recon" else 0)
    if spec["warmup"]:  # touches every weight (the LM head too), loads kernels and thread pools
        w = prefill(model, tok, ids[:, : spec["warmup"]], spec["setting"], spec["budget"])
        del w
    gc.collect()
    common.malloc_trim()
    locked = lock_file_pages() if spec.get("lock", True) else False
    rss_before = common.proc_status_kb("VmRSS") * 1024
    split_before = rss_split()
    kept: dict = {}

    def run():
        kept["r"] = prefill(model, tok, ids, spec["setting"], spec["budget"])

    peak, resident_after, probe = common.cpu_peak_extra_bytes(run)
    r = kept["r"]
    if "hwm_kb" in r:  # the module hooks reset VmHWM: the forward's peak is their highest reading
        peak = max(peak, r.pop("hwm_kb") * 1024 - rss_before)
    shape = model_shape(model)
    row = {k: spec[k] for k in KEY}
    gc.collect()
    common.malloc_trim()
    after = rss_split()
    # RSS counts file pages too (the mapped libraries), which the kernel may drop under memory
    # pressure during the call: anonymous memory alone is the cleaner "what the call keeps"
    row.update({f"{k}_before": v for k, v in split_before.items()})
    row.update({f"{k}_after": v for k, v in after.items()})
    # kvprune's per-thread CPU workspace, kept between calls (sized by the largest call)
    row["mlock"] = locked
    row["kp_cpu_workspace"] = kp.cpu_workspace_bytes()
    row.update({"tokens": n, "peak_extra": peak, "resident_after": resident_after,
                "probe": probe, "rss_before": rss_before, "weight_bytes": weight_bytes(model),
                "bytes_per_elem": bpe, **{k: v for k, v in r.items() if k != "keep"},
                **analytic(shape, n, spec["setting"], spec["budget"], bpe, repeat), "shape": shape,
                "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                "machine": common.machine()})
    return row


# ---------------------------------------------------------------------------------------------
# the parent: one fresh process per row
# ---------------------------------------------------------------------------------------------


def run_child(spec: dict, timeout: Optional[float] = None) -> dict:
    """``spec``'s row, measured in a fresh Python process (env: MALLOC_MMAP_THRESHOLD_, one OMP
    thread per torch thread); adds the child's lifetime peak RSS (``os.wait4``). A child that
    fails or is killed gives a row with ``error``."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD,
           "OMP_NUM_THREADS": str(spec["threads"])}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child",
                              json.dumps(spec)], stdout=out, stderr=err, env=env)
        deadline = None if not timeout else time.monotonic() + timeout
        while True:  # os.wait4, not p.wait: it reaps the child and returns its rusage
            pid, status, usage = os.wait4(p.pid, 0 if deadline is None else os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                p.kill()
                deadline = None
            else:
                time.sleep(0.5)
        rc = p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        lines = [ln for ln in out.read().splitlines() if ln.startswith("ROW ")]
        tail = err.read()[-2000:]
    maxrss = usage.ru_maxrss * 1024
    if rc != 0 or not lines:
        why = f"signal {-rc}" if rc < 0 else f"exit {rc}"
        if rc == -9:
            why += " (killed: out of memory or timeout?)"
        return {**{k: spec[k] for k in KEY}, "error": why, "stderr_tail": tail,
                "child_maxrss": maxrss, "wall_s": wall}
    return {**json.loads(lines[-1][4:]), "child_maxrss": maxrss, "wall_s": wall}


def read_rows(path: Path) -> list:
    if not path.is_file():
        return []
    return json.loads(path.read_text()).get("rows", [])


def key(row: dict) -> tuple:
    return tuple(row.get(k) for k in KEY)


def _mib(b) -> str:
    if b is None:
        return ""
    return f"{b / MiB:,.0f}" if b >= 100 * MiB else f"{b / MiB:,.1f}" if b >= 10 * MiB else f"{b / MiB:,.2f}"


def _order(r: dict) -> tuple:
    return (r.get("tokens") or r["tokens_requested"], SETTINGS.index(r["setting"]))


def fmt_table(rows: list) -> str:
    """A markdown table of ``rows`` (MiB; a failed row shows its error), then one of the
    per-module peaks where there are ``full+modules`` rows."""
    m = _mib
    lines = ["sizes in MiB (2^20 bytes)", "", "| tokens | setting | prefill s | KV held after | dense KV (hand) | "
             "1 full layer + compressed rest (hand) | peak extra | peak - KV high-water (hand) | "
             "resident after | weights | child max RSS |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=_order):
        if "error" in r:
            lines.append(f"| {r['tokens_requested']} | {r['setting']} | {r['error']} "
                         f"| | | | | | | | {m(r.get('child_maxrss'))} |")
            continue
        lines.append(f"| {r['tokens']} | {r['setting']} | {r['seconds']:.1f} | "
                     f"{m(r['kv_bytes'] + r['state_bytes'])} | {m(r['dense_kv_hand'])} | "
                     f"{m(r['one_layer_plus_rest'])} | {m(r['peak_extra'])} | "
                     f"{m(r['peak_extra'] - r['kv_high_water'] if 'kv_high_water' in r else None)} | {m(r['resident_after'])} | "
                     f"{m(r['weight_bytes'])} | {m(r.get('child_maxrss'))} |")
    mods = [r for r in sorted(rows, key=_order) if "module_peaks" in r]
    if mods:
        lines += ["", "| tokens | whole prefill peak | self_attn peak (max over layers) | "
                  "mlp peak (max over layers) | one [n, intermediate] tensor (hand) | "
                  "one [n, hidden] tensor (hand) |", "|---:|---:|---:|---:|---:|---:|"]
        for r in mods:
            p = r["module_peaks"]
            lines.append(f"| {r['tokens']} | {m(r['peak_extra'])} | {m(p['self_attn'])} | "
                         f"{m(p['mlp'])} | {m(r['mlp_intermediate'])} | {m(r['hidden_state'])} |")
    return "\n".join(lines)


def plot(rows: list, path: Path) -> None:
    """Peak extra bytes and KV bytes held against context length, one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [r for r in rows if "error" not in r and not r["setting"].endswith("+modules")]
    for i, s in enumerate(x for x in SETTINGS if any(r["setting"] == x for r in ok)):
        rs = sorted((r for r in ok if r["setting"] == s), key=lambda r: r["tokens"])
        n = [r["tokens"] for r in rs]
        c = f"C{i}"
        ax.plot(n, [r["peak_extra"] / MiB for r in rs], "o-", color=c, label=f"{s}: peak extra")
        ax.plot(n, [(r["kv_bytes"] + r["state_bytes"]) / MiB for r in rs], "s--", color=c,
                label=f"{s}: KV held after")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["tokens"] for r in ok})
    ax.set_xticks(ticks, [f"{t / 1024:.0f}k" if t % 1024 == 0 else str(t) for t in ticks])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("MiB")
    meta = ok[0] if ok else {}
    ax.set_title(f"kp.hf prefill, {meta.get('model', '')} {meta.get('dtype', '')}, "
                 f"budget {meta.get('budget', '')}: process peak vs KV held", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=common.parse_n, nargs="+", default=[8192, 16384, 32768],
                    help="prompt lengths (k suffix: 32k = 32768)")
    ap.add_argument("--settings", nargs="+", choices=SETTINGS, default=["full", "snapkv"])
    ap.add_argument("--budget", type=float, default=0.16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=256, help="tokens of the warm-up prefill (0: none)")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"a model common.load_model knows (default {DEFAULT_MODEL}; "
                    f"'{TINY}': a random 2-layer Qwen2, for tests)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per child (kill after)")
    ap.add_argument("--retry-failed", action="store_true", help="rerun rows stored with an error")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--table", action="store_true", help="print the table of --out, run nothing")
    ap.add_argument("--plot", action="store_true", help="plot --out to its folder's peak.png")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("ROW " + json.dumps(child(json.loads(args.child))), flush=True)
        return []
    if args.model not in (DEFAULT_MODEL, TINY) and not load_model_kw():
        ap.error("--model: this checkout's common.load_model loads only " + DEFAULT_MODEL)
    rows = read_rows(args.out)
    if args.plot:
        plot(rows, args.out.with_suffix(".png"))
        return rows
    if not args.table:
        for n in args.tokens:
            for s in args.settings:
                spec = {"model": args.model, "tokens_requested": n, "setting": s,
                        "budget": args.budget, "dtype": args.dtype, "threads": args.threads,
                        "warmup": args.warmup}
                old = [r for r in rows if key(r) == key(spec)]
                if old and not (args.retry_failed and "error" in old[-1]):
                    print(f"[skip] {n} {s}: in {args.out}", flush=True)
                    continue
                print(f"[run] {n} tokens, {s} ...", flush=True)
                row = run_child(spec, args.timeout)
                rows = [r for r in rows if key(r) != key(spec)] + [row]
                common.write_json(args.out, {"args": common.args_dict(args), "rows": rows})
                print(row.get("error") or
                      f"  {row['seconds']:.1f} s, peak extra {row['peak_extra'] / MiB:.0f} MiB, "
                      f"KV held {(row['kv_bytes'] + row['state_bytes']) / MiB:.1f} MiB", flush=True)
    print(fmt_table(rows))
    return rows


if __name__ == "__main__":
    main()
