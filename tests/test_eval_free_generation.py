"""eval_free_generation's --resume: which earlier rows it keeps (no model needed)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import eval_free_generation as efg  # noqa: E402


def _args(out: Path, **changed) -> argparse.Namespace:
    same = dict(prompts=3, tokens=512, gen=2048, interval=32, dtype="float32",
                model="qwen2.5-coder-0.5b-instruct", seed=0)
    return argparse.Namespace(out=out, **{**same, **changed})


def test_resume_keeps_the_rows_of_the_same_run_and_refuses_another(tmp_path):
    out = tmp_path / "free.json"
    assert efg._resumed(_args(out)) == []  # no file yet
    rows = [{"setting": "full"}, {"setting": "h2o held 256"}]
    out.write_text(json.dumps({"meta": vars(_args(out)) | {"out": str(out)}, "rows": rows}))
    assert efg._resumed(_args(out)) == rows
    with pytest.raises(ValueError, match="--resume: .* was run with gen=2048, this run has 700"):
        efg._resumed(_args(out, gen=700))


def test_loop_onset_finds_where_a_generation_starts_repeating_itself():
    """200 distinct tokens, then a 5-token phrase over and over: the 4-grams from 205 on
    repeat one 5 tokens back (those starting at 197-204 are new), so the first 128-token
    span at a multiple of 16 that is >= 90 % repeats starts at 208 (192's holds
    (320 - 205) / 128 = 0.898). Distinct tokens alone, or a phrase that comes back only
    more than 200 tokens later, never loop."""
    distinct = list(range(1000, 1200))
    assert efg.loop_onset(distinct + [1, 2, 3, 4, 5] * 60) == 208
    assert efg.loop_onset(list(range(2000))) is None
    far_apart = (list(range(10, 260)) + [1, 2, 3, 4, 5]) * 6  # each repeat 255 tokens later
    assert efg.loop_onset(far_apart) is None
    # one token over and over: repeats from 201 (200's four sevens are new), so 192's span
    # holds (320 - 201) / 128 = 0.93 and 176's (304 - 201) / 128 = 0.80
    assert efg.loop_onset(distinct + [7] * 300) == 192
