"""bench/ruler_variants.py: each screen setting builds the policy its name says.

The module patches eval_ruler's settings when imported, so it is checked in a fresh process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parent.parent / "bench"

CHECK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
import eval_ruler as er
import ruler_variants as rv

args = er.parse(["--quick"])
# the share each novelty setting names reaches the policy (kvzip-head's fields fill the rest)
for name, share, cls in [("kzkd-head-h50", 0.5, "KVzip"), ("kzkd-head-h25", 0.25, "KVzip"),
                         ("kzur-head-h50", 0.5, "KVzipUnroped"), ("kzfl-head-h50", 0.5, "KVzipFloor")]:
    p = rv._setting_policy(name, args)
    assert (type(p).__name__, p.novelty, p.window) == (cls, share, 0), (name, p)
assert rv._setting_policy("kvzip-head", args).novelty == 0.0

# the floor control: half of a 4-token budget (2 keys) to the head's own two largest maxima,
# raised by 1 above the rest (computed by hand)
p = rv.KVzipFloor(budget=4, n_sink=0, novelty=0.5)
s = torch.tensor([[[0.1, 0.5, 0.2, 0.9, 0.3, 0.05, 0.0, 0.4]]])
want = torch.tensor([[[0.1, 1.5, 0.2, 1.9, 0.3, 0.05, 0.0, 0.4]]])
assert torch.equal(p.rank_recorded(s), want)
print("ok")
"""


def test_screen_settings_build_the_policies_they_name():
    out = subprocess.run([sys.executable, "-c", CHECK, str(BENCH)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
