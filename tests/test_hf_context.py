"""kp.hf.compress_context on the tiny random Qwen2 of test_hf: a context compressed once (kvzip
and the other policies), then questions answered from it with ``CompressedContext.generate``.

The references are independent of kvprune_cuda.hf: eager attention weights recorded by
``test_hf._eager_capture`` and ``kvprune_cuda.reference``. Skipped without ``transformers``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvprune_cuda as kp  # noqa: E402
from helpers import HAS_CUDA  # noqa: E402
from kvprune_cuda import hf  # noqa: E402
from kvprune_cuda.hf import reconstruct  # noqa: E402
from kvprune_cuda import reference as ref  # noqa: E402
from kvprune_cuda.hf.ragged_layer import RaggedLayer  # noqa: E402
from kvprune_cuda.hf.reconstruct import RepeatPrompt  # noqa: E402
from test_hf import (  # noqa: E402,F401  (model: the module-scoped tiny Qwen2 fixture)
    D, HKV, HQ, N_LAYERS, _agnostic_expected_idx, _eager_capture, _ids, _manual_decode, model)

N, CHUNK, SINKS, W, BUDGET = 60, 25, 4, 8, 24
PROMPT = RepeatPrompt(first=[5, 6, 7], next=[8, 9], suffix=[10, 11])
POLICIES = ("kvzip", "snapkv", "streaming", "h2o")
GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
           return_dict_in_generate=True, output_logits=True)


def _compress(model, ctx, policy, budget=BUDGET, **kw):
    """compress_context with the test's sizes; budget_scope "layer" unless given."""
    kw.setdefault("repeat_prompt", PROMPT if policy == "kvzip" else None)
    kw.setdefault("budget_scope", "layer")
    if policy != "kvzip":  # snapkv: the reference's symmetric pool (_policy_scores); kvzip
        kw.setdefault("kernel_size", 7)  # ranks its maxima unpooled by default
        kw.setdefault("pool_shift", 0)
    return kp.hf.compress_context(model, ctx, policy, budget, n_sink=SINKS, window=W,
                                  chunk_size=kw.pop("chunk_size", CHUNK), **kw)


def _copy(cache):
    out = transformers.DynamicCache()
    for i in range(N_LAYERS):
        k, v = hf.cache_kv(cache, i)
        out.update(k.clone(), v.clone(), i)
    return out


@contextlib.contextmanager
def _attention_inputs(model):
    """Per layer, the hidden states each attention call receives (a forward pre-hook)."""
    got: dict[int, list] = {}

    def record(module, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        got.setdefault(module.layer_idx, []).append(hs.detach().double())

    handles = [layer.self_attn.register_forward_pre_hook(record, with_kwargs=True)
               for layer in model.model.layers]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def _output_weights(model, values, layer, hs):
    """KVzip+'s weights, in float64 from the model's o_proj and the context's ``values``
    [B, Hkv, n, D] in ``layer``: per query head and context key ``||W_O[:, head] v||``
    [B, Hq, n], per query ``1 / ||h||`` [B, r] of the attention inputs ``hs`` [B, r, hidden]."""
    o = model.model.layers[layer].self_attn.o_proj.weight.detach().double()
    v = values.double()                                          # [B, Hkv, n, D]
    norms = torch.stack([(v[:, h // (HQ // HKV)] @ o[:, h * D:(h + 1) * D].T).norm(dim=-1)
                         for h in range(HQ)], 1)
    return norms, 1.0 / hs.norm(dim=-1)


def _kvzip_reference(model, ctx, prompt, chunk_size, gqa="max", softmax="chunk",
                     context_only=False, weight="output"):
    """The full context cache, the eager calls of its prefill and per layer the kvzip score
    fp32 [B, Hkv, n]: max over chunks, over the chunk's queries and over the KV group's query
    heads (``gqa``) of each context key's eager softmax weight, renormalised over the keys
    ``softmax`` names ("all": as the eager weights are; "chunk": the first SINKS positions
    before the chunk, the chunk and the reconstruction tokens, only the chunk's keys scored).
    Every chunk runs on a fresh copy of the full context cache, so it sees the context and its
    own tokens only. ``context_only``: renormalise over the context keys (not kvzip: a foil).
    ``weight``: "output" (KVzip+, the library's default), each weight times
    :func:`_output_weights` before the maxima; "none", the plain weights."""
    n, b = ctx.shape[1], ctx.shape[0]
    full = transformers.DynamicCache()
    with _eager_capture(model) as prefill, torch.no_grad():
        model(input_ids=ctx, past_key_values=full, use_cache=True)
    scores = [torch.zeros(b, HKV, n, dtype=torch.float64) for _ in range(N_LAYERS)]
    for ids, (start, end) in zip(prompt.chunks(ctx, chunk_size), prompt.spans(n, chunk_size),
                                 strict=True):
        with _eager_capture(model) as calls, _attention_inputs(model) as inputs, torch.no_grad():
            model(input_ids=ids, past_key_values=_copy(full), use_cache=True)
        for i in range(N_LAYERS):
            ((_, key, weights),) = calls[i]
            assert key.shape[2] == n + ids.shape[1]
            if softmax == "chunk":
                pos = torch.arange(key.shape[2])
                kept = (pos < min(SINKS, start)) | ((pos >= start) & (pos < end)) | (pos >= n)
                weights = weights * kept
                weights = weights / weights.sum(-1, keepdim=True)
            w = weights[..., :n]
            if context_only:
                w = w / w.sum(-1, keepdim=True)
            if weight == "output":
                per_key, per_query = _output_weights(model, full.layers[i].values, i, inputs[i][0])
                w = w * per_key[:, :, None, :] * per_query[:, None, :, None]
            per_head = w.amax(2).view(b, HKV, HQ // HKV, n)             # max over queries
            s = per_head.amax(2) if gqa == "max" else per_head.mean(2)  # over the group
            if softmax == "chunk":
                s[..., :start], s[..., end:] = 0, 0
            scores[i] = torch.maximum(scores[i], s)
    return full, prefill, [s.float() for s in scores]


def _policy_scores(policy, prefill):
    """snapkv / h2o selection scores per layer from the context prefill's eager calls."""
    out = []
    for i in range(N_LAYERS):
        ((query, key, weights),) = prefill[i][:1]
        if policy == "snapkv":
            scores = ref.window_scores(query[:, :, -W:], key)
            out.append(ref.pool_scores(scores, 7, "max", window=W))
        else:
            n = key.shape[2]
            out.append(weights[0].sum(1).view(HKV, HQ // HKV, n).mean(1)[None].float())
    return out


def _assert_layers(cache, full, idx):
    for i in range(N_LAYERS):
        want_k, want_v = ref.gather_kv(*hf.cache_kv(full, i), idx[i])
        got_k, got_v = hf.cache_kv(cache, i)
        if hasattr(cache.layers[i], "decode"):  # fixed capacity (streaming / h2o): by position
            order = cache.layers[i].decode.slot_pos.long().argsort(2)[..., None]
            got_k, got_v = (torch.gather(x, 2, order.expand(x.shape)) for x in (got_k, got_v))
        assert got_k.shape == want_k.shape, i
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), i


# ---- kvzip scoring and selection ------------------------------------------------------------


def _recording(fold, taken):
    """Wraps ReconstructionScorer.__call__: records whether each call found an lse."""
    def wrapped(self, module, *args):
        taken.append(module.layer_idx in self.lse)
        return fold(self, module, *args)
    return wrapped


@pytest.mark.parametrize("weight", ["output", "none"])
@pytest.mark.parametrize("softmax", ["chunk", "all"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("gqa", ["max", "mean"])
def test_reconstruction_scores_match_eager_softmax(model, gen, gqa, impl, softmax, weight, monkeypatch):
    """reconstruct.score_reconstruction folds the max attention probability of every
    reconstruction query into each context key, the softmax over the sinks, the chunk and the
    reconstruction keys ("chunk") or over every key the query sees ("all"). With SDPA and
    "all" the lse comes from the model's own attention call (``hf.lse``, one pass of
    kp.window_scores), else kp.window_scores computes it (two passes)."""
    ctx = _ids(gen, 1, N)
    chunks, spans = PROMPT.chunks(ctx, CHUNK), PROMPT.spans(N, CHUNK)
    assert len(chunks) == 3 and spans == [(0, 25), (25, 50), (50, 60)]
    full, _, want = _kvzip_reference(model, ctx, PROMPT, CHUNK, gqa, softmax, weight=weight)
    comp = hf.KVCompressor(model, "kvzip", BUDGET,
                           options=kp.policy.Options(n_sink=SINKS, window=W, gqa=gqa, head_floor=0.0,
                                                     weight=weight),
                           compress_on_prefill=False).attach()
    cache = transformers.DynamicCache()
    def forward_chunks():
        for ids, span in zip(chunks, spans):
            yield span
            with torch.no_grad():
                model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache.crop(N - cache.get_seq_length())  # negative: 5.24 refuses a length

    saved = model.config._attn_implementation
    try:
        model.config._attn_implementation = impl
        with torch.no_grad():
            model(input_ids=ctx, past_key_values=cache, use_cache=True)
        taken = []
        monkeypatch.setattr(reconstruct.ReconstructionScorer, "__call__",
                            _recording(reconstruct.ReconstructionScorer.__call__, taken))
        reconstruct.score_reconstruction(comp, forward_chunks,
                                         kp.policy.make(comp.policy, softmax=softmax))
    finally:
        model.config._attn_implementation = saved
        comp.detach()
    assert len(taken) == N_LAYERS * len(chunks)
    assert all(t == (impl == "sdpa") for t in taken), taken  # lse from the model's attention
    assert comp.seen == N and not comp.compressed
    foils = [_kvzip_reference(model, ctx, PROMPT, CHUNK, gqa, "all" if softmax == "chunk"
                              else "chunk", weight=weight)[2]]
    if softmax == "all":
        foils.append(_kvzip_reference(model, ctx, PROMPT, CHUNK, gqa, "all", context_only=True,
                                      weight=weight)[2])
    for i in range(N_LAYERS):
        got = comp.selection_scores(cache, i)
        assert got.shape == (1, HKV, N) and got.dtype == torch.float32
        torch.testing.assert_close(got, want[i], rtol=1e-5, atol=1e-6 * float(want[i].max()))
        for foil in foils:  # (KVzip+'s maxima are ~1e-4: the tolerance scales with them)
            assert not torch.allclose(got, foil[i], rtol=1e-3, atol=1e-4 * float(want[i].max()))


def test_chunk_softmax_needs_the_span(model, gen):
    ctx = _ids(gen, 1, N)
    comp = hf.KVCompressor(model, "kvzip", BUDGET, options=kp.policy.Options(n_sink=SINKS, window=W),
                           compress_on_prefill=False).attach()
    cache = transformers.DynamicCache()
    def no_span():  # a forward before any span is yielded
        model(input_ids=PROMPT.chunks(ctx, CHUNK)[0], past_key_values=cache, use_cache=True)
        yield from ()
    try:
        with torch.no_grad():
            model(input_ids=ctx, past_key_values=cache, use_cache=True)
            with pytest.raises(RuntimeError, match="span"):
                reconstruct.score_reconstruction(comp, no_span)
            with pytest.raises(ValueError, match="kvzip"):
                reconstruct.score_reconstruction(comp, no_span, kp.policy.make("snapkv"))
    finally:
        comp.detach()
    with pytest.raises(ValueError, match="softmax"):
        kp.policy.make("kvzip", softmax="chunks")


@pytest.mark.parametrize("chunk_size,skip", [(25, 0), (25, 5), (7, 0), (2048, 0)])
def test_kvzip_keeps_reference_selection(model, gen, chunk_size, skip):
    ctx = _ids(gen, 1, N)
    prompt = RepeatPrompt(PROMPT.first, PROMPT.next, PROMPT.suffix, skip=skip)
    full, _, scores = _kvzip_reference(model, ctx, prompt, chunk_size)
    with _eager_capture(model):
        kvc = _compress(model, ctx, "kvzip", chunk_size=chunk_size, repeat_prompt=prompt)
    assert kvc.tokens_per_layer == [BUDGET] * N_LAYERS
    idx = [ref.select_keep(s, BUDGET, n_sink=SINKS, window=W) for s in scores]
    _assert_layers(kvc.cache(), full, idx)
    # the selection is not one a query-agnostic shortcut would make
    assert not all(torch.equal(i, ref.streaming_indices(1, HKV, N, BUDGET, n_sink=SINKS))
                   for i in idx)


@pytest.mark.parametrize("novelty", [0.5, 1.0])
def test_kvzip_novelty_keeps_each_heads_most_novel_keys_first(model, gen, novelty):
    """KVzip(novelty=f): the f * budget keys of each head least like the head's mean unit key
    (computed here in float64 from the full cache) go first, the rest by the maxima."""
    ctx = _ids(gen, 1, N)
    full, _, scores = _kvzip_reference(model, ctx, PROMPT, CHUNK)
    with _eager_capture(model):
        kvc = _compress(model, ctx, "kvzip", novelty=novelty, head_floor=0.0)
    count = int(novelty * BUDGET)
    idx = []
    for i, s in enumerate(scores):
        k = hf.cache_kv(full, i)[0].double()
        unit = k / k.norm(dim=-1, keepdim=True)
        mean = unit.mean(2, keepdim=True)
        novel = -(unit * mean).sum(-1) / mean.norm(dim=-1)  # [1, Hkv, N]
        bonus = torch.zeros_like(s).scatter_(-1, novel.topk(count, -1).indices, 1.0)
        idx.append(ref.select_keep(s + bonus, BUDGET, n_sink=SINKS, window=W))
    _assert_layers(kvc.cache(), full, idx)
    plain = [ref.select_keep(s, BUDGET, n_sink=SINKS, window=W) for s in scores]
    assert any(not torch.equal(a, b) for a, b in zip(idx, plain))  # the reservation changed it


@pytest.mark.parametrize("policy", ["kvzip", "kvzip-all", "snapkv", "h2o"])
def test_global_budget_follows_layer_budgets(model, gen, policy):
    ctx = _ids(gen, 1, N)
    policy, softmax = ("kvzip", "all") if policy == "kvzip-all" else (policy, "chunk")
    full, prefill, scores = _kvzip_reference(model, ctx, PROMPT, CHUNK, softmax=softmax)
    if policy != "kvzip":
        scores = _policy_scores(policy, prefill)
    with _eager_capture(model):
        kvc = _compress(model, ctx, policy, budget_scope="global", softmax=softmax, head_floor=0.0)
    want = kp.layer_budgets(scores, BUDGET, n_sink=SINKS, window=W)
    assert kvc.tokens_per_layer == want
    assert sum(want) == N_LAYERS * BUDGET
    if softmax == "all":  # (chunk softmax happens to split this context evenly)
        assert len(set(want)) > 1  # the layers really get different budgets
    _assert_layers(kvc.cache(), full,
                   [ref.select_keep(s, k, n_sink=SINKS, window=W) for s, k in zip(scores, want)])
    # a fraction resolves against the context length first (0.4 * 60 = 24 tokens)
    with _eager_capture(model):
        frac = _compress(model, ctx, policy, budget=0.4, budget_scope="global", softmax=softmax,
                         head_floor=0.0)
    assert frac.tokens_per_layer == want


@pytest.mark.parametrize("scope", ["global", "head"])
def test_global_budgets_rank_the_named_policys_scores(model, gen, scope):
    """score_context scores one prefill for several policies (what bench/eval_context.py
    does); ScoredContext.compress ranks the scores of the policy it is given, not the first's."""
    ctx = _ids(gen, 1, N)
    full, _, scores = _kvzip_reference(model, ctx, PROMPT, CHUNK)
    with _eager_capture(model):
        scored = kp.hf.score_context(model, ctx, ("snapkv", "kvzip"), n_sink=SINKS, window=W,
                                     gqa="max", chunk_size=CHUNK, repeat_prompt=PROMPT,
                                     head_floor=0.0)  # no floor: the maxima as the reference ranks them
    assert [p.name for p in scored.policies] == ["snapkv", "kvzip"]
    kvc = scored.compress(BUDGET, scope, policy="kvzip")
    if scope == "global":
        want = kp.layer_budgets(scores, BUDGET, n_sink=SINKS, window=W)
        _assert_layers(kvc.cache(), full, [ref.select_keep(s, k, n_sink=SINKS, window=W)
                                           for s, k in zip(scores, want)])
    else:
        assert [lay.lens.tolist() for lay in kvc.cache().layers] == \
            kp.head_budgets(scores, BUDGET, n_sink=SINKS, window=W).tolist()
    # the same scoring serves again, under another policy and budget
    again = scored.compress(0.5, "layer", policy="snapkv")
    assert again.policy.name == "snapkv" and again.tokens_per_layer == [N // 2] * N_LAYERS


def test_compress_refuses_a_policy_recorded_otherwise(model, gen):
    """ScoredContext.compress(policy=instance) ranks the evidence score_context recorded: an
    instance whose recording options (kvzip's weight, softmax, gqa, chunk_size, n_sink; h2o's
    gqa) differ from the recorder's is a ValueError naming the option, not a ranking of the
    other evidence; ranking options (head_floor, window) may differ."""
    ctx = _ids(gen, 1, N)
    scored = kp.hf.score_context(model, ctx, ("kvzip", "h2o"), n_sink=SINKS, chunk_size=CHUNK,
                                 repeat_prompt=PROMPT)
    kvzip, h2o = scored.policies
    for recorder, option, value in ((kvzip, "weight", "none"), (kvzip, "softmax", "all"),
                                    (kvzip, "gqa", "mean"), (kvzip, "chunk_size", 7),
                                    (kvzip, "n_sink", 1), (h2o, "gqa", "max")):
        with pytest.raises(ValueError, match=f"{option}={value!r}"):
            scored.compress(BUDGET, policy=kp.policy.make(recorder, **{option: value}))
    kvc = scored.compress(BUDGET, policy=kp.policy.make(kvzip, head_floor=0.5))
    assert kvc.policy.head_floor == 0.5 and kvc.policy.weight == "output"
    assert scored.compress(BUDGET, policy=kp.policy.make(h2o, window=4)).policy.window == 4
    # nor can one scoring record two kvzip evidences
    with pytest.raises(ValueError, match="weight='none'"):
        kp.hf.score_context(model, ctx, (kvzip, kp.policy.make(kvzip, weight="none")),
                            repeat_prompt=PROMPT)


@pytest.mark.parametrize("q", [5, 13])  # the window spans the context's end / lies in ids
def test_extend_equals_scoring_the_whole(model, gen, q):
    """ScoredContext.extend continues a scored context with more tokens (a question after a
    document) without prefilling the context again: snapkv's window and h2o's sums are those
    of one scoring of the whole; kvzip's evidence, of the context alone, is dropped."""
    ctx, qst = _ids(gen, 1, N), _ids(gen, 1, q)
    opts = dict(n_sink=SINKS, window=W)
    base = kp.hf.score_context(model, ctx, ("kvzip", "snapkv", "h2o"), **opts,
                               chunk_size=CHUNK, repeat_prompt=PROMPT)
    def keys(scored):  # each policy's kept keys, per layer
        return {p: [lay.keys.clone() for lay in scored.compress(BUDGET, "layer", policy=p).cache().layers]
                for p in ("kvzip", "snapkv", "h2o")}

    before = keys(base)
    ext = base.extend(qst)
    whole = kp.hf.score_context(model, torch.cat([ctx, qst], 1), ("snapkv", "h2o"), **opts)
    assert [p.name for p in ext.policies] == ["snapkv", "h2o"]
    assert torch.equal(ext.context_ids, whole.context_ids)
    answer = _ids(gen, 1, 2)
    for policy in ("snapkv", "h2o", "streaming", "full"):
        got = ext.compress(BUDGET, policy=policy)
        want = whole.compress(BUDGET, policy=policy)
        for a, b in zip(got.cache().layers, want.cache().layers, strict=True):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        g, w = got.generate(answer, **GEN), want.generate(answer, **GEN)
        assert torch.equal(g.sequences, w.sequences), policy
    with pytest.raises(RuntimeError, match="kvzip"):
        ext.compress(BUDGET, "layer", policy="kvzip")
    # the scored context itself is unchanged: every policy keeps the same keys as before
    assert torch.equal(base.context_ids, ctx)
    after = keys(base)
    for p in before:
        assert all(torch.equal(a, b) for a, b in zip(after[p], before[p], strict=True)), p
    for bad in (qst[0], _ids(gen, 2, q), qst[:, :0]):
        with pytest.raises(ValueError, match="ids"):
            base.extend(bad)


def _head_selection(scores):
    """Per layer, the kept positions of every (row, KV head) under kp.head_budgets: nested
    [B][Hkv] int64 1D (the reference's select_keep of that head's scores and count)."""
    counts = kp.head_budgets(scores, BUDGET, n_sink=SINKS, window=W)
    out = []
    for s, c in zip(scores, counts):
        b, hkv, _ = s.shape
        out.append([[ref.select_keep(s[i:i + 1, h:h + 1], int(c[i, h]), n_sink=SINKS,
                                     window=W)[0, 0].long() for h in range(hkv)]
                    for i in range(b)])
    return counts, out


@pytest.mark.parametrize("head_floor", [0.5, 0.9])
def test_kvzip_head_floor_gives_every_head_its_floor_first(model, gen, head_floor):
    """KVzip(head_floor=f) under the "head" scope: each (layer, row, KV head) first keeps its
    own int(f * budget) largest maxima (raised here by hand above every maximum, a
    probability <= 1), the rest of the shared budget by the maxima; so no head holds fewer.
    Plain maxima (weight "none"): with them some head of this context falls below 0.9's floor."""
    ctx = _ids(gen, 2, N)
    full, _, scores = _kvzip_reference(model, ctx, PROMPT, CHUNK, weight="none")
    floor = int(head_floor * BUDGET)
    raised = [s + torch.zeros_like(s).scatter_(-1, s.topk(floor, -1).indices, 1.0) for s in scores]
    counts, keep = _head_selection(raised)
    with _eager_capture(model):
        kvc = _compress(model, ctx, "kvzip", budget_scope="head", head_floor=head_floor,
                        weight="none")
    assert kvc.tokens_per_head == counts.tolist()
    assert int(counts.min()) >= floor
    raw = _head_selection(scores)[0]
    if head_floor == 0.9:  # 21 of 24: without the floor some head of this context holds fewer
        assert int(raw.min()) < floor and not torch.equal(counts, raw)
    else:  # 12: below every head's count here, so the floor changes nothing
        assert int(raw.min()) >= floor and torch.equal(counts, raw)
    cache = kvc.cache()
    for i in range(N_LAYERS):
        fk, fv = hf.cache_kv(full, i)
        for b in range(2):
            for h in range(HKV):
                idx, m = keep[i][b][h], int(counts[i, b, h])
                assert torch.equal(cache.layers[i].keys[b, h, :m], fk[b, h, idx]), (i, b, h)
                assert torch.equal(cache.layers[i].values[b, h, :m], fv[b, h, idx]), (i, b, h)


@pytest.mark.parametrize("softmax", ["chunk", "all"])
def test_kvzip_output_weight_ranks_by_kvzip_plus_maxima(model, gen, softmax):
    """KVzip(weight="output") (KVzip+): the maxima of each eager weight times the key's
    value's output norm through the query head's o_proj slice, over the query's hidden-state
    norm (float64 here, from the model's weights and the full cache); kept as ranked."""
    ctx = _ids(gen, 2, N)
    gains = [layer.input_layernorm.weight for layer in model.model.layers]
    try:  # uneven RMSNorm gains, so that ||h|| differs between tokens (all ones: it is constant)
        for layer in model.model.layers:
            layer.input_layernorm.weight = torch.nn.Parameter(0.5 + torch.rand(D * HQ, generator=gen))
        full, _, plain = _kvzip_reference(model, ctx, PROMPT, CHUNK, softmax=softmax, weight="none")
        _, _, scores = _kvzip_reference(model, ctx, PROMPT, CHUNK, softmax=softmax)
        with _eager_capture(model):
            kvc = _compress(model, ctx, "kvzip", budget_scope="head", head_floor=0.0,
                            softmax=softmax, weight="output")
    finally:
        for layer, w in zip(model.model.layers, gains):
            layer.input_layernorm.weight = w
    counts, keep = _head_selection(scores)
    assert not torch.equal(counts, _head_selection(plain)[0])  # the weighting moves the budgets
    assert kvc.tokens_per_head == counts.tolist()
    cache = kvc.cache()
    for i in range(N_LAYERS):
        fk = hf.cache_kv(full, i)[0]
        for b in range(2):
            for h in range(HKV):
                m = int(counts[i, b, h])
                assert torch.equal(cache.layers[i].keys[b, h, :m], fk[b, h, keep[i][b][h]]), (i, b, h)


@pytest.mark.parametrize("policy", ["kvzip", "snapkv", "h2o"])
def test_head_budget_keeps_each_heads_own_count(model, gen, policy):
    """budget_scope="head": kp.head_budgets' count per (layer, row, KV head), each head's top
    positions by its own scores, packed without padding (the evicted tokens' memory freed)."""
    rows = 2 if policy == "kvzip" else 1  # _policy_scores reads one row
    ctx = _ids(gen, rows, N)
    full, prefill, scores = _kvzip_reference(model, ctx, PROMPT, CHUNK)
    if policy != "kvzip":
        scores = _policy_scores(policy, prefill)
    counts, keep = _head_selection(scores)
    with _eager_capture(model):
        kvc = _compress(model, ctx, policy, budget_scope="head", head_floor=0.0)  # raw scores
    assert kvc.tokens_per_head == counts.tolist()
    if policy != "h2o":  # (h2o's sums happen to split this context evenly)
        assert len({x for lay in kvc.tokens_per_head for row in lay for x in row}) > 2
    size = next(model.parameters()).element_size()
    # K/V of the kept tokens, then the counts (int64), the padded view's mask (bool) and each
    # packed token's two int32 slot indices
    index = [rows * HKV * (8 + int(c.max())) + 8 * int(c.sum()) for c in counts]
    assert kvc.bytes_per_layer == [2 * int(c.sum()) * D * size + x for c, x in zip(counts, index)]
    kv = 2 * N_LAYERS * rows * HKV * BUDGET * D * size  # = the uniform budget's
    assert kvc.nbytes == kv + sum(index) + ctx.numel() * ctx.element_size() + ctx.numel()
    cache = kvc.cache()
    assert hf.kv_bytes(cache) == kv + sum(index)
    for i in range(N_LAYERS):
        lay = cache.layers[i]
        padded_k, padded_v = lay.keys, lay.values
        width = int(counts[i].max())
        assert padded_k.shape == (rows, HKV, width, D) and lay.get_seq_length() == width
        for b in range(rows):
            for h in range(HKV):
                idx, m = keep[i][b][h], int(counts[i, b, h])
                fk, fv = hf.cache_kv(full, i)
                assert torch.equal(padded_k[b, h, :m], fk[b, h, idx]), (i, b, h)
                assert torch.equal(padded_v[b, h, :m], fv[b, h, idx]), (i, b, h)
                assert not padded_k[b, h, m:].any() and not padded_v[b, h, m:].any()
                assert lay.valid()[b, h].tolist() == [t < m for t in range(width)]


# ---- generating from a compressed context ---------------------------------------------------


def test_full_generate_equals_plain_generate(model, gen):
    ctx, qst = _ids(gen, 1, N), _ids(gen, 1, 5)
    ids = torch.cat([ctx, qst], 1)
    with torch.no_grad():
        plain = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **GEN)
    kvc = kp.hf.compress_context(model, ctx, "full")
    assert kvc.tokens_per_layer == [N] * N_LAYERS
    out = kvc.generate(qst, **GEN)
    assert torch.equal(out.sequences, plain.sequences[:, N:])
    assert out.sequences.shape == (1, 5 + 8)
    for a, b in zip(out.logits, plain.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # without return_dict_in_generate: the ids tensor, context cut off
    ids_only = kvc.generate(qst, **{k: v for k, v in GEN.items()
                                    if k not in ("return_dict_in_generate", "output_logits")})
    assert torch.equal(ids_only, out.sequences)
    # teacher-forced: the question's logits, as one forward over context and question gives them
    with torch.no_grad():
        whole = model(input_ids=ids).logits[:, N:]
    torch.testing.assert_close(kvc.forward(qst).logits, whole, rtol=1e-4, atol=1e-4)


def _layer_state(kvc):
    """Per layer of a question's cache: the storage of K, V and, for fixed-capacity layers,
    slot positions, lengths and h2o scores (fixed layers are copies: their source's storage),
    with a copy of the values."""
    c, out = kvc.cache(), []
    for i in range(N_LAYERS):
        lay = c.layers[i]
        ts = [t for t in lay.decode if t is not None] if hasattr(lay, "decode") else [lay.keys, lay.values]
        if hasattr(lay, "decode"):
            assert all(a.data_ptr() != b.data_ptr() for a, b in zip(ts, kvc._layers[i].decode))
            ts = [t for t in kvc._layers[i].decode if t is not None]
        out.append([(t.data_ptr(), t.clone()) for t in ts])
    return out


@contextlib.contextmanager
def _masked_eager(model, keep):
    """Eager attention with every context key that ``keep[layer]`` (bool [B, Hkv, n]) drops
    masked out per KV head; keys after the context stay visible (feed one token per forward).
    The full cache then computes what a per-head compressed cache must. Independent of hf.py."""
    mod = sys.modules[type(model.model.layers[0].self_attn).__module__]
    eager = mod.eager_attention_forward

    def masked(module, query, key, value, attention_mask, *args, **kwargs):
        b, hq, q, length = *query.shape[:3], key.shape[2]
        kept = keep[module.layer_idx]
        allowed = torch.ones(b, hq, q, length, dtype=torch.bool)
        allowed[..., :kept.shape[2]] = kept.repeat_interleave(hq // kept.shape[1], 1)[:, :, None]
        mask = torch.zeros(allowed.shape, dtype=query.dtype).masked_fill(
            ~allowed, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, mask, *args, **kwargs)

    impl = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    mod.eager_attention_forward = masked
    try:
        yield
    finally:
        mod.eager_attention_forward = eager
        model.config._attn_implementation = impl


def test_head_budget_generate_equals_masked_full_cache(model, gen):
    """Greedy answers from a per-head compressed context (2 rows, default SDPA) == the full
    context cache with each head's evicted keys masked (eager), token by token."""
    ctx, qst = _ids(gen, 2, N), _ids(gen, 2, 5)
    full, _, scores = _kvzip_reference(model, ctx, PROMPT, CHUNK)
    _, keep_idx = _head_selection(scores)
    keep = []
    for layer in keep_idx:
        m = torch.zeros(2, HKV, N, dtype=torch.bool)
        for b, row in enumerate(layer):
            for h, idx in enumerate(row):
                m[b, h, idx] = True
        keep.append(m)
    kvc = _compress(model, ctx, "kvzip", budget_scope="head", head_floor=0.0)  # no floor: the maxima as ranked
    out = kvc.generate(qst, **GEN)
    teacher_forced = kvc.forward(qst).logits
    want_logits, question_logits, ids = [], [], qst
    with _masked_eager(model, keep), torch.no_grad():
        for t in range(qst.shape[1] + GEN["max_new_tokens"] - 1):
            pos = torch.full((2, 1), N + t)
            tok = ids[:, t:t + 1]
            lg = model(input_ids=tok, past_key_values=full, use_cache=True, position_ids=pos,
                       cache_position=pos[0]).logits[:, -1]
            if t < qst.shape[1]:
                question_logits.append(lg)
            if t >= qst.shape[1] - 1:
                want_logits.append(lg)
                if t + 1 >= ids.shape[1]:
                    ids = torch.cat([ids, lg.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out.sequences, ids)
    for a, b in zip(out.logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(teacher_forced, torch.stack(question_logits, 1), rtol=1e-4, atol=1e-4)
    # the foil: the same count per head of a layer (kvzip-global) answers differently
    other = _compress(model, ctx, "kvzip", budget_scope="global").generate(qst, **GEN)
    assert not all(torch.allclose(a, b, rtol=1e-3, atol=1e-3)
                   for a, b in zip(out.logits, other.logits))


def test_head_budget_generate_leaves_the_context_unchanged(model, gen):
    ctx, qst = _ids(gen, 1, N), _ids(gen, 1, 5)
    kvc = _compress(model, ctx, "kvzip", budget_scope="head")
    before = [(lay.past_k.data_ptr(), lay.past_k.clone(), lay.past_v.clone(), lay.lens.clone())
              for lay in kvc._layers]
    first, second = kvc.generate(qst, **GEN), kvc.generate(qst, **GEN)
    assert torch.equal(first.sequences, second.sequences)
    for lay, (p, k, v, lens) in zip(kvc._layers, before, strict=True):
        assert lay.past_k.data_ptr() == p and lay.new_k.shape[2] == 0
        assert torch.equal(lay.past_k, k) and torch.equal(lay.past_v, v)
        assert torch.equal(lay.lens, lens)
    assert kvc.cache().layers[0].past_k.data_ptr() == before[0][0]  # shared, not copied


def test_ragged_layer_rows():
    """RaggedLayer's batch reorderings (beam search, repeat): the padded view's rows move."""

    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 9, 4, generator=g), torch.randn(2, 2, 9, 4, generator=g)
    idx = [[torch.tensor([0, 3, 4]), torch.tensor([1])], [torch.tensor([2, 5]), torch.arange(9)]]
    lay = RaggedLayer.from_selection(k, v, idx)
    lay.update(k[:, :, :2], v[:, :, :2])
    assert lay.tokens.tolist() == [[5, 3], [4, 11]] and lay.get_seq_length() == 11
    want_k, want_v = lay.keys, lay.values
    assert torch.equal(want_k[1, 0, :2], k[1, 0, [2, 5]]) and not want_k[1, 0, 2:9].any()
    assert torch.equal(want_v[:, :, 9:], v[:, :, :2])
    lay.batch_repeat_interleave(2)
    assert torch.equal(lay.keys, want_k.repeat_interleave(2, 0))
    lay.batch_select_indices(torch.tensor([3, 0]))
    assert torch.equal(lay.keys, want_k[[1, 0]]) and torch.equal(lay.values, want_v[[1, 0]])
    lay.reorder_cache(torch.tensor([1, 1]))
    narrow = torch.cat([want_k[[0, 0], :, :3], want_k[[0, 0], :, 9:]], 2)  # row 0 keeps <= 3
    assert torch.equal(lay.keys, narrow) and lay.tokens.tolist() == [[5, 3], [5, 3]]
    kv = 2 * (2 * (3 + 1) + 2 * 2 * 2) * 4 * 4  # K and V: kept + appended, fp32 D=4
    index = 2 * 2 * 8 + 2 * 2 * 3 + 2 * 8 * 4  # counts (int64), padding mask (bool), slots (int32)
    assert kp.hf.memory.tensor_bytes(lay.tensors()) == kv + index


@pytest.mark.parametrize("policy", POLICIES)
def test_generate_leaves_the_context_unchanged(model, gen, policy):
    ctx, qst = _ids(gen, 1, N), _ids(gen, 1, 5)
    kvc = _compress(model, ctx, policy)
    before = _layer_state(kvc)
    first = kvc.generate(qst, **GEN)
    scored = kvc.forward(qst).logits
    second = kvc.generate(qst, **GEN)
    assert torch.equal(first.sequences, second.sequences)
    assert all(torch.equal(a, b) for a, b in zip(first.logits, second.logits, strict=True))
    assert torch.equal(kvc.forward(qst).logits, scored)
    after = _layer_state(kvc)
    for lay_before, lay_after in zip(before, after, strict=True):
        for (p, t), (p2, t2) in zip(lay_before, lay_after, strict=True):
            assert p == p2 and torch.equal(t, t2)
    assert kvc.tokens_per_layer == [BUDGET] * N_LAYERS


@pytest.mark.parametrize("policy", POLICIES)
def test_generate_equals_question_on_hand_built_cache(model, gen, policy):
    """The first generated token's logits == the question fed one token at a time (positions
    n, n+1, ...) to a plain DynamicCache holding the independently selected context K/V.
    kvzip / snapkv let the cache grow, so their whole greedy answer matches too."""
    ctx, qst = _ids(gen, 1, N), _ids(gen, 1, 5)
    with _eager_capture(model):
        full, prefill, scores = _kvzip_reference(model, ctx, PROMPT, CHUNK)
        if policy == "kvzip":
            idx = [ref.select_keep(s, BUDGET, n_sink=SINKS, window=W) for s in scores]
        else:
            idx, attended = _agnostic_expected_idx(policy, prefill, BUDGET, SINKS, W, qst.shape[1])
        kvc = _compress(model, ctx, policy)
        _assert_layers(kvc.cache(), full, idx)
        out = kvc.generate(qst, **GEN)
        by_hand = transformers.DynamicCache()
        for i in range(N_LAYERS):  # streaming / h2o: what remains after making room for qst
            by_hand.update(*ref.gather_kv(*hf.cache_kv(full, i), idx[i] if policy == "kvzip"
                                          else attended[i]), i)
        every = []
        with torch.no_grad():
            for t in range(qst.shape[1]):
                pos = torch.tensor([[N + t]])
                logits = model(input_ids=qst[:, t:t + 1], past_key_values=by_hand, use_cache=True,
                               position_ids=pos, cache_position=pos[0]).logits
                every.append(logits[:, -1])
        torch.testing.assert_close(out.logits[0], logits[:, -1], rtol=1e-4, atol=1e-4)
        # teacher-forced, one forward: every question token's logits as fed one at a time
        torch.testing.assert_close(kvc.forward(qst).logits, torch.stack(every, 1), rtol=1e-4, atol=1e-4)
        assert int(out.sequences[0, 5]) == int(logits[0, -1].argmax())
        if policy in ("kvzip", "snapkv"):
            answer = _manual_decode(model, by_hand, logits, 8, N + 5)
            assert out.sequences[0, 5:].tolist() == answer


@pytest.mark.parametrize("policy", POLICIES)
def test_questions_in_turn_equal_fresh_contexts(model, gen, policy):
    ctx = _ids(gen, 1, N)
    questions = [_ids(gen, 1, q) for q in (5, 3, 7)]
    kw = dict(GEN, max_new_tokens=4, min_new_tokens=4)  # streaming / h2o evict on the question
    kvc = _compress(model, ctx, policy)
    for qst in questions:
        got = kvc.generate(qst, **kw)
        want = _compress(model, ctx, policy).generate(qst, **kw)
        assert torch.equal(got.sequences, want.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits, strict=True))


def test_kvzip_batch_rows_match_single_rows(model, gen):
    ctx, qst = _ids(gen, 2, N), _ids(gen, 2, 5)
    out = _compress(model, ctx, "kvzip").generate(qst, **GEN)
    assert out.sequences.shape == (2, 5 + 8)
    for b in range(2):
        one = _compress(model, ctx[b:b + 1], "kvzip").generate(qst[b:b + 1], **GEN)
        assert torch.equal(out.sequences[b:b + 1], one.sequences)
        for a, c in zip(out.logits, one.logits, strict=True):
            torch.testing.assert_close(a[b:b + 1], c, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy,budget,scope", [
    ("kvzip", BUDGET, "layer"), ("kvzip", BUDGET, "global"), ("snapkv", 0.4, "layer"),
    ("full", 0.2, "layer")])
def test_reported_sizes(model, gen, policy, budget, scope):
    ctx = _ids(gen, 1, N)
    kvc = _compress(model, ctx, policy, budget, budget_scope=scope)
    size = next(model.parameters()).element_size()
    cache = kvc.cache()
    assert kvc.tokens_per_layer == [hf.cache_kv(cache, i)[0].shape[2] for i in range(N_LAYERS)]
    # K and V, and the slot validity mask (a bool per token and KV head)
    assert kvc.bytes_per_layer == [2 * HKV * t * D * size + HKV * t for t in kvc.tokens_per_layer]
    assert hf.kv_bytes(cache) == sum(2 * HKV * t * D * size for t in kvc.tokens_per_layer)
    ids = ctx.numel() * ctx.element_size()  # the context's token ids, kept for generate
    assert kvc.nbytes == sum(kvc.bytes_per_layer) + ids + N  # + the prefill's validity [1, N]
    total = N_LAYERS * (N if policy == "full" else BUDGET)
    assert sum(kvc.tokens_per_layer) == total and kvc.context_len == N
    assert kvc.prefill_seconds > 0 and kvc.compress_seconds > 0
    assert f"policy={policy!r}" in repr(kvc)


# ---- the reconstruction prompt --------------------------------------------------------------


def test_repeat_prompt_chunks_layout():
    rows = [list(range(100, 137)), list(range(200, 237))]
    ctx = torch.tensor(rows, dtype=torch.int32)
    p = RepeatPrompt(first=[1, 2], next=[3], suffix=[4, 5], skip=3, overlap=4)
    chunks = p.chunks(ctx, 10)
    pieces = [(3, 13), (13, 23), (23, 33), (33, 37)]
    assert len(chunks) == len(pieces)
    for c, (s, e) in enumerate(pieces):
        assert chunks[c].dtype == torch.int32
        for b, row in enumerate(rows):
            head = [1, 2] if c == 0 else [3] + row[pieces[c - 1][1] - 4:pieces[c - 1][1]]
            assert chunks[c][b].tolist() == head + [4, 5] + row[s:e], (c, b)
    one = RepeatPrompt(first=[1], next=[3], suffix=[4]).chunks(ctx, 100)
    assert len(one) == 1 and one[0][1].tolist() == [1, 4] + rows[1]


@pytest.mark.parametrize("overlap", [0, 1, 25])
def test_repeat_prompt_overlap(overlap):
    """The last ``overlap`` tokens of the previous chunk, all of it when shorter, none for 0."""
    ctx = torch.arange(100, 130)[None]
    chunks = RepeatPrompt(first=[1], next=[2], suffix=[3], overlap=overlap).chunks(ctx, 10)
    for c in (1, 2):
        prev = ctx[0, 10 * (c - 1):10 * c].tolist()
        tail = prev[len(prev) - min(overlap, len(prev)):]
        assert chunks[c][0].tolist() == [2] + tail + [3] + ctx[0, 10 * c:10 * c + 10].tolist()


class _CharTokenizer:
    """One token per character (id = code point); an optional chat template around a user turn."""

    def __init__(self, chat_template=None):
        self.chat_template = chat_template
        self.calls = []

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return SimpleNamespace(input_ids=_chars(text))

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        self.calls.append((messages, add_generation_prompt, tokenize))
        return "<u>" + messages[0]["content"] + "</u><a>"


def _chars(text):
    return [ord(ch) for ch in text]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_repeat_prompt_from_tokenizer_with_template(device):
    tok = _CharTokenizer(chat_template="{{ whatever }}")
    body = torch.tensor([_chars("abcdefgh")], device=device)
    with_header = torch.tensor([_chars("<u>abcdefgh")], device=device)
    p = RepeatPrompt.from_tokenizer(tok, with_header)
    assert tok.calls == [([{"role": "user", "content": "@@"}], True, False)]
    assert list(p.first) == _chars(reconstruct.FIRST_PROMPT)
    assert list(p.next) == _chars(reconstruct.NEXT_PROMPT)
    assert list(p.suffix) == _chars("</u><a>")
    assert p.skip == 3 and p.overlap == 8
    assert RepeatPrompt.from_tokenizer(tok, body).skip == 0            # no header
    assert RepeatPrompt.from_tokenizer(tok, with_header[:, :3]).skip == 0  # the header only
    assert RepeatPrompt.from_tokenizer(tok).skip == 0
    two = torch.cat([with_header, torch.tensor([_chars("<u>zzzzzzzz")], device=device)])
    assert RepeatPrompt.from_tokenizer(tok, two).skip == 3
    mixed = torch.cat([with_header, torch.tensor([_chars("<v>zzzzzzzz")], device=device)])
    assert RepeatPrompt.from_tokenizer(tok, mixed).skip == 0          # every row must match


def test_repeat_prompt_from_tokenizer_without_template():
    tok = _CharTokenizer(chat_template=None)
    p = RepeatPrompt.from_tokenizer(tok, torch.tensor([_chars("<u>abcdefgh")]))
    assert tok.calls == []
    assert list(p.suffix) == _chars("\n") and p.skip == 0
    assert list(p.first) == _chars(reconstruct.FIRST_PROMPT)


def test_kvzip_builds_its_prompt_from_the_tokenizer(model, gen):
    """tokenizer=: the chunks are those of RepeatPrompt.from_tokenizer (header skipped)."""
    tok = _CharTokenizer(chat_template="{{ whatever }}")  # ASCII: ids < the vocabulary's 128
    ctx = torch.cat([torch.tensor([_chars("<u>")]), _ids(gen, 1, N - 3)], 1)
    prompt = RepeatPrompt.from_tokenizer(tok, ctx)
    assert prompt.skip == 3
    full, _, scores = _kvzip_reference(model, ctx, prompt, CHUNK)
    _, _, others = _kvzip_reference(model, ctx, PROMPT, CHUNK)
    idx = [ref.select_keep(s, BUDGET, n_sink=SINKS, window=W) for s in scores]
    assert not all(torch.equal(a, ref.select_keep(b, BUDGET, n_sink=SINKS, window=W))
                   for a, b in zip(idx, others))  # the prompt matters
    with _eager_capture(model):
        kvc = _compress(model, ctx, "kvzip", repeat_prompt=None, tokenizer=tok)
    _assert_layers(kvc.cache(), full, idx)


# ---- arguments ------------------------------------------------------------------------------


def test_bad_arguments(model, gen):
    ctx = _ids(gen, 1, N)
    with pytest.raises(ValueError, match="policy"):
        kp.hf.compress_context(model, ctx, "nope", BUDGET)
    for policy in ("streaming", "full"):
        for scope in ("global", "head"):
            with pytest.raises(ValueError, match="budget_scope"):
                kp.hf.compress_context(model, ctx, policy, BUDGET, budget_scope=scope)
    with pytest.raises(ValueError, match="budget_scope"):
        kp.hf.compress_context(model, ctx, "snapkv", BUDGET, budget_scope="row")
    for bad in (ctx[0], ctx.tolist(), ctx[:, :0], ctx[None]):
        with pytest.raises(ValueError, match="context_ids"):
            kp.hf.compress_context(model, bad, "snapkv", BUDGET, n_sink=SINKS, window=W)
    for bad, error in ((0, ValueError), (-3, ValueError), (True, TypeError), (8.0, TypeError)):
        with pytest.raises(error, match="chunk_size"):
            _compress(model, ctx, "kvzip", chunk_size=bad)
    with pytest.raises(ValueError, match="budget"):
        _compress(model, ctx, "kvzip", 10)
    for bad in ("chunks", "none"):
        with pytest.raises(ValueError, match="softmax"):
            _compress(model, ctx, "kvzip", softmax=bad)
    with pytest.raises(ValueError, match="tokenizer"):  # a random model has no tokenizer to load
        kp.hf.compress_context(model, ctx, "kvzip", BUDGET, n_sink=SINKS, window=W)
    with pytest.raises(TypeError, match="kernal_size"):  # a misspelt option is not ignored
        kp.hf.compress_context(model, ctx, "snapkv", BUDGET, kernal_size=3)
    with pytest.raises(ValueError, match="policy"):
        hf.KVCompressor(model, "kvzip", BUDGET, options=kp.policy.Options(n_sink=SINKS, window=W))
    with pytest.raises(ValueError, match="policy"):
        with kp.hf.compress(model, policy="kvzip", budget=BUDGET, n_sink=SINKS, window=W):
            pass
    kvc = _compress(model, ctx, "kvzip")
    qst = _ids(gen, 1, 5)
    for name in ("input_ids", "past_key_values", "attention_mask", "cache_position",
                 "position_ids", "inputs_embeds"):
        with pytest.raises(ValueError, match=name):
            kvc.generate(qst, max_new_tokens=2, **{name: None})
    for field in ("skip", "overlap"):
        with pytest.raises(ValueError, match=field):
            RepeatPrompt(PROMPT.first, PROMPT.next, PROMPT.suffix, **{field: -1})
    with pytest.raises(ValueError, match="repeat_prompt"):
        _compress(model, ctx, "kvzip", repeat_prompt=RepeatPrompt([5], [6], [7], skip=N))
    for bad in (_ids(gen, 2, 5), qst[0], qst[:, :0], qst.tolist()):
        with pytest.raises(ValueError, match="question_ids"):
            kvc.generate(bad, max_new_tokens=2)
        with pytest.raises(ValueError, match="ids: expected"):
            kvc.forward(bad)
    for name in ("input_ids", "past_key_values", "attention_mask", "position_ids"):
        with pytest.raises(ValueError, match=f"{name}: set by CompressedContext.forward"):
            kvc.forward(qst, **{name: None})
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _package_imports() -> dict:
    """{module: the kvprune_cuda modules it imports at module level}, read from the sources."""
    import ast
    import pathlib

    root = pathlib.Path(kp.__file__).parent
    graph = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        graph[name] = [node for node in ast.parse(path.read_text()).body  # module level only
                       if isinstance(node, (ast.Import, ast.ImportFrom))]
    out = {}
    for m, nodes in graph.items():
        deps = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif node.module and node.level == 0:  # "from P import x": module P.x, else P
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in graph
                         else node.module for a in node.names}
        # a module's own packages run first whatever it imports: not an edge of its own
        out[m] = {d for d in deps if d in graph and d != m and not m.startswith(d + ".")}
    return out


def test_no_import_cycle_in_the_package():
    """The module-level imports of kvprune_cuda.hf and kvprune_cuda.policy form no cycle
    (the package root, which every module imports for its ops, is left out), and every
    module imports first in a fresh interpreter, in a random (seeded) order."""
    import random

    graph = {m: d - {"kvprune_cuda"} for m, d in _package_imports().items()
             if m.startswith(("kvprune_cuda.hf", "kvprune_cuda.policy"))}
    assert "kvprune_cuda.hf.context" in graph and "kvprune_cuda.hf.hooks" in graph
    done, path = set(), []

    def visit(m):
        assert m not in path, f"import cycle: {' -> '.join(path[path.index(m):] + [m])}"
        if m in done or m not in graph:
            return
        path.append(m)
        for d in graph[m]:
            visit(d)
        path.pop()
        done.add(m)

    for m in graph:
        visit(m)
    order = sorted(graph)
    random.Random(0).shuffle(order)
    code = ("import importlib, sys\nfor n in sys.argv[1:]: importlib.import_module(n)\n"
            "import kvprune_cuda as kp\n"
            "assert kp.hf.compress_context is sys.modules['kvprune_cuda.hf.context'].compress_context")
    subprocess.run([sys.executable, "-c", code, *order], check=True)


def test_defaults_are_the_measured_best(model, gen):
    """compress_context's defaults are the configuration the measurements favour: kvzip keeps
    a count per KV head (bench/RESULTS.md: 20/20 passkey at 10 %, where one count per layer
    gets 18/20 and a uniform budget 0/20), with KVzip's chunk softmax, GQA max, sinks only,
    and a quarter of each head's budget as its floor (bench/notes/2026-12-05-ruler-defaults.md:
    better than none at 10 / 16 / 25 % on the RULER-style suite, passkey 20/20), ranked by
    KVzip+'s output-weighted maxima (ibid., "KVzip+ becomes the default": 0.90 of full at 16 %
    against 0.83 with plain maxima on the same 130 samples, passkey 10/10, scoring 1.015x);
    the other policies one count per layer. A user's first call needs no option."""
    kvzip = kp.policy.make("kvzip")
    assert (kvzip.default_scope, kvzip.softmax, kvzip.gqa, kvzip.window, kvzip.head_floor,
            kvzip.novelty, kvzip.weight) == ("head", "chunk", "max", 0, 0.25, 0.0, "output")
    assert all(kp.policy.make(p).default_scope == "layer" for p in POLICIES if p != "kvzip")
    ctx = _ids(gen, 1, N)
    kvc = kp.hf.compress_context(model, ctx, "kvzip", BUDGET, n_sink=SINKS, chunk_size=CHUNK,
                                 repeat_prompt=PROMPT)
    assert all(isinstance(lay, RaggedLayer) for lay in kvc._layers)
    assert kvc.policy == kp.policy.KVzip(BUDGET, SINKS, chunk_size=CHUNK)
    snap = kp.hf.compress_context(model, ctx, "snapkv", BUDGET, n_sink=SINKS, window=W)
    assert snap.tokens_per_layer == [BUDGET] * N_LAYERS


def test_a_policy_instance_keeps_its_budget_and_options(model, gen):
    """compress_context(policy=instance) with nothing else keeps the instance's budget and
    options; a given budget replaces its budget only."""
    ctx = _ids(gen, 1, N)
    p = kp.policy.SnapKV(BUDGET, SINKS, W, kernel_size=3)
    kvc = kp.hf.compress_context(model, ctx, p, budget_scope="layer")
    assert kvc.policy == p and kvc.tokens_per_layer == [BUDGET] * N_LAYERS
    kvc = kp.hf.compress_context(model, ctx, p, 30, budget_scope="layer")
    assert kvc.policy == kp.policy.SnapKV(30, SINKS, W, kernel_size=3)
