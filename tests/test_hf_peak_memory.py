"""bench/hf_peak_memory.py on the tiny random Qwen2 of eval_ruler (no download): the bytes a
prefill's cache holds against the hand formula, and one fresh-process row (its kernel-measured
peak holds at least the cache it made; a second run resumes instead of measuring again)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import eval_ruler as er  # noqa: E402
import hf_peak_memory as hpm  # noqa: E402

N = 512


@pytest.fixture(scope="module")
def tiny():
    model = er.tiny_model()
    return model, torch.randint(3, 128, (1, N), generator=torch.Generator().manual_seed(0))


def _hand(model, tokens: int) -> int:
    """K and V of every layer, fp32: layers * 2 * kv_heads * tokens * head_dim * 4."""
    c = model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * tokens * c.head_dim * 4


def test_cache_bytes_are_the_hand_formula(tiny):
    model, ids = tiny
    full = hpm.prefill(model, None, ids, "full", 0.16)
    assert full["kv_bytes"] == _hand(model, N) and full["held_tokens"] == N
    assert full["logits_bytes"] == 128 * 4  # logits_to_keep=1: the last position only
    assert hpm.analytic(hpm.model_shape(model), N, "full", 0.16, 4)["dense_kv_hand"] == _hand(model, N)
    kept = round(0.16 * N)  # 82 > n_sink + window (36): the budget decides
    snap = hpm.prefill(model, None, ids, "snapkv", 0.16)
    assert snap["held_tokens"] == kept and snap["kv_bytes"] == _hand(model, kept)
    a = hpm.analytic(hpm.model_shape(model), N, "snapkv", 0.16, 4)
    assert a["one_layer_plus_rest"] == _hand(model, N) // 2 + _hand(model, kept) // 2  # 2 layers
    shape, token = hpm.model_shape(model), _hand(model, 1)
    bound = 2 * round(0.16 * 8192)  # prefill_max_held: 2x the budget's tokens
    assert hpm.analytic(shape, 8192, "snapkv-bounded", 0.16, 4)["kv_high_water"] == \
        (2 * bound + 2048) * token // 2  # both layers at the bound, the one compressing a chunk more
    assert hpm.analytic(shape, 8192, "snapkv-bounded-recon", 0.16, 4, 12)["kv_high_water"] == \
        2 * (bound + 2048 + 2048 + 12) * token // 2  # each: the bound, a chunk and its repetition
    every = hpm.prefill(model, None, ids, "full+logits", 0.16)
    assert every["logits_bytes"] == N * 128 * 4 and every["kv_bytes"] == _hand(model, N)
    probed = hpm.prefill(model, None, ids, "full+modules", 0.16)  # per-module hooks, removed after
    assert probed["kv_bytes"] == _hand(model, N) and set(probed["module_peaks"]) == {"self_attn", "mlp"}
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_fresh_process_row_and_resume(tmp_path, capsys):
    n, out = 2048, tmp_path / "peak.json"
    argv = ["--model", "tiny", "--tokens", str(n), "--settings", "full", "--dtype", "float32",
            "--warmup", "16", "--out", str(out)]
    (row,) = hpm.main(argv)
    assert "error" not in row, row
    kv = _hand(er.tiny_model(), n)
    assert row["kv_bytes"] == row["dense_kv_hand"] == kv
    assert row["probe"] == "VmHWM"
    # the kernel's count of resident pages against bytes of tensors: the prefill made the cache
    # (and the logits, freed after), so its peak holds at least that; the cache stays resident
    assert row["peak_extra"] >= kv and row["resident_after"] >= kv
    assert row["child_maxrss"] >= row["rss_before"] + row["peak_extra"] - (1 << 20)
    capsys.readouterr()
    assert hpm.main(argv) == [row]  # resumed: nothing measured again
    printed = capsys.readouterr().out
    assert "[skip]" in printed and f"| {n} | full |" in printed
