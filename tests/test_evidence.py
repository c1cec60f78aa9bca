"""kvprune_cuda.evidence.keep_last: the query window kp.hf and kp.vllm both record."""

import torch

from kvprune_cuda.evidence import keep_last


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
