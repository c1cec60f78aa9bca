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
