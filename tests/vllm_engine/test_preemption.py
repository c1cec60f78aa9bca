"""A request preempted during its prefill is compressed when its prompt completes, and then
generates exactly what it generates uninterrupted (kp.hf.compress's tokens)."""

from __future__ import annotations

import gc

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from test_engine import BLOCK, BUDGET, make_llm  # noqa: E402
from test_engine import hf_model, model_dir  # noqa: E402,F401  (fixtures)

VICTIM, HOG, GEN = 960, 300, 24


def test_preempted_during_its_prefill_is_compressed_when_its_prompt_completes(model_dir,
                                                                                hf_model):
    """A low-priority 960-token prompt (30 blocks), prefilled in 64-token chunks, cannot fit
    beside a high-priority request that decodes (10 blocks and growing) in the same 32-block
    pool: it is preempted with part of its prompt computed, waits, is recomputed from its first
    token (prefix caching off: no block comes back from the cache) and compressed in the step
    that completes its prompt: kept round(0.2 * 960) = 192 of 960, nothing pinned; 30 blocks
    then 6."""
    llm = make_llm(model_dir, num_gpu_blocks_override=33, scheduling_policy="priority",
                   max_num_batched_tokens=64, enable_prefix_caching=False,
                   **kp.vllm.engine_args("snapkv", BUDGET))
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    plans, preempted = [], []
    schedule, preempt = scheduler.schedule, scheduler._preempt_request

    def recording_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        plans.extend((r, tuple(c)) for r, c in out.kvprune_plan.rows.items())
        return out

    def recording_preempt(request, *args, **kwargs):
        preempted.append((request.request_id, request.num_computed_tokens,
                          request.num_output_tokens))
        return preempt(request, *args, **kwargs)

    scheduler.schedule, scheduler._preempt_request = recording_schedule, recording_preempt
    g = torch.Generator().manual_seed(9)
    victim = torch.randint(0, 512, (VICTIM,), generator=g).tolist()
    hog = torch.randint(0, 512, (HOG,), generator=g).tolist()
    params = lambda n: vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,  # noqa: E731
                                           detokenize=False)
    engine.add_request("hog", {"prompt_token_ids": hog}, params(600), priority=0)
    engine.add_request("victim", {"prompt_token_ids": victim}, params(GEN), priority=1)
    outputs = {}
    for _ in range(5000):
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    engine.step()
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    del llm
    gc.collect()
    victim_id = next(r for r, _, _ in preempted)
    assert all(r == victim_id for r, _, _ in preempted)
    # preempted mid-prefill: part of its prompt computed, nothing generated yet
    assert any(0 < computed < VICTIM and out == 0 for _, computed, out in preempted), preempted
    # one compression, when its prompt completed: (kept, pinned, held, kind) by hand
    assert [c for r, c in plans if r == victim_id] == [(192, 0, VICTIM, "prompt")]
    assert -(-VICTIM // BLOCK) == 30 and -(-192 // BLOCK) == 6
    with kp.hf.compress(hf_model, policy="snapkv", budget=BUDGET):
        gen = hf_model.generate(torch.tensor([victim]), max_new_tokens=GEN, do_sample=False)
    assert outputs["victim"] == gen[0, VICTIM:].tolist()  # as uninterrupted, in kp.hf
    assert len(outputs["hog"]) == 600
