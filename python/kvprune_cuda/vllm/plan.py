"""What one engine step compresses, as the scheduler decides it and the workers report it.

The scheduler hands every step's decisions to the workers inside the step's scheduler output,
vLLM's own path to them (pickled to worker processes): :class:`PlannedSchedulerOutput` is vLLM's
``SchedulerOutput`` with one declared field more, :class:`StepPlan`. A worker refuses a scheduler
output without it (the plan was lost, or the engine runs another scheduler), compacts every
planned request in every attention layer or raises, and returns what it compacted on the step's
model output (:class:`ReportedModelRunnerOutput`, with the seconds the step's forward took and
kvprune's own share of them); the scheduler frees a compressed request's emptied blocks only
when that report's digest equals its plan's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import NamedTuple

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput


KINDS = ("prompt", "chunk", "decode")  # what a compression is: the prompt's own at its end, a
# bounded prefill's after an earlier chunk (kvprune_cuda.policy.PrefillBound), the decode rule's


class Compression(NamedTuple):
    """One request's compression in a step: it keeps ``kept`` of the ``held`` tokens it holds
    once the step's are written, the first ``pinned`` (whole blocks) untouched; ``kind``: one
    of :data:`KINDS` (which policy selects, by which evidence)."""
    kept: int
    pinned: int
    held: int
    kind: str = "prompt"


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The compressions of engine step ``step`` (the scheduler's count of the steps it
    planned), by request id."""
    step: int
    rows: dict[str, Compression]

    def digest(self) -> str:
        """A short hash of the step number and every (request, compression)."""
        text = repr((self.step, sorted((r, tuple(c)) for r, c in self.rows.items())))
        return hashlib.sha1(text.encode()).hexdigest()[:16]


def _extended(cls, base, **fields):
    """An instance of ``cls`` (a dataclass extending ``type(base)``) with every field of
    ``base`` as it is, plus ``fields``."""
    extended = cls.__new__(cls)
    extended.__dict__.update(base.__dict__, **fields)
    return extended


@dataclasses.dataclass
class PlannedSchedulerOutput(SchedulerOutput):
    """vLLM's scheduler output with the step's :class:`StepPlan`."""
    kvprune_plan: StepPlan = None  # type: ignore[assignment]

    @classmethod
    def of(cls, output: SchedulerOutput, plan: StepPlan) -> "PlannedSchedulerOutput":
        return _extended(cls, output, kvprune_plan=plan)


@dataclasses.dataclass
class ReportedModelRunnerOutput(ModelRunnerOutput):
    """vLLM's model output with the digest of the :class:`StepPlan` the worker carried out
    ("": none) and the step's :class:`StepSeconds`."""
    kvprune_done: str = ""
    kvprune_seconds: "StepSeconds" = None  # type: ignore[assignment]

    @classmethod
    def of(cls, output: ModelRunnerOutput, digest: str,
           seconds: "StepSeconds") -> "ReportedModelRunnerOutput":
        return _extended(cls, output, kvprune_done=digest, kvprune_seconds=seconds)


class StepSeconds(NamedTuple):
    """A worker's timing of one step: ``forward``, the model runner's execution (the
    forward and kvprune's work in it, sampling apart); ``kvprune``, kvprune's own work in it
    (its bookkeeping of the step's rows, recording queries, scoring, selecting, compacting,
    truncating block tables). Wall-clock
    seconds of the worker's process (CPU: synchronous)."""
    kvprune: float
    forward: float

    def plus(self, other: "StepSeconds") -> "StepSeconds":
        """Both fields summed (a tuple's ``+`` would concatenate)."""
        return StepSeconds(self.kvprune + other.kvprune, self.forward + other.forward)

    @property
    def share(self) -> float:
        """kvprune's own work as a percentage of the forward."""
        return 100 * self.kvprune / max(self.forward, 1e-9)


class PlanNotCarriedOut(RuntimeError):
    """A worker did not compact what its step's plan says."""


def plan_of(scheduler_output) -> StepPlan:
    """The plan a worker must carry out; RuntimeError when the output has none."""
    plan = getattr(scheduler_output, "kvprune_plan", None)
    if not isinstance(plan, StepPlan):
        raise RuntimeError(
            "kvprune_cuda.vllm: the scheduler output carries no compression plan (the engine "
            "does not run kvprune_cuda.vllm.scheduler.Scheduler as its scheduler_cls, or the "
            "plan was lost on its way to the worker); refusing to run the step")
    return plan


def check_report(plan: StepPlan, model_output) -> None:
    """RuntimeError unless the worker reports having carried out exactly ``plan``."""
    if not plan.rows:
        return
    done = getattr(model_output, "kvprune_done", None)
    if done != plan.digest():
        raise RuntimeError(
            f"kvprune_cuda.vllm: step {plan.step} planned compressions of "
            f"{sorted(plan.rows)} (digest {plan.digest()}) but the worker reported "
            f"{done!r}; no block is freed")
