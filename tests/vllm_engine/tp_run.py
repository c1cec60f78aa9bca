"""Runs kp.vllm with tensor_parallel_size=2 on the CPU backend in a process of its own (vLLM
spawns one worker process per rank, each bound to one core), for test_engine.py.

    python tp_run.py MODEL_DIR PROMPTS_JSON BUDGET NEW_TOKENS BLOCK

prints one line "TP_RESULT {json}": the tokens, the blocks freed, each rank's kvprune stats.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank (one NUMA node)


def main() -> None:
    import vllm

    import kvprune_cuda as kp

    model_dir, prompts, budget, new_tokens, block = sys.argv[1], json.loads(sys.argv[2]), \
        float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    llm = vllm.LLM(model_dir, dtype="float32", max_model_len=1024, enforce_eager=True,
                   skip_tokenizer_init=True, block_size=block, seed=0, tensor_parallel_size=2,
                   **kp.vllm.engine_args("snapkv", budget))
    params = vllm.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                                 detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    print("TP_RESULT", json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "freed": scheduler.kvprune_freed_blocks,
                      "ranks": llm.collective_rpc("kvprune_stats")}))


if __name__ == "__main__":
    main()
