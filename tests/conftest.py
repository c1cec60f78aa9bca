"""Shared fixtures: the device parameter, seeded generators and output poisoning.

Every op test takes the ``device`` fixture: "cpu" always, "cuda" when a GPU is
present (skipped cleanly otherwise), so the same tests run unchanged on a GPU box,
and "cuda_emu": the CUDA kernels on CPU tensors under the SIMT emulator, each op
run under two thread schedules whose results must agree bit for bit (the test
sees device "cpu"; ``helpers.on_cuda_path`` tells it which kernels run).
"""

from __future__ import annotations

import os
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


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param != "cuda_emu":
        yield request.param
        return
    with kp.testing.emulate_cuda(schedules=EMULATED_SCHEDULES):
        yield "cpu"


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
