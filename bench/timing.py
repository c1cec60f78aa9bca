"""Timers and memory probes shared by the benchmarks.

CPU: time.perf_counter around each call; peak extra memory in a fresh process (see
``cpu_peak_extra_bytes``). CUDA: CUDA events around each call with the L2 flushed in between,
peak extra memory from the caching allocator's statistics.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import statistics
import time
from typing import Callable, Optional

import torch

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


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _proc_status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    """Resets this process's peak RSS (VmHWM) via /proc/self/clear_refs (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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
    _malloc_trim()
    rss_kb = _proc_status_kb("VmRSS")

    def resident_after() -> int:
        gc.collect()
        _malloc_trim()
        return (_proc_status_kb("VmRSS") - rss_kb) * 1024

    if rss_kb is not None and _reset_hwm() and _proc_status_kb("VmHWM") is not None:
        out = fn()
        peak_kb = _proc_status_kb("VmHWM")
        del out
        return (peak_kb - rss_kb) * 1024, resident_after(), "VmHWM"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = fn()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del out
    return (after - before) * 1024, resident_after(), "ru_maxrss"
