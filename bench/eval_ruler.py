#!/usr/bin/env python3
"""RULER-style tasks (``ruler_tasks.py``) under KV-cache compression, query-aware and query-agnostic.

Every setting runs on the very same samples and token ids (context ids + question ids, split
as ``ruler_tasks.prompt_ids`` does):

* ``full`` and query-aware (``<policy>-aware``, snapkv / streaming / h2o): the prompt
  (context and question: the question lies in SnapKV's observation window) but its last token
  scored once per sample for every policy,
  ``sc = kp.hf.score_context(model, prompt[:, :-1], ["snapkv", "h2o"])`` (or, when the
  query-agnostic settings run too, their context's scoring extended by the question,
  ``sc = scored_context.extend(question_ids[:, :-1])``: the context is prefilled once); per config
  ``sc.compress(budget=B, policy=P).generate(prompt[:, -1:], ...)`` (``P="full"``: nothing
  dropped; a setting that names a budget scope passes it, ``budget_scope=S``). The budget is a
  fraction of those tokens. The same semantics as ``kp.hf.compress`` around ``model.generate``
  but for the prompt's last token, which here attends to the compressed cache (and is not in
  the window) instead of the whole prompt; one prefill instead of one per config.
* query-agnostic (kvzip-head / kvzip-global / kvzip-layer: kvzip with no per-head floor and
  plain maxima, ``weight="none"``, as their records hold; kvzip-head-default: the library's
  kvzip; snapkv-agnostic, h2o-agnostic): the context compressed before the question is
  known: one ``kp.hf.score_context(model, context_ids, ["kvzip", "snapkv", "h2o"])`` per
  sample (kvzip's reconstruction forwards included; one per kvzip weight when the settings'
  differ), then per config ``sc.compress(budget=B, budget_scope=S, policy=P)`` and
  ``.generate(question_ids, ...)``: what ``kp.hf.compress_context`` does for one policy. The
  budget is a fraction of the context's tokens.
* bounded (snapkv-aware-bounded): the query-aware default with a bounded-peak prefill, what
  ``kp.hf.compress(..., prefill_max_held=N, prefill_chunk=C)`` does: the prompt but its last
  token prefilled in chunks of ``--prefill-chunk`` tokens, every layer compressed back to
  ``N = --prefill-held`` x the budget's tokens after each chunk that leaves more, and to the
  budget after the last; then that token starts the answer, as for snapkv-aware-default (the
  same tokens, the same budget; with N >= the prompt the two are identical). Its own prefill.
  The held tokens are ranked by the library's default signal ("max": each key's largest
  attention from any prompt query so far); snapkv-aware-bounded-far by the same maxima from
  the queries at least ``window`` positions after the key only (``prefill_signal="far"``);
  snapkv-aware-bounded-window by the policy's own selection by the last window queries
  (``prefill_signal="window"``); snapkv-aware-bounded-far-novel by "far" with half of each
  compression's kept tokens going first to each head's most novel keys
  (``prefill_novelty=0.5``); snapkv-aware-bounded-recon by KVzip+'s maxima from a forward
  that repeats each chunk after it (``prefill_signal="reconstruct"``, the sample's tokenizer's
  repeat prompt; a second pass over the prompt), -recon-novel with a quarter of each
  compression's kept tokens going first to the most novel keys.
* kvpress 0.5.5 (kvpress-snapkv / -streaming / -kvzip / -expected / -keydiff: ``SnapKVPress``,
  ``StreamingLLMPress``, ``KVzipPress``, ``ExpectedAttentionPress``, ``KeyDiffPress``: each key's
  cosine distance from its head's mean key): as kvpress's own pipeline
  runs them, query-agnostic: the context prefilled under ``with press(model)``, then the
  question and a greedy decode on that cache (positions continuing the context's), the same
  token budget (``compression_ratio = 1 - (kept + 0.5) / n``, kvpress floors the pruned
  count). ``kvpress-snapkv-aware``: query-aware (kvpress's pipeline compresses the context
  alone; a kvpress user compressing query-aware puts the question into the compressed text):
  the prompt but its last token prefilled under the press (the question in SnapKV's window),
  then that token: the peer of ``snapkv-aware``, on the same tokens and budget;
  ``kvpress-observed-aware`` likewise with ``ObservedAttentionPress`` (each key's attention
  averaged over the queries that see it; eager attention for its prefill), the peer of
  ``h2o-aware`` (summed); ``kvpress-adakv-aware`` / ``-chunkkv-aware`` / ``-pyramidkv-aware`` /
  ``-criticalkv-aware`` likewise with SnapKVPress's window and pool under ``AdaKVPress``
  (head-adaptive budgets), ``ChunkKVPress`` (whole chunks), ``PyramidKVPress`` (layer budgets)
  and ``CriticalKVPress`` (SnapKV's scores weighted by each value's output norm). The scorer
  presses (SnapKV, StreamingLLM, ExpectedAttention, KeyDiff, CriticalKV) and ChunkKV / PyramidKV
  prune the cache, so their bytes are really freed; ``KVzipPress`` and ``AdaKVPress`` mask
  evicted keys and free nothing (their rows say "masked"; their tokens are the unmasked ones).

Recorded per (sample, setting, budget): the answer, RULER's score (fraction of the reference
strings in the answer, case-insensitive), the KV bytes the cache holds (``ctx.nbytes`` of the
compressed context: after the context for the query-agnostic settings, after
the prompt but its last token for full and the query-aware ones; ``kp.hf.kv_bytes`` of the
cache after the context for kvpress, after the prompt but its last token for
kvpress-snapkv-aware), and wall seconds: the config's own compression and
answer (kvpress: its prefill too); the shared prefills and kvzip's reconstruction are
recorded once per sample (``shared_seconds``). Decoding stops at EOS, at the task's
``max_new_tokens`` (RULER's: niah 128, vt 30, cwe 120, fwe 50) or as soon as every reference is
in the answer (the score can no longer change).

    .venv/bin/python bench/eval_ruler.py --tokens 4096 --samples 5 --out bench/results/ruler_4k.json
    .venv/bin/python bench/eval_ruler.py --table bench/results/ruler_4k.json --plot bench/results/ruler_4k/plot.png
    .venv/bin/python bench/eval_ruler.py --quick      # tiny random model, no download (CI)
    .venv/bin/python bench/eval_ruler.py --model qwen2.5-coder-1.5b-instruct --tokens 4096 --out ...

``--table`` also prints a task-family table (each family the mean of its tasks' means) and, per
family and query mode, our best setting against kvpress's best press of the same mode on the
samples that press ran. With ``--configs A B`` the tables hold only full, A and B, on the samples
all of them ran; with ``--rows A B`` only full, A and B, each on every sample it ran. ``--threads``
(default 1) sets torch's threads: the 2-core machine is shared.

``--model`` picks the model (``scripts/fetch_model.py``'s table; default the 0.5B). Every record
names its model (a record without one, written before there was a choice, is the 0.5B's;
``--quick``'s are ``tiny-random``): ``--skip-done`` skips only the same model's results, and
``--table`` tables one model, the files' only one or ``--model``'s.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ruler_tasks as rt  # noqa: E402

import kvprune_cuda as kp  # noqa: E402

import common  # noqa: E402

# name -> (kind, policy, budget scope; for kvpress "aware": the question compressed with the context)
SETTINGS = {
    "full": ("full", None, None),
    "snapkv-aware": ("aware", "snapkv", None),
    "snapkv-aware-default": ("aware", "snapkv", None),
    "snapkv-aware-k15": ("aware", "snapkv", None),
    "snapkv-aware-k31": ("aware", "snapkv", None),
    "streaming-aware": ("aware", "streaming", None),
    "h2o-aware": ("aware", "h2o", None),
    "kvzip-head": ("agnostic", "kvzip", "head"),
    "kvzip-head-default": ("agnostic", "kvzip", "head"),
    "kvzip-global": ("agnostic", "kvzip", "global"),
    "kvzip-layer": ("agnostic", "kvzip", "layer"),
    "snapkv-aware-bounded": ("bounded", "snapkv", ("max", 0.0)),  # (prefill_signal, _novelty)
    "snapkv-aware-bounded-far": ("bounded", "snapkv", ("far", 0.0)),
    "snapkv-aware-bounded-window": ("bounded", "snapkv", ("window", 0.0)),
    "snapkv-aware-bounded-far-novel": ("bounded", "snapkv", ("far", 0.5)),
    "snapkv-aware-bounded-recon": ("bounded", "snapkv", ("reconstruct", 0.0)),
    "snapkv-aware-bounded-recon-novel": ("bounded", "snapkv", ("reconstruct", 0.25)),
    "snapkv-agnostic": ("agnostic", "snapkv", "layer"),
    "h2o-agnostic": ("agnostic", "h2o", "layer"),
    "kvpress-snapkv": ("kvpress", "SnapKVPress", None),
    "kvpress-snapkv-aware": ("kvpress", "SnapKVPress", "aware"),
    "kvpress-streaming": ("kvpress", "StreamingLLMPress", None),
    "kvpress-kvzip": ("kvpress", "KVzipPress", None),
    "kvpress-expected": ("kvpress", "ExpectedAttentionPress", None),
    "kvpress-observed-aware": ("kvpress", "ObservedAttentionPress", "aware"),
    "kvpress-adakv-aware": ("kvpress", "AdaKVPress", "aware"),
    "kvpress-chunkkv-aware": ("kvpress", "ChunkKVPress", "aware"),
    "kvpress-pyramidkv-aware": ("kvpress", "PyramidKVPress", "aware"),
    "kvpress-criticalkv-aware": ("kvpress", "CriticalKVPress", "aware"),
    "kvpress-keydiff": ("kvpress", "KeyDiffPress", None),
}
EAGER_PRESSES = ("ObservedAttentionPress",)  # presses that read the attention weights
MASKING_PRESSES = ("KVzipPress", "AdaKVPress")  # presses that mask evicted keys, freeing none
# setting -> policy options over the run's (ruler_probe.py: a wider pool keeps needle values)
# (snapkv-aware and snapkv-agnostic: the library's default until pool_shift, as their records
# hold; snapkv-aware-default: the library's default of the run, what kp.hf.compress does;
# kvzip-head / -global / -layer: no per-head floor and plain maxima, as their records hold;
# kvzip-head-default: what kp.hf.compress_context does)
OPTIONS = {"snapkv-aware": {"kernel_size": 7, "pool_shift": 0},
           "snapkv-aware-k15": {"kernel_size": 15, "pool_shift": 0},
           "snapkv-aware-k31": {"kernel_size": 31, "pool_shift": 0},
           "snapkv-agnostic": {"kernel_size": 7, "pool_shift": 0},
           "kvzip-head": {"head_floor": 0.0, "weight": "none"},
           "kvzip-global": {"head_floor": 0.0, "weight": "none"},
           "kvzip-layer": {"head_floor": 0.0, "weight": "none"}}
HEADLINE_BUDGET = 0.16
HEADLINE_KEEP = 0.991
BOOTSTRAP_REPS = 1000


def config_name(setting: str, frac: Optional[float]) -> str:
    return setting if setting == "full" else f"{setting}@{frac * 100:g}%"


def split_name(name: str) -> tuple[str, Optional[float]]:
    if "@" not in name:
        return name, None
    s, b = name.split("@")
    return s, float(b.rstrip("%")) / 100


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------

def tiny_model():
    """A tiny random Qwen2 (2 layers, GQA 4/2, head_dim 16, vocab 128: the ids of
    ``ruler_tasks.CharTokenizer``), attention sharpened as in tests/test_hf.py. No download."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=True, use_sliding_window=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    m = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return m


def bytes_per_token(model) -> int:
    """K and V bytes of one token in every layer and KV head (dense layout)."""
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    el = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * el


# ---------------------------------------------------------------------------------------------
# one setting on one sample
# ---------------------------------------------------------------------------------------------

def _stopper(tok, refs):
    """Stops ``generate`` once every reference is in the answer (the score cannot change)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AllFound(StoppingCriteria):
        start = None

        def __call__(self, input_ids, scores, **kwargs):
            if self.start is None:  # first call: one new token so far
                self.start = input_ids.shape[1] - 1
            done = rt.score(tok.decode(input_ids[0, self.start:]), refs) == 1.0
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool)

    return StoppingCriteriaList([AllFound()])


def _gen_kwargs(tok, refs, max_new):
    return {"max_new_tokens": max_new, "do_sample": False, "pad_token_id": tok.pad_token_id,
            "stopping_criteria": _stopper(tok, refs)}


def _make_press(kvpress, cls: str, ratio: float, args):
    """kvpress's ``cls`` at ``ratio``; SnapKV's window and pool for SnapKVPress, the presses
    that wrap it (AdaKVPress: head-adaptive budgets with its 0.2 safeguard; ChunkKVPress: whole
    20-token chunks; CriticalKVPress: its two-stage value-norm weighting) and PyramidKVPress
    (its layer budgets)."""
    snap = dict(compression_ratio=ratio, window_size=args.window,
                kernel_size=args.kernel_size or common.KVPRESS_KERNEL)
    if cls == "SnapKVPress":
        return kvpress.SnapKVPress(**snap)
    if cls in ("AdaKVPress", "ChunkKVPress", "CriticalKVPress"):
        return getattr(kvpress, cls)(press=kvpress.SnapKVPress(**snap))
    if cls == "PyramidKVPress":
        return kvpress.PyramidKVPress(**snap)
    if cls == "StreamingLLMPress":
        return kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=args.n_sink)
    if cls == "KVzipPress":
        return kvpress.KVzipPress(compression_ratio=ratio, n_sink=args.n_sink, chunk_size=args.chunk_size)
    return getattr(kvpress, cls)(compression_ratio=ratio)


@torch.no_grad()
def _greedy(model, tok, cache, qst, n_ctx, max_new, refs):
    """kvpress's own answer loop (its pipeline's generate_answer): the question at positions
    n_ctx.., then greedy tokens until EOS, ``max_new`` or every reference found."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pos = torch.arange(n_ctx, n_ctx + qst.shape[1]).unsqueeze(0)
    lg = model(input_ids=qst, past_key_values=cache, position_ids=pos).logits
    out = [int(lg[0, -1].argmax())]
    p = n_ctx + qst.shape[1]
    while len(out) < max_new and out[-1] not in eos and rt.score(tok.decode(out), refs) < 1.0:
        lg = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache,
                   position_ids=torch.tensor([[p]])).logits
        out.append(int(lg[0, -1].argmax()))
        p += 1
    return out


def _policies(names, args):
    """The named policies with the run's options (kvzip keeps its own window 0)."""
    return [kp.policy.make(n, n_sink=args.n_sink, kernel_size=args.kernel_size,
                           pool_shift=args.pool_shift, chunk_size=args.chunk_size,
                           window=None if n == "kvzip" else args.window)
            for n in names]


def _setting_policy(setting: str, args):
    """The policy of ``setting`` with the run's options and the setting's own (OPTIONS)."""
    return kp.policy.make(_policies([SETTINGS[setting][1]], args)[0], **OPTIONS.get(setting, {}))


def _ranked(names) -> set:
    """The policies among ``names`` that rank keys by recorded evidence (not full, streaming)."""
    return {n for n in names if kp.policy.make(n).ranks}


def _recorded_with(setting: str, args) -> tuple:
    """((option, value), ...): what the evidence of ``setting`` is recorded with (its policy's
    ``recorded_with``, e.g. kvzip's weight): settings of one policy that differ here need
    scorings of their own ("context", "context 2", ... in the shared seconds)."""
    p = _setting_policy(setting, args)
    return tuple((f, getattr(p, f)) for f in p.recorded_with)


def _scored(model, tok, ids, names, args, recorded_with: Optional[dict] = None):
    """``kp.hf.score_context`` of ``ids`` recording every ranking policy in ``names`` ("full"
    when none ranks), each with the options ``recorded_with`` gives its name
    (:func:`_recorded_with`); (ScoredContext, {prefill, score} seconds)."""
    ranks = _ranked(names)
    ranked = [n for n in dict.fromkeys(names) if n in ranks] or ["full"]
    window = None if "kvzip" in ranked else args.window  # the options override every policy's
    recorders = [kp.policy.make(p, **dict((recorded_with or {}).get(n, ())))
                 for n, p in zip(ranked, _policies(ranked, args), strict=True)]
    sc = kp.hf.score_context(model, ids, recorders, tokenizer=tok,
                             n_sink=args.n_sink, window=window, kernel_size=args.kernel_size)
    return sc, {"tokens": ids.shape[1], "prefill": sc.prefill_seconds, "score": sc.score_seconds}


def _from_scored(sc, tok, qst, refs, policy, frac, scope, max_new, kv_at) -> dict:
    """One config out of a shared ScoredContext: compress, then answer ``qst``."""
    t0 = time.perf_counter()
    c = sc.compress(budget=frac, budget_scope=scope, policy=policy)
    t1 = time.perf_counter()
    g = c.generate(qst, **_gen_kwargs(tok, refs, max_new))
    rec = {"seconds": time.perf_counter() - t0, "compress_seconds": t1 - t0,
           "kv_bytes": c.nbytes, "kv_at": kv_at, "tokens_per_layer": list(c.tokens_per_layer),
           "budget_tokens": kp.hf.resolve_budget(frac, sc.context_ids.shape[1]) if frac else
           sc.context_ids.shape[1], "new": g[0, qst.shape[1]:].tolist()}
    del c
    return rec


def run_sample(model, tok, ctx, qst, refs, cfgs, args, max_new, kvpress=None) -> tuple[dict, dict]:
    """Every (setting, budget) of ``cfgs`` on one sample: ({config name: record}, shared
    seconds). Records: {answer, score, kv_bytes, kv_at, held_tokens, new_tokens, seconds,
    budget_tokens, tokens_per_layer, ...}; ``seconds`` is the config's own compression and
    answer, the shared prefills and kvzip's reconstruction are in the second dict.

    full and the query-aware settings share one scoring of the prompt but its last token
    (``kp.hf.score_context``: snapkv's window is the last ``window`` of those tokens, the
    question's end and the answer prefix; h2o's sums are over all of them), compressed per
    config (``ScoredContext.compress``); the prompt's last token then starts the answer
    (``CompressedContext.generate``). The query-agnostic settings share the context's
    prefill (and kvzip's reconstruction of it), one per set of recording options
    (:func:`_recorded_with`: kvzip-head's plain maxima beside kvzip-head-default's KVzip+ take
    two); the question follows the compressed context. When both groups run and the
    query-aware policies are scored for the context too (in the context scoring run last),
    the prompt's scoring extends the context's (``ScoredContext.extend`` of the question but
    its last token) instead of prefilling the context again. kvpress runs as its own pipeline
    does, one prefill per config.
    """
    out: dict = {}
    shared: dict = {}
    prompt = torch.cat([ctx, qst], 1)
    aware = [(s, f) for s, f in cfgs if SETTINGS[s][0] in ("full", "aware")]
    agnostic = [(s, f) for s, f in cfgs if SETTINGS[s][0] == "agnostic"]
    aware_names = list(dict.fromkeys(SETTINGS[s][1] for s, _ in aware if s != "full"))
    groups: list = []  # ({policy name: recorded with}, configs): one scoring each
    for s, f in agnostic:
        name, recorded_with = SETTINGS[s][1], _recorded_with(s, args)
        group = next((g for g in groups if g[0].get(name, recorded_with) == recorded_with), None)
        if group is None:
            groups.append(group := ({}, []))
        group[0][name] = recorded_with
        group[1].append((s, f))
    groups.sort(key=lambda g: _ranked(aware_names) <= _ranked(g[0]))  # the one to extend: last
    sc, context_names, label = None, [], None
    for i, (recorded_with, group) in enumerate(groups):
        del sc
        context_names, label = list(recorded_with), "context" if i == 0 else f"context {i + 1}"
        sc, shared[label] = _scored(model, tok, ctx, [SETTINGS[s][1] for s, _ in group], args,
                                    recorded_with)
        for s, f in group:
            out[config_name(s, f)] = _from_scored(sc, tok, qst, refs, _setting_policy(s, args), f,
                                                  SETTINGS[s][2], max_new,
                                                  "after the context")
    if aware:
        if sc is not None and qst.shape[1] > 1 and _ranked(aware_names) <= _ranked(context_names):
            sc = sc.extend(qst[:, :-1])
            shared["prompt"] = {"tokens": prompt.shape[1] - 1, "prefill": sc.prefill_seconds,
                                "score": 0.0, "extends": label}
        else:
            del sc
            sc, shared["prompt"] = _scored(model, tok, prompt[:, :-1], aware_names, args)
        for s, f in aware:
            policy = "full" if s == "full" else _setting_policy(s, args)
            out[config_name(s, f)] = _from_scored(sc, tok, prompt[:, -1:], refs, policy, f,
                                                  SETTINGS[s][2], max_new, "after the prompt")
    del sc
    for s, f in cfgs:
        if SETTINGS[s][0] == "bounded":
            out[config_name(s, f)] = _bounded(model, tok, prompt, refs, _setting_policy(s, args),
                                              f, args, max_new, *SETTINGS[s][2])
        if SETTINGS[s][0] == "kvpress":  # query-aware: the prompt but its last token, then it
            aware_press = _press_mode(s) == "aware"
            c, q = (prompt[:, :-1], prompt[:, -1:]) if aware_press else (ctx, qst)
            out[config_name(s, f)] = _kvpress(model, tok, c, q, refs, SETTINGS[s][1], f, args,
                                              max_new, kvpress, "after the prompt" if aware_press
                                              else "after the context")
    for rec in out.values():
        new = rec.pop("new")
        answer = tok.decode(new, skip_special_tokens=True)
        rec.update(answer=answer, score=rt.score(answer, refs), new_tokens=len(new))
        if rec.get("kv_bytes") is not None:
            rec["held_tokens"] = rec["kv_bytes"] / bytes_per_token(model)
    return {config_name(s, f): out[config_name(s, f)] for s, f in cfgs}, shared


def _bounded(model, tok, prompt, refs, policy, frac, args, max_new, signal: str,
             novelty: float) -> dict:
    """The bounded-peak prefill of ``prompt`` but its last token (module doc), then that token
    starts the answer; its record has the bound, the chunk, the peak held and the prefill's
    seconds (compression included) besides the usual."""
    from transformers import DynamicCache

    ids = prompt[:, :-1]
    budget = kp.hf.resolve_budget(frac, ids.shape[1])
    bound = int(args.prefill_held * budget)
    repeat = kp.hf.RepeatPrompt.from_tokenizer(tok) if signal == "reconstruct" else None
    comp = kp.hf.KVCompressor(model, policy, frac, prefill_max_held=bound,
                              prefill_chunk=args.prefill_chunk, prefill_signal=signal,
                              prefill_novelty=novelty, repeat_prompt=repeat)
    cache = DynamicCache()
    comp.attach()
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            comp.base(input_ids=ids, past_key_values=cache, use_cache=True)
            t1 = time.perf_counter()
    finally:
        comp.detach()
    c = kp.hf.CompressedContext(model, comp.policy, ids, cache, comp.snapshot(), t1 - t0, 0.0)
    g = c.generate(prompt[:, -1:], **_gen_kwargs(tok, refs, max_new))
    return {"seconds": time.perf_counter() - t0, "prefill_seconds": t1 - t0,
            "kv_bytes": c.nbytes, "kv_at": "after the prompt",
            "tokens_per_layer": list(c.tokens_per_layer), "budget_tokens": budget,
            "prefill_max_held": bound, "prefill_chunk": args.prefill_chunk,
            "prefill_signal": signal, "prefill_novelty": novelty,
            "peak_held": comp.peak_held, "new": g[0, 1:].tolist()}


def _kvpress(model, tok, ctx, qst, refs, cls, frac, args, max_new, kvpress, kv_at) -> dict:
    """kvpress's press ``cls`` as its pipeline runs it: ``ctx`` prefilled under ``with
    press(model)``, then ``qst`` and a greedy decode on that cache (query-agnostic: the
    context, then the question; query-aware: the prompt but its last token, then that token)."""
    from transformers import DynamicCache

    n_ctx = ctx.shape[1]
    rec: dict = {}
    t0 = time.perf_counter()
    kb = kp.hf.resolve_budget(frac, n_ctx)
    press = _make_press(kvpress, cls, 1.0 - (kb + 0.5) / n_ctx, args)
    if cls == "CriticalKVPress" and getattr(model.config, "head_dim", None) is None:
        # kvpress 0.5.5 reads config.head_dim, which Qwen2's config leaves out (its attention
        # uses hidden_size / num_attention_heads then): the same value, set for the press
        model.config.head_dim = model.config.hidden_size // model.config.num_attention_heads
    cache = DynamicCache()
    eager = cls in EAGER_PRESSES  # it reads the attention weights: eager attention, this prefill
    attn = model.config._attn_implementation
    if eager:
        model.set_attn_implementation("eager")
    try:
        with torch.no_grad(), press(model):
            model.model(input_ids=ctx, past_key_values=cache, use_cache=True,
                        output_attentions=eager)
    finally:
        if eager:
            model.set_attn_implementation(attn)
    layers = model.model.layers
    if cls in MASKING_PRESSES:  # masked, not freed
        hkv = model.config.num_key_value_heads
        masked = [0 if getattr(l.self_attn, "masked_key_indices", None) is None
                  else int(l.self_attn.masked_key_indices[0].numel()) for l in layers]
        rec["kv_bytes"], rec["kv_at"] = None, "masked, not freed"
        rec["kv_bytes_allocated"] = kp.hf.kv_bytes(cache)
        rec["tokens_per_layer"] = [n_ctx - m / hkv for m in masked]
    else:
        rec["kv_bytes"], rec["kv_at"] = kp.hf.kv_bytes(cache), kv_at
        rec["tokens_per_layer"] = [int(cache.layers[i].keys.shape[2]) for i in range(len(layers))]
    rec["budget_tokens"] = kb
    try:
        rec["new"] = _greedy(model, tok, cache, qst, n_ctx, max_new, refs)
    finally:
        for lay in layers:  # a masking press's masks must not leak into the next run
            lay.self_attn.masked_key_indices = None
    del cache
    rec["seconds"] = time.perf_counter() - t0
    return rec


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------

def configs(settings, budgets):
    return [(s, None if s == "full" else b) for s in settings for b in ([None] if s == "full" else budgets)]


def run(model, tok, samples, settings, budgets, args, kvpress=None, out: Optional[Path] = None,
        log=print, done: frozenset = frozenset()) -> dict:
    """Every (setting, budget) on every sample but those in ``done`` ((model, task, index,
    seed, tokens, config name) of earlier files: :func:`done_configs`); returns (and writes to
    ``out`` after each sample) the result data."""
    data = {"meta": common.run_meta(), "args": common.args_dict(args), "settings": list(settings),
            "budgets": list(budgets), "records": [], "skipped": {}}
    t_run = time.perf_counter()
    for s in samples:
        ctx, qst = rt.prompt_ids(tok, s)
        rec = {"model": args.model, "task": s.task, "index": s.index, "seed": args.seed,
               "tokens": args.tokens, "context_tokens": ctx.shape[1],
               "question_tokens": qst.shape[1], "refs": s.refs,
               "meta": {k: v for k, v in s.meta.items() if k != "needles"}, "results": {}}
        max_new = args.max_new_tokens or rt.MAX_NEW_TOKENS.get(s.task, 128)
        cfgs = []
        for setting, frac in configs(settings, budgets):
            if SETTINGS[setting][0] == "kvpress" and kvpress is None:
                data["skipped"][setting] = "kvpress not importable"
            elif setting == "kvpress-kvzip" and not _has_hub_tokenizer(model):
                data["skipped"][setting] = "KVzipPress loads the tokenizer of model.config.name_or_path"
            elif (args.model, s.task, s.index, args.seed, args.tokens,
                  config_name(setting, frac)) not in done:
                cfgs.append((setting, frac))
        if not cfgs:
            continue
        rec["results"], rec["shared_seconds"] = run_sample(model, tok, ctx, qst, s.refs, cfgs, args,
                                                           max_new, kvpress)
        for name, r in rec["results"].items():
            log(f"{s.task}#{s.index} {name}: score {r['score']:.2f} ({r['seconds']:.1f} s) "
                f"{r['answer'][:60]!r}")
        log(f"{s.task}#{s.index} shared: {rec['shared_seconds']}")
        data["records"].append(rec)
        data["wall_seconds"] = time.perf_counter() - t_run
        if out is not None:
            common.write_json(out, data)
    return data


def record_model(r: dict) -> str:
    """The model of a record: one written before records named theirs is the 0.5B's."""
    return r.get("model", common.DEFAULT_MODEL)


def done_configs(files) -> frozenset:
    """(model, task, index, seed, tokens, config name) of every result in the given --out files."""
    return frozenset((record_model(r), r["task"], r["index"], r.get("seed"), r.get("tokens"), name)
                     for f in files for r in json.loads(Path(f).read_text())["records"]
                     for name in r["results"])


def _has_hub_tokenizer(model) -> bool:
    p = getattr(model.config, "name_or_path", "") or ""
    return bool(p) and Path(p).exists()


# ---------------------------------------------------------------------------------------------
# tables, headline, plot
# ---------------------------------------------------------------------------------------------

def merge(parts: list) -> dict:
    """Records of several files on the same samples (same model, task, index, refs): later
    files add or replace configs."""
    data = {"meta": parts[0].get("meta"), "records": [], "merged": []}
    by_key: dict = {}
    for p in parts:
        data["merged"].append({"meta": p.get("meta"), "wall_seconds": p.get("wall_seconds")})
        for r in p["records"]:
            key = (record_model(r), r["task"], r["index"], r.get("seed"), r.get("tokens"))
            old = by_key.get(key)
            if old is None:
                by_key[key] = {**r, "results": dict(r["results"])}
                data["records"].append(by_key[key])
            else:
                if old["refs"] != r["refs"]:
                    raise ValueError(f"--table: {key}: the files hold different samples")
                old["results"].update(r["results"])
    return data


def of_model(data: dict, name: Optional[str]) -> dict:
    """``data`` with only the records of model ``name`` (None: the one model of its records;
    records of several need a name)."""
    models = sorted({record_model(r) for r in data["records"]})
    if name is None and len(models) > 1:
        raise SystemExit(f"--table: the files hold records of {', '.join(models)}: "
                         "pick one with --model")
    name = name or (models[0] if models else common.DEFAULT_MODEL)
    if models and name not in models:
        raise SystemExit(f"--table: the files hold no records of {name} (only of {', '.join(models)})")
    return {**data, "model": name, "records": [r for r in data["records"] if record_model(r) == name]}


def only_configs(data: dict, names: list) -> dict:
    """``data`` with only full and the configs ``names``, each on every sample it ran (paired
    with full where both ran, as the tables always are)."""
    keep = {"full", *names}
    records = [{**r, "results": {k: v for k, v in r["results"].items() if k in keep}}
               for r in data["records"] if keep & set(r["results"])]
    return {**data, "records": records}


def same_samples(data: dict, names: list) -> dict:
    """:func:`only_configs` on the samples where full and every one of ``names`` ran (a
    comparison on the same samples)."""
    keep, data = {"full", *names}, only_configs(data, names)
    return {**data, "records": [r for r in data["records"] if set(r["results"]) == keep]}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summary(data) -> dict:
    """{config: {task: [scores]}}, plus per config the KV MiB and seconds lists."""
    scores: dict = {}
    kv: dict = {}
    secs: dict = {}
    for r in data["records"]:
        for name, res in r["results"].items():
            scores.setdefault(name, {}).setdefault(r["task"], []).append(res["score"])
            kv.setdefault(name, []).append(res.get("kv_bytes"))
            secs.setdefault(name, []).append(res["seconds"])
    return {"scores": scores, "kv": kv, "secs": secs}


def _pairs(data, name, tasks) -> dict:
    """{task: [(``name``'s score, full's score)]} on the samples of ``tasks`` both ran."""
    out: dict = {}
    for r in data["records"]:
        if r["task"] in tasks and name in r["results"] and "full" in r["results"]:
            out.setdefault(r["task"], []).append((r["results"][name]["score"],
                                                   r["results"]["full"]["score"]))
    return out


def ratio_to_full(data, name, tasks) -> Optional[float]:
    pairs = [p for ps in _pairs(data, name, tasks).values() for p in ps]
    full = sum(b for _, b in pairs)
    return sum(a for a, _ in pairs) / full if full else None


def table(data) -> str:
    sm = summary(data)
    tasks = [t for t in rt.TASKS if any(r["task"] == t for r in data["records"])]
    names = sorted(sm["scores"], key=_config_order)
    head = "| config | " + " | ".join(tasks) + " | mean | x full | KV held (MiB, mean) | seconds (mean) |"
    rows = [head, "|---" * (len(tasks) + 5) + "|"]
    for nm in names:
        cells = []
        for t in tasks:
            xs = sm["scores"][nm].get(t, [])
            cells.append(f"{100 * sum(xs) / len(xs):.0f} ({len(xs)})" if xs else "")
        allx = [x for t in tasks for x in sm["scores"][nm].get(t, [])]
        rf = ratio_to_full(data, nm, tasks)
        kvs = sm["kv"][nm]
        kvtxt = ("masked, not freed" if all(k is None for k in kvs)
                 else f"{_mean(kvs) / 2**20:.1f}")
        rows.append(f"| {nm} | " + " | ".join(cells) + f" | {100 * _mean(allx):.1f} | "
                    + ("n/a" if rf is None else f"{rf:.3f}") + f" | {kvtxt} | {_mean(sm['secs'][nm]):.1f} |")
    n_samples = {t: sum(r["task"] == t for r in data["records"]) for t in tasks}
    out = "\n".join(rows)
    out += ("\n\nScores x100 (samples in parentheses); mean over all the config's samples; x full: "
            "the config's summed score over full's on the same samples. KV held: after the "
            "context (query-agnostic, kvpress) or after the prompt but its last token (full, "
            "query-aware, kvpress-snapkv-aware); seconds: the config's own compression and answer, the shared "
            "prefills apart. Samples "
            "per task: " + ", ".join(f"{t} {n}" for t, n in n_samples.items()) + ".")
    return out + "\n\n" + family_table(data) + "\n\n" + ratio_table(data) + "\n\n" + versus_kvpress(data) + "\n\n" + headline(data)


def _config_order(name: str) -> tuple:
    """Table order: full, then by budget, then in SETTINGS order."""
    setting, frac = split_name(name)
    return name != "full", frac or 0, list(SETTINGS).index(setting)


def _kind(name: str) -> str:
    """The kind of a config name: "full", "aware", "agnostic" or "kvpress"."""
    return SETTINGS[split_name(name)[0]][0]


def _families(data) -> list:
    """The task families with at least one record, in FAMILIES order."""
    return [f for f, ts in rt.FAMILIES.items() if any(r["task"] in ts for r in data["records"])]


def _sample_scores(data, name, tasks) -> dict:
    """{(task, index): score} of config ``name`` on the samples of ``tasks``."""
    return {(r["task"], r["index"]): r["results"][name]["score"] for r in data["records"]
            if r["task"] in tasks and name in r["results"]}


def _family_score(scores: dict) -> Optional[float]:
    """A family's score: the mean over its tasks of each task's mean (tasks weigh equally
    whatever their sample counts)."""
    by_task: dict = {}
    for (task, _), x in scores.items():
        by_task.setdefault(task, []).append(x)
    return _mean([_mean(xs) for xs in by_task.values()]) if by_task else None


def family_table(data) -> str:
    """config x task family: the family's score (:func:`_family_score`), the mean over the
    families the config ran (and how many), and the ratio of that mean to full's, both on the
    samples both ran."""
    fams = _families(data)
    names = sorted({n for r in data["records"] for n in r["results"]}, key=_config_order)
    keys = {(n, f): _sample_scores(data, n, rt.FAMILIES[f]) for n in names for f in fams}
    cell = {nf: _family_score(s) for nf, s in keys.items()}
    rows = ["| config | " + " | ".join(fams) + " | mean of its families | families | x full |",
            "|---" * (len(fams) + 4) + "|"]
    for n in names:
        ran = [f for f in fams if cell[n, f] is not None]
        m = _mean([cell[n, f] for f in ran])
        both = {f: keys[n, f].keys() & keys["full", f].keys() for f in ran} if "full" in names else {}
        a = [_family_score({k: keys[n, f][k] for k in both[f]}) for f in both]
        b = [_family_score({k: keys["full", f][k] for k in both[f]}) for f in both]
        ratio = ("n/a" if not both or None in a + b or not _mean(b)
                 else f"{_mean(a) / _mean(b):.3f}")
        rows.append(f"| {n} | " + " | ".join("" if cell[n, f] is None else f"{100 * cell[n, f]:.0f}"
                                            for f in fams)
                    + f" | {'' if m is None else f'{100 * m:.1f}'} | {len(ran)}/{len(fams)} | {ratio} |")
    return ("\n".join(rows) + "\n\nPer task family: the mean over its tasks of each task's mean score "
            "(x100); mean of its families: over the families the config ran (compare rows that "
            "ran the same families); x full: that mean over full's, both on the samples both ran.")


def _ratio_interval(pairs: dict, reps: int = BOOTSTRAP_REPS, seed: int = 0) -> tuple:
    """95 % percentile bootstrap interval of a ratio to full: ``pairs`` {family: {task: [(config
    score, full's score) per sample]}}; each resample draws every task's samples with
    replacement (pairs stay together), then takes the mean over families of the family scores
    (:func:`_family_score`: tasks weigh equally) over full's. (low, high); None where full's
    resampled mean is 0."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(reps):
        fam_a, fam_b = [], []
        for by_task in pairs.values():
            ta, tb = [], []
            for ps in by_task.values():
                draw = [ps[rng.randrange(len(ps))] for _ in ps]
                ta.append(_mean([a for a, _ in draw]))
                tb.append(_mean([b for _, b in draw]))
            fam_a.append(_mean(ta))
            fam_b.append(_mean(tb))
        if _mean(fam_b):
            ratios.append(_mean(fam_a) / _mean(fam_b))
    if not ratios:
        return None, None
    ratios.sort()
    return ratios[int(0.025 * (len(ratios) - 1))], ratios[int(round(0.975 * (len(ratios) - 1)))]


def _ratio_cell(pairs: dict) -> str:
    """"x [low, high]": the ratio to full of ``pairs`` (:func:`_ratio_interval`'s argument)
    and its 95 % bootstrap interval; "" without pairs, "n/a" where full scores 0."""
    if not pairs:
        return ""
    full = _mean([_mean([_mean([b for _, b in ps]) for ps in t.values()]) for t in pairs.values()])
    if not full:
        return "n/a"
    own = _mean([_mean([_mean([a for a, _ in ps]) for ps in t.values()]) for t in pairs.values()])
    lo, hi = _ratio_interval(pairs)
    return f"{own / full:.2f}" + ("" if lo is None else f" [{lo:.2f}, {hi:.2f}]")


def ratio_table(data) -> str:
    """config x task family: the family's score over full's on the samples both ran, with a
    95 % bootstrap interval (:func:`_ratio_interval`); the last column, the mean of the
    families (the family table's x full) with its interval."""
    fams = _families(data)
    names = sorted({n for r in data["records"] for n in r["results"]} - {"full"}, key=_config_order)
    rows = ["| config | " + " | ".join(fams) + " | mean of the families |",
            "|---" * (len(fams) + 2) + "|"]
    for n in names:
        per = {f: _pairs(data, n, rt.FAMILIES[f]) for f in fams}
        rows.append(f"| {n} | " + " | ".join(_ratio_cell({f: per[f]}) for f in fams)
                    + f" | {_ratio_cell({f: p for f, p in per.items() if p})} |")
    return ("\n".join(rows) + f"\n\nx full per task family, on the samples the config and full both "
            f"ran, with a 95 % percentile bootstrap interval ({BOOTSTRAP_REPS} resamples of each "
            "task's samples, config and full paired); n/a: full scores 0 there.")


def _best_on(data, names, tasks, keys) -> Optional[tuple]:
    """(name, family score, samples) of the best of ``names`` on the samples of ``keys`` it
    ran: among those sharing the most of ``keys``, the highest score; None when none shares
    any."""
    on = {}
    for n in names:
        s = _sample_scores(data, n, tasks)
        common = keys & s.keys()
        if common:
            on[n] = (len(common), _family_score({k: s[k] for k in common}), common)
    if not on:
        return None
    best = max(on, key=lambda n: (on[n][0], on[n][1], n))
    return best, on[best][1], on[best][2]


def _press_mode(name: str) -> str:
    """A kvpress config's query mode: "aware" (the question compressed with the context) or
    "agnostic"."""
    return "aware" if SETTINGS[split_name(name)[0]][2] == "aware" else "agnostic"


def versus_kvpress(data) -> str:
    """Per task family and budget, query-aware and query-agnostic apart: kvpress's best press
    of that mode against our best setting of the same mode, both on the samples of that press
    that the setting ran too."""
    lines = ["Ours against kvpress's best press of the same mode, per family (both on the same "
             "samples):", ""]
    names = {n for r in data["records"] for n in r["results"]}
    for b in sorted({split_name(n)[1] for n in names if _kind(n) == "kvpress"}):
        at = [n for n in names if split_name(n)[1] == b]
        for fam, tasks in rt.FAMILIES.items():
            verdict = []
            for mode in ("aware", "agnostic"):
                presses = {n: _sample_scores(data, n, tasks) for n in at
                           if _kind(n) == "kvpress" and _press_mode(n) == mode}
                presses = {n: s for n, s in presses.items() if s}
                if not presses:
                    continue
                best = max(presses, key=lambda n: (_family_score(presses[n]), len(presses[n]), n))
                top = _best_on(data, [n for n in at if _kind(n) == mode], tasks,
                               set(presses[best]))
                if top is None:
                    verdict.append(f"query-{mode}: {best}, no query-{mode} setting of ours on "
                                   "its samples")
                    continue
                press_score = _family_score({k: presses[best][k] for k in top[2]})
                verdict.append(f"query-{mode}: {best} {100 * press_score:.0f} against ours "
                               f"{top[0]} {100 * top[1]:.0f} on the same {len(top[2])} "
                               f"sample{'s' * (len(top[2]) != 1)} "
                               f"({'>=' if top[1] >= press_score else '<'})")
            if verdict:
                lines.append(f"- {fam} at {b:.0%}: " + "; ".join(verdict))
    if len(lines) == 2:
        lines.append("- no kvpress results in these files")
    return "\n".join(lines)


def headline(data, budget: float = HEADLINE_BUDGET, keep: float = HEADLINE_KEEP) -> str:
    """Which settings keep >= ``keep`` of full's variable-tracking and multi-key scores at ``budget``."""
    vt, mk = ("vt",), rt.FAMILIES["niah_multikey"]
    names = sorted({n for r in data["records"] for n in r["results"]
                    if split_name(n)[1] is not None and abs(split_name(n)[1] - budget) < 1e-9},
                   key=lambda n: list(SETTINGS).index(split_name(n)[0]))
    lines = [f"Headline check at {budget:.0%}: settings keeping >= {keep:.1%} of full's "
             "variable-tracking (vt) and multi-key (niah_multikey_*) scores "
             "(summed scores over full's, same samples):", ""]
    passed = []
    for nm in names:
        rv, rm = ratio_to_full(data, nm, vt), ratio_to_full(data, nm, mk)
        nv, nk = (sum(map(len, _pairs(data, nm, ts).values())) for ts in (vt, mk))
        ok = rv is not None and rm is not None and rv >= keep and rm >= keep
        if ok:
            passed.append(nm)
        fmt = lambda r, n: "n/a (no samples or full scores 0)" if r is None else f"{r:.3f} ({n} samples)"  # noqa: E731
        lines.append(f"- {nm}: vt {fmt(rv, nv)}, multi-key {fmt(rm, nk)} -> {'KEEPS' if ok else 'no'}")
    if not names:
        lines.append(f"- no config at {budget:.0%} in these files")
    lines += ["", "Keep >= %.1f %% of full on both: %s" % (100 * keep, ", ".join(passed) or "none")]
    return "\n".join(lines)


def budget_curves(data, fam: str) -> dict:
    """Score vs budget in task family ``fam``, each setting on its own samples: {setting:
    (points, samples)}, points [(budget, family score)] on the samples where the setting ran
    at every one of its budgets and full ran too, ending at (1.0, full's family score on those
    samples), so that each curve is paired with full and the settings' sample counts show."""
    tasks = rt.FAMILIES[fam]
    names = {n for r in data["records"] for n in r["results"]}
    scores = {n: _sample_scores(data, n, tasks) for n in names}
    budgets: dict = {}
    for n in names:
        s, b = split_name(n)
        if b is not None and scores[n]:  # run in this family
            budgets.setdefault(s, []).append(b)
    full = scores.get("full", {})
    curves = {}
    for s, bs in budgets.items():
        keys = set(full).intersection(*(scores[config_name(s, b)].keys() for b in bs))
        if keys:
            pts = [(b, _family_score({k: scores[config_name(s, b)][k] for k in keys})) for b in sorted(bs)]
            curves[s] = (pts + [(1.0, _family_score({k: full[k] for k in keys}))], len(keys))
    return curves


def plot(data, path: Path) -> None:
    """Score vs budget per task family (one panel per family, a line per setting ending at
    full's score on the same samples: :func:`budget_curves`; kvpress's presses dotted); with a
    single budget, one bar per setting in each family group instead (family scores as in
    :func:`family_table`), ours solid and kvpress's hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = _families(data)
    budgets = sorted({split_name(n)[1] for r in data["records"] for n in r["results"]} - {None})
    settings = [s for s in SETTINGS if any(split_name(n)[0] == s for r in data["records"] for n in r["results"])]
    colors = plt.get_cmap("tab20").colors
    if len(budgets) == 1:
        names = [config_name(s, budgets[0]) for s in settings]
        fig, ax = plt.subplots(figsize=(1.6 * len(fams) + 3, 3.8))
        w = 0.8 / len(names)
        for j, (s, nm) in enumerate(zip(settings, names)):
            ys = [_family_score(_sample_scores(data, nm, rt.FAMILIES[f])) for f in fams]
            ax.bar([i + (j - len(names) / 2) * w for i in range(len(fams))],
                   [0 if y is None else 100 * y for y in ys], w, label=nm, color=colors[j % 20],
                   hatch="//" if SETTINGS[s][0] == "kvpress" else None, edgecolor="k", linewidth=0.3)
        ax.set_xticks(range(len(fams)), fams)
        ax.set_ylabel("score (x100)")
        ax.set_title(f"RULER-style, {budgets[0]:.0%} of the tokens kept (full: 100 % kept)")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    else:
        cols = min(4, len(fams) + 1)
        rows = -(-(len(fams) + 1) // cols)  # the last free panel holds the legend
        fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 3.4 * rows), squeeze=False)
        axes = axes.ravel()
        for ax, fam in zip(axes, fams):
            curves = budget_curves(data, fam)
            for j, s in enumerate(settings):
                if s in curves:
                    pts, n = curves[s]
                    kvp = SETTINGS[s][0] == "kvpress"
                    ax.plot([100 * b for b, _ in pts], [100 * y for _, y in pts],
                            marker="x" if kvp else "o", ls=":" if kvp else "-",
                            color=colors[j % 20], label=s)
                    ax.annotate(str(n), (100 * pts[0][0], 100 * pts[0][1]), fontsize=5,
                                color=colors[j % 20], xytext=(-9, 0), textcoords="offset points")
            ax.set_title(f"{fam} (numbers: samples)")
            ax.set_xscale("log")
            ax.set_xticks([100 * b for b in budgets] + [100], [f"{100 * b:g}" for b in budgets] + ["full"])
            ax.minorticks_off()
            ax.set_xlabel("budget (% of tokens)")
            ax.set_ylim(-5, 105)
        for ax in axes[::cols]:
            ax.set_ylabel("score (x100)")
        handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}
        for ax in axes[len(fams):]:
            ax.axis("off")
        axes[len(fams)].legend([handles[s] for s in settings if s in handles],
                               [s for s in settings if s in handles], fontsize=8, loc="center")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------

QUICK = {"tokens": 900, "samples": 1, "budgets": [0.5], "max_new_tokens": 6}
QUICK_MODEL = "tiny-random"  # the model --quick's records name


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="target prompt length (context + question)")
    ap.add_argument("--samples", type=int, default=5,
                    help="run sample indices [--first-sample, --samples) of every task")
    ap.add_argument("--first-sample", type=int, default=0,
                    help="start at this sample index (a later part of a run whose earlier "
                         "indices another part ran; below --samples)")
    ap.add_argument("--tasks", nargs="+", default=list(rt.TASKS), choices=rt.TASKS)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.16, 0.25, 0.5],
                    help="fractions of the prompt (query-aware) or context (query-agnostic) tokens")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: RULER's per task")
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--kernel-size", type=int, default=None, help="snapkv's pool (default: the library's)")
    ap.add_argument("--pool-shift", type=int, default=None, help="snapkv's pool shift (default: the library's)")
    ap.add_argument("--chunk-size", type=int, default=2048, help="kvzip's reconstruction chunk (ours and KVzipPress)")
    ap.add_argument("--prefill-held", type=float, default=2.0,
                    help="snapkv-aware-bounded: prefill_max_held as a multiple of the budget's tokens")
    ap.add_argument("--prefill-chunk", type=int, default=2048,
                    help="snapkv-aware-bounded: the bounded prefill's chunk (tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    common.add_model_arg(ap, default=None, help=f"model (default {common.DEFAULT_MODEL}; with "
                         "--table: the files' only one)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--quick", action="store_true",
                    help="tiny random model + character tokenizer + toy text (no download): "
                         f"{QUICK} unless given")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/ruler.json)")
    ap.add_argument("--skip-done", type=Path, nargs="+", metavar="FILE",
                    help="earlier --out files: their (sample, config) results are not run again "
                         "(a run in parts; --table merges the files)")
    ap.add_argument("--table", type=Path, nargs="+",
                    help="only print the tables of earlier --out files (and, with --out, write them merged)")
    ap.add_argument("--configs", nargs="+", metavar="CONFIG",
                    help="with --table: only full and these configs (e.g. kvzip-head@16%%), on "
                         "the samples where all of them ran")
    ap.add_argument("--rows", nargs="+", metavar="CONFIG",
                    help="with --table: only full and these configs, each on all its samples")
    ap.add_argument("--plot", type=Path, nargs="?", const=Path("bench/results/ruler.png"),
                    help="score vs budget per task family (PNG)")
    args = ap.parse_args(argv)
    if args.quick:
        given = set(a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:])
                    if a.startswith("--"))
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)
        if "dtype" not in given:
            args.dtype = "float32"
        if "model" in given:
            ap.error("--quick runs its tiny random model: leave --model out")
        args.model = QUICK_MODEL
    elif not args.table:
        args.model = args.model or common.DEFAULT_MODEL
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if args.table:
        data = of_model(merge([json.loads(Path(f).read_text()) for f in args.table]), args.model)
        print(f"model: {data['model']}")
        if args.configs:
            data = same_samples(data, args.configs)
        if args.rows:
            data = only_configs(data, args.rows)
        print(table(data))
        if args.out:  # the study's parts as one file; its meta: this merge's run, the parts' under "merged"
            common.write_json(args.out, {**data, "meta": {}})
            print(f"wrote {args.out}")
        if args.plot:
            plot(data, args.plot)
            print(f"wrote {args.plot}")
        return data
    if not 0 <= args.first_sample < args.samples:
        raise SystemExit(f"--first-sample {args.first_sample}, --samples {args.samples}: no "
                         "sample to run (the indices run are [--first-sample, --samples))")
    threads0 = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.quick:
            model, tok, novels = tiny_model().to(getattr(torch, args.dtype)), rt.CharTokenizer(), rt.toy_novels()
        else:
            model, tok = common.load_model(args.dtype, args.model)
            novels = common.load_novels()
        kvpress = None
        if any(SETTINGS[s][0] == "kvpress" for s in args.settings):
            try:
                import logging

                import kvpress
                logging.getLogger("kvpress.presses.kvzip_press").setLevel(logging.ERROR)
            except ImportError:
                if not args.quick:
                    raise SystemExit("kvpress is not installed (pip install '.[eval]'); "
                                     "or leave the kvpress-* settings out")
        samples = rt.make_samples(args.tasks, args.samples, tok, args.tokens, novels, args.seed,
                                  args.first_sample)
        out = args.out or Path(__file__).resolve().parent / "results" / (
            "ruler_quick.json" if args.quick else "ruler.json")
        data = run(model, tok, samples, args.settings, args.budgets, args, kvpress, out,
                   log=(lambda *a: None) if args.quick else print,
                   done=done_configs(args.skip_done or []))
        print(table(data))
        print(f"wrote {out}")
        if args.plot:
            plot(data, args.plot)
            print(f"wrote {args.plot}")
        return data
    finally:
        torch.set_num_threads(threads0)


if __name__ == "__main__":
    main()
