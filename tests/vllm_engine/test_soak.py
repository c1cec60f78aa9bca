"""A bounded soak of kvprune_cuda.vllm in vLLM 0.32.0 (CPU): many requests through one small
pool, with vLLM's defaults (chunked prefill, prefix caching), shared system prompts,
decode-time compression of long answers, aborts at random points and preemption.

Seeded and bounded (a fixed request count and step limit). It asserts: no exception; every
request that finished without being preempted generated what it generates alone, one at a
time, in the same engine (prefix cache emptied first), or, where it kept a prefix whole
because another request shared it, what kp.hf generates under that rule; after everything
ends the BlockPool holds exactly its initial free blocks, no block id twice, and the
scheduler's and the worker's per-request state is empty. Counts (requests, aborts by
phase, preemptions, blocks freed by compression, prefixes kept whole) are printed.
"""

from __future__ import annotations

import gc
import random

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from test_engine import make_llm, hf_model, model_dir  # noqa: E402,F401  (fixtures)

REQUESTS = 200
MAX_MODEL_LEN = 1024
POOL_BLOCKS = 32  # 1024 token slots, the least vLLM accepts (one max_model_len request)
CHUNK = 128       # max_num_batched_tokens: chunked prefill with vLLM's default on
DECODE = dict(decode="snapkv", max_held=160, interval=32)  # long answers compressed again


PHASES = ("prefill chunk", "right after compression", "decode")


def _params(max_tokens):
    return vllm.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                               detokenize=False)


def _workload(rng):
    """(prompt, max_tokens, arrival step, abort: a step, a phase of PHASES or None) per id."""
    lengths = [8, 35, 36, 37, 64, 97, 200, 301, 600, 900]  # below / at / above n_sink + window
    systems = [[rng.randrange(1, 512) for _ in range(n)] for n in (64, 128)]
    out = {}
    for i in range(REQUESTS):
        n = rng.choice(lengths) if i % 4 else rng.randint(2, 900)
        system = systems[i % 2] if i % 3 == 1 else []  # a shared system prompt
        n = max(n - len(system), 1)
        max_tokens = 1 if i % 17 == 0 else rng.randint(1, 48)
        if i % 3 == 0:  # long answers of compressed prompts fill the pool while decoding
            n, max_tokens = rng.choice([301, 450, 600]), rng.randint(100, 200)
        prompt = system + [rng.randrange(1, 512) for _ in range(n)]
        max_tokens = min(max_tokens, MAX_MODEL_LEN - len(prompt))
        arrival = rng.randint(0, 20)
        roll = rng.random()  # abort: at a random step, or once the request reaches a phase
        abort = (arrival + rng.randint(1, 60) if roll < 0.1 else
                 rng.choice(PHASES) if roll < 0.25 else None)
        out[str(i)] = (prompt, max_tokens, arrival, abort)
    return out


def _phase(engine, core, req_id, prompt_len):
    """Where a request (external id) is when it is aborted."""
    internal = engine.output_processor.external_req_ids.get(req_id, [])
    request = core.scheduler.requests.get(internal[0]) if internal else None
    if request is None:
        return "finished"
    if request.num_computed_tokens == 0:
        return "waiting"
    if request.num_computed_tokens < prompt_len:
        return "prefill chunk"
    if request.num_output_tokens <= 1:
        return "right after compression"
    return "decode"


def _check_pool_and_state(llm, core):
    pool = core.scheduler.kv_cache_manager.block_pool
    free = []
    block = pool.free_block_queue.fake_free_list_head.next_free_block
    while block is not None and block is not pool.free_block_queue.fake_free_list_tail:
        free.append(block.block_id)
        block = block.next_free_block
    assert len(free) == len(set(free)), "a block is free twice"
    assert pool.get_num_free_blocks() == len(free) == pool.num_gpu_blocks - 1  # block 0: null
    assert not core.scheduler.requests and not core.scheduler.kvprune_held
    assert not core.scheduler._compressing and not core.scheduler._prefix_hits
    for group in core.scheduler.kv_cache_manager.coordinator.single_type_managers:
        assert not group.req_to_blocks
    stats = llm.collective_rpc("kvprune_stats")[0]
    assert stats["evicted"] == {} and stats["recorded_windows"] == 0, stats


def _hf_pinned(hf_model, prompt, max_tokens, kept, pinned):
    """kp.hf's greedy tokens with the first ``pinned`` prompt tokens kept whole and ``kept``
    kept of the prompt (None: the prompt stays whole), under the same decode-time rule."""
    policy = "full" if kept is None else "snapkv"
    sinks = max(4, pinned)  # the engine's target keeps the pinned prefix and the window
    decode = {**DECODE, "max_held": max(DECODE["max_held"], sinks + 32)}
    with kp.hf.compress(hf_model, policy, budget=kept or 1.0, n_sink=sinks, window=32,
                        **decode):
        gen = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False)
    return gen[0, len(prompt):].tolist()


def test_soak_aborts_preemption_and_faults_lose_no_block(model_dir, hf_model):
    rng = random.Random(0)
    work = _workload(rng)
    llm = make_llm(model_dir, max_num_batched_tokens=CHUNK, max_num_seqs=16,
                   num_gpu_blocks_override=POOL_BLOCKS + 1,
                   **kp.vllm.engine_args("snapkv", 0.2, **DECODE))
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    preempted: set = set()
    preempted_compressed: set = set()  # preempted while holding a compressed cache
    preempted_decode: set = set()      # ... after a decode-time compression
    preempt = core.scheduler._preempt_request

    def counting_preempt(request, *args, **kwargs):
        r = engine.output_processor.request_states[request.request_id].external_req_id
        preempted.add(r)
        if request.request_id in core.scheduler.kvprune_held:
            preempted_compressed.add(r)
            steps = plans.get(r, [])
            if len(steps) - (steps[0][2] == len(work[r][0])) > 0:
                preempted_decode.add(r)  # compressed while decoding, then preempted
        return preempt(request, *args, **kwargs)

    core.scheduler._preempt_request = counting_preempt
    plans: dict = {}  # id -> every Compression (kept, pinned, held, kind) the scheduler decided
    schedule = core.scheduler.schedule

    def recording_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for internal, step in out.kvprune_plan.rows.items():
            r = engine.output_processor.request_states[internal].external_req_id
            plans.setdefault(r, []).append(step)
        return out

    core.scheduler.schedule = recording_schedule
    # fault: a prompt of exactly max_model_len leaves no room to generate: vLLM refuses it
    with pytest.raises(Exception, match="maximum model length"):
        engine.add_request("too-long", {"prompt_token_ids": [1] * MAX_MODEL_LEN}, _params(1))
    outputs, aborted, step = {}, {}, 0
    freed_before = core.scheduler.kvprune_freed_blocks
    pending = sorted(work, key=lambda r: work[r][2])
    while (pending or engine.has_unfinished_requests()) and step < 12000:
        while pending and work[pending[0]][2] <= step:
            r = pending.pop(0)
            engine.add_request(r, {"prompt_token_ids": work[r][0]}, _params(work[r][1]))
        for r, (prompt, _, arrival, abort) in work.items():
            if abort is None or r in outputs or r in aborted or arrival > step:
                continue
            phase = _phase(engine, core, r, len(prompt))
            if abort == step or abort == phase:
                aborted[r] = phase
                engine.abort_request([r])
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    assert not pending and not engine.has_unfinished_requests(), f"stuck after {step} steps"
    engine.step()  # one empty step delivers the last finished ids to the worker
    _check_pool_and_state(llm, core)
    freed = core.scheduler.kvprune_freed_blocks - freed_before
    phases = {p: sum(1 for x in aborted.values() if x == p) for p in set(aborted.values())}
    policy = kp.vllm.engine_policy("snapkv", 0.2)
    prompt_kept, pinned = {}, {}  # of finished requests that kept a shared prefix whole
    for r in outputs:
        steps, n = plans.get(r, []), len(work[r][0])
        prompt_kept[r] = steps[0][0] if steps and steps[0][2] == n else None  # always first
        p = max((step.pinned for step in steps), default=0)
        if r not in preempted and (p or not steps and kp.vllm.kept_tokens(policy, n)):
            pinned[r] = p  # alone, with nothing to share, it would keep other tokens
    decode_compressed = sum(len(plans.get(r, [])) - (prompt_kept[r] is not None)
                            for r in outputs)
    print(f"\nsoak: {REQUESTS} requests in {step} steps, {len(outputs)} finished, "
          f"{len(aborted)} aborted {phases}, {len(preempted)} preempted "
          f"({len(preempted_compressed)} holding a compressed cache, {len(preempted_decode)} "
          f"after a decode-time compression), {freed} blocks freed "
          f"by compression, {decode_compressed} decode-time compressions of finished requests, "
          f"{len(pinned)} finished keeping a shared prefix whole, 0 leaked")
    assert len(preempted_compressed) > 0 and freed > 0 and len(pinned) > 0
    assert decode_compressed > 0
    assert all(phases.get(p) for p in ("waiting", *PHASES)), phases
    assert len(outputs) + len(aborted) == REQUESTS
    assert all(len(outputs[r]) == work[r][1] for r in outputs)

    # a sample of requests compressed alone (never preempted, nothing pinned): kp.hf's tokens
    # under the same rule, an oracle outside the engine
    sample = [r for r in sorted(outputs) if r not in preempted and r not in pinned
              and prompt_kept.get(r) is not None][:6]
    assert len(sample) == 6
    for r in sample:
        assert outputs[r] == _hf_pinned(hf_model, work[r][0], work[r][1], prompt_kept[r], 0), r

    # every finished request that was never preempted generates what it generates alone
    # (a preempted one is recomputed dense: its continuation is the dense cache's); one that
    # kept a shared prefix whole, what kp.hf generates under that rule
    mismatched = []
    for r, got in outputs.items():
        if r in preempted:
            continue
        if r in pinned:
            if got != _hf_pinned(hf_model, work[r][0], work[r][1], prompt_kept[r], pinned[r]):
                mismatched.append(r)
            continue
        assert engine.reset_prefix_cache()  # alone: nothing read from the cache either
        engine.add_request(f"alone-{r}", {"prompt_token_ids": work[r][0]}, _params(work[r][1]))
        alone = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    alone = list(out.outputs[0].token_ids)
        if alone != got:
            mismatched.append(r)
    engine.step()
    _check_pool_and_state(llm, core)
    del llm
    gc.collect()
    assert not mismatched, f"batched != alone for {mismatched}"
