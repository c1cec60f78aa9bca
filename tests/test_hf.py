"""kvprune_cuda.hf on a tiny randomly initialised Qwen2 (GQA, RoPE): runs in seconds, no download.

Skipped cleanly when ``transformers`` is not installed.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda import hf  # noqa: E402
from kvprune_cuda import reference as ref  # noqa: E402

N_LAYERS, HQ, HKV, D = 2, 4, 2, 16


def _tiny(config_cls, model_cls):
    """A tiny random causal LM (GQA, RoPE) of the given family, attention sharpened."""
    torch.manual_seed(0)
    cfg = config_cls(
        vocab_size=128, hidden_size=HQ * D, intermediate_size=128, num_hidden_layers=N_LAYERS,
        num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=True, use_sliding_window=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    m = model_cls(cfg).eval()
    # Sharpen attention so eviction visibly matters (Qwen3 normalises q, so scale q_norm too).
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            if getattr(layer.self_attn, "q_norm", None) is not None:
                layer.self_attn.q_norm.weight.mul_(4.0)
    return m


@pytest.fixture(scope="module")
def model():
    return _tiny(transformers.Qwen2Config, transformers.Qwen2ForCausalLM)


@pytest.fixture(scope="module")
def qwen3():
    """Qwen3: RMS-normalised queries and keys (``q_norm`` / ``k_norm``) before RoPE."""
    if not hasattr(transformers, "Qwen3Config"):
        pytest.skip("this transformers has no Qwen3")
    m = _tiny(transformers.Qwen3Config, transformers.Qwen3ForCausalLM)
    assert m.model.layers[0].self_attn.q_norm is not None
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
    assert kvc.compressed_len == 40
    assert torch.equal(plain, ours)


@contextlib.contextmanager
def _eager_capture(model, values=False):
    """Runs ``model`` with eager attention and records, per layer and call, what each attention
    module hands to its attention function: ``(query [B,Hq,q,D], key [B,Hkv,L,D], weights
    [B,Hq,q,L])`` -- the module's own post-RoPE (and post-q_norm) queries, the cache it attends
    over (after the update, before any eviction) and its softmax weights; with ``values``, the
    cache's values [B,Hkv,L,D] too (a fourth element). Independent of hf.py.
    """
    mod = sys.modules[type(model.model.layers[0].self_attn).__module__]
    eager = mod.eager_attention_forward
    calls: dict[int, list] = {}

    def capture(module, query, key, value, attention_mask, *args, **kwargs):
        out, weights = eager(module, query, key, value, attention_mask, *args, **kwargs)
        calls.setdefault(module.layer_idx, []).append(
            (query.detach().clone(), key.detach().clone(), weights.detach().double())
            + ((value.detach().clone(),) if values else ()))
        return out, weights

    impl = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    mod.eager_attention_forward = capture
    try:
        yield calls
    finally:
        mod.eager_attention_forward = eager
        model.config._attn_implementation = impl


def _capture_full(model, ids, window):
    """Full-cache prefill, and each layer's last ``window`` post-RoPE queries as its attention
    function received them (not recomputed with hf.py's own ``_queries``)."""
    cache = transformers.DynamicCache()
    with _eager_capture(model) as calls, torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    qs = {i: c[0][0][:, :, -window:] for i, c in calls.items()}
    return cache, qs


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("policy,kernel_size,shift", [("streaming", 5, 0), ("snapkv", 5, 0),
                                                      ("snapkv", 5, 2), ("snapkv", 49, 16)])
def test_prefill_compression_matches_reference(request, gen, policy, kernel_size, shift, arch):
    model = request.getfixturevalue("model" if arch == "qwen2" else "qwen3")
    n, budget, w = 64, 24, 8
    ids = _ids(gen, 1, n)
    full, qs = _capture_full(model, ids, w)
    cache = transformers.DynamicCache()
    with kp.hf.compress(model, policy=policy, budget=budget, n_sink=4, window=w,
                        kernel_size=kernel_size, pool_shift=shift):
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    for i in range(N_LAYERS):
        k, v = hf.cache_kv(full, i)
        if policy == "snapkv":
            exp = ref.snapkv(qs[i], k, v, budget, n_sink=4, window=w, kernel_size=kernel_size,
                             pool_shift=shift)
        else:
            exp = ref.streaming(k, v, budget, n_sink=4)
        got_k, got_v = hf.cache_kv(cache, i)
        assert got_k.shape == (1, HKV, budget, D)
        torch.testing.assert_close(got_k, exp[0].to(got_k.dtype), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_v, exp[1].to(got_v.dtype), rtol=1e-5, atol=1e-5)
    positions = HKV * budget * 4 + 4 if policy == "streaming" else 0  # ring: slot_pos, seq_lens
    assert hf.kv_bytes(cache) == N_LAYERS * (2 * HKV * budget * D * 4 + positions)
    assert hf.kv_bytes(full) == 2 * N_LAYERS * HKV * n * D * 4


def test_the_default_policy_runs_the_fused_snapkv(model, gen, monkeypatch):
    """kp.hf's default policy (snapkv: 49-wide pool shifted by 16) compresses every layer with
    one kp.snapkv call, and never ranks through kp.select_keep."""
    from kvprune_cuda.policy import snapkv as snapkv_module
    calls = []

    def fused(*args, **kwargs):
        calls.append(kwargs["pool_shift"])
        return kp.snapkv(*args, **kwargs)

    monkeypatch.setattr(snapkv_module, "snapkv", fused)
    monkeypatch.setattr(kp, "select_keep", None)  # the staged path would fail on it
    with kp.hf.compress(model, budget=48) as comp, torch.no_grad():
        assert comp.policy == kp.policy.SnapKV(budget=48)
        model(input_ids=_ids(gen, 1, 120), use_cache=True)
    assert calls == [16] * N_LAYERS


class _OldestSnapKV(kp.policy.SnapKV):
    """Scores the oldest tokens highest: a subclass whose ``score`` the fused snapkv op would
    not compute."""

    def score(self, queries, keys, *, scale=None, seq_lens=None):
        b, hkv, n = keys.shape[:3]
        return -torch.arange(n, dtype=torch.float32).expand(b, hkv, n).clone()


class _OldestStreaming(kp.policy.Streaming):
    """Streaming with the recency order reversed (a ``score`` kp.streaming would not use)."""

    score = _OldestSnapKV.score


@pytest.mark.parametrize("policy_cls", [_OldestSnapKV, _OldestStreaming])
def test_a_policy_subclass_scores_are_the_ones_ranked(model, gen, policy_cls):
    """A subclass overriding ``score`` keeps what its scores rank first (here the oldest
    tokens besides the window), not what the parent's fused op would keep."""
    n, budget, w = 64, 24, 8
    ids = _ids(gen, 1, n)
    full, _ = _capture_full(model, ids, w)
    cache = transformers.DynamicCache()
    policy = policy_cls(budget=budget, n_sink=4, window=w)
    with kp.hf.compress(model, policy=policy) as comp, torch.no_grad():
        assert comp.policy == policy
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    keep = list(range(budget - w)) + list(range(n - w, n))
    for i in range(N_LAYERS):
        k, v = hf.cache_kv(full, i)
        got_k, got_v = hf.cache_kv(cache, i)
        torch.testing.assert_close(got_k, k[:, :, keep], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_v, v[:, :, keep], rtol=1e-5, atol=1e-5)


def test_a_policy_instance_keeps_its_options(model):
    """Options left out keep the instance's; given ones replace them."""
    p = kp.policy.SnapKV(budget=24, window=8, kernel_size=15, pool="avg")
    with kp.hf.compress(model, policy=p) as comp:
        assert comp.policy == p
    with kp.hf.compress(model, policy=p, budget=30) as comp:
        assert comp.policy == kp.policy.SnapKV(budget=30, window=8, kernel_size=15, pool="avg")
    with kp.hf.compress(model) as comp:  # a name: the class defaults
        assert comp.policy == kp.policy.SnapKV()


def _manual_decode(model, cache, first_logits, steps, pos0):
    """Greedy decode on an explicitly compressed cache (keys at original positions)."""
    out = [int(first_logits[0, -1].argmax())]
    with torch.no_grad():
        for t in range(steps - 1):
            pos = torch.tensor([[pos0 + t]])
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
    with kp.hf.compress(model, policy="snapkv", budget=budget, n_sink=4, window=w, kernel_size=7,
                        pool_shift=0):
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


def test_left_padded_row_keeps_its_own_tokens_under_the_default_pool(model, gen):
    """With the default snapkv (a shifted pool, ranked by kp.select_keep), a left-padded row
    keeps the keys it keeps alone: its scores are computed on its unpadded keys."""
    a, b = _ids(gen, 1, 160), _ids(gen, 1, 120)
    batch, mask = torch.zeros(2, 160, dtype=torch.long), torch.zeros(2, 160, dtype=torch.long)
    batch[0], mask[0] = a[0], 1
    batch[1, 40:], mask[1, 40:] = b[0], 1
    both, alone = transformers.DynamicCache(), transformers.DynamicCache()
    with kp.hf.compress(model, policy="snapkv", budget=48, n_sink=4, window=8) as kvc:
        assert kvc.policy.shift == 16
        with torch.no_grad():
            model(input_ids=batch, attention_mask=mask, past_key_values=both, use_cache=True,
                  position_ids=(mask.cumsum(-1) - 1).clamp_min(0))  # as generate() gives them
    with kp.hf.compress(model, policy="snapkv", budget=48, n_sink=4, window=8):
        with torch.no_grad():
            model(input_ids=b, past_key_values=alone, use_cache=True)
    for i in range(N_LAYERS):
        torch.testing.assert_close(hf.cache_kv(both, i)[0][1], hf.cache_kv(alone, i)[0][0],
                                   rtol=1e-4, atol=1e-4)


def test_streaming_decode_keeps_budget(model, gen):
    ids = _ids(gen, 1, 40)
    cache = transformers.DynamicCache()
    with kp.hf.compress(model, policy="streaming", budget=16, n_sink=4, window=8) as kvc:
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                           past_key_values=cache, pad_token_id=0)
    assert kvc.compressed_len == 16
    assert hf.cache_kv(cache, 0)[0].shape[2] == 16


def test_h2o_decode_keeps_budget_and_sinks(model, gen):
    ids = _ids(gen, 1, 40)
    cache = transformers.DynamicCache()
    with kp.hf.compress(model, policy="h2o", budget=20, n_sink=4, window=8) as kvc:
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                           past_key_values=cache, pad_token_id=0)
    for layer in range(N_LAYERS):  # 40 prompt tokens + 9 decode forwards, 20 slots all in use
        c = cache.layers[layer].decode
        assert c.seq_lens.tolist() == [49] and c.k.shape[2] == 20 and bool((c.slot_pos >= 0).all())
        assert bool((c.slot_pos[..., :4] == torch.arange(4, dtype=torch.int32)).all())  # sinks
    assert kvc.compressed_len == 20 and hf.cache_kv(cache, 1)[0].shape[2] == 20


def test_query_agnostic_two_forwards(model, gen):
    """Context compressed alone, then a multi-token question on the compressed cache: the hooks'
    mask keeps the question causal (a wrong mask would let question tokens see later ones).
    Streaming's capacity (65) holds context and question: nothing is evicted."""
    ctx, qst = _ids(gen, 1, 60), _ids(gen, 1, 5)
    with kp.hf.compress(model, policy="streaming", budget=65, n_sink=4, window=8):
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
        hf.KVCompressor(model, policy="snapkv", budget=10, options=kp.policy.Options(n_sink=4, window=32))
    with pytest.raises(ValueError, match="budget"):
        hf.KVCompressor(model, policy="snapkv", budget=1.5)
    assert hf.resolve_budget(0.2, 4000) == 800 and hf.resolve_budget(512, 4000) == 512
    assert hf.resolve_budget is kp.policy.resolve_budget


def _lookup_gen(model, ids, n=40):
    """Greedy prompt-lookup generation: candidates from earlier n-grams, the cache rolled back
    past the rejected ones."""
    with torch.no_grad():
        return model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0, prompt_lookup_num_tokens=3,
                              max_matching_ngram_size=1)


@pytest.mark.parametrize("policy, decode", [
    ("snapkv", {}), ("snapkv", {"decode": "streaming", "max_held": 48, "interval": 16}),
    ("full", {"decode": "snapkv", "max_held": 48, "interval": 16})])
def test_candidate_generation_on_a_compressed_cache_is_refused(model, gen, policy, decode):
    # Rolling the cache back past rejected candidates cannot undo a compression or a decode
    # rule's evidence: it used to continue silently with other tokens from the second on.
    prompt = _ids(gen, 1, 120)
    prompt = torch.cat([prompt, prompt[:, :30]], 1)  # repeats: candidates get proposed
    with hf.compress(model, policy=policy, budget=0.3, window=8, **decode):
        with pytest.raises(ValueError, match="cache_position: .* cannot be cropped or rolled"):
            _lookup_gen(model, prompt)


def test_a_cropped_compressed_cache_is_refused(model, gen):
    # The length check alone (a forward without cache_position, as newer transformers make).
    prompt = _ids(gen, 1, 120)
    cache = transformers.DynamicCache()
    with hf.compress(model, policy="snapkv", budget=0.3, window=8), torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)
        model(prompt[:, -1:], past_key_values=cache, use_cache=True)  # decoding is fine
        cache.crop(cache.get_seq_length() - 2)
        with pytest.raises(ValueError, match="cache_position: .* cannot be cropped or rolled"):
            model(prompt[:, -1:], past_key_values=cache, use_cache=True)


def test_candidate_generation_without_compression_is_exact(model, gen):
    prompt = _ids(gen, 1, 120)
    prompt = torch.cat([prompt, prompt[:, :30]], 1)
    with hf.compress(model, policy="full"):
        assert torch.equal(_lookup_gen(model, prompt), _gen(model, prompt, n=40))


def test_h2o_scores_are_accumulated_attention(model, gen):
    """The H2O score of a key = sum over every prompt query of its attention probability, mean
    over the query heads of its KV head (eager attention weights as the oracle)."""
    ids = _ids(gen, 1, 48)
    kvc = hf.KVCompressor(model, "h2o", 1.0, options=kp.policy.Options(n_sink=4, window=8),
                          compress_on_prefill=False).attach()
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


# ---- what each layer holds after decoding (items: streaming / h2o eviction content) ---------


def _positions(calls, layer):
    """Per call of one layer: the stream position held in every slot of every KV head.

    A call's new tokens are the key rows never seen before (random keys are distinct), at the
    next positions in slot order (one token per decode call; the prefill is in order); every
    other row is identified by exact equality with a key seen earlier. Returns
    [(pos [Hkv, L] long, weights [Hq, q, L] double)] per call (B = 1)."""
    seen: list[dict] = [dict() for _ in range(HKV)]  # per KV head: key bytes -> position
    count, out = 0, []
    for query, key, weights in calls[layer]:
        q, length = query.shape[2], key.shape[2]
        pos = torch.empty(HKV, length, dtype=torch.long)
        for g in range(HKV):
            new = 0
            for s in range(length):
                row = key[0, g, s].numpy().tobytes()
                if row not in seen[g]:
                    seen[g][row] = count + new
                    new += 1
                pos[g, s] = seen[g][row]
            assert new == q, (layer, g, new, q)
        count += q
        out.append((pos, weights[0]))
    return out


def _slot_positions(cache, layer):
    """[Hkv, C] positions a FixedCapacityLayer holds (B = 1)."""
    lay = cache.layers[layer]
    assert type(lay).__name__ == "FixedCapacityLayer"
    return lay.decode.slot_pos[0].long()


def test_streaming_decode_holds_sinks_and_most_recent(model, gen):
    """At every decode step each layer and KV head attends over exactly the sinks plus the
    ``budget - n_sink`` most recent positions, the new token's included (StreamingLLM: room is
    made before the token is attended), and the cache ends holding the same."""
    n, budget, sinks, new = 40, 16, 4, 10
    ids = _ids(gen, 1, n)
    cache = transformers.DynamicCache()
    with _eager_capture(model) as calls:
        with kp.hf.compress(model, policy="streaming", budget=budget, n_sink=sinks, window=8):
            with torch.no_grad():
                model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, past_key_values=cache, pad_token_id=0)
    for layer in range(N_LAYERS):
        assert len(calls[layer]) == new  # the prefill, then one call per decoded token but the last
        steps = _positions(calls, layer)
        held = [pos for pos, _ in steps[1:]] + [_slot_positions(cache, layer)]
        for step, pos in enumerate(held, start=1):
            total = n + step if step < new else n + new - 1  # tokens seen by this call
            want = list(range(sinks)) + list(range(total - (budget - sinks), total))
            for g in range(HKV):
                assert sorted(pos[g].tolist()) == want, (layer, step, g)


def test_h2o_decode_evicts_lowest_accumulated_attention(model, gen):
    """H2O: after the prefill each layer keeps sinks, the last ``window`` and the highest
    accumulated prompt attention; before each decoded token is attended, the slot given up for
    it is the one with the lowest accumulated attention (eager softmax weights of every query
    so far, GQA mean) among positions outside the sinks and the ``window`` most recent."""
    n, budget, sinks, w, new = 40, 20, 4, 8, 12
    ids = _ids(gen, 1, n)
    cache = transformers.DynamicCache()
    with _eager_capture(model) as calls:
        with kp.hf.compress(model, policy="h2o", budget=budget, n_sink=sinks, window=w):
            with torch.no_grad():
                model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, past_key_values=cache, pad_token_id=0)
    group = HQ // HKV
    evictions = 0
    for layer in range(N_LAYERS):
        steps = _positions(calls, layer)
        score = torch.zeros(HKV, n + new, dtype=torch.float64)  # accumulated, by position
        (pos0, weights0), decode = steps[0], steps[1:]
        score.scatter_add_(1, pos0, weights0.sum(1).view(HKV, group, -1).mean(1))
        middle = torch.arange(sinks, n - w)
        before = []  # per KV head: positions held after the prefill compression
        for g in range(HKV):
            top = middle[torch.sort(-score[g, sinks:n - w], stable=True).indices]
            before.append(sorted(list(range(sinks)) + top[:budget - sinks - w].tolist()
                                 + list(range(n - w, n))))
        for step, (pos, weights) in enumerate(decode, start=1):
            seen = n + step - 1  # tokens seen before this call's token
            for g in range(HKV):
                cand = torch.tensor([p for p in before[g] if sinks <= p < seen - w])
                victim = int(cand[torch.argmin(score[g, cand])])
                want = sorted([p for p in before[g] if p != victim] + [seen])
                assert sorted(pos[g].tolist()) == want, (layer, step, g)
                gap = torch.sort(score[g, cand]).values[:2]
                assert float(gap[1] - gap[0]) > 1e-6, "tie: the choice would be ambiguous"
                evictions += 1
            score.scatter_add_(1, pos, weights.sum(1).view(HKV, group, -1).mean(1))
            before = [sorted(pos[g].tolist()) for g in range(HKV)]
        final = _slot_positions(cache, layer)
        assert [sorted(final[g].tolist()) for g in range(HKV)] == before
        got = cache.layers[layer].decode.h2o_scores[0].double()  # the scores the op accumulated
        torch.testing.assert_close(got, torch.gather(score, 1, final), rtol=1e-4, atol=1e-5)
    assert evictions == N_LAYERS * HKV * (new - 1)


def test_h2o_long_forward_keeps_all_its_tokens(model, gen):
    """A forward of more new tokens than one kp.h2o_evict call frees (64) makes room piece by
    piece, and no piece evicts the tokens of an earlier one (they have no score yet)."""
    n, q_len, budget = 120, 70, 100
    with kp.hf.compress(model, policy="h2o", budget=budget, n_sink=4, window=8):
        cache = transformers.DynamicCache()
        with torch.no_grad():
            model(input_ids=_ids(gen, 1, n), past_key_values=cache, use_cache=True)
            model(input_ids=_ids(gen, 1, q_len), past_key_values=cache, use_cache=True)
    for layer in range(N_LAYERS):
        for g, held in enumerate(_slot_positions(cache, layer).tolist()):
            assert set(range(n, n + q_len)) <= set(held), (layer, g)
            assert set(range(4)) <= set(held) and len(set(held)) == budget, (layer, g)


def test_fixed_capacity_forward_too_long_is_refused(model, gen):
    """More new tokens in one forward than a streaming / h2o cache can make room for."""
    ctx = _ids(gen, 1, 40)
    for policy, budget, room in (("streaming", 16, 12), ("h2o", 20, 8)):
        with kp.hf.compress(model, policy=policy, budget=budget, n_sink=4, window=8):
            cache = transformers.DynamicCache()
            with torch.no_grad():
                model(input_ids=ctx, past_key_values=cache, use_cache=True)
                model(input_ids=_ids(gen, 1, room), past_key_values=cache, use_cache=True)
                with pytest.raises(ValueError, match=f"at most {room} per forward"):
                    model(input_ids=_ids(gen, 1, room + 1), past_key_values=cache, use_cache=True)


# ---- query-agnostic: a compressed context, then a multi-token question ----------------------


def _agnostic_expected_idx(policy, calls, budget, sinks, w, q_len):
    """Per layer, from the context's own eager queries / weights and kvprune_cuda.reference:
    the positions [1, Hkv, budget] kept after compressing the context alone, and those the
    question attends to: for streaming / h2o (fixed capacity) the kept ones minus the room
    made for its ``q_len`` tokens (the oldest non-sinks; h2o: the lowest accumulated attention
    outside sinks and window, ties to the oldest), for snapkv all of them."""
    kept, attended = {}, {}
    for layer, ((query, key, weights),) in ((i, c[:1]) for i, c in calls.items()):
        n = key.shape[2]
        mass = weights[0].sum(1).view(HKV, HQ // HKV, n).mean(1)[None].float()  # h2o's scores
        if policy == "streaming":
            kept[layer] = ref.streaming_indices(1, HKV, n, budget, n_sink=sinks)
        elif policy == "snapkv":
            scores = ref.window_scores(query[:, :, -w:], key)
            pooled = ref.pool_scores(scores, 7, "max", window=w)
            kept[layer] = ref.select_keep(pooled, budget, n_sink=sinks, window=w)
        else:  # h2o: attention of every context query, GQA mean
            kept[layer] = ref.select_keep(mass, budget, n_sink=sinks, window=w)
        idx = kept[layer].long()
        if policy == "snapkv":
            attended[layer] = idx
            continue
        # the kept positions ranked for eviction: sinks and window never, then by score, oldest first
        key_ = torch.gather(mass, 2, idx) if policy == "h2o" else idx.float()
        protected = (idx < sinks) | ((idx >= n - w) & (policy == "h2o"))
        order = torch.sort(key_.masked_fill(protected, float("inf")), dim=2, stable=True).indices
        attended[layer] = torch.sort(torch.gather(idx, 2, order[..., q_len:]), dim=2).values
    return kept, attended


@pytest.mark.parametrize("policy", ["streaming", "snapkv", "h2o"])
def test_query_agnostic_compressed_context_then_question(model, gen, policy):
    """A 60-token context compressed to 24 tokens on its own, then a 5-token question in one
    forward: its logits equal the question fed one token at a time to a plain DynamicCache
    built by hand from the full context cache at the independently computed positions the
    question attends to (original RoPE positions, no hooks). Everything runs in eager attention, so the context
    forwards with and without hooks are bitwise the same."""
    n, q_len, budget, sinks, w = 60, 5, 24, 4, 8
    ctx, qst = _ids(gen, 1, n), _ids(gen, 1, q_len)
    with _eager_capture(model) as calls:
        _agnostic_run(model, policy, ctx, qst, calls, n, budget, sinks, w)


def _agnostic_run(model, policy, ctx, qst, calls, n, budget, sinks, w):
    q_len = qst.shape[1]
    with torch.no_grad():
        full = transformers.DynamicCache()
        model(input_ids=ctx, past_key_values=full, use_cache=True)
    keep, attended = _agnostic_expected_idx(policy, calls, budget, sinks, w, q_len)
    with kp.hf.compress(model, policy=policy, budget=budget, n_sink=sinks, window=w,
                        kernel_size=7, pool_shift=0) as kvc:
        cache = transformers.DynamicCache()
        with torch.no_grad():
            model(input_ids=ctx, past_key_values=cache, use_cache=True)
            assert kvc.compressed_len == budget
            for layer in range(N_LAYERS):
                got = hf.cache_kv(cache, layer)[0]
                if policy != "snapkv":  # slots in position order
                    order = _slot_positions(cache, layer).argsort(1)[None, :, :, None]
                    got = torch.gather(got, 2, order.expand(got.shape))
                want = ref.gather_kv(*hf.cache_kv(full, layer), keep[layer])[0]
                assert torch.equal(got, want.to(got.dtype)), layer
            lg_two = model(input_ids=qst, past_key_values=cache, use_cache=True).logits
    by_hand = transformers.DynamicCache()
    for layer in range(N_LAYERS):
        kk, vv = ref.gather_kv(*hf.cache_kv(full, layer), attended[layer])
        by_hand.update(kk.contiguous(), vv.contiguous(), layer)
    rows = []
    with torch.no_grad():
        for t in range(q_len):
            pos = torch.tensor([[n + t]])
            rows.append(model(input_ids=qst[:, t:t + 1], past_key_values=by_hand, use_cache=True,
                              position_ids=pos, cache_position=pos[0]).logits)
    torch.testing.assert_close(lg_two, torch.cat(rows, 1), rtol=1e-4, atol=1e-4)
