"""Runs one vLLM engine (CPU backend) in a process of its own, for the engine tests whose
engines cannot share the pytest process: tensor_parallel_size=2 (vLLM spawns one worker
process per rank, each bound to one core) and speculative decoding (after such an engine,
vLLM 0.32 fails to start another in the same process: its Triton kernel overrides are
registered twice).

    python engine_run.py MODEL_DIR JOB_JSON

JOB_JSON: {"prompts": [[token ids]...], "max_tokens": N, "block": B, "engine": {vllm.LLM
keyword arguments beyond the tests' common ones, kp.vllm.engine_args's included}}.
Prints one line "ENGINE_RESULT {json}": the tokens, the blocks kvprune freed, whether the pool
is whole again, each rank's kvprune stats (when kvprune's worker runs) and the speculative
draft tokens scheduled. A failure to build the engine exits non-zero with vLLM's error.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    model_dir, job = sys.argv[1], json.loads(sys.argv[2])
    engine = job["engine"]
    ranks = engine.get("tensor_parallel_size", 1)
    if ranks > 1:  # one core per rank
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(ranks))))
    import vllm

    llm = vllm.LLM(model_dir, dtype="float32", max_model_len=1024, enforce_eager=True,
                   skip_tokenizer_init=True, block_size=job["block"], seed=0,
                   max_num_batched_tokens=1024, **engine)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    drafts = []
    schedule = scheduler.schedule
    def counted_schedule(*args, **kwargs):  # noqa: E306
        out = schedule(*args, **kwargs)
        drafts.append(sum(len(t) for t in out.scheduled_spec_decode_tokens.values()))
        return out

    scheduler.schedule = counted_schedule
    params = vllm.SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True,
                                 detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params,
                        use_tqdm=False)
    llm.llm_engine.step()  # an empty step delivers the finished ids to the workers
    pool = scheduler.kv_cache_manager.block_pool
    kvprune = "worker_cls" in engine
    print("ENGINE_RESULT", json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "freed": getattr(scheduler, "kvprune_freed_blocks", 0),
        "pool_whole": pool.get_num_free_blocks() == pool.num_gpu_blocks - 1,  # block 0: null
        "ranks": llm.collective_rpc("kvprune_stats") if kvprune else [],
        "draft_tokens": sum(drafts)}))


if __name__ == "__main__":
    main()
