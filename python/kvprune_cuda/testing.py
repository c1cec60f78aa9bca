"""Testing aids: run the CUDA kernels on the CPU under the SIMT emulator.

``emulate_cuda()`` makes every kvprune op called on CPU tensors (by this thread)
execute the CUDA backend's kernels, compiled for the host against the project's
emulated SIMT runtime instead of the CPU kernels::

    import kvprune_cuda as kp
    with kp.testing.emulate_cuda(schedules=("forward", "reverse")):
        kept = kp.snapkv(q, k, v, budget=256)      # CPU tensors, CUDA kernels

The emulator runs each block's threads as cooperatively scheduled fibers, with
real barriers, warp collectives and mma.sync fragment layouts, and fails a launch
(RuntimeError naming the kernel, block and threads) where a GPU would hang or be
undefined. Inside the context, fresh tensors are filled with NaN / the integer
maximum (PyTorch's deterministic mode with fill_uninitialized_memory), so output
elements a kernel forgets to write show. With several ``schedules`` every op runs once per schedule (the thread
order between barriers), in-place arguments restored in between, and the results
must agree bit for bit: a difference is a race, raised as ScheduleRaceError. It
shows logic, bounds, barriers and layouts, not speed; see README.md.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvprune_cuda import _C

SCHEDULES = ("forward", "reverse", "shuffled")

__all__ = ["SCHEDULES", "ScheduleRaceError", "emulate_cuda", "emulating_cuda"]


class ScheduleRaceError(AssertionError):
    """Two thread schedules of the emulator gave different results: a race."""


def emulating_cuda() -> bool:
    """Whether ops on CPU tensors currently run the emulated CUDA kernels (this thread)."""
    return bool(_C._cuda_emulation_enabled())


@contextlib.contextmanager
def emulate_cuda(
    schedules: Sequence[str] = ("forward",), *, seed: int = 0, sm_count: int = 132,
    host_threads: int = 0, slow_worker: bool = False,
) -> Iterator[None]:
    """Run kvprune ops on CPU tensors through the CUDA kernels, emulated.

    schedules: thread orders between barriers, each "forward", "reverse" or "shuffled"
        (a permutation drawn from ``seed``, new at every barrier). With more than one,
        each op runs under each and must give bitwise-equal results.
    sm_count: the SM count the launch heuristics see (an H100/H200 has 132).
    host_threads: host threads running blocks in parallel (0: one per CPU, at most 8).
    slow_worker: makes the calling host thread a slow SM. Its first block runs before any
        other, and when the first thread of one of its blocks reaches a barrier and when the
        barrier opens, it waits until every other host thread waits on an unset flag or has
        no block left, so the others' blocks overtake its blocks (ordering bugs between blocks
        show); with ``host_threads=2``, the same way on every run.
    """
    if not _C.build_info()["cuda_emulator"]:
        raise RuntimeError("this build of kvprune_cuda has no CUDA emulator "
                           "(kp.build_info()['cuda_emulator'] is False)")
    if not schedules:
        raise ValueError("schedules must name at least one schedule")
    codes = []
    for name in schedules:
        if name not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
        codes.append(SCHEDULES.index(name))
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")

    def use(code: int) -> None:
        _C._set_cuda_emulation(True, code, seed, sm_count, host_threads, slow_worker)

    if emulating_cuda():
        raise RuntimeError("emulate_cuda() is already active on this thread")
    use(codes[0])
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        if len(codes) == 1:
            yield
        else:
            with _CompareSchedules(list(schedules), codes, use):
                yield
    finally:
        _C._set_cuda_emulation(False, 0, 0, 132, 0, 0)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _real_cpu_tensors(args, kwargs) -> bool:
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    return all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)


class _CompareSchedules(TorchDispatchMode):
    """Runs every kvprune op once per schedule and compares the results bitwise."""

    def __init__(self, names, codes, use):
        super().__init__()
        self.names, self.codes, self.use = names, codes, use

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "kvprune" or not _real_cpu_tensors(args, kwargs):
            return func(*args, **kwargs)  # other ops, and fake/meta tensors (torch.compile)
        # Arguments the op writes in place (Tensor(a!) in its schema).
        written = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(value, torch.Tensor):
                    written.append((arg.name, value))
        before = [t.clone() for _, t in written]
        runs = []
        try:
            for n, code in enumerate(self.codes):
                if n > 0:
                    for (_, t), saved in zip(written, before):
                        t.copy_(saved)
                self.use(code)
                out = func(*args, **kwargs)
                flat = list(out) if isinstance(out, (tuple, list)) else [out]
                tensors = [("output %d" % i, o.clone()) for i, o in enumerate(flat)
                           if isinstance(o, torch.Tensor)]
                tensors += [(name, t.clone()) for name, t in written]
                runs.append(tensors)
        finally:
            self.use(self.codes[0])
        first = runs[0]
        for name, run in zip(self.names[1:], runs[1:]):
            for (what, a), (_, b) in zip(first, run):
                if not _same_bits(a, b):
                    raise ScheduleRaceError(
                        f"{func}: {what} differs between the {self.names[0]!r} and {name!r} "
                        f"thread schedules of the CUDA emulator (a race in the kernel)")
        return out
