"""bench/eval_ppl.py's --context mode on the tiny random Qwen2 of eval_ruler --quick (no
download): a context compressed once, the rest of the text read after it in one forward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import eval_ppl  # noqa: E402
import eval_ruler as er  # noqa: E402
import ruler_tasks as rt  # noqa: E402

import kvprune_cuda as kp  # noqa: E402


class _Bar:
    n = 0

    def update(self, k):
        self.n += k


def test_scoring_groups_split_only_what_is_recorded_otherwise():
    made = [kp.policy.make(eval_ppl.CONTEXT_POLICIES[n][0], **eval_ppl.CONTEXT_POLICIES[n][1])
            for n in ("kvzip", "snapkv", "kvzip-plain")] + [kp.policy.make("h2o")]
    groups = eval_ppl.scoring_groups(made)
    assert [[p.name for p in g] for g in groups] == [["kvzip", "snapkv", "h2o"], ["kvzip"]]
    assert (groups[0][0].weight, groups[1][0].weight) == ("output", "none")
    # a kept window does not shape the reconstruction maxima: the default's scoring serves it
    windowed = kp.policy.make("kvzip", **eval_ppl.CONTEXT_POLICIES["kvzip-w32"][1])
    assert windowed.window == 32 and eval_ppl.scoring_groups([made[0], windowed]) == [[made[0], windowed]]


def test_context_nll_equals_the_plain_forward_when_everything_is_kept():
    """Budget = the whole context: every policy's NLL of the continuation is the plain
    model's over the whole text; a smaller budget changes it (the foil)."""
    torch.manual_seed(0)
    model, tok = er.tiny_model(), rt.CharTokenizer()
    ids = torch.randint(20, 120, (1, 200))
    prompt = 150
    plain = eval_ppl.nll_full(model, ids)[prompt:]
    bar = _Bar()
    names = list(eval_ppl.CONTEXT_POLICIES)
    out = eval_ppl.nll_context(model, tok, ids, prompt, names, [prompt, 40], bar, n_sink=4, window=8)
    assert bar.n == len(names) * 2 and set(out) == {(n, b) for n in names for b in (prompt, 40)}
    for n in names:
        nll, held = out[n, prompt]
        assert nll.shape == plain.shape
        torch.testing.assert_close(nll, plain, rtol=1e-4, atol=1e-4)
        small, held_small = out[n, 40]
        assert held_small < held and not torch.allclose(small, plain, rtol=1e-3, atol=1e-3), n


def test_bucket_means_are_the_means_of_consecutive_runs():
    nll = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert eval_ppl.bucket_means(nll, 2) == [1.5, 3.5, 5.0]
    assert eval_ppl.bucket_means(nll, 5) == [3.0]
