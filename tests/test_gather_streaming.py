"""kp.gather_kv and kp.streaming against the reference (bit-exact copies)."""

from __future__ import annotations

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda import reference as ref

from helpers import (
    DTYPES, LAYOUTS, assert_gathered, dtype_id, on_cuda_path, poison_beyond, randn_tokens,
    seq_lens_tensor,
)


def make_kv(batch, heads, length, dim, dtype, device, layout, gen):
    k = randn_tokens(batch, heads, length, dim, dtype=dtype, device=device, layout=layout, gen=gen)
    v = randn_tokens(batch, heads, length, dim, dtype=dtype, device=device, layout=layout, gen=gen)
    return k, v


def random_idx(batch, heads, length, budget, gen, device):
    """Ascending kept positions with -1 padding in some rows (like select_keep's output)."""
    idx = torch.full((batch, heads, budget), -1, dtype=torch.int32)
    for b in range(batch):
        for h in range(heads):
            count = budget if (b + h) % 2 == 0 else budget // 2
            count = min(count, length)
            idx[b, h, :count] = torch.randperm(length, generator=gen)[:count].sort().values.int()
    return idx.to(device)


def out_buffers(kind, batch, heads, budget, dim, dtype, device):
    """Caller-provided outputs, NaN-poisoned: plain tensors, or a strided view into a
    [B, budget + 2, H, D] cache (the view's neighbours must stay untouched)."""
    nan = lambda *shape: torch.full(shape, float("nan"), dtype=dtype, device=device)
    if kind == "dense":
        return nan(batch, heads, budget, dim), nan(batch, heads, budget, dim), None
    big_k, big_v = nan(batch, budget + 2, heads, dim), nan(batch, budget + 2, heads, dim)
    view = lambda big: big[:, 1 : budget + 1].transpose(1, 2)
    return view(big_k), view(big_v), (big_k, big_v)


# (N, budget, D): tiny, odd D (1, 3, 24), budget > N (padding), the usual 64/128/256.
GATHER_SHAPES = [(1, 1, 64), (5, 8, 3), (37, 12, 1), (100, 40, 24), (1000, 150, 128),
                 (4099, 615, 256)]


@pytest.mark.parametrize("out_kind", ["alloc", "dense", "strided"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("length,budget,dim", GATHER_SHAPES,
                         ids=[f"N{n}-K{k}-D{d}" for n, k, d in GATHER_SHAPES])
def test_gather_matches_reference(length, budget, dim, dtype, layout, out_kind, device, gen):
    batch, heads = 2, 3
    k, v = make_kv(batch, heads, length, dim, dtype, device, layout, gen)
    idx = random_idx(batch, heads, length, budget, gen, device)
    exp_k, exp_v = ref.gather_kv(k, v, idx)
    if out_kind == "alloc":
        out_k, out_v = kp.gather_kv(k, v, idx)
    else:
        given_k, given_v, bigs = out_buffers(out_kind, batch, heads, budget, dim, dtype, device)
        out_k, out_v = kp.gather_kv(k, v, idx, out_k=given_k, out_v=given_v)
        assert out_k is given_k and out_v is given_v
        if bigs is not None:  # rows outside the view still hold the poison
            for big in bigs:
                assert big[:, [0, budget + 1]].isnan().all()
    assert torch.equal(out_k.cpu(), exp_k) and torch.equal(out_v.cpu(), exp_v)
    assert_gathered(k, v, idx, out_k, out_v)


def test_gather_k_and_v_in_different_layouts(device, gen):
    k = randn_tokens(2, 2, 50, 16, device=device, layout="contig", gen=gen)
    v = randn_tokens(2, 2, 50, 16, device=device, layout="bnhd", gen=gen)
    idx = random_idx(2, 2, 50, 20, gen, device)
    out_k, out_v = kp.gather_kv(k, v, idx)
    exp_k, exp_v = ref.gather_kv(k, v, idx)
    assert torch.equal(out_k.cpu(), exp_k) and torch.equal(out_v.cpu(), exp_v)


def test_gather_out_of_range_indices(device, gen):
    """CPU rejects kept indices outside [-1, N), naming idx; the CUDA kernels cannot
    check without a host sync and write a zero row for every index outside [0, N)."""
    k, v = make_kv(1, 2, 16, 8, torch.float32, device, "contig", gen)
    idx = torch.tensor([[[-1, 0, 15, 16, -7, 1 << 30, 3, 3]]], dtype=torch.int32).expand(1, 2, 8)
    idx = idx.contiguous().to(device)
    if not on_cuda_path(device):
        with pytest.raises(IndexError, match=r"idx holds 16 at \[0, 0, 3\]"):
            kp.gather_kv(k, v, idx)
        idx = idx.clamp(-1, 15)  # in range; -1 (padding) still gives a zero row
    out_k, out_v = kp.gather_kv(k, v, idx)
    exp_k, exp_v = ref.gather_kv(k, v, idx)
    assert torch.equal(out_k.cpu(), exp_k) and torch.equal(out_v.cpu(), exp_v)


def test_gather_empty(device, gen):
    k, v = make_kv(2, 2, 10, 8, torch.float16, device, "contig", gen)
    out_k, out_v = kp.gather_kv(k, v, torch.empty(2, 2, 0, dtype=torch.int32, device=device))
    assert out_k.shape == out_v.shape == (2, 2, 0, 8)
    no_rows = torch.empty(0, 2, 4, dtype=torch.int32, device=device)
    out_k, out_v = kp.gather_kv(k[:0], v[:0], no_rows)
    assert out_k.shape == (0, 2, 4, 8)


# ---------------------------------------------------------------- streaming

@pytest.mark.parametrize("layout", ["contig", "bnhd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("budget,n_sink", [(16, 4), (16, 0), (4, 4), (1, 0), (300, 4)])
def test_streaming_matches_reference(budget, n_sink, dtype, layout, device, gen):
    lens = [200, 0, 3, min(budget, 200), min(budget + 1, 200), 150]
    seq_lens = seq_lens_tensor(lens, device)
    k, v = make_kv(len(lens), 2, 200, 64, dtype, device, layout, gen)
    exp_k, exp_v, exp_idx = ref.streaming(k, v, budget, n_sink=n_sink, seq_lens=seq_lens)
    poison_beyond(k, lens)
    poison_beyond(v, lens)
    out_k, out_v, idx = kp.streaming(k, v, budget, n_sink=n_sink, seq_lens=seq_lens)
    assert torch.equal(idx.cpu(), exp_idx)
    assert torch.equal(out_k.cpu(), exp_k) and torch.equal(out_v.cpu(), exp_v)


@pytest.mark.parametrize("length", [1, 37, 4099])
def test_streaming_without_seq_lens(length, device, gen):
    k, v = make_kv(1, 3, length, 24, torch.bfloat16, device, "sliced", gen)
    kept = kp.streaming(k, v, 64)
    assert isinstance(kept, kp.KeptKV)
    exp_k, exp_v, exp_idx = ref.streaming(k, v, 64)
    assert torch.equal(kept.idx.cpu(), exp_idx)
    assert torch.equal(kept.k.cpu(), exp_k) and torch.equal(kept.v.cpu(), exp_v)
