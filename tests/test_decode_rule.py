"""The decode-time rule (kp.policy.DecodeRule): when it compresses and to how many tokens,
against the plain spec (reference.periodic_decode), and kp.hf's cache under it."""

import random

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda import policy as policies
from kvprune_cuda import reference as ref


def test_when_and_how_many_follow_the_spec():
    rng = random.Random(0)
    for _ in range(200):
        n_sink, window = rng.randint(0, 8), rng.randint(1, 16)
        max_held = rng.randint(n_sink + window, 120)
        interval = rng.randint(window, 48)
        rule = policies.make_decode(rng.choice(["streaming", "snapkv"]), max_held, interval,
                                    n_sink=n_sink, window=window)
        prompt = rng.randint(1, 200)
        _, events = ref.periodic_decode(list(range(prompt)), 150, max_held=max_held,
                                        interval=interval, n_sink=n_sink, window=window)
        held, got = prompt, []
        for g in range(1, 151):
            held += 1
            kept = rule.compresses(g, 1, held)
            if kept is not None:
                got.append((g, held, kept))
                held = kept
        assert got == events


def test_pinned_prefix_and_multi_token_forwards():
    rule = policies.make_decode("streaming", 64, 32, n_sink=4, window=8)
    assert rule.target() == 64 and rule.target(pinned=96) == 104
    assert rule.compresses(32, 1, 100, pinned=96) is None     # 100 <= 104: nothing to drop
    assert rule.compresses(32, 1, 110, pinned=96) == 104
    assert rule.compresses(31, 1, 100) is None                 # not at a multiple of 32
    assert rule.compresses(40, 10, 100) == 64                  # a forward that crossed 32
    assert rule.compresses(0, 1, 100) is None


@pytest.mark.parametrize("kwargs, name, error", [
    (dict(decode="ring", max_held=64, interval=32), "decode", ValueError),
    (dict(decode="snapkv", max_held=20, interval=32), "max_held", ValueError),
    (dict(decode="snapkv", max_held=0.5, interval=32), "max_held", TypeError),
    (dict(decode="snapkv", max_held=64, interval=8), "interval", ValueError),   # < window
    (dict(decode="streaming", max_held=64, interval=0), "interval", ValueError),
    (dict(decode="streaming", max_held=64, interval=None), "interval", ValueError),
    (dict(decode="streaming", max_held=64, interval=32.0), "interval", TypeError),
    (dict(decode=None, max_held=64, interval=32), "decode", ValueError),
])
def test_bad_arguments_are_named(kwargs, name, error):
    with pytest.raises(error, match=name):
        policies.make_decode(**kwargs, n_sink=4, window=32)


def test_kp_hf_streaming_decode_holds_the_specified_positions():
    """Teacher-forced through kp.hf with decode="streaming": layer 0's keys (a function of
    token and position only) are the dense run's at exactly the positions the spec holds."""
    transformers, model = _tiny_qwen()
    ids = torch.randint(0, 128, (1, 230))
    prompt, steps = 100, 129
    dense = transformers.DynamicCache()
    with torch.no_grad():
        model(ids[:, : prompt + steps], past_key_values=dense, use_cache=True)
    with kp.hf.compress(model, "snapkv", 40, n_sink=4, window=8, decode="streaming",
                        max_held=48, interval=16) as comp, torch.no_grad():
        cache = transformers.DynamicCache()
        model(ids[:, :prompt], past_key_values=cache, use_cache=True)
        for t in range(prompt, prompt + steps):
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        assert comp.nbytes < 64 * 1024  # the decode window's queries only: bounded
    held, events = ref.periodic_decode(list(range(prompt)), steps, max_held=48, interval=16,
                                       n_sink=4, window=8, pick=None)
    assert len(events) == steps // 16
    k = cache.layers[0].keys
    assert k.shape[2] == len(held) == 48 + steps % 16
    # the prompt's 40 kept positions are snapkv's; from the first decode compression on,
    # streaming keeps the sinks and the most recent: compare the positions after the sinks
    tail = held[4:]
    assert torch.allclose(k[:, :, 4:], dense.layers[0].keys[:, :, tail], atol=1e-5)


def _tiny_qwen(seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(seed)
    return transformers, transformers.Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("gqa, chunk", [("mean", 1), ("max", 1), ("mean", 16)])
def test_kp_hf_h2o_decode_holds_the_specified_positions(gqa, chunk):
    """decode="h2o" through kp.hf (one token per forward, or teacher-forced 16 at a time):
    layer 0's held keys are the dense run's at the positions the plain spec
    (reference.periodic_h2o_decode, on layer 0's own dense queries and keys) holds, per KV
    head."""
    transformers, model = _tiny_qwen()
    from kvprune_cuda.hf import scoring
    ids = torch.randint(0, 128, (1, 230))
    prompt, steps = 60, 160
    attn0, seen = model.model.layers[0].self_attn, {}
    hook = attn0.register_forward_hook(
        lambda m, a, kw, out: seen.update(hs=kw["hidden_states"], pe=kw["position_embeddings"]),
        with_kwargs=True)
    dense = transformers.DynamicCache()
    with torch.no_grad():
        model(ids[:, : prompt + steps], past_key_values=dense, use_cache=True)
        queries = scoring.post_rope_queries(attn0, seen["hs"], *seen["pe"])[0]  # [Hq, T, D]
    hook.remove()
    keys = dense.layers[0].keys[0]                                               # [Hkv, T, D]
    with kp.hf.compress(model, "full", n_sink=4, window=8, gqa=gqa, decode="h2o",
                        max_held=48, interval=16) as comp, torch.no_grad():
        cache = transformers.DynamicCache()
        model(ids[:, :prompt], past_key_values=cache, use_cache=True)
        for t in range(prompt, prompt + steps, chunk):
            model(ids[:, t : t + chunk], past_key_values=cache, use_cache=True)
        assert comp.layers[0].h2o.shape == (1, 2, 48)   # the held keys' sums, no more
    held, events = ref.periodic_h2o_decode(queries, keys, list(range(prompt)), max_held=48,
                                           interval=16, n_sink=4, window=8,
                                           scale=attn0.scaling, gqa=gqa)
    assert [e[0] for e in events] == list(range(16, steps + 1, 16))
    k = cache.layers[0].keys[0]
    assert k.shape[1] == 48
    for h in range(2):
        assert torch.allclose(k[h], keys[h, held[h]], atol=1e-5), h
    assert held[0] != held[1]  # the heads choose apart (not streaming)
    assert held[0] != list(range(4)) + list(range(prompt + steps - 44, prompt + steps))
