"""Prefix caching on (vLLM's default) with compression: blocks shared with another request
are kept whole and never rewritten, the budget applies to each request's own tokens, and no
request hits content that compaction rewrote.

One engine runs three cases at once: (a) requests sharing a 128-token system prompt; (c) a
request that hits the first blocks of another in the step that compresses that other; (b) a
request arriving after another with the same prompt was compressed. Every request's
(kept, pinned) is read off the scheduler while it runs, and its tokens equal kp.hf's under
the same rule: snapkv with the pinned tokens as sinks (``kvprune_cuda.vllm.rules.with_pinned``).
"""

from __future__ import annotations

import gc

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from test_engine import BLOCK, BUDGET, NEW_TOKENS, make_llm  # noqa: E402
from test_engine import hf_model, model_dir  # noqa: E402,F401  (fixtures)

SYSTEM = 128  # tokens of the shared system prompt: 4 blocks


def _external(engine, internal: str) -> str:
    return engine.output_processor.request_states[internal].external_req_id


def _blocks_bytes(llm, block_ids):
    """Every layer's cache rows of ``block_ids`` (a copy), from the worker."""
    def read(worker):
        runner = worker.model_runner
        return [layer.kv_cache[block_ids].clone() for layer in worker.kvprune.layers]
    return llm.collective_rpc(read)[0]


def hf_snapkv_pinned(hf_model, prompt, kept, pinned):
    with kp.hf.compress(hf_model, "snapkv", budget=kept, n_sink=max(4, pinned), window=32):
        gen = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                do_sample=False)
    return gen[0, len(prompt):].tolist()


def test_shared_blocks_stay_shared_and_whole(model_dir, hf_model):
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, 512, (n,), generator=g).tolist()  # noqa: E731
    system, x, z = rand(SYSTEM), rand(300), rand(300)
    prompts = {"c1": x, "c2": x[:160] + rand(140), "a": z}           # (c) and (b)'s first
    prompts.update({f"sys{i}": system + rand(n) for i, n in enumerate((150, 200, 97, 300))})
    llm = make_llm(model_dir, max_num_seqs=16, **kp.vllm.engine_args("snapkv", BUDGET))
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    scheduler = core.scheduler
    assert scheduler.kv_cache_manager.enable_caching  # vLLM's default stands
    params = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                 detokenize=False)
    for r, p in prompts.items():
        engine.add_request(r, {"prompt_token_ids": p}, params)
    held, outputs, system_blocks, system_bytes = {}, {}, None, None
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        for internal, h in scheduler.kvprune_held.items():
            held.setdefault(_external(engine, internal), h)
        if system_blocks is None and "sys0" in held:  # the system prompt's blocks, shared
            internal = next(i for i in scheduler.requests if _external(engine, i) == "sys0")
            blocks = scheduler._groups()[0].req_to_blocks[internal][: SYSTEM // BLOCK]
            assert all(b.ref_cnt >= 2 and b.block_hash is not None for b in blocks)
            system_blocks = [b.block_id for b in blocks]
            system_bytes = _blocks_bytes(llm, system_blocks)
        if "a" in held and "b" not in prompts:  # (b): z again, once "a" is compressed
            prompts["b"] = z
            engine.add_request("b", {"prompt_token_ids": z}, params)
    assert set(outputs) == set(prompts)

    # (a) every system-prompt request pins the shared prompt and compresses its own suffix
    for r in prompts:
        if r.startswith("sys"):
            assert held[r].pinned == SYSTEM, (r, held[r])
    # (c) c2 hit c1's first 5 blocks in the step that compressed c1: both keep them whole
    assert held["c1"].pinned == held["c2"].pinned == 160
    # (b) b found none of a's rewritten blocks in the cache: both computed z in full alike
    assert held["a"].pinned == held["b"].pinned == 0 and outputs["a"] == outputs["b"]
    # kept = pinned + max(round(0.2 * own tokens), n_sink + window = 36), by hand
    assert {r: held[r].kept for r in prompts} == {
        "c1": 160 + 36, "c2": 160 + 36,        # 140 own tokens: 28 < 36
        "a": 60, "b": 60,                      # 300 tokens, nothing pinned
        "sys0": 128 + 36, "sys1": 128 + 40,    # own 150 (30 < 36), 200
        "sys2": 128 + 36, "sys3": 128 + 60}    # own 97 (19 < 36), 300
    for r, p in prompts.items():
        assert outputs[r] == hf_snapkv_pinned(hf_model, p, held[r].kept, held[r].pinned), r
    # the shared blocks were never written: byte-identical after every compression
    after = _blocks_bytes(llm, system_blocks)
    assert all(torch.equal(u, v) for u, v in zip(system_bytes, after))
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    del llm
    gc.collect()


def test_a_shared_block_after_an_unshared_one_is_pinned_too():
    """vLLM may hold two blocks under one hash, so another request can share a later block of
    this one without the block before it: everything up to the last shared block is pinned."""
    from types import SimpleNamespace

    from kvprune_cuda.vllm.scheduler import Scheduler

    blocks = lambda *refs: [SimpleNamespace(ref_cnt=r) for r in refs]  # noqa: E731
    group = SimpleNamespace(block_size=BLOCK, req_to_blocks={})
    fake = SimpleNamespace(_groups=lambda: [group])
    for refs, pinned in (((2, 1, 2, 1), 3 * BLOCK), ((2, 2, 1), 2 * BLOCK), ((1, 1), 0), ((), 0)):
        group.req_to_blocks["r"] = blocks(*refs)
        assert Scheduler._shared_tokens(fake, "r") == pinned, refs
