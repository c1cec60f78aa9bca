#!/usr/bin/env python3
"""Proof that the emulator's checks can fail: mutants of the real CUDA kernels.

Each mutant is one textual change to a kernel source (a removed __syncthreads, a
store one element past the end, a swapped mma fragment register, a warp shuffle
whose mask misses a lane, ...). The runner copies csrc/, applies the change,
compiles the changed kernel file for the emulator with AddressSanitizer and UBSan,
links it with mutant_driver.cpp and the emulator runtime ahead of the unchanged
core library, runs the driver's case and requires it to FAIL with the expected
report. The unchanged kernels must pass the same cases first.

    run_mutants.py --cxx g++ --cuda-include DIR --core-lib libkvprune_core.a \
                   --source-dir REPO --work-dir DIR
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import re
import shutil
import subprocess
import sys

# name, kernel file, text to replace (exactly once), replacement, driver case,
# what the failure report must match.
MUTANTS = [
    ("removed __syncthreads after staging Q (tensor-core window scores)",
     "csrc/cuda/window_scores_mma.cuh",
     "  }\n  __syncthreads();\n  // The logits' scale:",
     "  }\n  // The logits' scale:",
     "window_scores", r"race: the forward and reverse schedules|wrong: scores differ"),
    ("removed __syncthreads before the next scan tile reuses the scan storage (select)",
     "csrc/cuda/select_keep.cu",
     "    __syncthreads();  // shared.scan is reused by the next tile\n",
     "",
     "select_keep", r"race: the forward and reverse schedules"),
    ("removed both __syncthreads between a compaction slab's loads and its stores",
     "csrc/cuda/compact_kv.cu",
     "  __syncthreads();  // every read of the slab happens before any write of it\n"
     "  if (threadIdx.x == 0) simt::set_flag(flags + slab);\n"
     "  for (int64_t earlier = threadIdx.x; earlier < slab; earlier += kBlock)\n"
     "    simt::wait_flag(flags + earlier);\n"
     "  __syncthreads();  // ... and every read of an earlier slab\n",
     "  if (threadIdx.x == 0) simt::set_flag(flags + slab);\n"
     "  for (int64_t earlier = threadIdx.x; earlier < slab; earlier += kBlock)\n"
     "    simt::wait_flag(flags + earlier);\n",
     "compact_kv", r"race: the forward and reverse schedules|wrong: the compacted K/V differ"),
    ("a compaction slab that never sets its flag (the next slab of its row waits forever)",
     "csrc/cuda/compact_kv.cu",
     "  if (threadIdx.x == 0) simt::set_flag(flags + slab);\n",
     "",
     "compact_kv", r"waits at compact_kv\.cu:\d+ on a flag"),
    ("a compaction slab that stores without waiting for the earlier slabs' loads",
     "csrc/cuda/compact_kv.cu",
     "  for (int64_t earlier = threadIdx.x; earlier < slab; earlier += kBlock)\n"
     "    simt::wait_flag(flags + earlier);\n",
     "",
     "compact_kv", r"race: the forward and reverse schedules|wrong: the compacted K/V differ"),
    ("a compaction slab that sets its flag before the block's loads are done",
     "csrc/cuda/compact_kv.cu",
     "  __syncthreads();  // every read of the slab happens before any write of it\n"
     "  if (threadIdx.x == 0) simt::set_flag(flags + slab);\n",
     "  if (threadIdx.x == 0) simt::set_flag(flags + slab);\n"
     "  __syncthreads();  // every read of the slab happens before any write of it\n",
     "compact_kv", r"race: the forward and reverse schedules|wrong: the compacted K/V differ"),
    ("store one element past the end (pool_scores bound j >= length -> j > length)",
     "csrc/cuda/pool_scores.cu",
     "if (j >= a.length) break;",
     "if (j > a.length) break;",
     "pool_scores", r"heap-buffer-overflow"),
    ("swapped mma fragment registers a1 <-> a2",
     "csrc/cuda/window_scores_mma.cuh",
     "row_lo.x, row_hi.x, row_lo.y, row_hi.y, kv.x, kv.y",
     "row_lo.x, row_lo.y, row_hi.x, row_hi.y, kv.x, kv.y",
     "window_scores", r"wrong: scores differ from the CPU backend"),
    ("warp shuffle whose mask misses lane 31",
     "csrc/cuda/window_scores_mma.cuh",
     "const float other = __shfl_xor_sync(0xffffffffu, v, mask);",
     "const float other = __shfl_xor_sync(0x7fffffffu, v, mask);",
     "window_scores", r"does not name its own lane|which is not in the mask"),
    ("one thread returns before a barrier the rest of the block reaches",
     "csrc/cuda/select_keep.cu",
     "  if (!task.selects) return;  // uniform per CTA\n\n  uint32_t* hist",
     "  if (!task.selects || threadIdx.x == 7) return;\n\n  uint32_t* hist",
     "select_keep", r"reached by only part of the block"),
    ("83 KB of dynamic shared memory without raising the kernel's limit",
     "csrc/cuda/window_scores.cu",
     "err = simt::set_max_dynamic_smem(kernel, static_cast<int>(std::min(raised, max_smem)));",
     "err = cudaSuccess;",
     "window_scores", r"dynamic shared memory, the kernel allows 49152"),
]

SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def compile_object(args, source: pathlib.Path, csrc: pathlib.Path, out: pathlib.Path, emulated: bool):
    cmd = [args.cxx, "-std=c++17", "-O1", "-g", *SANITIZE, f"-I{csrc}", f"-I{args.cuda_include}",
           "-w", "-c", str(source), "-o", str(out)]
    if emulated:
        cmd[1:1] = ["-x", "c++", "-DKVPRUNE_EMULATOR_BUILD=1"]
    subprocess.run(cmd, check=True)


def link(args, objects, out: pathlib.Path):
    subprocess.run([args.cxx, *SANITIZE, *map(str, objects), str(args.core_lib), "-lpthread",
                    "-o", str(out)], check=True)


def run_case(binary: pathlib.Path, case: str) -> tuple[int, str]:
    proc = subprocess.run([str(binary), case], capture_output=True, text=True, timeout=600,
                          env={"ASAN_OPTIONS": "detect_leaks=0", "PATH": "/usr/bin:/bin"})
    return proc.returncode, proc.stdout + proc.stderr


def run_mutant(args, work: pathlib.Path, csrc: pathlib.Path, common: list, i: int,
               mutant: tuple) -> tuple[str, bool]:
    """(report line, caught) of mutant ``i``: its tree, its changed kernel, its driver run."""
    name, rel, old, new, case, expected = mutant
    tree = work / f"mutant{i}"
    shutil.copytree(csrc, tree / "csrc")
    target = tree / rel
    text = target.read_text()
    if text.count(old) != 1:
        return f"FAIL: mutant '{name}': the text to change occurs {text.count(old)} times in {rel}", False
    target.write_text(text.replace(old, new))
    kernel_file = rel if rel.endswith(".cu") else {
        "csrc/cuda/window_scores_mma.cuh": "csrc/cuda/window_scores.cu"}[rel]
    obj = tree / "mutated.o"
    compile_object(args, tree / kernel_file, tree / "csrc", obj, emulated=True)
    binary = tree / "driver"
    link(args, [obj, *common], binary)
    code, output = run_case(binary, case)
    caught = code != 0 and re.search(expected, output) is not None
    first = next((line for line in output.splitlines() if re.search(expected, line)),
                 output.strip().splitlines()[0] if output.strip() else "(no output)")
    return f"{'caught' if caught else 'MISSED'}: {name} [{case}, exit {code}]: {first[:300]}", caught


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--cxx", "--cuda-include", "--core-lib", "--source-dir", "--work-dir"):
        parser.add_argument(name, required=True)
    args = parser.parse_args()
    source = pathlib.Path(args.source_dir)
    work = pathlib.Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    csrc = source / "csrc"

    # The runtime is compiled here with the sanitizers on, so fiber switches are announced.
    common = []
    for name, path in [("driver", source / "tests/emu/mutant_driver.cpp"),
                       ("runtime", csrc / "emu/runtime.cpp"), ("fiber", csrc / "emu/fiber.cpp")]:
        obj = work / f"{name}.o"
        compile_object(args, path, csrc, obj, emulated=False)
        common.append(obj)
    control = work / "control"
    link(args, common, control)
    failures = 0
    for case in sorted({m[4] for m in MUTANTS}):
        code, output = run_case(control, case)
        if code != 0:
            print(f"FAIL: the unchanged kernels fail case {case}:\n{output}")
            failures += 1
    if failures:
        return 1

    # Each mutant has its own tree, object and binary: they compile and run in parallel.
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda im: run_mutant(args, work, csrc, common, *im),
                                enumerate(MUTANTS)))
    for line, caught in results:
        print(line)
        failures += not caught
    print(f"{len(MUTANTS) - failures} of {len(MUTANTS)} mutants caught")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
