"""kvprune_cuda.policy.output_weight (KVzip+'s weighting), against a hand computation, the
library's unweighted kernel (kp.window_scores) and float64 loops written here."""

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda.policy.output_weight import value_output_norms, weighted_maxima


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


@pytest.mark.parametrize("gqa", ["max", "mean", "sum"])
def test_unit_weights_give_the_kernels_maxima(gqa):
    g = torch.Generator().manual_seed(1)
    b, hq, hkv, w, n, d, m = 2, 4, 2, 5, 12, 8, 7
    q, k = torch.randn(b, hq, w, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    start = torch.rand(b, hkv, m, generator=g) * 0.3  # folded: max(out, new)
    got = weighted_maxima(q, k, torch.ones(b, hq, m), torch.ones(b, w), start.clone(), gqa=gqa)
    want = kp.window_scores(q, k, gqa=gqa, qreduce="max", out=start.clone())
    assert torch.allclose(got, want, atol=1e-6)


def test_weighted_maxima_against_a_float64_loop(monkeypatch):
    monkeypatch.setattr("kvprune_cuda.policy.output_weight.BLOCK", 40)  # several query blocks
    g = torch.Generator().manual_seed(2)
    b, hq, hkv, w, n, d, m = 1, 4, 2, 6, 10, 4, 8
    q, k = torch.randn(b, hq, w, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    kw, qw = torch.rand(b, hq, m, generator=g) * 3, torch.rand(b, w, generator=g) + 0.5
    got = weighted_maxima(q, k, kw, qw, torch.zeros(b, hkv, m), scale=0.7, gqa="max")
    want = torch.zeros(b, hkv, m, dtype=torch.float64)
    for h in range(hq):
        for i in range(w):
            seen = n - w + i + 1  # query i sees itself and every key before it
            logits = (k[0, h // 2, :seen].double() @ q[0, h, i].double()) * 0.7
            p = torch.softmax(logits, 0)
            for t in range(min(m, seen)):
                want[0, h // 2, t] = max(want[0, h // 2, t], p[t] * kw[0, h, t] * qw[0, i])
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-7)


def test_weighted_maxima_names_its_bad_arguments():
    q, k, out = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 6, 4), torch.zeros(1, 1, 5)
    kw, qw = torch.ones(1, 2, 5), torch.ones(1, 3)
    for bad, name in [((q, k, kw[:, :1], qw, out), "key_weight"), ((q, k, kw, qw[:, :2], out), "query_weight"),
                      ((q, k, kw, qw, torch.zeros(1, 1, 7)), "out"), ((q, k[..., :3], kw, qw, out), "keys")]:
        with pytest.raises(ValueError, match=name):
            weighted_maxima(*bad)


def test_kvzip_weight_is_checked_and_needs_its_weights():
    with pytest.raises(ValueError, match="weight"):
        kp.policy.KVzip(weight="value")
    with pytest.raises(TypeError, match="weight"):
        kp.policy.KVzip(weight=True)
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 6, 4)
    with pytest.raises(ValueError, match="weights"):
        kp.policy.KVzip(weight="output").score(q, k)
    with pytest.raises(ValueError, match="weights"):
        kp.policy.KVzip().score(q, k, weights=(torch.ones(1, 2, 6), torch.ones(1, 3)))
    got = kp.policy.KVzip(weight="output").score(q, k, weights=(torch.full((1, 2, 6), 2.0), torch.ones(1, 3)))
    assert torch.allclose(got, 2 * kp.policy.KVzip().score(q, k), atol=1e-6)
