"""kvprune_cuda.engine: the query window kp.hf and kp.vllm both record (keep_last), and the
kept tokens they both choose (kept_indices), by hand."""

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda.engine import keep_last, kept_indices


def test_keep_last_by_hand():
    a = torch.arange(5.0).view(5, 1, 1)           # queries 0..4 ([q, Hq, D], vLLM's layout)
    w = keep_last(None, a, 3, 0)
    assert w.flatten().tolist() == [2.0, 3.0, 4.0]
    w = keep_last(w, torch.tensor([5.0, 6.0]).view(2, 1, 1), 3, 0)
    assert w.flatten().tolist() == [4.0, 5.0, 6.0]
    w = keep_last(w, torch.arange(10.0, 20.0).view(10, 1, 1), 3, 0)
    assert w.flatten().tolist() == [17.0, 18.0, 19.0]
    assert keep_last(None, a, 0, 0).shape == (0, 1, 1)
    assert keep_last(None, a[:2], 3, 0).flatten().tolist() == [0.0, 1.0]


def test_keep_last_copies_along_the_hf_layout():
    q = torch.arange(24.0).view(1, 2, 6, 2)      # [B, Hq, q, D], kp.hf's layout
    w = keep_last(None, q, 2, 2)
    assert torch.equal(w, q[:, :, 4:])
    q.zero_()                                     # a copy: the forward's tensor may go
    assert w.sum() > 0 and w.untyped_storage().nbytes() == w.numel() * 4


def test_kept_indices_are_the_sinks_the_window_and_the_top_scores():
    # streaming scores recency: 2 sinks, a window of 3 and the 3 most recent of the rest
    keys = torch.randn(1, 2, 20, 4)
    idx = kept_indices(kp.policy.Streaming(budget=8, n_sink=2, window=3), None, keys, 8)
    assert idx.tolist() == [[[0, 1, 14, 15, 16, 17, 18, 19]] * 2]
    # snapkv: the window's queries vote; a key equal to every query wins outside the window
    q = torch.zeros(1, 2, 4, 4)
    q[..., 0] = 8.0
    keys = torch.zeros(1, 1, 30, 4)
    keys[0, 0, 10, 0] = 1.0
    p = kp.policy.SnapKV(budget=7, n_sink=2, window=4, kernel_size=1)
    assert kept_indices(p, q, keys, 7).tolist() == [[[0, 1, 10, 26, 27, 28, 29]]]
    with pytest.raises(ValueError, match="queries"):
        kept_indices(p, q[:, :, :2], keys, 7)


def test_kept_indices_of_the_default_policy_come_from_the_fused_select(monkeypatch):
    """The default snapkv (49-wide pool shifted by 16) selects with one kp.snapkv_select call
    (what kp.vllm compacts by), keeping what its staged score ranks; a subclass that overrides
    ``score`` is ranked staged."""
    from kvprune_cuda.policy import snapkv as snapkv_module
    calls = []

    def fused(*args, **kwargs):
        calls.append(kwargs["pool_shift"])
        return kp.snapkv_select(*args, **kwargs)

    monkeypatch.setattr(snapkv_module, "snapkv_select", fused)
    q, keys = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 300, 16)
    p = kp.policy.SnapKV(budget=60)
    idx = kept_indices(p, q, keys, 60, scale=0.3)
    assert calls == [16]
    staged = kp.select_keep(p.score(q[:, :, -32:], keys, scale=0.3), 60, n_sink=4, window=32)
    assert torch.equal(idx, staged)

    class Recent(kp.policy.SnapKV):
        def score(self, queries, keys, *, scale=None, seq_lens=None):
            return torch.arange(keys.shape[2], dtype=torch.float32).repeat(*keys.shape[:2], 1)

    assert Recent(budget=60).select_indices(q, keys, 60) is None
    assert kept_indices(Recent(budget=60), q, keys, 60)[0, 0, 4:].tolist() == list(range(244, 300))
    assert calls == [16]
