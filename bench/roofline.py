"""The machine's fp32 FMA roofline, measured: bench/fma_probe.c built on the fly and timed; where
the CPU has bf16 dot products (AVX512-BF16), their rate too (the bf16 roofline).

    python bench/roofline.py                 # prints GFLOP/s on 1 thread and on N threads

``measure(threads)`` compiles the probe with the system C compiler (``cc``/``gcc``/``g++``; -O2
and -mavx512f -mfma, else -mavx2 -mfma, as /proc/cpuinfo offers) into a temporary folder,
loads it with ctypes and returns the best of a few runs (a roofline is a maximum). It is
the yardstick the CPU benchmark rows are reported against (DESIGN.md §5: the score products
are 2·Hq·W·N·D flops per pass); torch.mm is kept only as a second reference.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

SRC = Path(__file__).resolve().parent / "fma_probe.c"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_flags() -> list[str]:
    flags = _cpu_flags()
    if "avx512f" in flags:
        return ["-mavx512f", "-mfma"] + (["-mavx512bf16"] if "avx512_bf16" in flags else [])
    if "avx2" in flags and "fma" in flags:
        return ["-mavx2", "-mfma"]
    return []


def build(out_dir: Path) -> Path:
    """Compiles the probe into ``out_dir``; returns the shared library's path."""
    cc = next((c for c in (os.environ.get("CC"), "cc", "gcc", "g++", "clang") if c and shutil.which(c)),
              None)
    if cc is None:
        raise RuntimeError("roofline: no C compiler found (set CC)")
    lib = out_dir / "libfma_probe.so"
    lang = ["-x", "c"] if cc.endswith("++") else []
    cmd = [cc, "-O2", *isa_flags(), "-shared", "-fPIC", *lang, str(SRC), "-o", str(lib), "-lpthread", "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return lib


class Probe:
    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvprune-fma-")
        self.lib = ctypes.CDLL(str(build(Path(self._dir.name))))
        for probe in (self.lib.fma_gflops, self.lib.bf16_gflops):
            probe.restype = ctypes.c_double
            probe.argtypes = [ctypes.c_int, ctypes.c_int64]
        self.lanes = int(self.lib.fma_lanes())
        self.has_bf16 = self.lib.bf16_gflops(1, 1) > 0

    def gflops(self, threads: int, seconds: float = 0.3, tries: int = 3, kind: str = "fp32") -> float:
        """Best of ``tries`` runs of about ``seconds`` each; ``kind`` "fp32" (FMA) or "bf16"
        (dot products; 0 where the CPU has none)."""
        probe = self.lib.bf16_gflops if kind == "bf16" else self.lib.fma_gflops
        iters = 1 << 16
        while True:  # calibrate to about `seconds`
            rate = probe(threads, iters)
            if rate <= 0:
                return 0.0
            elapsed = iters * threads / (rate * 1e9) * (64.0 if kind == "bf16" else 2.0 * self.lanes) * 16
            if elapsed > seconds / 4:
                break
            iters *= 4
        iters = max(1, int(iters * seconds / elapsed))
        return max(probe(threads, iters) for _ in range(tries))


def measure(threads: int) -> dict:
    """{"lanes", "gflops_1t", "gflops": on ``threads`` threads, "threads", "isa", and the bf16
    dot-product rates "bf16_gflops_1t", "bf16_gflops" (0 where the CPU has none)}."""
    p = Probe()
    return {"isa": " ".join(isa_flags()) or "scalar", "lanes": p.lanes, "threads": threads,
            "gflops_1t": p.gflops(1), "gflops": p.gflops(threads),
            "bf16_gflops_1t": p.gflops(1, kind="bf16"), "bf16_gflops": p.gflops(threads, kind="bf16")}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("threads", nargs="?", type=int, default=os.cpu_count() or 1,
                    help="threads of the second run (default: all cores)")
    threads = ap.parse_args(argv).threads
    r = measure(threads)
    print(f"fp32 FMA roofline ({r['isa']}, {r['lanes']} lanes): {r['gflops_1t']:.1f} GFLOP/s on 1 "
          f"thread, {r['gflops']:.1f} GFLOP/s on {threads} threads; load {os.getloadavg()[0]:.2f}")
    if r["bf16_gflops_1t"]:
        print(f"bf16 dot-product roofline (vdpbf16ps): {r['bf16_gflops_1t']:.1f} GFLOP/s on 1 thread, "
              f"{r['bf16_gflops']:.1f} GFLOP/s on {threads} threads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
