"""bench/ruler_probe.py's own rules: the trailing pool and the kept-position matching."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import ruler_probe as rp  # noqa: E402

import kvprune_cuda as kp  # noqa: E402


@pytest.mark.parametrize("pool", ["max", "avg"])
@pytest.mark.parametrize("kernel_size", [1, 7, 15])
def test_trailing_pool_is_the_pool_of_the_scores_ending_at_each_position(pool, kernel_size):
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 60, 16)
    got = rp.TrailingSnapKV(window=8, kernel_size=kernel_size, pool=pool).score(q, k)
    s = kp.window_scores(q, k, gqa="mean")
    want = s.clone()  # the window's 8 positions are copied
    for t in range(60 - 8):
        seg = s[..., max(0, t - kernel_size + 1): t + 1]
        want[..., t] = seg.max(-1).values if pool == "max" else seg.sum(-1) / kernel_size
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_kept_positions_match_exact_copies_only():
    torch.manual_seed(1)
    full = torch.randn(1, 2, 20, 8)
    keep = [[0, 3, 4, 19], [1, 2, 5, 6]]
    kept = torch.stack([full[0, h, keep[h]] for h in range(2)])[None]
    kept[0, 1, 3] += 1e-3  # not a copy: not matched
    got = rp.kept_positions(full, kept)
    want = torch.zeros(2, 20, dtype=torch.bool)
    want[0, keep[0]] = True
    want[1, [1, 2, 5]] = True
    assert torch.equal(got, want)


def test_last_token_group_answers_as_generate_on_the_whole_prompt():
    er = pytest.importorskip("eval_ruler")
    model = er.tiny_model().float()
    prompt = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    aware = kp.hf.score_context(model, prompt[:, :-1], ["snapkv"], window=8)
    sc, first = rp.with_last_token(model, aware, prompt[:, -1:])
    assert torch.equal(sc.context_ids, prompt)
    got = sc.compress(policy="full").generate(first, max_new_tokens=5, do_sample=False)
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got[0], want[0, prompt.shape[1]:])


def test_needle_spans_of_multivalue_cover_every_value_and_key():
    """niah_multivalue hides one key with four values: all four values (and the key in each
    needle) are the asked needle's, none are "others"."""
    import ruler_tasks as rt
    needles = [f"One of the special magic numbers for sharp-tunnel is: {v}." for v in ("111", "222", "333")]
    text = "Prose. " + " Prose. ".join(needles) + " End."
    sample = rt.Sample("niah_multivalue", 0, text, "q", "a", ["111", "222", "333"],
                       {"keys": ["sharp-tunnel"], "values": ["111", "222", "333"],
                        "asked": ["sharp-tunnel"], "needles": needles})
    spans = rp.needle_spans(sample, text)
    assert [text[a:b] for a, b in spans["value"]] == ["111", "222", "333"]
    assert [text[a:b] for a, b in spans["key"]] == ["sharp-tunnel"] * 3
    assert spans["others"] == []
