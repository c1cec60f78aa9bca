"""Shared fixtures: the device parameter, seeded generators and output poisoning.

Every op test takes the ``device`` fixture: "cpu" always, "cuda" when a GPU is
present (skipped cleanly otherwise), so the same tests run unchanged on a GPU box,
and "cuda_emu": the CUDA kernels on CPU tensors under the SIMT emulator, each op
run under two thread schedules whose results must agree bit for bit (the test
sees device "cpu"; ``helpers.on_cuda_path`` tells it which kernels run).
"""

from __future__ import annotations

import collections
import os
import pathlib
import re
import zlib

# Deterministic mode (see poison_uninitialized_memory) wants a fixed cuBLAS workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from helpers import HAS_CUDA, HAS_EMULATOR  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")),
    pytest.param("cuda_emu", marks=pytest.mark.skipif(not HAS_EMULATOR, reason="no CUDA emulator")),
]
# Thread orders every emulated op runs under (results compared bitwise).
EMULATED_SCHEDULES = ("forward", "reverse")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes several seconds (compile, long sequences)")


# opcheck and torch.compile cannot trace through the dispatch mode that compares
# schedules: these tests run under one schedule.
SINGLE_SCHEDULE_FILES = ("test_dispatcher.py",)


def launch_counts() -> dict:
    return dict(kp._C._emulated_launch_counts()) if HAS_EMULATOR else {}


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param != "cuda_emu":
        yield request.param
        return
    single = request.node.path.name in SINGLE_SCHEDULE_FILES
    with kp.testing.emulate_cuda(schedules=EMULATED_SCHEDULES[:1] if single else EMULATED_SCHEDULES):
        yield "cpu"


# ---- which CUDA kernels the passing tests ran under the emulator ------------------------
# Printed at the end of the run; with KVPRUNE_EMU_KERNEL_TABLE=path also written there
# as a Markdown table. Kernels of csrc/cuda that no passing test ran are named.
KERNEL_TESTS: collections.Counter = collections.Counter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = launch_counts()
    yield
    after = launch_counts()
    ran = {k for k, n in after.items() if n > before.get(k, 0)}
    if ran and getattr(item, "emulated_passed", False):
        for kernel in ran:
            KERNEL_TESTS[kernel] += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.emulated_passed = report.passed
    elif report.failed:  # setup or teardown
        item.emulated_passed = False


def kernel_family(name: str) -> str:
    return re.sub(r"^.*::", "", name.split("<")[0])


def source_kernels() -> set:
    root = pathlib.Path(__file__).resolve().parent.parent / "csrc" / "cuda"
    names = set()
    for path in root.glob("*.cu*"):
        text = re.sub(r"__launch_bounds__\([^)]*\)", "", path.read_text())
        for m in re.finditer(r"__global__[^(]*?\b(\w+)\s*\(", text):
            names.add(m.group(1))
    return names


def pytest_terminal_summary(terminalreporter):
    if not KERNEL_TESTS:
        return
    families = collections.Counter()
    for name, tests in KERNEL_TESTS.items():
        families[kernel_family(name)] += tests
    missing = sorted(source_kernels() - set(families))
    terminalreporter.write_line(
        f"cuda_emu: {len(KERNEL_TESTS)} kernel instantiations of {len(families)} kernels ran in "
        f"passing tests; kernels of csrc/cuda never run: {', '.join(missing) or 'none'}")
    path = os.environ.get("KVPRUNE_EMU_KERNEL_TABLE")
    if path:
        lines = ["| kernel | instantiation | passing cuda_emu tests that ran it |", "|---|---|---|"]
        for name in sorted(KERNEL_TESTS, key=lambda n: (kernel_family(n), n)):
            lines.append(f"| `{kernel_family(name)}` | `{name}` | {KERNEL_TESTS[name]} |")
        for name in missing:
            lines.append(f"| `{name}` | (none) | 0 |")
        pathlib.Path(path).write_text("\n".join(lines) + "\n")


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test id: reproducible, different per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def poison_uninitialized_memory():
    """Fill every torch.empty (the ops' outputs and workspaces included) with NaN /
    the integer maximum, so elements an op forgets to write show up in the checks."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
