"""kvprune_cuda.hf on a tiny randomly initialised Qwen2 (GQA, RoPE): runs in seconds, no download.

Skipped cleanly when ``transformers`` is not installed.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda import hf  # noqa: E402
from kvprune_cuda import reference as ref  # noqa: E402

N_LAYERS, HQ, HKV, D = 2, 4, 2, 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=128, hidden_size=HQ * D, intermediate_size=128, num_hidden_layers=N_LAYERS,
        num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=True, use_sliding_window=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    m = transformers.Qwen2ForCausalLM(cfg).eval()
    # Sharpen attention so eviction visibly matters.
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return m


def _gen(model, ids, mask=None, n=8):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                              min_new_tokens=n, pad_token_id=0)


def _ids(gen, b, n):
    return torch.randint(3, 128, (b, n), generator=gen)


def test_core_does_not_import_transformers():
    import subprocess
    import sys
    code = ("import sys, kvprune_cuda; assert 'transformers' not in sys.modules; "
            "assert 'kvprune_cuda.hf' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_full_equals_plain_generate(model, gen):
    ids = _ids(gen, 1, 40)
    plain = _gen(model, ids)
    with kp.hf.compress(model, policy="full"):
        ours = _gen(model, ids)
    assert torch.equal(plain, ours)


@pytest.mark.parametrize("policy", ["streaming", "snapkv", "h2o"])
def test_budget_above_prompt_equals_plain(model, gen, policy):
    """A budget that keeps every prompt token goes through the masked path yet changes nothing
    (streaming/h2o then cap decode at the budget, which is never reached here)."""
    ids = _ids(gen, 1, 40)
    plain = _gen(model, ids)
    with kp.hf.compress(model, policy=policy, budget=64, n_sink=4, window=8) as kvc:
        ours = _gen(model, ids)
    assert kvc.kept == 40
    assert torch.equal(plain, ours)


def _capture_full(model, ids, window):
    """Full-cache prefill with the queries each layer computes (captured by an attention hook)."""
    seen = {}

    def hook(mod, args, kwargs, out):
        seen[mod.layer_idx] = kwargs
    hs = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    for h in hs:
        h.remove()
    qs = {}
    for i, kw in seen.items():
        attn = model.model.layers[i].self_attn
        cos, sin = kw["position_embeddings"]
        qs[i] = hf.KVCompressor._queries(attn, kw["hidden_states"], cos, sin)[:, :, -window:]
    return cache, qs


@pytest.mark.parametrize("policy", ["streaming", "snapkv"])
def test_prefill_compression_matches_reference(model, gen, policy):
    n, budget, w = 64, 24, 8
    ids = _ids(gen, 1, n)
    full, qs = _capture_full(model, ids, w)
    cache = transformers.DynamicCache()
    with kp.hf.compress(model, policy=policy, budget=budget, n_sink=4, window=w, kernel_size=5):
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    for i in range(N_LAYERS):
        k, v = hf.cache_kv(full, i)
        if policy == "snapkv":
            exp = ref.snapkv(qs[i], k, v, budget, n_sink=4, window=w, kernel_size=5)
        else:
            exp = ref.streaming(k, v, budget, n_sink=4)
        got_k, got_v = hf.cache_kv(cache, i)
        assert got_k.shape == (1, HKV, budget, D)
        torch.testing.assert_close(got_k, exp[0].to(got_k.dtype), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_v, exp[1].to(got_v.dtype), rtol=1e-5, atol=1e-5)
    assert hf.kv_bytes(cache) == 2 * N_LAYERS * HKV * budget * D * 4
    assert hf.kv_bytes(full) == 2 * N_LAYERS * HKV * n * D * 4


def _manual_decode(model, cache, first_logits, steps, pos0, keep=None):
    """Greedy decode on an explicitly compressed cache (keys at original positions)."""
    out = [int(first_logits[0, -1].argmax())]
    with torch.no_grad():
        for t in range(steps - 1):
            pos = torch.tensor([[pos0 + t]])
            if keep is not None:
                pass
            lg = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True,
                       position_ids=pos, cache_position=pos[0]).logits
            out.append(int(lg[0, -1].argmax()))
    return out


def test_snapkv_generate_equals_manual_compressed_cache(model, gen):
    """generate() under the context == prefill, compress with the reference, decode by hand with
    original positions and a mask over the kept entries only."""
    n, budget, w = 64, 24, 8
    ids = _ids(gen, 1, n)
    full, qs = _capture_full(model, ids, w)
    comp = transformers.DynamicCache()
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=transformers.DynamicCache(), use_cache=True).logits
    for i in range(N_LAYERS):
        k, v = hf.cache_kv(full, i)
        kk, vv, _ = ref.snapkv(qs[i], k, v, budget, n_sink=4, window=w, kernel_size=7)
        comp.update(kk.to(k.dtype).contiguous(), vv.to(v.dtype).contiguous(), i)
    expected = _manual_decode(model, comp, logits, 6, n)
    with kp.hf.compress(model, policy="snapkv", budget=budget, n_sink=4, window=w, kernel_size=7):
        got = _gen(model, ids, n=6)[0, n:].tolist()
    assert got == expected


@pytest.mark.parametrize("policy", ["full", "streaming", "snapkv", "h2o"])
def test_left_padded_batch_matches_single(model, gen, policy):
    """Row b of a left-padded batch generates what it generates alone (same token budget)."""
    a, b = _ids(gen, 1, 50), _ids(gen, 1, 37)
    batch = torch.zeros(2, 50, dtype=torch.long)
    mask = torch.zeros(2, 50, dtype=torch.long)
    batch[0], mask[0] = a[0], 1
    batch[1, 13:], mask[1, 13:] = b[0], 1
    kw = dict(policy=policy, budget=30, n_sink=4, window=8)
    with kp.hf.compress(model, **kw):
        out_b = _gen(model, batch, mask, n=6)
        out_a1 = _gen(model, a, n=6)
        out_b1 = _gen(model, b, n=6)
    assert out_b[0, 50:].tolist() == out_a1[0, 50:].tolist()
    assert out_b[1, 50:].tolist() == out_b1[0, 37:].tolist()


def test_streaming_decode_keeps_budget(model, gen):
    ids = _ids(gen, 1, 40)
    cache = transformers.DynamicCache()
    with kp.hf.compress(model, policy="streaming", budget=16, n_sink=4, window=8) as kvc:
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                           past_key_values=cache, pad_token_id=0)
    assert kvc.kept == 16
    assert hf.cache_kv(cache, 0)[0].shape[2] == 16


def test_h2o_decode_keeps_budget_and_sinks(model, gen):
    ids = _ids(gen, 1, 40)
    cache = transformers.DynamicCache()
    with kp.hf.compress(model, policy="h2o", budget=20, n_sink=4, window=8) as kvc:
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                           past_key_values=cache, pad_token_id=0)
        st = kvc.layers[0]
        assert st.valid.shape[2] == 20 and bool(st.valid.all())
    assert hf.cache_kv(cache, 1)[0].shape[2] == 20


def test_query_agnostic_two_forwards(model, gen):
    """Context compressed alone, then a multi-token question on the compressed cache: the hooks'
    mask keeps the question causal (a wrong mask would let question tokens see later ones)."""
    ctx, qst = _ids(gen, 1, 60), _ids(gen, 1, 5)
    with kp.hf.compress(model, policy="streaming", budget=60, n_sink=4, window=8):
        cache = transformers.DynamicCache()
        with torch.no_grad():
            model(input_ids=ctx, past_key_values=cache, use_cache=True)
            lg_two = model(input_ids=qst, past_key_values=cache, use_cache=True).logits
    with torch.no_grad():
        lg_one = model(input_ids=torch.cat([ctx, qst], 1)).logits[:, -5:]
    torch.testing.assert_close(lg_two, lg_one, rtol=1e-4, atol=1e-4)


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="policy"):
        hf.KVCompressor(model, policy="nope")
    with pytest.raises(ValueError, match="budget"):
        hf.KVCompressor(model, policy="snapkv", budget=10, n_sink=4, window=32)
    with pytest.raises(ValueError, match="budget"):
        hf.KVCompressor(model, policy="snapkv", budget=1.5)
    assert hf.resolve_budget(0.2, 4000) == 800 and hf.resolve_budget(512, 4000) == 512


def test_h2o_scores_are_accumulated_attention(model, gen):
    """The H2O score of a key = sum over every prompt query of its attention probability, mean
    over the query heads of its KV head (eager attention weights as the oracle)."""
    ids = _ids(gen, 1, 48)
    kvc = hf.KVCompressor(model, "h2o", 1.0, n_sink=4, window=8, compress_on_prefill=False).attach()
    try:
        with torch.no_grad():
            model(input_ids=ids[:, :40], past_key_values=transformers.DynamicCache(), use_cache=True)
            # a second chunk on the same cache accumulates on top
            cache = transformers.DynamicCache()
            model(input_ids=ids[:, :40], past_key_values=cache, use_cache=True)
            model(input_ids=ids[:, 40:], past_key_values=cache, use_cache=True)
    finally:
        kvc.detach()
    impl = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            att = model(input_ids=ids, output_attentions=True).attentions
    finally:
        model.config._attn_implementation = impl
    for i in range(N_LAYERS):
        a = att[i][0].double().sum(1)                      # [Hq, N] summed over queries
        exp = a.view(HKV, HQ // HKV, -1).mean(1)           # GQA mean
        torch.testing.assert_close(kvc.layers[i].h2o[0].double(), exp, rtol=1e-4, atol=1e-4)
