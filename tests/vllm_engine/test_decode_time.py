"""Decode-time compression in vLLM (``engine_args(decode=..., max_held=..., interval=...)``):
a long generation is compressed back to ``max_held`` tokens every ``interval`` generated
tokens and its emptied blocks are freed while it generates; kp.vllm generates exactly the
tokens kp.hf.compress generates under the same rule (fp32 greedy, the tiny model)."""

from __future__ import annotations

import gc

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from test_engine import BLOCK, BUDGET, make_llm  # noqa: E402
from test_engine import hf_model, model_dir, prompts  # noqa: E402,F401  (fixtures)

GEN = 100          # generated tokens: compressions after 32, 64 and 96 of them
MAX_HELD, INTERVAL = 64, 32


def expected_freed(policy, prompt_lens):
    """Blocks freed by the prompt's compression and by every decode-time compression."""
    rule = kp.policy.make_decode("streaming", MAX_HELD, INTERVAL)
    freed = 0
    for n in prompt_lens:
        held = kp.vllm.kept_tokens(kp.vllm.engine_policy(policy, BUDGET), n) or n
        freed += -(-n // BLOCK) - (-(-held // BLOCK))
        for g in range(1, GEN):  # the last token's KV is never written
            held += 1
            kept = rule.compresses(g, 1, held)
            if kept is not None:
                freed += -(-held // BLOCK) - (-(-kept // BLOCK))
                held = kept
    return freed


@pytest.mark.parametrize("prefill, decode", [("snapkv", "streaming"), ("snapkv", "snapkv"),
                                             ("full", "snapkv"), ("snapkv", "h2o")])
def test_decode_compression_frees_blocks_and_matches_kp_hf(model_dir, hf_model, prompts,
                                                           prefill, decode):
    rule = dict(decode=decode, max_held=MAX_HELD, interval=INTERVAL)
    llm = make_llm(model_dir, **kp.vllm.engine_args(prefill, BUDGET, **rule))
    params = vllm.SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True,
                                 detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    out = [list(o.outputs[0].token_ids) for o in outs]
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    llm.llm_engine.step()  # an empty step delivers the finished ids to the worker
    stats = llm.collective_rpc("kvprune_stats")[0]
    freed = scheduler.kvprune_freed_blocks
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    del llm
    gc.collect()
    assert freed == expected_freed(prefill, [len(p) for p in prompts])
    assert stats["evicted"] == {} and stats["decode_evidence"] == 0
    def hf(p, **decode):
        with kp.hf.compress(hf_model, prefill, BUDGET, **decode):
            gen = hf_model.generate(torch.tensor([p]), max_new_tokens=GEN, do_sample=False)
        return gen[0, len(p):].tolist()

    assert out == [hf(p, **rule) for p in prompts]
    assert out[0] != hf(prompts[0])  # the decode-time compressions changed it: teeth


def test_bad_decode_arguments_are_named():
    for kwargs, name in (({"decode": "ring", "max_held": 64, "interval": 32}, "decode"),
                         ({"decode": "snapkv", "max_held": 10, "interval": 32}, "max_held"),
                         ({"decode": "snapkv", "max_held": 64, "interval": 16}, "interval"),
                         ({"decode": "streaming", "max_held": 64}, "interval"),
                         ({"max_held": 64}, "decode")):
        with pytest.raises(ValueError, match=name):
            kp.vllm.engine_args("snapkv", BUDGET, **kwargs)


def test_interval_must_free_whole_blocks(model_dir):
    with pytest.raises(Exception, match="interval"):
        make_llm(model_dir, **kp.vllm.engine_args("snapkv", BUDGET, decode="streaming",
                                                  max_held=64, interval=40))


def test_preempted_after_decode_compression_is_compressed_back(model_dir):
    """A low-priority request, decode-compressed, is preempted when a long high-priority
    prompt needs its blocks; resumed, it is recomputed dense and the rule compresses it back
    in the step that completes the recompute. No block is lost, no state is left."""
    llm = make_llm(model_dir, num_gpu_blocks_override=33, scheduling_policy="priority",
                   **kp.vllm.engine_args("full", decode="snapkv", max_held=MAX_HELD,
                                         interval=INTERVAL))
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    plans, preempted, schedule, preempt = [], [], scheduler.schedule, scheduler._preempt_request

    def recording_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        plans.extend((r, *step) for r, step in out.kvprune_plan.rows.items())
        return out

    def recording_preempt(request, *args, **kwargs):
        preempted.append((request.request_id, request.request_id in scheduler.kvprune_held))
        return preempt(request, *args, **kwargs)

    scheduler.schedule, scheduler._preempt_request = recording_schedule, recording_preempt
    g = torch.Generator().manual_seed(3)
    prompt = lambda n: torch.randint(0, 512, (n,), generator=g).tolist()  # noqa: E731
    params = lambda n: vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,  # noqa: E731
                                           detokenize=False)
    engine.add_request("victim", {"prompt_token_ids": prompt(100)}, params(200), priority=1)
    outputs = {}
    for step in range(2000):
        if step == 40:  # the victim was compressed at 32 generated tokens
            engine.add_request("long", {"prompt_token_ids": prompt(900)}, params(100))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = len(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    engine.step()
    stats = llm.collective_rpc("kvprune_stats")[0]
    pool = scheduler.kv_cache_manager.block_pool
    assert outputs == {"victim": 200, "long": 100}
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert stats["evicted"] == {} and stats["decode_evidence"] == 0
    assert not scheduler.kvprune_held and not scheduler.requests
    del llm
    gc.collect()
    victims = [r for r, compressed in preempted if compressed]
    assert victims, f"no decode-compressed request was preempted: {preempted}"
    steps = [p for p in plans if p[0] == victims[0]]
    # before: 100 + 32 -> 64; after the resume, one compression of the dense recompute
    # (100 prompt tokens + every generated token so far) back to 64, then every 32 as before
    assert steps[0][1:] == (MAX_HELD, 0, 100 + INTERVAL, "decode")
    resumed = [s for s in steps if s[3] > 100 + 2 * INTERVAL]
    assert resumed and resumed[0][1] == MAX_HELD, steps
