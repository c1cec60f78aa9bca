"""Helpers every bench/ script shares: one place for each.

* the run's description: ``commit`` / ``dirty`` of the checkout, ``cpu_name``, ``machine``,
  ``run_meta`` (command line, commit, machine, date) and ``write_json`` (a result file with it);
* timers: ``time_cpu``, ``time_cpu_interleaved``, ``time_cuda`` (CUDA events, L2 flushed in
  between), ``cuda_copy_bandwidth``;
* memory: ``rss_mib`` (current), ``peak_rss_mib`` (this process's high-water mark),
  ``cpu_peak_extra_bytes`` (peak extra RSS of one call, run it in a fresh process),
  ``cuda_peak_extra_bytes`` (caching allocator statistics);
* the real-model evaluations (eval_passkey.py, eval_ppl.py, eval_context.py, bench_vllm.py):
  ``load_model`` (by name: ``add_model_arg`` gives a script ``--model``, the 0.5B by default),
  ``load_novels``, ``threads``, the pass-key prompts (``build_prompt``, ``build_haystack``) and
  the HF cache plumbing (``attention_modules``, ``Recorder``, ``cache_from``, ``layers_of``,
  ``apply_press``, ``stop_at_key``, ``add_trial_args``).

Model and text come from the project's fetch scripts (``scripts/fetch_model.py``,
``scripts/fetch_text.py``), cached under ``.cache/`` -- nothing is downloaded by hand.

CPU timing: time.perf_counter around each call; peak extra memory in a fresh process (see
``cpu_peak_extra_bytes``). CUDA: CUDA events around each call with the L2 flushed in between,
peak extra memory from the caching allocator's statistics.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"

# ---------------------------------------------------------------------------------------------
# the run: checkout, machine, result files
# ---------------------------------------------------------------------------------------------


def _git(*args: str) -> Optional[str]:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=10).stdout
    except Exception:  # noqa: BLE001
        return None


def commit() -> str:
    """The checkout's short commit (a read-only query), "unknown" outside a git tree."""
    out = _git("rev-parse", "--short", "HEAD")
    return out.strip() if out else "unknown"


def dirty() -> Optional[bool]:
    """Whether tracked files differ from that commit (None outside a git tree)."""
    out = _git("status", "--porcelain", "--untracked-files=no")
    return None if out is None else bool(out.strip())


def cpu_name() -> str:
    """/proc/cpuinfo's model name, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def machine() -> str:
    """CPU, torch threads, torch and transformers versions, on one line."""
    try:
        tf = __import__("transformers").__version__
    except ImportError:
        tf = "absent"
    return (f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"transformers {tf}")


# the checkout when the run starts (this module's import): the code a run loads is that commit's,
# whatever is committed while it runs
_START = {"commit": commit(), "dirty": dirty(),
          "date": datetime.datetime.now().isoformat(timespec="seconds")}
_META: dict = {}


def run_meta() -> dict:
    """What every result file records about its run: command line, the commit, dirty flag and
    date of its start (``_START``), and the machine with torch's thread count at the first call
    (after the script set it; later calls return the same values)."""
    if not _META:
        _META.update({"command": " ".join(sys.argv), "commit": _START["commit"],
                      "dirty": _START["dirty"], "machine": machine(), "date": _START["date"]})
    return dict(_META)


def write_json(path: Path, data: dict, indent: Optional[int] = 1) -> None:
    """Writes ``data`` as JSON to ``path`` (folders made as needed) with ``run_meta()`` added
    under each key ``data`` does not set itself: into ``data["meta"]`` where there is one, else
    at the top level."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data.get("meta"), dict):
        data = {**data, "meta": {**run_meta(), **data["meta"]}}
    else:
        data = {**run_meta(), **data}
    path.write_text(json.dumps(data, indent=indent))


def args_dict(args: argparse.Namespace) -> dict:
    """``vars(args)`` with paths, and lists of them, as strings (JSON-ready)."""
    plain = lambda v: str(v) if isinstance(v, Path) else v  # noqa: E731
    return {k: [plain(x) for x in v] if isinstance(v, list) else plain(v) for k, v in vars(args).items()}


def parse_n(text: str) -> int:
    """A token count with an optional k / m suffix (binary: 32k = 32768)."""
    text = text.strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def threads() -> int:
    """Torch threads of the real-model evaluations: $KVPRUNE_THREADS, default 2."""
    return int(os.environ.get("KVPRUNE_THREADS", "2"))


# ---------------------------------------------------------------------------------------------
# timers
# ---------------------------------------------------------------------------------------------


def summarize(seconds: list[float]) -> dict:
    """Median / min / max of a list of per-call times, in milliseconds."""
    ms = [s * 1e3 for s in seconds]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
            "reps": len(ms)}


def time_cpu(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> dict:
    """Wall time of ``fn()`` on the host: ``warmup`` untimed calls, then ``repeats`` timed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return summarize(times)


def time_cpu_interleaved(fns: list[Callable[[], object]], repeats: int = 5,
                         warmup: int = 1) -> list[dict]:
    """Like ``time_cpu`` for several functions, their reps interleaved round-robin.

    On a shared, noisy host, load from other processes then lands on every function alike,
    which keeps same-run ratios meaningful even when absolute times drift.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [summarize(ts) for ts in times]


class L2Flusher:
    """Writes a buffer larger than the L2 (H200: 60 MB) so the next call starts cold."""

    def __init__(self, device: torch.device, nbytes: int = 256 << 20):
        self.buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


def time_cuda(fn: Callable[[], object], repeats: int = 20, warmup: int = 3,
              flush: Optional[L2Flusher] = None) -> dict:
    """Device time of ``fn()`` between two CUDA events on the current stream.

    All reps are queued without host syncs (the flush before each rep, outside its events, keeps
    the queue ahead of the GPU so launch latency is hidden as in a real engine); one sync at the
    end. Returns median / min / max ms.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        if flush is not None:
            flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)])


# ---------------------------------------------------------------------------------------------
# bandwidth ceiling
# ---------------------------------------------------------------------------------------------


def cuda_copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written.

    ``dst.copy_(src)`` of a ``nbytes`` buffer, median of ``repeats`` after warm-up.
    """
    src = torch.randn(nbytes // 4, device="cuda")  # random, never zeros
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), repeats=repeats, warmup=3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (t["median_ms"] / 1e3)


# ---------------------------------------------------------------------------------------------
# peak extra memory
# ---------------------------------------------------------------------------------------------


def cuda_peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes the caching allocator hands out during ``fn()`` beyond what was live before.

    Outputs count (they are part of the extra memory a call needs); inputs do not.
    """
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def proc_status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_hwm() -> bool:
    """Resets this process's peak RSS (VmHWM) via /proc/self/clear_refs (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_mib() -> float:
    """This process's resident size now (VmRSS), MiB; nan where /proc is missing."""
    kb = proc_status_kb("VmRSS")
    return float("nan") if kb is None else kb / 1024


def peak_rss_mib() -> float:
    """This process's peak resident size so far (ru_maxrss), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_peak_extra_bytes(fn: Callable[[], object]) -> tuple[int, int, str]:
    """Peak resident bytes during ``fn()`` above the resident size before it, and the bytes
    still resident once its outputs are freed (what the call keeps: kvprune's per-thread CPU
    workspace). Run in a fresh process, with the inputs already built (and touched) first.

    Preferred probe: reset VmHWM, call, read VmHWM, minus VmRSS before the call (exact for this
    call). Fallback: ru_maxrss after the call minus ru_maxrss before it (a high-water mark
    that also holds whatever peak building the inputs reached, so it can under-report).
    Run the child with MALLOC_MMAP_THRESHOLD_ set so freed buffers leave the RSS instead of
    staying in malloc's heap for reuse. Returns (peak bytes, resident-after bytes, method).
    """
    gc.collect()
    malloc_trim()
    rss_kb = proc_status_kb("VmRSS")

    def resident_after() -> int:
        gc.collect()
        malloc_trim()
        return (proc_status_kb("VmRSS") - rss_kb) * 1024

    if rss_kb is not None and reset_hwm() and proc_status_kb("VmHWM") is not None:
        out = fn()
        peak_kb = proc_status_kb("VmHWM")
        del out
        return (peak_kb - rss_kb) * 1024, resident_after(), "VmHWM"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = fn()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del out
    return (after - before) * 1024, resident_after(), "ru_maxrss"


# ---------------------------------------------------------------------------------------------
# real model and text
# ---------------------------------------------------------------------------------------------


def _fetch(name: str):
    """scripts/fetch_model.py or scripts/fetch_text.py, imported as modules."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    return __import__(name)


_models = _fetch("fetch_model")
DEFAULT_MODEL = _models.DEFAULT  # the 0.5B: a result that names no model is its
MODEL_NAMES = list(_models.MODELS)


def add_model_arg(ap: argparse.ArgumentParser, **kwargs) -> None:
    """``--model NAME``: a model of scripts/fetch_model.py's table, the 0.5B unless given (an
    unknown name is refused, the known ones listed); ``kwargs`` replace ``default`` / ``help``."""
    opts = {"default": DEFAULT_MODEL, "help": f"model (default {DEFAULT_MODEL})"}
    ap.add_argument("--model", choices=MODEL_NAMES, **{**opts, **kwargs})


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    """The cached HF copy of model ``name`` (fetched and converted if needed)."""
    model = _models.spec(name)
    gguf = _models.fetch_gguf(model, _models.CACHE)
    return _models.convert_to_hf(model, gguf, _models.CACHE)


def load_model(dtype: str = "bfloat16", model: str = DEFAULT_MODEL):
    """(model, tokenizer) of the cached HF copy of the model named ``model`` (fetches it if
    needed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(model)
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                              attn_implementation="sdpa").eval()
    return hf, tok


def load_novels() -> dict[str, str]:
    fetch_text = _fetch("fetch_text")
    d = fetch_text.fetch(fetch_text.CACHE)
    return {n: (d / f"{n}.txt").read_text(encoding="utf-8") for n in fetch_text.NOVELS}


# ---------------------------------------------------------------------------------------------
# pass-key prompts
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# HF cache plumbing of the evaluations
# ---------------------------------------------------------------------------------------------


def attention_modules(model) -> dict:
    """{layer_idx: attention module} of ``model``: the modules kp.hf's hooks attach to."""
    import kvprune_cuda as kp

    return {m.layer_idx: m for m in kp.hf.KVCompressor(model, "full").attn}


class Recorder:
    """Keeps, per layer, the last ``n`` layer inputs and RoPE cos/sin (what kvpress.compress
    reads), over the forwards run while it is attached (until :meth:`remove`); with
    ``first_only`` each layer keeps only its first forward's (a context's prefill, not the
    kvzip reconstruction forwards kp.hf.score_context runs after it)."""

    def __init__(self, model, n, first_only: bool = False):
        self.n, self.first_only, self.data, self.handles = n, first_only, {}, []
        for m in attention_modules(model).values():
            self.handles.append(m.register_forward_hook(self._hook, with_kwargs=True))

    def _hook(self, mod, args, kwargs, out):
        old = self.data.get(mod.layer_idx)
        if old is not None and self.first_only:
            return
        hs = kwargs["hidden_states"][:, -self.n:]
        cos, sin = (t[:, -self.n:] for t in kwargs["position_embeddings"])
        if old is not None:
            hs, cos, sin = (torch.cat([a, b], 1)[:, -self.n:] for a, b in zip(old, (hs, cos, sin)))
        self.data[mod.layer_idx] = (hs, cos, sin)

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()


def cache_from(layers_kv):
    from transformers import DynamicCache

    c = DynamicCache()
    for i, (k, v) in enumerate(layers_kv):
        c.update(k, v, i)
    return c


def layers_of(cache, n_layers):
    import kvprune_cuda as kp

    return [kp.hf.cache_kv(cache, i) for i in range(n_layers)]


def apply_press(press, cache, recorded, attn):
    """A new DynamicCache: a kvpress press's ``compress`` of every layer of ``cache`` (a
    DynamicCache holding a context uncompressed; left as it is) with the recorded layer inputs
    (:class:`Recorder`). Wrap it with ``kp.hf.CompressedContext.from_cache(model, context_ids,
    cache)`` to ask it questions."""
    out = []
    for i, (k, v) in enumerate(layers_of(cache, len(attn))):
        hs, cos, sin = recorded[i]
        k2, v2 = press.compress(attn[i], hs, k, v, None, {"position_embeddings": (cos, sin)})
        out.append((k2.contiguous(), v2.contiguous()))
    return cache_from(out)


def stop_at_key(tok, key, lead: int = 0):
    """A ``stopping_criteria`` for ``generate``: stops once ``key`` is in the text of the new
    tokens (and of the ``lead`` tokens before them): greedy answers stop once they hold the
    pass key."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class KeySeen(StoppingCriteria):
        start = None

        def __call__(self, input_ids, scores, **kwargs):
            if self.start is None:  # first call: one new token so far
                self.start = input_ids.shape[1] - 1 - lead
            done = [key in tok.decode(row[self.start:]) for row in input_ids]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([KeySeen()])


KVPRESS_KERNEL = 7  # SnapKVPress's pool when --kernel-size is not given


def add_trial_args(ap: argparse.ArgumentParser) -> None:
    """The passkey options eval_passkey.py and eval_context.py share."""
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096], help="prompt lengths")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--trials-per-depth", type=int, default=4)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--kernel-size", type=int, default=None,
                    help="snapkv's pool (default: the library's; kvpress's SnapKVPress: 7)")
    ap.add_argument("--gen-steps", type=int, default=7)
    ap.add_argument("--no-kvpress", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", help="model and KV dtype (bf16: AMX on the CPU)")
    add_model_arg(ap)
