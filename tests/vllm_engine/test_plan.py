"""The compression plan is declared and fail-loud (kvprune_cuda.vllm.plan): a worker refuses a
step without its plan, raises when a planned request was not compacted in every layer, and
the scheduler frees no block unless the worker reports the plan it was given."""

from __future__ import annotations

import gc

import pytest

vllm = pytest.importorskip("vllm")

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda.vllm import worker as kv_worker  # noqa: E402
from kvprune_cuda.vllm.plan import (Compression, StepPlan, check_report,  # noqa: E402
                                    plan_of)
from test_engine import BUDGET, make_llm, model_dir, prompts  # noqa: E402,F401


def test_a_step_without_a_plan_is_refused():
    from vllm.v1.core.sched.output import SchedulerOutput

    with pytest.raises(RuntimeError, match="carries no compression plan"):
        plan_of(SchedulerOutput.make_empty())  # vLLM's own, without the plan


def test_the_report_must_match_the_plan():
    plan = StepPlan(7, {"a": Compression(60, 0, 300), "b": Compression(40, 32, 200)})
    done = type("Out", (), {"kvprune_done": StepPlan(7, dict(plan.rows)).digest()})
    check_report(plan, done)
    check_report(StepPlan(8, {}), object())  # nothing planned: nothing to report
    for wrong in (StepPlan(8, dict(plan.rows)), StepPlan(7, {"a": plan.rows["a"]}),
                  StepPlan(7, {**plan.rows, "b": Compression(41, 32, 200)})):
        with pytest.raises(RuntimeError, match="no block is freed"):
            check_report(plan, type("Out", (), {"kvprune_done": wrong.digest()}))
    with pytest.raises(RuntimeError, match="reported None"):
        check_report(plan, object())  # a worker that never saw the plan reports nothing


def test_a_skipped_compaction_stops_the_engine(model_dir, prompts, monkeypatch):
    """A worker whose attention wrapper does not compact (what torch.compile did to the old
    forward hook) raises instead of letting the scheduler free blocks still in use."""
    monkeypatch.setattr(kv_worker.RunnerHooks, "_after_attention", lambda *a, **k: None)
    llm = make_llm(model_dir, **kp.vllm.engine_args("snapkv", BUDGET))
    params = vllm.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    with pytest.raises(Exception, match="compacted in all 2 layers"):
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    del llm
    gc.collect()
