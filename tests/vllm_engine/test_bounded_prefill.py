"""The bounded-peak prefill in vLLM (``engine_args(prefill_max_held=...)``): a prompt four times
longer than the KV pool runs, compressed back to the bound after every chunk of vLLM's chunked
prefill; kp.vllm generates exactly the tokens kp.hf.compress generates with the same bound and
chunk (fp32 greedy, the tiny model), the blocks it holds never pass the hand-computed peak, and
no block is lost, also when a request is aborted mid-prefill."""

from __future__ import annotations

import gc

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from test_engine import BLOCK, make_llm, run_in_process  # noqa: E402
from test_engine import hf_model, model_dir  # noqa: E402,F401  (fixtures)

POOL = 8                 # blocks: 7 usable (block 0 is vLLM's null block), 224 tokens
PROMPT = 900             # > 4 x 224; chunks of 64: 14 x 64 + 4
CHUNK, BOUND, BUDGET = 64, 64, 48
RULE = dict(decode="snapkv", max_held=64, interval=32)
GEN = 40                 # one decode-time compression, after 32 generated tokens
# held while prefilling: 64, then 64 + 64 = 128 -> 64 after every chunk, 64 + 4 = 68 -> 48
PEAK_BLOCKS = -(-(BOUND + CHUNK) // BLOCK)  # 4


@pytest.fixture(scope="module")
def long_prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (PROMPT,), generator=g).tolist() for _ in range(2)]


def bounded_args(signal=None, novelty=None, **rule):
    return kp.vllm.engine_args("snapkv", BUDGET, prefill_max_held=BOUND, prefill_signal=signal,
                               prefill_novelty=novelty, **rule)


def hf_bounded(hf_model, prompt, signal=None, novelty=None):
    with kp.hf.compress(hf_model, "snapkv", BUDGET, prefill_max_held=BOUND, prefill_chunk=CHUNK,
                        prefill_signal=signal, prefill_novelty=novelty, **RULE) as comp:
        gen = hf_model.generate(torch.tensor([prompt]), max_new_tokens=GEN, do_sample=False)
    assert comp.peak_held == BOUND + CHUNK
    return gen[0, len(prompt):].tolist()


def run_steps(llm, requests, abort_after=None, later=None, hits=None):
    """Steps the engine through ``requests`` ({id: prompt}); per step the blocks each request
    holds once the step is scheduled (its new tokens' slots allocated, none freed yet).
    ``abort_after``: (id, step) aborts that request after that step; ``later``: (step,
    {id: prompt}) adds those after that step; ``hits`` (a dict) gets each request's
    prefix-cache hits as the scheduler saw them."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = vllm.SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True,
                                 detokenize=False)
    for req_id, prompt in requests.items():
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    blocks, tokens, step = [], {}, 0
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    schedule = scheduler.schedule

    def scheduled(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if hits is not None:
            hits.update({r.rsplit("-", 1)[0]: n for r, n in scheduler._prefix_hits.items()})
        blocks.append({r.rsplit("-", 1)[0]: len(b)  # vLLM's id: ours and a suffix
                       for r, b in manager.req_to_blocks.items() if b})
        return out

    scheduler.schedule = scheduled
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        if abort_after is not None and step == abort_after[1]:
            engine.abort_request([abort_after[0]])
        if later is not None and step == later[0]:
            for req_id, prompt in later[1].items():
                engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    engine.step()  # an empty step delivers the finished ids to the worker
    return tokens, blocks, scheduler


@pytest.mark.parametrize("signal,novelty", [("max", None), ("far", None), ("window", None),
                                            ("far", 0.5)])
def test_a_prompt_four_times_the_pool_runs_and_matches_kp_hf(model_dir, hf_model, long_prompts,
                                                             signal, novelty):
    llm = make_llm(model_dir, num_gpu_blocks_override=POOL, max_num_batched_tokens=CHUNK,
                   **bounded_args(signal, novelty, **RULE))
    tokens, blocks, scheduler = run_steps(llm, {"long": long_prompts[0]})
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_gpu_blocks == POOL and PROMPT > 4 * (POOL - 1) * BLOCK
    assert pool.get_num_free_blocks() == POOL - 1  # every block back
    stats = llm.collective_rpc("kvprune_stats")[0]
    del llm
    gc.collect()
    peak = max(b.get("long", 0) for b in blocks)
    assert peak == PEAK_BLOCKS
    assert stats["evicted"] == {} and stats["recorded_windows"] == stats["bound_scores"] == 0
    # the worker timed its own work (scoring, selecting, compacting) inside every forward
    assert 0 < stats["seconds"]["kvprune"] < stats["seconds"]["forward"], stats["seconds"]
    assert tokens["long"] == hf_bounded(hf_model, long_prompts[0], signal, novelty)


def test_aborted_mid_prefill_loses_no_block_and_spares_the_other(model_dir, hf_model,
                                                                  long_prompts):
    """Two long prompts share the pool; one is aborted after its prompt was compressed a
    few times: every block returns and the other's tokens are kp.hf's."""
    llm = make_llm(model_dir, num_gpu_blocks_override=POOL, max_num_batched_tokens=CHUNK,
                   **bounded_args(**RULE))
    tokens, blocks, scheduler = run_steps(
        llm, {"kept": long_prompts[0], "aborted": long_prompts[1]}, abort_after=("aborted", 22))
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == POOL - 1
    assert scheduler.kvprune_held == {}
    del llm
    gc.collect()
    assert "aborted" not in tokens
    # it prefilled past the bound (compressed, blocks freed) before it was aborted
    assert max(b.get("aborted", 0) for b in blocks) == PEAK_BLOCKS
    assert max(b.get("kept", 0) for b in blocks) <= PEAK_BLOCKS
    assert tokens["kept"] == hf_bounded(hf_model, long_prompts[0])


def test_a_long_prompt_another_request_repeats_is_not_shared_and_so_not_pinned(
        model_dir, hf_model, long_prompts):
    """Two requests with the same long prompt, the second added once the first's first chunk
    is computed (and would be in the prefix cache): with a bounded prefill the first's blocks
    stay out of the prefix cache, so the second hits none of them, neither pins a shared
    prefix (which would raise its target past the bound), both stay within the bound's peak
    and both generate kp.hf's tokens (each prefills in chunks of 64: vLLM's cap per request
    and step, two requests per step)."""
    llm = make_llm(model_dir, num_gpu_blocks_override=12, max_num_batched_tokens=2 * CHUNK,
                   long_prefill_token_threshold=CHUNK, **bounded_args(**RULE))
    hits: dict = {}
    tokens, blocks, scheduler = run_steps(llm, {"first": long_prompts[0]},
                                          later=(1, {"second": long_prompts[0]}), hits=hits)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 12 - 1
    del llm
    gc.collect()
    assert hits == {"first": 0, "second": 0}
    assert max(b.get("first", 0) for b in blocks) == PEAK_BLOCKS
    assert max(b.get("second", 0) for b in blocks) == PEAK_BLOCKS
    assert tokens["first"] == tokens["second"] == hf_bounded(hf_model, long_prompts[0])


def test_without_a_decode_rule_a_model_length_past_the_pool_is_refused(model_dir, long_prompts):
    """A generation may then grow to max_model_len: vLLM's start-up check stands, with the
    reason and the fix named."""
    result = run_in_process(model_dir, [long_prompts[0]], 8, num_gpu_blocks_override=POOL,
                            **bounded_args())
    assert not isinstance(result, dict)
    assert "To serve at least one request" in result.stderr
    assert "prefill_max_held bounds what a prompt holds while it prefills" in result.stderr


def test_the_bounded_rules_by_hand():
    bound = kp.policy.make_prefill_bound(BOUND, kp.vllm.engine_policy("snapkv", BUDGET))
    rule = kp.policy.make_decode(**RULE)
    assert kp.vllm.rules.bounded_peak(bound, rule, CHUNK) == 64 + 64 + 32
    assert kp.vllm.rules.bounded_peak(bound, None, CHUNK) is None
    assert bound.peak(CHUNK, pinned=96) == 96 + 32 + 64  # a long cached prefix: kept whole
    assert kp.vllm.rules.prefill_compresses(bound, 64, 64, PROMPT, 128) == BOUND
    assert kp.vllm.rules.prefill_compresses(bound, 0, 64, PROMPT, 64) is None  # not over
    assert kp.vllm.rules.prefill_compresses(bound, 896, 4, PROMPT, 68) is None  # the last
    assert kp.vllm.rules.compresses(kp.vllm.engine_policy("snapkv", BUDGET), 896, 4, PROMPT,
                                    0, 0, 68) == BUDGET
