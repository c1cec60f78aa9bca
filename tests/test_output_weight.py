"""kvprune_cuda.policy.output_weight (KVzip+'s key weights) against a hand computation and a
float64 projection per head; KVzip(weight=...) checked. The weighted maxima themselves:
test_window_scores_weights.py."""

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda.policy.output_weight import value_output_norms


def test_value_output_norms_by_hand():
    # one KV head (D = 2) shared by two query heads; o_proj maps head 0 by [[3, 0], [0, 4]]
    # (hidden 2), head 1 by twice the identity
    o_weight = torch.tensor([[3.0, 0.0, 2.0, 0.0],
                             [0.0, 4.0, 0.0, 2.0]])
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]).view(1, 1, 3, 2)
    got = value_output_norms(o_weight, values)
    want = torch.tensor([[[3.0, 4.0, 5.0], [2.0, 2.0, 8 ** 0.5]]])
    assert got.shape == (1, 2, 3) and torch.allclose(got, want)


def test_value_output_norms_match_the_projection_per_head():
    g = torch.Generator().manual_seed(0)
    b, hkv, grp, n, d, hidden = 2, 2, 3, 9, 4, 10
    o_weight, values = torch.randn(hidden, hkv * grp * d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    want = torch.empty(b, hkv * grp, n, dtype=torch.float64)
    for h in range(hkv * grp):
        w = o_weight[:, h * d:(h + 1) * d].double()
        want[:, h] = (values[:, h // grp].double() @ w.T).norm(dim=-1)
    assert torch.allclose(value_output_norms(o_weight, values).double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="o_weight"):
        value_output_norms(torch.randn(hidden, 5), values)
    with pytest.raises(ValueError, match="values"):
        value_output_norms(o_weight, values[0])


def test_kvzip_weight_is_checked_and_needs_its_weights():
    with pytest.raises(ValueError, match="weight"):
        kp.policy.KVzip(weight="value")
    with pytest.raises(TypeError, match="weight"):
        kp.policy.KVzip(weight=True)
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 6, 4)
    assert kp.policy.KVzip().weight == "output"  # KVzip+ by default
    with pytest.raises(ValueError, match="weights"):
        kp.policy.KVzip().score(q, k)
    with pytest.raises(ValueError, match="weights"):
        kp.policy.KVzip(weight="none").score(q, k, weights=(torch.ones(1, 2, 6), torch.ones(1, 2, 3)))
    got = kp.policy.KVzip().score(q, k, weights=(torch.full((1, 2, 6), 2.0), torch.ones(1, 2, 3)))
    assert torch.allclose(got, 2 * kp.policy.KVzip(weight="none").score(q, k), atol=1e-6)


def test_output_weights_need_the_attentions_o_proj():
    """A model whose attention has no o_proj cannot run KVzip+: a ValueError naming weight and
    the way out (weight="none"), not an AttributeError deep in the reconstruction."""
    pytest.importorskip("transformers")
    from kvprune_cuda.hf.reconstruct import output_weights

    with pytest.raises(ValueError, match="weight.*o_proj.*weight='none'"):
        output_weights(torch.nn.Module(), torch.randn(1, 3, 8), torch.randn(1, 1, 5, 4))
