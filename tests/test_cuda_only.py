"""CUDA-only behaviour: graph capture and replay, non-default streams, very long
sequences, and agreement with the CPU backend. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda import reference as ref

from helpers import (
    assert_gathered, assert_scores_close, check_selection, lse_f64, poison_beyond, randn_tokens,
    rng, score_tol, seq_lens_tensor, window_scores_f64,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = "cuda"


def graph_inputs(gen):
    """q [2,8,16,128], k/v [2,2,700,128] (BNHD view), lse, seq_lens, scores, idx (bf16)."""
    dt = torch.bfloat16
    q = randn_tokens(2, 8, 16, 128, dtype=dt, device=CUDA, gen=gen)
    k = randn_tokens(2, 2, 700, 128, dtype=dt, device=CUDA, gen=gen, layout="bnhd")
    v = randn_tokens(2, 2, 700, 128, dtype=dt, device=CUDA, gen=gen, layout="bnhd")
    lens = seq_lens_tensor([700, 413], CUDA)
    scores = torch.rand(2, 2, 700, generator=gen).to(CUDA)
    return dict(q=q, k=k, v=v, lse=lse_f64(q, k, seq_lens=lens), lens=lens, scores=scores,
                idx=kp.select_keep(scores, 100, seq_lens=lens))


# Each entry computes outputs from the tensors in `t` only (so refilling them in
# place changes what a replay produces).
GRAPH_CALLS = {
    "snapkv": lambda t: tuple(kp.snapkv(t["q"], t["k"], t["v"], 100)),
    "snapkv-lse-ragged-avg": lambda t: tuple(kp.snapkv(
        t["q"], t["k"], t["v"], 100, pool="avg", gqa="max", lse=t["lse"], seq_lens=t["lens"])),
    "window_scores": lambda t: (kp.window_scores(t["q"], t["k"], seq_lens=t["lens"]),),
    "pool-select": lambda t: (kp.select_keep(kp.pool_scores(t["scores"], seq_lens=t["lens"]), 100,
                                             seq_lens=t["lens"]),),
    "gather_kv": lambda t: kp.gather_kv(t["k"], t["v"], t["idx"]),
    "streaming": lambda t: tuple(kp.streaming(t["k"], t["v"], 100, seq_lens=t["lens"])),
}


@pytest.mark.parametrize("name", list(GRAPH_CALLS))
def test_cuda_graph_capture_and_replay(name, gen):
    call = GRAPH_CALLS[name]
    static = graph_inputs(gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (lazy init, allocator)
        call(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(static)
    graph.replay()
    torch.cuda.synchronize()
    first = [t.clone() for t in captured]
    for got, want in zip(first, call(static)):
        assert torch.equal(got, want), "replay differs from eager"

    # New values in the same buffers: a replay must follow them (no baked-in host reads).
    fresh = graph_inputs(rng(1234))
    fresh["lens"] = seq_lens_tensor([651, 90], CUDA)
    for key, value in fresh.items():
        static[key].copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    expected = call(static)
    for got, want in zip(captured, expected):
        assert torch.equal(got, want), "replay after an in-place update differs from eager"
    assert any(not torch.equal(a, b) for a, b in zip(first, captured)), "replay output is stale"


@pytest.mark.parametrize("name", ["snapkv", "window_scores", "gather_kv", "streaming"])
def test_runs_on_the_current_stream(name, gen):
    """The op is ordered after earlier work on a side stream: it must see the inputs
    written there behind a long sleep (it would read stale values on another stream)."""
    call = GRAPH_CALLS[name]
    t = graph_inputs(gen)
    fresh = graph_inputs(rng(99))
    expected = call({**t, "k": fresh["k"], "v": fresh["v"]})
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the update
        t["k"].copy_(fresh["k"])
        t["v"].copy_(fresh["v"])
        got = call(t)
    side.synchronize()
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


BIG_N = 1 << 20


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
def test_long_sequence_window_scores(with_lse, dtype):
    """N = 2^20 with small heads against a float64 oracle computed on the GPU."""
    gen = rng(7)
    q = randn_tokens(1, 2, 8, 64, dtype=dtype, device=CUDA, gen=gen)
    k = randn_tokens(1, 1, BIG_N, 64, dtype=dtype, device=CUDA, gen=gen)
    lse = lse_f64(q, k) if with_lse else None
    out = kp.window_scores(q, k, lse=lse)
    assert_scores_close(out, window_scores_f64(q, k, lse=lse), score_tol(CUDA, dtype))


@pytest.mark.slow
def test_long_sequence_snapkv_and_select():
    """Ragged N up to 2^20: fused snapkv and standalone select, tie-tolerant."""
    gen = rng(8)
    lens = [BIG_N, BIG_N // 2 + 3]
    seq_lens = seq_lens_tensor(lens, CUDA)
    q = randn_tokens(2, 2, 8, 64, dtype=torch.bfloat16, device=CUDA, gen=gen)
    k = randn_tokens(2, 1, BIG_N, 64, dtype=torch.bfloat16, device=CUDA, gen=gen)
    v = randn_tokens(2, 1, BIG_N, 64, dtype=torch.bfloat16, device=CUDA, gen=gen)
    scores = window_scores_f64(q, k, seq_lens=seq_lens)
    budget, tol = BIG_N // 7, score_tol(CUDA, torch.bfloat16)
    pooled = ref.pool_scores(scores.cpu(), 7, "max", window=8, seq_lens=seq_lens.cpu())
    poison_beyond(k, lens)
    poison_beyond(v, lens)
    kept = kp.snapkv(q, k, v, budget, window=8, seq_lens=seq_lens)
    atol = 2 * tol * scores.double().amax(dim=-1).cpu()
    check_selection(kept.idx, pooled, budget, n_sink=4, window=8, seq_lens=seq_lens.cpu(),
                    atol=atol)
    k, v = (torch.nan_to_num(t, nan=0.0) for t in (k, v))
    assert_gathered(k, v, kept.idx, kept.k, kept.v)

    # Standalone select on the oracle's own pooled scores is exact.
    idx = kp.select_keep(pooled.to(CUDA), budget, window=8, seq_lens=seq_lens)
    assert torch.equal(idx.cpu(), ref.select_keep(pooled, budget, window=8,
                                                  seq_lens=seq_lens.cpu()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cpu_and_cuda_agree(dtype, gen):
    lens = [4099, 1000, 33]
    seq_lens = seq_lens_tensor(lens, "cpu")
    q = randn_tokens(3, 8, 32, 128, dtype=dtype, gen=gen)
    k = randn_tokens(3, 2, 4099, 128, dtype=dtype, gen=gen, layout="bnhd")
    v = randn_tokens(3, 2, 4099, 128, dtype=dtype, gen=gen, layout="bnhd")
    on_cuda = [t.to(CUDA) for t in (q, k, v, seq_lens)]
    cpu_scores = kp.window_scores(q, k, seq_lens=seq_lens)
    cuda_scores = kp.window_scores(*on_cuda[:2], seq_lens=on_cuda[3])
    assert_scores_close(cuda_scores, cpu_scores, score_tol(CUDA, dtype) + 1e-5, seq_lens)

    budget = 615
    cpu_kept = kp.snapkv(q, k, v, budget, seq_lens=seq_lens)
    cuda_kept = kp.snapkv(*on_cuda[:3], budget, seq_lens=on_cuda[3])
    pooled = kp.pool_scores(cpu_scores, 7, "max", window=32, seq_lens=seq_lens)
    atol = 2 * (score_tol(CUDA, dtype) + 1e-5) * cpu_scores.double().amax(dim=-1)
    for kept in (cpu_kept, cuda_kept):
        check_selection(kept.idx, pooled, budget, n_sink=4, window=32, seq_lens=seq_lens,
                        atol=atol)
    assert_gathered(*on_cuda[1:3], cuda_kept.idx, cuda_kept.k, cuda_kept.v)


def test_outputs_follow_the_inputs_device(gen):
    """Outputs land on the inputs' device even when another device is current."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    t = graph_inputs(gen)
    moved = {key: value.to("cuda:1") for key, value in t.items()}
    with torch.cuda.device(0):
        kept = kp.snapkv(moved["q"], moved["k"], moved["v"], 100)
    assert kept.idx.device == torch.device("cuda:1")
    for got, want in zip(kept, kp.snapkv(t["q"], t["k"], t["v"], 100)):
        assert torch.equal(got.cpu(), want.cpu())


def _h2o_step(cache: "kp.DecodeCache", q, k_new, v_new, slots):
    """One H2O decode layer-step: append into ``slots`` (int32 [B, Hkv, 1], written with the
    next step's slots), scores + attention output, evict."""
    kp.streaming_append(cache.k, cache.v, cache.slot_pos, cache.seq_lens, k_new, v_new,
                        n_sink=4, slots=slots)
    out = kp.decode_scores(q, cache.k, cache.slot_pos, cache.seq_lens, cache.h2o_scores,
                           v_cache=cache.v)
    slots.copy_(kp.h2o_evict(cache.h2o_scores, cache.slot_pos, cache.seq_lens, n_sink=4,
                             recent=32))
    return out


def _decode_state(gen, device, capacity=1024, filled=1000):
    """A bf16 H2O cache (B 2, Hkv 2, D 128) holding ``filled`` tokens, h2o scores set."""
    cache = kp.DecodeCache.empty(2, 2, capacity, 128, device=device, h2o=True)
    k = randn_tokens(2, 2, filled, 128, dtype=torch.bfloat16, device=device, gen=gen)
    v = randn_tokens(2, 2, filled, 128, dtype=torch.bfloat16, device=device, gen=gen)
    kp.streaming_append(cache.k, cache.v, cache.slot_pos, cache.seq_lens, k, v, n_sink=4)
    cache.h2o_scores.copy_(torch.rand(cache.h2o_scores.shape, generator=gen).to(device))
    slots = kp.h2o_evict(cache.h2o_scores, cache.slot_pos, cache.seq_lens, n_sink=4, recent=32)
    return cache, slots


def test_decode_layer_step_graph_replay_matches_eager(gen):
    """The decode layer-step (append + scores + evict, capacity 1024) captured once in a
    CUDA graph and replayed across the cache's filling and its evictions gives, step by step,
    the eager step's cache, h2o scores, slots and attention output."""
    cache, slots = _decode_state(gen, CUDA)
    q = torch.empty(2, 8, 1, 128, dtype=torch.bfloat16, device=CUDA)
    k_new = torch.empty(2, 2, 1, 128, dtype=torch.bfloat16, device=CUDA)
    v_new = torch.empty_like(k_new)
    step_gen = rng(7)

    def refill():
        for x in (q, k_new, v_new):
            x.copy_(randn_tokens(*x.shape, dtype=x.dtype, device=CUDA, gen=step_gen))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (one real step)
        refill()
        _h2o_step(cache, q, k_new, v_new, slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _h2o_step(cache, q, k_new, v_new, slots)
    eager_cache = kp.DecodeCache(*(t.clone() for t in cache))
    eager_slots = slots.clone()
    for _ in range(40):  # 1001 -> 1041 tokens: the last 24 steps evict
        refill()
        graph.replay()
        want = _h2o_step(eager_cache, q, k_new, v_new, eager_slots)
        torch.cuda.synchronize()
        assert torch.equal(captured, want)
        assert torch.equal(slots, eager_slots)
        for got_t, want_t in zip(cache, eager_cache):
            assert torch.equal(got_t, want_t)
    assert int(cache.seq_lens[0]) == 1041 and bool((cache.slot_pos >= 1024).any())
