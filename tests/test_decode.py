"""Decode-time eviction ops (streaming_append, rerotate_keys, gather_kv(rope=...),
decode_scores, h2o_evict) against kvprune_cuda.reference, on CPU and CUDA."""

from __future__ import annotations

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda import reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# `device` ("cpu", and "cuda" when a GPU is present) comes from conftest.py.


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=torch.float32, device="cpu", seed=0):
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float32).to(dtype).to(device)


def _bnhd_view(x: torch.Tensor) -> torch.Tensor:
    """The same values as x [B,H,N,D], stored as [B,N,H,D] and viewed back (strided)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


# ---- streaming_append ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strided", [False, True])
def test_ring_after_many_wraps_is_sinks_plus_recent(device, dtype, strided):
    B, H, C, S, D = 2, 3, 16, 4, 8
    chunks = [1, 3, 1, 7, 20, 1, 2, 13, 1, 1, 30, 5] * 4  # 20 and 30 exceed the ring (12)
    total = sum(chunks)
    stream_k = _randn(B, H, total, D, dtype=dtype, device=device, seed=1)
    stream_v = _randn(B, H, total, D, dtype=dtype, device=device, seed=2)
    cache = kp.DecodeCache.empty(B, H, C, D, dtype=dtype, device=device)
    k_cache, v_cache = (_bnhd_view(cache.k), _bnhd_view(cache.v)) if strided else (cache.k, cache.v)
    expect = [t.clone() for t in (k_cache, v_cache, cache.slot_pos, cache.seq_lens)]
    start = 0
    for t in chunks:
        k_new, v_new = stream_k[:, :, start:start + t], stream_v[:, :, start:start + t]
        kp.streaming_append(k_cache, v_cache, cache.slot_pos, cache.seq_lens, k_new, v_new, n_sink=S)
        expect = list(ref.streaming_append(*expect, k_new, v_new, n_sink=S))
        start += t
    for got, want in zip((k_cache, v_cache, cache.slot_pos, cache.seq_lens), expect):
        assert torch.equal(got.cpu(), want)
    assert cache.seq_lens.tolist() == [total] * B
    keep = ref.streaming_cache_positions(total, C, S)
    for b in range(B):
        for h in range(H):
            pos = cache.slot_pos[b, h].cpu().long()
            assert sorted(pos.tolist()) == keep
            assert pos[:S].tolist() == list(range(S))  # sinks never move
            assert torch.equal(k_cache[b, h].cpu(), stream_k[b, h, pos.to(device)].cpu())
            assert torch.equal(v_cache[b, h].cpu(), stream_v[b, h, pos.to(device)].cpu())


def test_append_ragged_lengths_and_zero_sinks(device):
    B, H, C, D = 3, 2, 8, 4
    cache = kp.DecodeCache.empty(B, H, C, D, dtype=torch.float32, device=device)
    cache.seq_lens.copy_(torch.tensor([0, 5, 11], dtype=torch.int32))
    expect = [t.clone() for t in (cache.k, cache.v, cache.slot_pos, cache.seq_lens)]
    for step in range(9):
        k_new = _randn(B, H, 2, D, device=device, seed=10 + step)
        v_new = _randn(B, H, 2, D, device=device, seed=50 + step)
        kp.streaming_append(cache.k, cache.v, cache.slot_pos, cache.seq_lens, k_new, v_new, n_sink=0)
        expect = list(ref.streaming_append(*expect, k_new, v_new, n_sink=0))
    for got, want in zip((cache.k, cache.v, cache.slot_pos, cache.seq_lens), expect):
        assert torch.equal(got.cpu(), want)


def test_append_with_slots(device):
    B, H, C, D = 2, 2, 6, 4
    cache = kp.DecodeCache.empty(B, H, C, D, dtype=torch.bfloat16, device=device)
    expect = [t.clone() for t in (cache.k, cache.v, cache.slot_pos, cache.seq_lens)]
    for step in range(7):
        k_new = _randn(B, H, 2, D, dtype=torch.bfloat16, device=device, seed=step)
        v_new = _randn(B, H, 2, D, dtype=torch.bfloat16, device=device, seed=100 + step)
        perm = torch.stack([torch.randperm(C, generator=_gen(step))[:2] for _ in range(B * H)])
        slots = perm.view(B, H, 2).int()
        slots[0, 1, 0] = -1  # dropped token
        slots = slots.to(device)
        kp.streaming_append(cache.k, cache.v, cache.slot_pos, cache.seq_lens, k_new, v_new,
                            n_sink=1, slots=slots)
        expect = list(ref.streaming_append(*expect, k_new, v_new, n_sink=1, slots=slots.cpu()))
    for got, want in zip((cache.k, cache.v, cache.slot_pos, cache.seq_lens), expect):
        assert torch.equal(got.cpu(), want)


def test_long_stream_matches_reference(device):
    B, H, C, S, D, total = 1, 2, 64, 4, 16, 5000
    cache = kp.DecodeCache.empty(B, H, C, D, dtype=torch.float16, device=device)
    stream = _randn(B, H, total, D, dtype=torch.float16, device=device, seed=3)
    for p in range(total):
        tok = stream[:, :, p:p + 1]
        kp.streaming_append(cache.k, cache.v, cache.slot_pos, cache.seq_lens, tok, tok, n_sink=S)
    pos = cache.slot_pos.cpu().long()
    for h in range(H):
        assert sorted(pos[0, h].tolist()) == ref.streaming_cache_positions(total, C, S)
        assert torch.equal(cache.k[0, h].cpu(), stream[0, h].cpu()[pos[0, h]])


# ---- RoPE re-rotation -----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [None, 32])
def test_rerotate_matches_recomputed_rope_fp32(device, layout, rotary_dim):
    B, H, N, D = 2, 3, 37, 64
    raw = _randn(B, H, N, D, seed=4)
    old = torch.randint(0, 100_000, (B, H, N), generator=_gen(5), dtype=torch.int32)
    new = torch.randint(0, 100_000, (B, H, N), generator=_gen(6), dtype=torch.int32)
    old[0, 0, :3] = -1  # empty slots are left alone
    new[1, 2, 5] = -1
    rope = dict(theta=500000.0, rotary_dim=rotary_dim, layout=layout)
    k = ref.rope_rotate(raw, old.clamp(min=0), **rope).float()
    k_in = k.clone()
    want = ref.rope_rotate(raw, new.clamp(min=0), **rope).float()
    skip = (old < 0) | (new < 0)
    want[skip] = k_in[skip]
    got = _bnhd_view(k.to(device))
    out = kp.rerotate_keys(got, old.to(device), new.to(device),
                           rope=kp.Rope(theta=500000.0, rotary_dim=rotary_dim, layout=layout))
    assert out is got
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    if rotary_dim is not None:
        assert torch.equal(got.cpu()[..., rotary_dim:], k_in[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rerotate_half_dtypes_and_broadcast_positions(device, dtype):
    B, H, N, D = 1, 2, 50, 128
    raw = _randn(B, H, N, D, seed=7)
    old = torch.arange(1000, 1000 + N, dtype=torch.int32)  # broadcast [N]
    new = torch.arange(N, dtype=torch.int32)
    inv_freq = ref.rope_inv_freq(D, 10000.0).float() / 4.0  # linear rope scaling
    k = ref.rope_rotate(raw, old, inv_freq=inv_freq).to(dtype)
    want = ref.rerotate_keys(k, old, new, inv_freq=inv_freq)
    got = k.to(device)
    kp.rerotate_keys(got, old.to(device), new.to(device), rope=kp.Rope(inv_freq=inv_freq.to(device)))
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_kv_fused_rope(device, layout, dtype):
    B, H, N, D, budget = 2, 2, 300, 64, 40
    raw = _randn(B, H, N, D, seed=8)
    k = ref.rope_rotate(raw, torch.arange(N), layout=layout).to(dtype).to(device)
    v = _randn(B, H, N, D, dtype=dtype, device=device, seed=9)
    lens = torch.tensor([N, 30], dtype=torch.int32)
    idx = ref.streaming_indices(B, H, N, budget, n_sink=4, seq_lens=lens).to(device)  # row 1 padded
    rope = kp.Rope(layout=layout)
    got_k, got_v = kp.gather_kv(k, v, idx, rope=rope)
    want_k, want_v = ref.gather_kv_rope(k.cpu(), v.cpu(), idx.cpu(), layout=layout)
    assert torch.equal(got_v.cpu(), want_v)
    torch.testing.assert_close(got_k.cpu().float(), want_k.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype])
    if dtype == torch.float32:  # equals RoPE recomputed at the compacted positions
        keep = idx.cpu().long().clamp(min=0)
        raw_kept = torch.gather(raw, 2, keep[..., None].expand(B, H, budget, D))
        recomputed = ref.rope_rotate(raw_kept, torch.arange(budget), layout=layout).float()
        recomputed[idx.cpu() < 0] = 0
        torch.testing.assert_close(got_k.cpu(), recomputed, atol=1e-5, rtol=1e-5)
    out_k = torch.full((B, budget, H, D), float("nan"), dtype=dtype, device=device).transpose(1, 2)
    out_v = torch.full_like(out_k, float("nan"))
    kp.gather_kv(k, v, idx, out_k=out_k, out_v=out_v, rope=rope)
    assert torch.equal(out_k, got_k) and torch.equal(out_v, got_v)
    plain_k, _ = kp.gather_kv(k, v, idx)  # rope=None keeps the old behaviour
    assert torch.equal(plain_k.cpu(), ref.gather_kv(k.cpu(), v.cpu(), idx.cpu())[0])


# ---- decode_scores --------------------------------------------------------------------


def _filled_cache(B, Hkv, C, D, dtype, device, seed=0, holes=True):
    """Random cache whose slots hold shuffled positions < seq_lens (some empty)."""
    k = _randn(B, Hkv, C, D, dtype=dtype, device=device, seed=seed)
    v = _randn(B, Hkv, C, D, dtype=dtype, device=device, seed=seed + 1)
    lens = torch.tensor([C + 50 + 7 * b for b in range(B)], dtype=torch.int32)
    pos = torch.empty(B, Hkv, C, dtype=torch.int32)
    g = _gen(seed + 2)
    for b in range(B):
        for h in range(Hkv):
            pos[b, h] = torch.randperm(int(lens[b]), generator=g)[:C].int()
            pos[b, h, 0] = lens[b] - 1  # the newest token is always cached
            pos[b, h, 1] = lens[b] - 2
    if holes:
        pos[0, 0, 3:6] = -1
    return k, v, pos.to(device), lens.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", ["mean", "max", "sum"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 1, 33, 64), (2, 6, 2, 3, 17, 40), (2, 2, 2, 2, 130, 128)])
def test_decode_scores_matches_reference(device, dtype, gqa, shape):
    B, Hq, Hkv, T, C, D = shape
    k, v, pos, lens = _filled_cache(B, Hkv, C, D, dtype, device, seed=11)
    q = _randn(B, Hq, T, D, dtype=dtype, device=device, seed=12)
    scores = torch.rand(B, Hkv, C, generator=_gen(13)).to(device)
    want_scores, want_out = ref.decode_scores(q, k, pos, lens, scores, gqa=gqa, v_cache=v)
    out = kp.decode_scores(q, k, pos, lens, scores, gqa=gqa, v_cache=v)
    torch.testing.assert_close(scores.cpu(), want_scores, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=TOL[dtype] * 2, rtol=TOL[dtype])
    # scores only, strided q / cache
    scores2 = torch.zeros(B, Hkv, C, device=device)
    assert kp.decode_scores(_bnhd_view(q), _bnhd_view(k), pos, lens, scores2, gqa=gqa) is None
    want2, _ = ref.decode_scores(q, k, pos, lens, torch.zeros(B, Hkv, C), gqa=gqa)
    torch.testing.assert_close(scores2.cpu(), want2, atol=1e-5, rtol=1e-5)


def test_decode_scores_query_sees_nothing(device):
    B, Hq, Hkv, C, D = 1, 2, 1, 8, 16
    k = _randn(B, Hkv, C, D, device=device)
    pos = torch.full((B, Hkv, C), -1, dtype=torch.int32, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    scores = torch.zeros(B, Hkv, C, device=device)
    out = kp.decode_scores(_randn(B, Hq, 1, D, device=device), k, pos, lens, scores, v_cache=k)
    assert torch.count_nonzero(scores) == 0 and torch.count_nonzero(out) == 0


# ---- h2o_evict ------------------------------------------------------------------------


@pytest.mark.parametrize("num", [1, 3])
def test_h2o_evict_matches_reference(device, num):
    B, H, C = 2, 3, 40
    _, _, pos, lens = _filled_cache(B, H, C, 4, torch.float32, device, seed=20, holes=False)
    pos[1, 2, 7] = -1  # a hole left by an earlier eviction
    scores = torch.rand(B, H, C, generator=_gen(21)).to(device)
    want_scores, want_pos, want_next = ref.h2o_evict(scores, pos, lens, n_sink=4, recent=8, num=num)
    got_next = kp.h2o_evict(scores, pos, lens, n_sink=4, recent=8, num=num)
    assert torch.equal(got_next.cpu(), want_next)
    assert torch.equal(pos.cpu(), want_pos)
    assert torch.equal(scores.cpu(), want_scores)
    assert got_next[1, 2, 0].item() == 7  # holes first
    # idempotent: a second call without an append picks the same slots
    assert torch.equal(kp.h2o_evict(scores, pos, lens, n_sink=4, recent=8, num=num).cpu(), want_next)


# Where the lowest score sits, relative to the boundaries of the evictable range
# [n_sink, n - recent): the last sink, the first evictable, and n - recent and its neighbours.
BOUNDARY_CASES = {"sink-1": (4, -1, False), "sink": (4, 0, True), "recent-2": (-8, -2, True),
                  "recent-1": (-8, -1, True), "recent": (-8, 0, False), "recent+1": (-8, 1, False)}


@pytest.mark.parametrize("case", list(BOUNDARY_CASES))
def test_h2o_evict_window_boundaries(device, case):
    """A full cache, one token to place: the victim is the lowest score among positions in
    [n_sink, n - recent) and nothing else; expectations written out by hand (no reference)."""
    B, H, C, S, R = 2, 2, 24, 4, 8
    lens = [50, 47]  # rows see different n, so the boundary is per row
    base, offset, evictable = BOUNDARY_CASES[case]
    decoy_pos = S + 3  # clearly evictable: the victim whenever the lowest score is protected
    pos = torch.empty(B, H, C, dtype=torch.int32)
    scores = torch.empty(B, H, C)
    want_slot = torch.empty(B, H, 1, dtype=torch.int32)
    for b, n in enumerate(lens):
        # sinks, the 8 positions after them, the last 12 positions (C = 24 held in all)
        held = list(range(S)) + list(range(S, S + 8)) + list(range(n - (C - S - 8), n))
        low = (base if base > 0 else n + base) + offset  # position that gets the lowest score
        for h in range(H):
            perm = torch.randperm(C, generator=_gen(100 * b + h))
            pos[b, h] = torch.tensor(held, dtype=torch.int32)[perm]  # slot != position
            scores[b, h] = 0.5 + 0.5 * torch.rand(C, generator=_gen(7 + b + h))
            slot_of = {int(p): s for s, p in enumerate(pos[b, h].tolist())}
            scores[b, h, slot_of[low]] = 0.01
            scores[b, h, slot_of[decoy_pos]] = 0.1
            want_slot[b, h, 0] = slot_of[low] if evictable else slot_of[decoy_pos]
    lens_t = torch.tensor(lens, dtype=torch.int32)
    pos_d, scores_d = pos.to(device), scores.to(device)
    got = kp.h2o_evict(scores_d, pos_d, lens_t.to(device), n_sink=S, recent=R, num=1)
    assert got.cpu().tolist() == want_slot.tolist(), case
    want_pos, want_scores = pos.clone(), scores.clone()
    for b in range(B):
        for h in range(H):
            want_pos[b, h, want_slot[b, h, 0]] = -1
            want_scores[b, h, want_slot[b, h, 0]] = 0.0
    assert torch.equal(pos_d.cpu(), want_pos) and torch.equal(scores_d.cpu(), want_scores)


def test_h2o_evict_filling_and_ties(device):
    B, H, C = 1, 2, 10
    pos = torch.full((B, H, C), -1, dtype=torch.int32)
    pos[0, :, :8] = torch.arange(8, dtype=torch.int32)
    lens = torch.tensor([8], dtype=torch.int32)
    scores = torch.zeros(B, H, C)
    got = kp.h2o_evict(scores.to(device), pos.to(device), lens.to(device), n_sink=2, recent=3, num=4)
    # positions 8, 9 fill in order; 10, 11 evict the oldest non-sink tokens (all scores tie)
    assert got.cpu()[0, 0].tolist() == [8, 9, 2, 3]


def test_h2o_decode_loop(device):
    """append -> decode_scores -> h2o_evict for many steps; picks equal the reference's up to ties."""
    B, Hq, Hkv, C, D, S, R = 2, 4, 2, 24, 32, 2, 4
    steps = 80
    cache = kp.DecodeCache.empty(B, Hkv, C, D, dtype=torch.float32, device=device, h2o=True)
    next_slot = None
    stream_k = _randn(B, Hkv, steps, D, device=device, seed=30)
    stream_q = _randn(B, Hq, steps, D, device=device, seed=31) * 3
    for p in range(steps):
        tok = stream_k[:, :, p:p + 1]
        kp.streaming_append(cache.k, cache.v, cache.slot_pos, cache.seq_lens, tok, tok, n_sink=S,
                            slots=next_slot)
        kp.decode_scores(stream_q[:, :, p:p + 1], cache.k, cache.slot_pos, cache.seq_lens,
                         cache.h2o_scores)
        before = cache.h2o_scores.cpu().clone()
        want_scores, want_pos, want_next = ref.h2o_evict(before, cache.slot_pos, cache.seq_lens,
                                                         n_sink=S, recent=R)
        next_slot = kp.h2o_evict(cache.h2o_scores, cache.slot_pos, cache.seq_lens, n_sink=S, recent=R)
        got, want = next_slot.cpu(), want_next
        for b in range(B):
            for h in range(Hkv):
                g, w = int(got[b, h, 0]), int(want[b, h, 0])
                assert g >= 0
                assert abs(float(before[b, h, g]) - float(before[b, h, w])) <= 1e-6
        # every cached token is the one its slot_pos says
        pos = cache.slot_pos.cpu().long()
        for b in range(B):
            for h in range(Hkv):
                held = pos[b, h] >= 0
                assert torch.equal(cache.k[b, h].cpu()[held], stream_k[b, h].cpu()[pos[b, h][held]])
    assert cache.seq_lens.tolist() == [steps] * B
    # sinks and the recent window survive
    pos = cache.slot_pos.cpu()
    for b in range(B):
        for h in range(Hkv):
            held = set(pos[b, h].tolist())
            assert set(range(S)) <= held and set(range(steps - R, steps)) <= held


# ---- errors and torch.compile -----------------------------------------------------------


def test_bad_arguments_raise_clear_errors():
    cache = kp.DecodeCache.empty(1, 2, 8, 4, dtype=torch.float32, h2o=True)
    tok = torch.randn(1, 2, 1, 4)
    with pytest.raises(ValueError, match="n_sink"):
        kp.streaming_append(cache.k, cache.v, cache.slot_pos, cache.seq_lens, tok, tok, n_sink=8)
    with pytest.raises(TypeError, match="slot_pos"):
        kp.streaming_append(cache.k, cache.v, cache.slot_pos.long(), cache.seq_lens, tok, tok)
    with pytest.raises(TypeError, match="k_new"):
        kp.streaming_append(cache.k, cache.v, cache.slot_pos, cache.seq_lens, tok.half(), tok.half())
    with pytest.raises(ValueError, match="k_new"):
        kp.streaming_append(cache.k, cache.v, cache.slot_pos, cache.seq_lens, tok[:, :1], tok[:, :1])
    with pytest.raises(ValueError, match="seq_lens"):
        bad = torch.tensor([-1], dtype=torch.int32)
        kp.streaming_append(cache.k, cache.v, cache.slot_pos, bad, tok, tok)
    with pytest.raises(ValueError, match="layout"):
        kp.rerotate_keys(cache.k, cache.slot_pos, cache.slot_pos, rope=kp.Rope(layout="llama"))
    with pytest.raises(ValueError, match="rotary_dim"):
        kp.rerotate_keys(cache.k, cache.slot_pos, cache.slot_pos, rope=kp.Rope(rotary_dim=3))
    with pytest.raises(ValueError, match="new_pos"):
        kp.rerotate_keys(cache.k, cache.slot_pos, cache.slot_pos[:, :, :3], rope=kp.Rope())
    with pytest.raises(ValueError, match="multiple"):
        kp.decode_scores(torch.randn(1, 3, 1, 4), cache.k, cache.slot_pos, cache.seq_lens, cache.h2o_scores)
    with pytest.raises(ValueError, match="h2o_scores"):
        kp.decode_scores(torch.randn(1, 2, 1, 4), cache.k, cache.slot_pos, cache.seq_lens,
                         cache.h2o_scores[:, :, :4])
    with pytest.raises(ValueError, match="gqa"):
        kp.decode_scores(torch.randn(1, 2, 1, 4), cache.k, cache.slot_pos, cache.seq_lens,
                         cache.h2o_scores, gqa="median")
    with pytest.raises(ValueError, match="capacity"):
        kp.h2o_evict(cache.h2o_scores, cache.slot_pos, cache.seq_lens, n_sink=4, recent=4)
    with pytest.raises(TypeError, match="h2o_scores"):
        kp.h2o_evict(cache.h2o_scores.double(), cache.slot_pos, cache.seq_lens, n_sink=1, recent=1)


def test_opcheck_schemas_and_fakes():
    cache = kp.DecodeCache.empty(1, 2, 8, 16, dtype=torch.float32, h2o=True)
    tok = torch.randn(1, 2, 1, 16)
    ops = torch.ops.kvprune
    torch.library.opcheck(ops.streaming_append.default,
                          (cache.k, cache.v, cache.slot_pos, cache.seq_lens, tok, tok, 2, None))
    q = torch.randn(1, 4, 1, 16)
    torch.library.opcheck(ops.decode_scores.default,
                          (q, cache.k, cache.slot_pos, cache.seq_lens, cache.h2o_scores, None, "mean", cache.v))
    torch.library.opcheck(ops.h2o_evict.default, (cache.h2o_scores, cache.slot_pos, cache.seq_lens, 2, 2, 1))
    pos = torch.arange(8, dtype=torch.int32).expand(1, 2, 8).contiguous()
    torch.library.opcheck(ops.rerotate_keys.default, (cache.k, pos, pos + 3, 10000.0, 16, "neox", None))
    idx = torch.arange(4, dtype=torch.int32).expand(1, 2, 4).contiguous()
    torch.library.opcheck(ops.gather_kv_rope.default, (cache.k, cache.v, idx, 10000.0, 8, "gptj", None))
