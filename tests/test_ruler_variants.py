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
import eval_ruler as er
import ruler_variants as rv

args = er.parse(["--quick"])
# the share each reservation setting names reaches the policy (kvzip-head's fields fill the rest)
for name, field, share, cls in [("kzkd-head-h50", "novelty", 0.5, "KVzip"),
                                ("kzkd-head-h25", "novelty", 0.25, "KVzip"),
                                ("kzur-head-h50", "novelty", 0.5, "KVzipUnroped"),
                                ("kzfl-head-h50", "head_floor", 0.5, "KVzip"),
                                ("kzfl-head-h25", "head_floor", 0.25, "KVzip")]:
    p = rv._setting_policy(name, args)
    assert (type(p).__name__, getattr(p, field), p.window) == (cls, share, 0), (name, p)
    if field == "novelty":  # no floor beside it (the records' kvzip-head has none)
        assert p.head_floor == 0.0, (name, p)
# the KVzip+ screen ranks the maxima it records beside the plain ones, with the floor it names
for name, floor in [("kzplus-head", 0.0), ("kzplus-head-h25", 0.25)]:
    p = rv._setting_policy(name, args)
    assert (type(p).__name__, p.head_floor, p.window, p.weight) == ("KVzipPlus", floor, 0, "none"), (name, p)
# kvzip-head and the kz* screens rank plain maxima, as their records hold; the library's default
# is KVzip+ with the floor, what kzplus-head-h25 ranks
for name in ("kvzip-head", "kzfl-head-h25", "kzkd-head-h50", "kz-head-p7"):
    assert rv._setting_policy(name, args).weight == "none", name
assert (rv._setting_policy("kvzip-head", args).novelty,
        rv._setting_policy("kvzip-head", args).head_floor) == (0.0, 0.0)
default = rv._setting_policy("kvzip-head-default", args)
assert default == er.kp.policy.make(rv._setting_policy("kzfl-head-h25", args), weight="output")
assert default.weight == "output" and er._recorded_with("kzplus-head-h25", args) == \
    er._recorded_with("kzfl-head-h25", args) != er._recorded_with("kvzip-head-default", args)
# the vote floors: the default's votes, lifted by 1e3 at exactly the positions each names
torch = er.torch
g = torch.Generator().manual_seed(0)
q, k = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 20, 8, generator=g)
plain = er.kp.policy.SnapKV(window=3).score(q, k)
for policy, lifted in [(rv.SnapKVPrefix(prefix=5, window=3), [0, 1, 2, 3, 4]),
                       (rv.SnapKVPrefix(prefix=40, window=3), list(range(17))),
                       (rv.SnapKVStride(stride=6, window=3), [0, 6, 12])]:
    lift = torch.zeros(20)
    lift[lifted] = 1e3
    assert torch.equal(policy.score(q, k), plain + lift), policy
# AdaKV's safeguard: half of each head's 10 kept tokens (budget 0.5 of 20) lifted, the head's
# best votes between the 4 sinks and the 3-token window; the rest as voted (unpooled votes: the
# default pool's plateaus would tie them all)
plain = er.kp.policy.SnapKV(window=3, kernel_size=1).score(q, k)
floor = rv.SnapKVFloor(floor=0.5, budget=0.5, window=3, kernel_size=1).score(q, k)
lifted = (floor - plain) > 0
assert torch.equal(floor[~lifted], plain[~lifted])
assert torch.equal(floor[lifted], plain[lifted] + 1e3)
for h in range(2):
    where = lifted[0, h].nonzero().flatten().tolist()
    assert len(where) == 5 and all(4 <= i < 17 for i in where), where
    rest = [i for i in range(4, 17) if i not in where]
    assert plain[0, h, where].min() >= plain[0, h, rest].max(), h
# the scoped screens rank the default's votes under the scope they name
assert [er.SETTINGS[s][::2] for s in ("sv-d-head", "sv-d-head-f20", "sv-d-global")] == \
    [("aware", "head"), ("aware", "head"), ("aware", "global")]
# the question-window screen votes with each sample's question, all its tokens but the last
import ruler_tasks as rt
seen, compress = [], er.kp.hf.ScoredContext.compress


def spy(self, *a, policy=None, **kw):
    seen.append(policy.window)
    return compress(self, *a, policy=policy, **kw)


er.kp.hf.ScoredContext.compress = spy
quick = er.parse(["--quick", "--window", "256", "--tasks", "niah_single_1", "vt", "--settings", "sv-d-wq"])
tok = rt.CharTokenizer()
samples = rt.make_samples(quick.tasks, quick.samples, tok, quick.tokens, rt.toy_novels(), quick.seed)
er.run(er.tiny_model(), tok, samples, quick.settings, quick.budgets, quick, log=lambda *a: None)
questions = [rt.prompt_ids(tok, s)[1].shape[1] - 1 for s in samples]
assert seen == questions and len(set(questions)) == 2, (seen, questions)
print("ok")
"""


def test_screen_settings_build_the_policies_they_name():
    out = subprocess.run([sys.executable, "-c", CHECK, str(BENCH)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
