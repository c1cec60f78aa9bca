"""The CUDA kernels under the SIMT emulator (kp.testing.emulate_cuda) where the shared
device grid does not reach: plans that depend on the device (SM count, head splits
when a group's queries overflow shared memory, many CTAs per selected row), every
gather vector width, shuffled schedules, and agreement with the CPU backend. Sizes
are cut to what the emulator runs in seconds; tests/test_cuda_only.py has the GPU
versions (graphs, streams, N = 2^20)."""

from __future__ import annotations

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda import reference as ref

from helpers import (
    HAS_EMULATOR, assert_gathered, assert_scores_close, check_selection, expected_gather,
    lse_f64, randn_tokens, rng, score_tol, seq_lens_tensor, window_scores_f64,
)

pytestmark = pytest.mark.skipif(not HAS_EMULATOR, reason="no CUDA emulator in this build")

CUDA_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-3}


def emulated(**options):
    return kp.testing.emulate_cuda(schedules=("forward", "reverse"), **options)


@pytest.mark.parametrize("sm_count", [1, 7, 132])
@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
def test_window_scores_for_any_sm_count(sm_count, with_lse, gen):
    """The key chunking follows the SM count (tiles per CTA 1..64); scores must not."""
    q = randn_tokens(1, 4, 24, 64, dtype=torch.bfloat16, gen=gen)
    k = randn_tokens(1, 2, 3000, 64, dtype=torch.bfloat16, gen=gen, layout="bnhd")
    lse = lse_f64(q, k) if with_lse else None
    with emulated(sm_count=sm_count):
        out = kp.window_scores(q, k, lse=lse)
    assert_scores_close(out, window_scores_f64(q, k, lse=lse), CUDA_TOL[torch.bfloat16])


@pytest.mark.parametrize("gqa", ["mean", "max"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_head_splits(dtype, gqa, gen):
    """D = 256, W = 128, G = 4: one CTA's shared memory holds 3 heads' rows in the stats
    pass and 3 in the probs pass, so the group is split over CTAs and reduced after."""
    lens = seq_lens_tensor([300, 129], "cpu")
    q = randn_tokens(2, 4, 128, 256, dtype=dtype, gen=gen)
    k = randn_tokens(2, 1, 300, 256, dtype=dtype, gen=gen)
    before = dict(kp._C._emulated_launch_counts())
    with emulated():
        out = kp.window_scores(q, k, gqa=gqa, seq_lens=lens)
    after = dict(kp._C._emulated_launch_counts())
    split_reduce = [n for n in after if "split_reduce" in n]
    assert split_reduce and after[split_reduce[0]] > before.get(split_reduce[0], 0), \
        "the head-split path did not run"
    assert_scores_close(out, window_scores_f64(q, k, gqa=gqa, seq_lens=lens), CUDA_TOL[dtype], lens)


def test_select_many_ctas_per_row(gen):
    """70k candidates per row: 18 CTAs share a row's radix select, ties included."""
    n = 70_000
    scores = torch.rand(1, 2, n, generator=gen)
    scores[0, 1, 1000:40000] = 0.5  # a long run of equal scores: ties across CTAs
    lens = seq_lens_tensor([n], "cpu")
    with emulated():
        idx = kp.select_keep(scores, 9000, n_sink=4, window=32, seq_lens=lens)
    assert torch.equal(idx, ref.select_keep(scores, 9000, n_sink=4, window=32, seq_lens=lens))


@pytest.mark.parametrize("dtype,dim,offset,width", [
    (torch.float32, 4, 0, 16), (torch.float16, 4, 0, 8), (torch.float16, 6, 0, 4),
    (torch.bfloat16, 128, 1, 2), (torch.float32, 3, 0, 4),
], ids=["16B", "8B", "4B-fp16", "2B-misaligned", "4B-fp32"])
def test_gather_every_vector_width(dtype, dim, offset, width, gen):
    """Rows are copied in 16/8/4/2-byte vectors, whichever divides every address."""
    base_k = torch.randn(2, 3, 50, dim + offset, generator=gen).to(dtype)
    base_v = torch.randn(2, 3, 50, dim + offset, generator=gen).to(dtype)
    k, v = base_k[..., offset:], base_v[..., offset:]
    idx = torch.randint(-1, 50, (2, 3, 17), generator=gen, dtype=torch.int32)
    before = dict(kp._C._emulated_launch_counts())
    with emulated():
        out_k, out_v = kp.gather_kv(k, v, idx)
    after = dict(kp._C._emulated_launch_counts())
    vec = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "short unsigned int"}[width]
    ran = [n for n in after if n.startswith("gather_kv_kernel<") and after[n] > before.get(n, 0)]
    assert ran == [f"gather_kv_kernel<{vec}>"], ran
    assert torch.equal(out_k, expected_gather(k, idx)) and torch.equal(out_v, expected_gather(v, idx))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_shuffled_schedules_agree(seed, gen):
    """The fused chain under shuffled thread orders (a new permutation at every barrier)
    gives the same bits as the forward order."""
    q = randn_tokens(2, 4, 20, 128, dtype=torch.bfloat16, gen=gen)
    k = randn_tokens(2, 2, 700, 128, dtype=torch.bfloat16, gen=gen, layout="bnhd")
    v = randn_tokens(2, 2, 700, 128, dtype=torch.bfloat16, gen=gen, layout="bnhd")
    lens = seq_lens_tensor([700, 301], "cpu")
    with kp.testing.emulate_cuda(schedules=("forward", "shuffled", "reverse"), seed=seed):
        kept = kp.snapkv(q, k, v, 120, window=20, seq_lens=lens)
    pooled = ref.pool_scores(window_scores_f64(q, k, seq_lens=lens), 7, "max", window=20,
                             seq_lens=lens)
    atol = 2 * CUDA_TOL[torch.bfloat16] * pooled.double().amax(dim=-1)
    check_selection(kept.idx, pooled, 120, n_sink=4, window=20, seq_lens=lens, atol=atol)
    assert_gathered(k, v, kept.idx, kept.k, kept.v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cpu_and_emulated_cuda_agree(dtype, gen):
    lens = seq_lens_tensor([1500, 700, 33], "cpu")
    q = randn_tokens(3, 8, 32, 128, dtype=dtype, gen=gen)
    k = randn_tokens(3, 2, 1500, 128, dtype=dtype, gen=gen, layout="bnhd")
    v = randn_tokens(3, 2, 1500, 128, dtype=dtype, gen=gen, layout="bnhd")
    cpu_scores = kp.window_scores(q, k, seq_lens=lens)
    cpu_kept = kp.snapkv(q, k, v, 300, seq_lens=lens)
    with emulated():
        emu_scores = kp.window_scores(q, k, seq_lens=lens)
        emu_kept = kp.snapkv(q, k, v, 300, seq_lens=lens)
    assert_scores_close(emu_scores, cpu_scores, CUDA_TOL[dtype] + 1e-5, lens)
    pooled = kp.pool_scores(cpu_scores, 7, "max", window=32, seq_lens=lens)
    atol = 2 * (CUDA_TOL[dtype] + 1e-5) * cpu_scores.double().amax(dim=-1)
    for kept in (cpu_kept, emu_kept):
        check_selection(kept.idx, pooled, 300, n_sink=4, window=32, seq_lens=lens, atol=atol)
    assert_gathered(k, v, emu_kept.idx, emu_kept.k, emu_kept.v)


def test_emulate_cuda_switches_only_inside(gen):
    assert not kp.testing.emulating_cuda()
    with kp.testing.emulate_cuda():
        assert kp.testing.emulating_cuda()
        with pytest.raises(RuntimeError, match="already active"):
            with kp.testing.emulate_cuda():
                pass
    assert not kp.testing.emulating_cuda()


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedules=()), "at least one"), (dict(schedules=("sideways",)), "schedule must be"),
    (dict(sm_count=0), "sm_count"), (dict(seed=-1), "seed"), (dict(host_threads=-2), "host_threads"),
])
def test_emulate_cuda_rejects_bad_options(kwargs, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        with kp.testing.emulate_cuda(**kwargs):
            pass
    assert not kp.testing.emulating_cuda()
