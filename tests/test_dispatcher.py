"""Dispatcher integration: opcheck (schema, fake impls, AOT dispatch), torch.compile
with fullgraph=True, and build_info()."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys

import pytest
import torch

import kvprune_cuda as kp

from helpers import HAS_CUDA, lse_f64, randn_tokens

OPS = torch.ops.kvprune


def op_samples(device, gen):
    """(id, op overload, args) with small inputs for every op of the kvprune namespace."""
    q = randn_tokens(2, 4, 8, 32, device=device, gen=gen)
    k = randn_tokens(2, 2, 48, 32, device=device, gen=gen, layout="bnhd")
    v = randn_tokens(2, 2, 48, 32, device=device, gen=gen, layout="bnhd")
    lens = torch.tensor([48, 20], dtype=torch.int32, device=device)
    lse = lse_f64(q, k)
    scores = torch.rand(2, 2, 48, generator=gen).to(device)
    idx = kp.select_keep(scores, 20, n_sink=2, window=8)
    out = lambda: torch.full((2, 2, 20, 32), float("nan"), device=device)
    return [
        ("window_scores", OPS.window_scores.default, (q, k, None, None, "mean", None)),
        ("window_scores-lse-seq_lens", OPS.window_scores.default, (q, k, lse, 0.3, "max", lens)),
        ("window_scores-qmax", OPS.window_scores.default, (q, k, None, None, "sum", lens, "max")),
        ("window_scores_out-qmax", OPS.window_scores_out.default,
         (q, k, None, None, "mean", lens, "max", torch.rand(2, 2, 30, generator=gen).to(device))),
        ("window_scores_out-qmax-weights", OPS.window_scores_out.default,
         (q, k, lse, None, "max", lens, "max", torch.rand(2, 2, 30, generator=gen).to(device), None,
          torch.rand(2, 4, 8, generator=gen).to(device), torch.rand(2, 4, 30, generator=gen).to(device))),
        ("window_scores-qmax-key-weight", OPS.window_scores.default,
         (q, k, None, None, "mean", None, "max", None, None, torch.rand(2, 4, 48, generator=gen).to(device))),
        ("window_scores_out-sum-lse", OPS.window_scores_out.default,
         (q, k, lse, None, "max", None, "sum", torch.rand(2, 2, 48, generator=gen).to(device))),
        ("pool_scores", OPS.pool_scores.default, (scores, 7, "max", 8, None)),
        ("pool_scores-avg-seq_lens", OPS.pool_scores.default, (scores, 5, "avg", 8, lens)),
        ("select_keep", OPS.select_keep.default, (scores, 20, 2, 8, lens)),
        ("gather_kv", OPS.gather_kv.default, (k, v, idx)),
        ("gather_kv_out", OPS.gather_kv_out.default, (k, v, idx, out(), out())),
        ("snapkv", OPS.snapkv.default, (q, k, v, 20, 2, 8, 7, "max", "mean", None, None, None)),
        ("snapkv-lse-seq_lens", OPS.snapkv.default,
         (q, k, v, 20, 2, 8, 5, "avg", "sum", lse, None, lens)),
        ("streaming", OPS.streaming.default, (k, v, 20, 4, lens)),
    ]


SAMPLE_IDS = [s[0] for s in op_samples("cpu", torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("sample", range(len(SAMPLE_IDS)), ids=SAMPLE_IDS)
def test_opcheck(sample, device, gen):
    _, op, args = op_samples(device, gen)[sample]
    torch.library.opcheck(op, args)


def test_fake_shapes_match_real(device, gen):
    """The fake impls (FakeTensorMode) report the real outputs' shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for _, op, args in op_samples(device, gen):
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = op(*fake_args)
        if real is None:  # *_out ops: mutate their outputs, return nothing
            assert fake is None, op
            continue
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        assert len(real) == len(fake), (op, len(real), len(fake))  # zip would hide a missing one
        for r, f in zip(real, fake, strict=True):
            assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device), op


def compress(q, k, v, lse, buf_k, buf_v):
    """What an engine would compile: scores for logging, the fused compression, and a
    compaction into caller-owned buffers (a mutating op)."""
    scores = kp.window_scores(q, k, lse=lse, gqa="max")
    kept = kp.snapkv(q, k, v, 24, n_sink=2, window=8, lse=lse)
    kp.gather_kv(k, v, kept.idx, out_k=buf_k, out_v=buf_v)
    return scores.sum(dim=-1), kept.k * 2, kept.v, kept.idx


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend, device, gen):
    if backend == "inductor" and device == "cpu":
        # ~30 s of C++ codegen on a 2-core box; the custom ops are opaque to inductor
        # anyway, and aot_eager already exercises the fake impls and functionalisation.
        pytest.skip("inductor on the CPU is too slow for the test budget; aot_eager covers it")
    q = randn_tokens(2, 4, 8, 32, device=device, gen=gen)
    k = randn_tokens(2, 2, 64, 32, device=device, gen=gen)
    v = randn_tokens(2, 2, 64, 32, device=device, gen=gen)
    lse = lse_f64(q, k)
    buffers = lambda: [torch.full((2, 2, 24, 32), float("nan"), device=device) for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(compress, fullgraph=True, backend=backend)
    for q_now, lse_now in ((q, lse), (randn_tokens(2, 4, 8, 32, device=device, gen=gen), None)):
        got_bufs, want_bufs = buffers(), buffers()
        got = compiled(q_now, k, v, lse_now, *got_bufs)
        want = compress(q_now, k, v, lse_now, *want_bufs)
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)  # fused sum may reorder
        for g, w in zip(got[1:] + tuple(got_bufs), want[1:] + tuple(want_bufs)):
            assert torch.equal(g, w)


def test_build_info():
    info = kp.build_info()
    assert {"version", "cuda", "cuda_archs"} <= set(info)
    assert isinstance(info["version"], str) and info["version"] == kp.__version__
    assert isinstance(info["cuda"], bool) and isinstance(info["cuda_archs"], str)
    if info["cuda"]:
        assert info["cuda_archs"], "CUDA compiled in but no architectures reported"
    try:
        installed = importlib.metadata.version("kvprune_cuda")
    except importlib.metadata.PackageNotFoundError:
        installed = None  # running from a source tree
    if installed is not None:
        assert installed == info["version"]


def _cpu_flags() -> set:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")),
                    set())


@pytest.mark.skipif(platform.machine() != "x86_64" or not os.path.exists("/proc/cpuinfo"),
                    reason="x86-64 Linux only (/proc/cpuinfo)")
def test_build_info_names_the_cpu_kernels_the_cpu_supports():
    """The CPU window_scores kernels chosen at run time are the best /proc/cpuinfo allows: bf16
    dot products (vdpbf16ps) where it lists avx512_bf16."""
    flags = _cpu_flags()
    avx512 = {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= flags
    expected = ("avx512bf16" if avx512 and "avx512_bf16" in flags else "avx512" if avx512
                else "avx2" if {"avx2", "fma", "f16c"} <= flags else "baseline")
    assert kp.build_info()["cpu_kernels"] == (os.environ.get("KVPRUNE_CPU_KERNELS") or expected)


_SCORES_IN_A_CHILD = """
import torch, kvprune_cuda as kp
from kvprune_cuda import reference as ref
print(kp.build_info()["cpu_kernels"])
g = torch.Generator().manual_seed(0)
q = torch.randn(2, 4, 8, 64, generator=g).bfloat16()
k = torch.randn(2, 2, 300, 64, generator=g).bfloat16()
got, want = kp.window_scores(q, k), ref.window_scores(q.double(), k.double())
print(float((got.double() - want).abs().max() / want.abs().max()))
"""


def test_kvprune_cpu_kernels_picks_the_variant_and_names_a_wrong_one():
    """KVPRUNE_CPU_KERNELS runs the named variant (baseline: every host has it) with the same
    scores as the reference; a name the CPU lacks or no variant has is refused, named."""
    def child(value):
        env = {**os.environ, "KVPRUNE_CPU_KERNELS": value}
        return subprocess.run([sys.executable, "-c", _SCORES_IN_A_CHILD], env=env, cwd="/tmp",
                              capture_output=True, text=True, timeout=300)

    run = child("baseline")
    assert run.returncode == 0, run.stderr[-2000:]
    name, error = run.stdout.split()
    assert name == "baseline" and float(error) < 1e-5
    run = child("avx9000")
    assert run.returncode != 0
    assert ("KVPRUNE_CPU_KERNELS=avx9000: expected one of avx512bf16, avx512, avx2, baseline"
            in run.stderr)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_build_info_covers_this_gpu():
    info = kp.build_info()
    assert info["cuda"], "a GPU is present but the CUDA kernels were not compiled in"
    major, minor = torch.cuda.get_device_capability()
    archs = {a.strip().rstrip("af-").replace("sm_", "").replace("compute_", "")
             for a in info["cuda_archs"].replace(";", ",").split(",") if a.strip()}
    assert any(int(a[:-1]) == major and int(a[-1]) <= minor for a in archs if a.isdigit()), (
        f"no kernel for sm_{major}{minor} in {info['cuda_archs']}")


def test_public_api_surface():
    for name in ("window_scores", "pool_scores", "select_keep", "gather_kv", "snapkv",
                 "streaming", "build_info", "KeptKV"):
        assert hasattr(kp, name) and name in kp.__all__, name
        assert getattr(kp, name).__doc__, f"{name} has no docstring"
