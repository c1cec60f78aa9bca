"""kvprune_cuda.vllm with an fp8 KV cache (``kv_cache_dtype`` "fp8" / "fp8_e5m2").

vLLM 0.32's CPU backend stores fp8 K/V only on x86 with AVX-512 or AMX; elsewhere it refuses
the setting, and these tests are skipped with that reason.
"""

from __future__ import annotations

import gc

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import _custom_ops as vllm_ops  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda.vllm.cpu_cache import FP8_CACHE_DTYPES, compact_request, request_keys  # noqa: E402
from test_decode_time import GEN, INTERVAL, MAX_HELD  # noqa: E402
from test_decode_time import expected_freed as decode_freed  # noqa: E402
from test_engine import BLOCK, BUDGET, NEW_TOKENS, expected_freed, make_llm  # noqa: E402
from test_engine import hf_model, model_dir, prompts  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU backend stores an fp8 KV cache only on x86 with AVX-512 or AMX")


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_is_read_dequantised_and_compacted_byte_for_byte(cache_dtype):
    # vLLM's own write op fills an fp8 cache; kvprune reads its keys back dequantised and
    # moves the kept tokens' bytes (K and V) unchanged.
    torch.manual_seed(0)
    num_blocks, hkv, d, k_scale, v_scale = 6, 2, 64, 0.5, 0.25
    cache = torch.zeros(num_blocks, hkv, BLOCK, 2 * d, dtype=torch.uint8)
    halves = cache.view(num_blocks, hkv, 2 * BLOCK, d).chunk(2, dim=2)
    n = 3 * BLOCK - 5
    key, value = 3 * torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    block_ids = torch.tensor([4, 1, 3], dtype=torch.int32)
    slots = (block_ids.long()[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:n]
    vllm_ops.cpu_attn_reshape_and_cache(key, value, *halves, slots, "vec", k_scale=k_scale,
                                        v_scale=v_scale, kv_cache_dtype=cache_dtype)
    fp8 = cache.view(FP8_CACHE_DTYPES[cache_dtype])

    keys = request_keys(fp8, block_ids, n, torch.float32, k_scale)
    assert keys.shape == (1, hkv, n, d) and keys.dtype == torch.float32
    per_token = fp8.view(num_blocks, hkv, 2 * BLOCK * d)
    k_bytes = per_token[block_ids.long(), :, : BLOCK * d].view(3, hkv, d, BLOCK)
    k_bytes = k_bytes.permute(1, 0, 3, 2).reshape(hkv, 3 * BLOCK, d)[:, :n]  # [Hkv, n, D]
    assert torch.equal(keys[0], k_bytes.float() * k_scale)  # exactly what attention reads
    exact = key.transpose(0, 1)
    mantissa_bits = 3 if cache_dtype == "fp8" else 2  # e4m3, e5m2: rounding, not a misread
    assert ((keys[0] - exact).abs() <= exact.abs() * 2.0 ** -mantissa_bits + 0.01).all()

    v_bytes = per_token[block_ids.long(), :, BLOCK * d:].view(3, hkv, BLOCK, d)
    v_bytes = v_bytes.transpose(0, 1).reshape(hkv, 3 * BLOCK, d)[:, :n]
    before_k, before_v = k_bytes.clone(), v_bytes.clone()
    kept = 40
    idx = torch.stack([torch.randperm(n)[:kept].sort().values for _ in range(hkv)])
    compact_request(fp8, block_ids[None], n, idx[None].to(torch.int32))
    after_k = request_keys(fp8, block_ids, kept, torch.float32, 1.0)[0]
    after_v = per_token[block_ids.long(), :, BLOCK * d:].view(3, hkv, BLOCK, d)
    after_v = after_v.transpose(0, 1).reshape(hkv, 3 * BLOCK, d)[:, :kept]
    for h in range(hkv):
        raw_k = before_k[h, idx[h]].view(torch.uint8)
        assert torch.equal(after_k[h].to(FP8_CACHE_DTYPES[cache_dtype]).view(torch.uint8), raw_k)
        assert torch.equal(after_v[h].view(torch.uint8), before_v[h, idx[h]].view(torch.uint8))


def run_fp8(model_dir, prompts, cache_dtype, max_tokens, **kwargs):
    """(tokens per prompt, blocks freed by kvprune, worker stats or None) of one engine
    whose pool is checked whole again once every request ended."""
    llm = make_llm(model_dir, kv_cache_dtype=cache_dtype, **kwargs)
    params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                 detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.step()  # an empty step delivers the finished ids to the worker
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all back (block 0 = null)
    stats = llm.collective_rpc("kvprune_stats")[0] if "worker_cls" in kwargs else None
    freed = getattr(scheduler, "kvprune_freed_blocks", 0)
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], freed, stats


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_compresses_and_frees_blocks(model_dir, hf_model, prompts, cache_dtype):
    plain, _, _ = run_fp8(model_dir, prompts, cache_dtype, NEW_TOKENS)
    out, freed, stats = run_fp8(model_dir, prompts, cache_dtype, NEW_TOKENS,
                                **kp.vllm.engine_args("snapkv", BUDGET))
    assert freed == expected_freed("snapkv") == 15
    layers = hf_model.config.num_hidden_layers
    assert stats["compactions"] == layers * len(prompts) and stats["evicted"] == {}
    assert [o[0] for o in out] == [p[0] for p in plain]  # the prefill itself is exact
    assert out != plain  # eviction changed the continuation


def test_fp8_cache_with_h2o_decode_rule(model_dir, prompts):
    # h2o reads the held keys (dequantised) at every decode step.
    args = kp.vllm.engine_args("snapkv", BUDGET, decode="h2o", max_held=MAX_HELD,
                               interval=INTERVAL)
    out, freed, stats = run_fp8(model_dir, prompts, "fp8", GEN, **args)
    assert freed == decode_freed("snapkv", [len(p) for p in prompts])
    assert stats["evicted"] == {} and stats["decode_evidence"] == 0
    assert all(len(o) == GEN for o in out)
