"""A user's own policy (user_policy.QueryKeyMax: defined outside kvprune_cuda, not a subclass
of a built-in, scoring by the last window queries) runs in kp.hf.compress and in kp.vllm,
which generate the same tokens with it and free the same blocks."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from test_engine import BUDGET, NEW_TOKENS, run_vllm  # noqa: E402
from test_engine import hf_model, model_dir, prompts  # noqa: E402,F401  (fixtures)
from user_policy import QueryKeyMax  # noqa: E402


def test_a_user_policy_runs_in_kp_hf_and_kp_vllm_alike(model_dir, hf_model, prompts):
    policy = QueryKeyMax(BUDGET)
    assert not isinstance(policy, (kp.policy.SnapKV, kp.policy.Streaming))
    out, scheduler, stats = run_vllm(model_dir, prompts, **kp.vllm.engine_args(policy))
    # prompts of 300, 200, 97 tokens keep 60, 40, 36: blocks of 32 go 10->2, 7->2, 4->2
    assert scheduler.kvprune_freed_blocks == 8 + 5 + 2
    assert stats["compactions"] == len(prompts) * hf_model.config.num_hidden_layers
    ref = []
    for p in prompts:
        with kp.hf.compress(hf_model, policy=policy):
            gen = hf_model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)
        ref.append(gen[0, len(p):].tolist())
    assert out == ref
    by_name, _, _ = run_vllm(model_dir, prompts, **kp.vllm.engine_args("qk-max", BUDGET))
    assert by_name == out  # registered: the name works as well
    snapkv, _, _ = run_vllm(model_dir, prompts, **kp.vllm.engine_args("snapkv", BUDGET))
    assert snapkv != out  # the policy decides what is kept
