"""kvprune_cuda.vllm inside vLLM 0.32.0's CPU engine, on a tiny random Qwen2 (no download).

Runs in its own virtual environment (scripts/test_vllm.sh: torch 2.13.0 CPU, vllm-cpu
0.32.0, kvprune_cuda built against that torch); skipped where vllm is not installed.
Greedy decoding in fp32; the model's weights are drawn wide enough (initializer_range
0.2) that its next token depends on the context, so evicting the wrong tokens shows.
"""

from __future__ import annotations

import gc
import os

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
import transformers  # noqa: E402

import kvprune_cuda as kp  # noqa: E402

for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                   ("VLLM_HOST_IP", "127.0.0.1"), ("HF_HUB_OFFLINE", "1")):
    os.environ.setdefault(key, value)

BLOCK = 32
PROMPT_LENS = (300, 200, 97)
NEW_TOKENS = 16
BUDGET = 0.2


def tiny_model() -> "transformers.Qwen2ForCausalLM":
    """The tests' random Qwen2 (vocabulary 512, 2 layers, 4 query and 2 KV heads), seeded."""
    cfg = transformers.Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=2048,
                                   tie_word_embeddings=True, initializer_range=0.2)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_model().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def make_llm(model_dir, **kwargs):
    kwargs.setdefault("max_num_batched_tokens", 1024)  # every prompt in one step
    return vllm.LLM(model_dir, dtype="float32", max_model_len=1024, enforce_eager=True,
                    skip_tokenizer_init=True, block_size=BLOCK, seed=0, **kwargs)


def run_vllm(model_dir, prompts, **kwargs):
    """(tokens per prompt, scheduler, worker stats or None) of one engine."""
    llm = make_llm(model_dir, **kwargs)
    params = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                 detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    stats = llm.collective_rpc("kvprune_stats")[0] if "worker_cls" in kwargs else None
    result = [list(o.outputs[0].token_ids) for o in outs], scheduler, stats
    del llm
    gc.collect()
    return result


def expected_freed(policy):
    freed = 0
    for n in PROMPT_LENS:
        kept = kp.vllm.kept_tokens(kp.vllm.engine_policy(policy, BUDGET), n)
        if kept is not None:
            freed += -(-n // BLOCK) - (-(-kept // BLOCK))
    return freed


def hf_greedy(model, prompt, compressor=None):
    """Greedy tokens; ``compressor`` (a KVCompressor recording the prefill) is applied
    between the prefill and the first decode step."""
    cache = transformers.DynamicCache()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
        if compressor is not None:
            compressor(cache)
        out = [int(logits[0, -1].argmax())]
        while len(out) < NEW_TOKENS:
            logits = model(torch.tensor([[out[-1]]]), past_key_values=cache,
                           use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
    return out


def test_full_policy_equals_plain_vllm(model_dir, prompts):
    plain, _, _ = run_vllm(model_dir, prompts)
    full, scheduler, stats = run_vllm(model_dir, prompts, **kp.vllm.engine_args(policy="full"))
    assert full == plain
    assert scheduler.kvprune_freed_blocks == 0 and stats["compactions"] == 0


def test_plain_vllm_equals_transformers(model_dir, hf_model, prompts):
    # The yardstick of the comparisons below: both engines agree without compression.
    plain, _, _ = run_vllm(model_dir, prompts)
    assert plain == [hf_greedy(hf_model, p) for p in prompts]


def test_snapkv_frees_blocks_and_matches_kp_hf(model_dir, hf_model, prompts):
    out, scheduler, stats = run_vllm(model_dir, prompts, **kp.vllm.engine_args("snapkv", BUDGET))
    assert scheduler.kvprune_freed_blocks == expected_freed("snapkv") == 15
    assert stats["compactions"] == len(PROMPT_LENS) * hf_model.config.num_hidden_layers
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == \
        scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1  # all back (block 0 = null)
    assert out == hf_snapkv(hf_model, prompts)
    plain = [hf_greedy(hf_model, p) for p in prompts]
    assert all(o[0] == r[0] for o, r in zip(out, plain))  # the prefill itself is exact
    assert out != plain  # eviction changed the continuation: the comparison has teeth


def hf_snapkv(hf_model, prompts):
    """kp.hf.compress's greedy tokens under the same policy (the equivalence yardstick)."""
    ref = []
    for p in prompts:
        with kp.hf.compress(hf_model, policy="snapkv", budget=BUDGET):
            gen = hf_model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)
        ref.append(gen[0, len(p):].tolist())
    return ref


@pytest.mark.parametrize("chunk", [40, 64])
def test_chunked_prefill_compresses_at_the_last_chunk(model_dir, hf_model, prompts, chunk):
    """vLLM's default chunked prefill: a step computes at most ``chunk`` tokens, so each prompt
    is computed in pieces (chunk 40: the 300-token prompt's last piece holds 20 tokens, so its
    32-query observation window spans two chunks) and compressed at the step of its last
    piece, scoring every prompt key through the request's blocks. The tokens equal
    kp.hf.compress's and the freed blocks those of one-step prefills; no recorded window
    queries are left behind."""
    args = kp.vllm.engine_args("snapkv", BUDGET)
    assert "enable_chunked_prefill" not in args  # vLLM's default (on) stands
    out, scheduler, stats = run_vllm(model_dir, prompts, max_num_batched_tokens=chunk,
                                     max_num_seqs=4, **args)
    assert scheduler.vllm_config.scheduler_config.enable_chunked_prefill
    assert scheduler.kvprune_freed_blocks == expected_freed("snapkv")
    assert stats["compactions"] == len(PROMPT_LENS) * hf_model.config.num_hidden_layers
    assert stats["recorded_windows"] == 0
    assert out == hf_snapkv(hf_model, prompts)


def run_in_process(model_dir, prompts, max_tokens, **engine):
    """engine_run.py's result for one engine in a process of its own, or the
    CalledProcessError of one that failed (its stderr: vLLM's error)."""
    import json
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).with_name("engine_run.py")
    job = {"prompts": prompts, "max_tokens": max_tokens, "block": BLOCK, "engine": engine}
    run = subprocess.run([sys.executable, str(script), model_dir, json.dumps(job)],
                         capture_output=True, text=True, timeout=600)
    if run.returncode:
        return subprocess.CalledProcessError(run.returncode, script.name, run.stdout,
                                             run.stderr)
    line = next(l for l in run.stdout.splitlines() if l.startswith("ENGINE_RESULT "))
    return json.loads(line.split(" ", 1)[1])


def test_tensor_parallel_2_equals_tp1(model_dir, hf_model, prompts):
    """tensor_parallel_size=2 (two CPU ranks, one KV head each): every rank compacts its own
    heads with the same kept count (it depends only on the prompt), no communication; the
    tokens equal TP=1's (which equal kp.hf.compress's) and the same blocks are freed."""
    result = run_in_process(model_dir, prompts, NEW_TOKENS, tensor_parallel_size=2,
                            **kp.vllm.engine_args("snapkv", BUDGET))
    assert isinstance(result, dict), result.stderr[-3000:]
    assert result["tokens"] == hf_snapkv(hf_model, prompts)
    assert result["freed"] == expected_freed("snapkv") and result["pool_whole"]
    layers = hf_model.config.num_hidden_layers
    assert [r["compactions"] for r in result["ranks"]] == [len(PROMPT_LENS) * layers] * 2


def test_streaming_keeps_sinks_and_recent(model_dir, hf_model, prompts):
    out, scheduler, _ = run_vllm(model_dir, prompts, **kp.vllm.engine_args("streaming", BUDGET))
    assert scheduler.kvprune_freed_blocks == expected_freed("streaming")

    def keep_sinks_and_recent(prompt):
        comp = kp.hf.KVCompressor(hf_model, "snapkv", BUDGET, compress_on_prefill=False).attach()

        def apply(cache):
            n = len(prompt)
            # select_keep on an increasing ramp keeps the sinks and the most recent tokens.
            ramp = torch.arange(n, dtype=torch.float32).expand(1, 2, n).contiguous()
            for i in range(hf_model.config.num_hidden_layers):
                comp.compress_layer(cache, i, ramp)
        return comp, apply

    ref = []
    for p in prompts:
        comp, apply = keep_sinks_and_recent(p)
        try:
            ref.append(hf_greedy(hf_model, p, apply))
        finally:
            comp.detach()
    assert out == ref


def test_decode_allocates_on_held_tokens(model_dir, prompts):
    """After compression, a request gets a new block only when its held tokens (kept +
    generated) fill the last one; positions keep counting the original prompt."""
    llm = make_llm(model_dir, **kp.vllm.engine_args("snapkv", BUDGET))
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    params = vllm.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False)
    engine.add_request("r", {"prompt_token_ids": prompts[0]}, params)  # 300 -> 60 kept
    held_blocks = []
    while engine.has_unfinished_requests():
        engine.step()
        reqs = list(core.scheduler.requests.values())
        if reqs:
            manager = core.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
            held_blocks.append((reqs[0].num_computed_tokens,
                                len(manager.req_to_blocks[reqs[0].request_id])))
    del llm
    gc.collect()
    # num_computed counts positions (300 + generated); blocks follow 60 + generated.
    assert held_blocks[0] == (300, 2)
    for computed, blocks in held_blocks:
        assert blocks == -(-(computed - 240) // BLOCK) or computed == 300


def test_more_requests_fit_in_a_small_pool(model_dir):
    """A pool holding 4 dense 300-token requests runs more of them at once compressed."""
    g = torch.Generator().manual_seed(2)
    many = [torch.randint(0, 512, (300,), generator=g).tolist() for _ in range(12)]
    peaks = {}
    for name, args in (("dense", {}), ("snapkv", kp.vllm.engine_args("snapkv", BUDGET))):
        llm = make_llm(model_dir, num_gpu_blocks_override=4 * 10 + 3, max_num_seqs=16, **args)
        engine = llm.llm_engine
        core = engine.engine_core.engine_core
        params = vllm.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                     detokenize=False)
        for i, p in enumerate(many):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, len(core.scheduler.running))
        peaks[name] = peak
        del llm
        gc.collect()
    assert peaks["dense"] <= 4
    assert peaks["snapkv"] >= 2 * peaks["dense"]
