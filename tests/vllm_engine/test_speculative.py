"""kvprune_cuda.vllm beside vLLM's speculative decoding (n-gram drafts, CPU backend).

Each speculative engine runs in a process of its own (engine_run.py): after one, vLLM 0.32
cannot start another engine in the same process.
"""

from __future__ import annotations

import subprocess

import pytest

vllm = pytest.importorskip("vllm")

import kvprune_cuda as kp  # noqa: E402
from test_engine import BUDGET, NEW_TOKENS, expected_freed, run_in_process, run_vllm  # noqa: E402
from test_engine import model_dir, prompts  # noqa: E402,F401  (fixtures)

# drafts from any earlier occurrence of the last token: proposed at almost every step
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
         "prompt_lookup_min": 1}


def test_prompt_compression_with_speculative_decoding_equals_without(model_dir, prompts):
    """The prompt is compressed before any draft exists; the draft tokens are then written
    and checked against the compacted cache: the same tokens as without drafts, the same
    blocks freed, none lost."""
    plain, scheduler, _ = run_vllm(model_dir, prompts, **kp.vllm.engine_args("snapkv", BUDGET))
    spec = run_in_process(model_dir, prompts, NEW_TOKENS, speculative_config=NGRAM,
                          **kp.vllm.engine_args("snapkv", BUDGET))
    assert isinstance(spec, dict), spec.stderr[-3000:]
    assert spec["draft_tokens"] >= NEW_TOKENS  # the drafts were proposed and verified
    assert spec["tokens"] == plain
    assert spec["freed"] == scheduler.kvprune_freed_blocks == expected_freed("snapkv")
    assert spec["pool_whole"]


def test_decode_rule_refuses_speculative_decoding(model_dir, prompts):
    args = kp.vllm.engine_args("snapkv", BUDGET, decode="streaming", max_held=64, interval=32)
    failed = run_in_process(model_dir, prompts, 4, speculative_config=NGRAM, **args)
    assert isinstance(failed, subprocess.CalledProcessError)
    assert "speculative_config: kvprune_cuda.vllm's decode-time rule" in failed.stderr
