"""kp.hf's bounded-peak prefill (``prefill_max_held``, ``prefill_chunk``) on the tiny Qwen2.

The oracle is the model's own attention calls (test_hf's ``_eager_capture``: what each chunk's
attention received, independent of hf's code) and the plain reference: after every chunk but
the last, a layer holding more than the bound keeps exactly ``ref.snapkv`` of what it held,
voted for by the last ``window`` queries; the peak is hand-computed.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda import hf  # noqa: E402
from kvprune_cuda import reference as ref  # noqa: E402

from test_hf import D, HKV, N_LAYERS, _eager_capture, _gen, _ids, model  # noqa: E402,F401
from test_hf_context import PROMPT, _attention_inputs, _output_weights  # noqa: E402
from test_policy import _max_probability_by_hand  # noqa: E402

N, CHUNK, BOUND, BUDGET, W = 196, 48, 40, 24, 8  # the last chunk (4) is shorter than W
OPTS = dict(n_sink=4, window=W, kernel_size=5, pool_shift=2)


def _expected_max(q, k, carried, far=0, novelty=None):
    """The "max" (``far`` 0) or "far" (``far`` = W) signal's kept positions of a chunk whose
    attention got queries ``q`` and keys ``k``, by the reference, and the running maxima after
    it (``carried``: before). "far": each query scores the keys ``far`` or more positions
    before it (test_policy checks that rule by hand). ``novelty``: that share of the bound
    goes first to each head's keys least aligned with its mean unit key (the sinks and the
    window aside), after pooling."""
    fresh = _max_probability_by_hand(q, k, far).float()
    if carried is not None:
        fresh[..., :carried.shape[-1]] = torch.maximum(fresh[..., :carried.shape[-1]], carried)
    pooled = ref.pool_scores(fresh, 5, "max", window=W, shift=2)
    if novelty:
        unit = k.double() / k.double().norm(dim=-1, keepdim=True)
        mean = unit.mean(2, keepdim=True)
        cosine = (unit * mean).sum(-1) / mean.norm(dim=-1)  # [B, Hkv, n]
        cosine[..., :4] = cosine[..., -W:] = float("inf")  # the sinks and window: kept anyway
        novel = (-cosine).topk(int(novelty * BOUND), -1).indices  # 20 <= 40 - 4 - 8
        pooled = pooled.clone()
        pooled.scatter_(-1, novel, pooled.gather(-1, novel) + 1)
    idx = ref.select_keep(pooled, BOUND, n_sink=4, window=W).long()
    return idx, fresh.gather(2, idx)


@pytest.mark.parametrize("signal,novelty", [("max", None), ("far", None), ("window", None),
                                            ("far", 0.5)])
def test_each_chunk_keeps_the_reference_selection_and_the_peak_is_bound_plus_chunk(
        model, gen, signal, novelty):
    """After each chunk, what the next chunk's attention received begins with the reference's
    selection of what this one's received: "max" by the running maximum over every prompt
    query so far of each key's attention (ref.window_scores qreduce "max"), pooled; "far" the
    same from the queries W or more positions after the key (with ``novelty``, half the bound
    to each head's most novel keys first); "window" by ref.snapkv voted for by the last W queries; the last chunk keeps ref.snapkv's budget."""
    ids = _ids(gen, 1, N)
    cache = transformers.DynamicCache()
    with _eager_capture(model) as calls, torch.no_grad():
        with kp.hf.compress(model, "snapkv", BUDGET, **OPTS, prefill_max_held=BOUND,
                            prefill_chunk=CHUNK, prefill_signal=signal,
                            prefill_novelty=novelty) as comp:
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    # held after each chunk, by hand: 48 -> 40, 40+48 = 88 -> 40 (x3), 40+4 = 44 -> 24 (the budget)
    assert comp.peak_held == BOUND + CHUNK == 88
    assert (comp.prompt_len, comp.compressed_len) == (N, BUDGET)
    for i in range(N_LAYERS):
        chunks = calls[i]
        assert [c[0].shape[2] for c in chunks] == [48, 48, 48, 48, 4]
        assert [c[1].shape[2] for c in chunks] == [48, 88, 88, 88, 44]
        queries = torch.cat([c[0] for c in chunks], 2)  # every prompt query, in order
        seen, carried = 0, None
        for j, (q, k, _) in enumerate(chunks):
            seen += q.shape[2]
            window = queries[:, :, seen - W:seen]  # the last one spans two chunks
            if j == len(chunks) - 1:
                exp_k = ref.snapkv(window, k, k, BUDGET, **OPTS)[0]
                got = hf.cache_kv(cache, i)[0]
            else:
                idx, carried = (ref.snapkv(window, k, k, BOUND, **OPTS)[2].long(), None) \
                    if signal == "window" else \
                    _expected_max(q, k, carried, W if signal == "far" else 0, novelty)
                exp_k = torch.gather(k, 2, idx[..., None].expand(-1, -1, -1, k.shape[-1]))
                got = chunks[j + 1][1][:, :, :BOUND]  # what the next chunk attended over
            torch.testing.assert_close(got, exp_k.to(got.dtype), rtol=0, atol=0)


@contextlib.contextmanager
def _forward_inputs(model):
    """The input ids of every base-model forward and the positions of every rotary embedding
    (the forwards that run: a split prompt's outer call has none)."""
    ids, positions = [], []
    hooks = [model.model.register_forward_pre_hook(
                 lambda m, a, kw: ids.append(kw.get("input_ids")), with_kwargs=True),
             model.model.rotary_emb.register_forward_pre_hook(
                 lambda m, a, kw: positions.append(a[1] if len(a) > 1 else kw["position_ids"]),
                 with_kwargs=True)]
    try:
        yield ids, positions
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("bound", [BOUND, 100])
def test_reconstruct_keeps_each_chunks_repetition_maxima_and_drops_its_keys(model, gen, bound):
    """"reconstruct": after each chunk but the last, one forward repeats the chunk (the repeat
    prompt, quoting the 8 tokens before the chunk after the first, then the chunk's ids, at the
    positions after the chunk's), and the layer keeps what the reference selects by the
    running maximum of KVzip+'s scores, unpooled: each chunk key's largest eager attention weight from
    the repetition's queries, renormalised over the sinks, the chunk and the repetition,
    times its value's output norm over the query's input norm (test_hf_context's oracle);
    the repetition's own keys are gone before the next chunk; the peak holds one repetition.
    With a bound of 100 the first two chunks are held whole and their maxima carried."""
    ids = _ids(gen, 1, N)
    cache = transformers.DynamicCache()
    with _eager_capture(model, values=True) as calls, _attention_inputs(model) as inputs, \
            _forward_inputs(model) as (forwards, positions), torch.no_grad():
        with kp.hf.compress(model, "snapkv", BUDGET, **OPTS, prefill_max_held=bound,
                            prefill_chunk=CHUNK, prefill_signal="reconstruct",
                            repeat_prompt=PROMPT) as comp:
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    # the repetitions: 3 + 2 + 48 (the first), 2 + 8 + 2 + 48 (the next, quoting 8 tokens)
    assert comp.peak_held == bound + CHUNK + 60 == comp.prefill_bound.peak(
        CHUNK, repeat=PROMPT.extra_tokens())
    assert (comp.prompt_len, comp.compressed_len) == (N, BUDGET)
    assert torch.equal(forwards[0], ids) and len(forwards) == 10  # the split call, then 9
    for j in range(4):
        s, e = CHUNK * j, CHUNK * (j + 1)
        head = [5, 6, 7] if j == 0 else [8, 9] + ids[0, s - 8:s].tolist()
        assert forwards[2 * j + 2][0].tolist() == head + [10, 11] + ids[0, s:e].tolist()
        assert positions[2 * j].tolist() == [list(range(s, e))]
        assert positions[2 * j + 1].tolist() == [list(range(e, e + len(head) + 2 + CHUNK))]
    assert positions[8].tolist() == [list(range(4 * CHUNK, N))]
    for i in range(N_LAYERS):
        held = [48, 96, 144, 148, 104] if bound == 100 else [48, 88, 88, 88, 44]
        assert [c[1].shape[2] for c in calls[i][0::2]] == held
        chunks, repeats = calls[i][0::2], calls[i][1::2]
        carried = None
        for j, (rq, rk, rw, rv) in enumerate(repeats):
            n = chunks[j][1].shape[2]
            start, pos = n - CHUNK, torch.arange(rk.shape[2])
            assert rk.shape[2] == n + (53 if j == 0 else 60)
            assert torch.equal(rk[:, :, :n], chunks[j][1])  # the repetition attends over the held
            w = rw * ((pos < 4) | (pos >= start))  # the sinks, the chunk, the repetition
            w = (w / w.sum(-1, keepdim=True))[..., :n]
            per_key, per_query = _output_weights(model, rv[:, :, :n], i, inputs[i][2 * j + 1])
            w = w * per_key[:, :, None, :] * per_query[:, None, :, None]
            fresh = w.amax(2).view(1, HKV, -1, n).amax(2)  # over queries, then the KV group
            fresh[..., :start] = 0
            if carried is not None:
                fresh[..., :carried.shape[-1]] = torch.maximum(fresh[..., :carried.shape[-1]],
                                                               carried)
            if n <= bound:  # held whole, its maxima carried
                carried, exp_k = fresh, chunks[j][1]
            else:  # ranked unpooled, as KVzip ranks its maxima
                idx = ref.select_keep(fresh.float(), bound, n_sink=4, window=W).long()
                carried = fresh.gather(2, idx)
                exp_k = torch.gather(chunks[j][1], 2, idx[..., None].expand(-1, -1, -1, D))
            nxt = chunks[j + 1][1][:, :, :exp_k.shape[2]]  # what the next chunk attended over
            torch.testing.assert_close(nxt, exp_k, rtol=0, atol=0)
        window = torch.cat([c[0] for c in chunks], 2)[:, :, N - W:]  # the prompt's, not a repetition's
        exp_k = ref.snapkv(window, chunks[-1][1], chunks[-1][1], BUDGET, **OPTS)[0]
        torch.testing.assert_close(hf.cache_kv(cache, i)[0], exp_k, rtol=0, atol=0)


def test_reconstruct_compresses_each_row_as_it_would_alone(model, gen):
    ids = _ids(gen, 2, N)
    caches = [transformers.DynamicCache() for _ in range(3)]
    with torch.no_grad(), kp.hf.compress(model, "snapkv", BUDGET, **OPTS, prefill_max_held=BOUND,
                                         prefill_chunk=CHUNK, prefill_signal="reconstruct",
                                         repeat_prompt=PROMPT):
        for rows, cache in zip((ids, ids[:1], ids[1:]), caches):
            model(input_ids=rows, past_key_values=cache, use_cache=True)
    for i in range(N_LAYERS):
        both = hf.cache_kv(caches[0], i)[0]
        for r in range(2):
            torch.testing.assert_close(both[r:r + 1], hf.cache_kv(caches[r + 1], i)[0],
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("signal", ["max", "reconstruct"])
def test_layer_zero_holds_its_keys_at_their_original_positions(model, gen, signal):
    """Layer 0's keys depend on the token and its position only: every key the bounded
    prefill holds is the full prefill's key of some position, the sinks at 0..3 in order
    (none of a repetition's: those come after the prompt's positions)."""
    ids = _ids(gen, 1, N)
    full, cache = transformers.DynamicCache(), transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=full, use_cache=True)
        with kp.hf.compress(model, "snapkv", BUDGET, **OPTS, prefill_max_held=BOUND,
                            prefill_chunk=CHUNK, prefill_signal=signal,
                            repeat_prompt=PROMPT if signal == "reconstruct" else None):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    fk, k = hf.cache_kv(full, 0)[0][0], hf.cache_kv(cache, 0)[0][0]  # [Hkv, n, D], [Hkv, 24, D]
    for h in range(k.shape[0]):
        match = (k[h][:, None, :] == fk[h][None, :, :]).all(-1)     # [24, n]
        assert bool(match.any(1).all())
        pos = match.float().argmax(1)
        assert pos[:4].tolist() == [0, 1, 2, 3] and bool((pos[1:] > pos[:-1]).all())
        assert pos[-W:].tolist() == list(range(N - W, N))


def test_a_bound_above_the_prompt_generates_what_the_unbounded_prefill_does(model, gen):
    ids = _ids(gen, 1, N)
    with kp.hf.compress(model, "snapkv", BUDGET, **OPTS) as comp:
        plain = _gen(model, ids, n=12)
    with kp.hf.compress(model, "snapkv", BUDGET, **OPTS, prefill_max_held=N,
                        prefill_chunk=CHUNK) as bounded:
        chunked = _gen(model, ids, n=12)
    assert torch.equal(plain, chunked)
    assert (bounded.compressed_len, bounded.peak_held) == (comp.compressed_len, N)


def test_generate_after_a_bounded_prefill_continues_at_the_original_positions(model, gen):
    """A prompt 5x the bound: the generated tokens are those of a manual decode on the
    bounded cache whose positions the hooks count themselves (n, n+1, ...: generate's come
    from its mask), and the peak stays the bound plus one chunk."""
    ids = _ids(gen, 1, N)
    cache = transformers.DynamicCache()
    with kp.hf.compress(model, "snapkv", BUDGET, **OPTS, prefill_max_held=BOUND,
                        prefill_chunk=CHUNK) as comp, torch.no_grad():
        out = _gen(model, ids, n=6)
        manual = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        tokens = [int(manual.argmax(-1))]
        for t in range(5):
            step = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                         use_cache=True)
            tokens.append(int(step.logits[0, -1].argmax()))
    assert out[0, N:].tolist() == tokens
    assert comp.peak_held == BOUND + CHUNK


@pytest.mark.parametrize("policy,why", [("streaming", "fixed-capacity"), ("full", "every token"),
                                        ("h2o", "fixed-capacity")])
def test_a_policy_without_a_chunk_selection_is_refused(model, policy, why):
    with pytest.raises(ValueError, match=f"prefill_max_held: policy '{policy}'.*{why}"):
        with kp.hf.compress(model, policy, 0.2, prefill_max_held=BOUND):
            pass


def test_bad_bounded_prefill_arguments(model, gen):
    with pytest.raises(ValueError, match="prefill_chunk: given without prefill_max_held"):
        with kp.hf.compress(model, "snapkv", 0.2, prefill_chunk=CHUNK):
            pass
    with pytest.raises(ValueError, match="prefill_max_held must be an int >= 1"):
        with kp.hf.compress(model, "snapkv", 0.2, prefill_max_held=0):
            pass
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        with kp.hf.compress(model, "snapkv", 0.2, prefill_max_held=BOUND, prefill_chunk=0):
            pass
    ids = _ids(gen, 2, N)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with kp.hf.compress(model, "snapkv", BUDGET, **OPTS, prefill_max_held=BOUND,
                        prefill_chunk=CHUNK):
        with pytest.raises(ValueError, match="attention_mask: a bounded prefill"):
            _gen(model, ids, mask)
        with pytest.raises(ValueError, match="output_hidden_states: a bounded prefill"):
            model(input_ids=ids[:1], output_hidden_states=True)
        with pytest.raises(ValueError, match=r"attention_mask: a bounded prefill .* takes a \[B, n\]"):
            model(input_ids=ids[:1], attention_mask=mask[:1, None, None, :].float())
        with pytest.raises(ValueError, match="token_type_ids: a bounded prefill"):
            model(input_ids=ids[:1], token_type_ids=torch.zeros_like(ids[:1]))
        with torch.no_grad():
            short = _gen(model, ids[:1, :CHUNK], n=4)  # after the refusals: not split
            out = model(input_ids=ids[:1])  # no cache given: one is made, and held bounded
    assert out.past_key_values.get_seq_length() == BUDGET
    with kp.hf.compress(model, "snapkv", BUDGET, **OPTS):  # what the unbounded compressor gives
        assert torch.equal(short, _gen(model, ids[:1, :CHUNK], n=4))
    assert "forward" not in model.model.__dict__  # detached: the class's forward again
    with pytest.raises(ValueError, match="repeat_prompt: only a bounded prefill with "
                                         "prefill_signal='reconstruct'"):
        with kp.hf.compress(model, "snapkv", BUDGET, **OPTS, prefill_max_held=BOUND,
                            repeat_prompt=PROMPT):
            pass
    skipping = kp.hf.RepeatPrompt(PROMPT.first, PROMPT.next, PROMPT.suffix, skip=3)
    for bad in (skipping, [5, 6, 7]):
        with pytest.raises(ValueError, match="repeat_prompt: expected a RepeatPrompt with skip 0"):
            with kp.hf.compress(model, "snapkv", BUDGET, **OPTS, prefill_max_held=BOUND,
                                prefill_signal="reconstruct", repeat_prompt=bad):
                pass
    with pytest.raises(ValueError, match="tokenizer: builds the repeat prompt of prefill_signal="):
        with kp.hf.compress(model, "snapkv", BUDGET, **OPTS, prefill_max_held=BOUND,
                            tokenizer=object()):
            pass
    with pytest.raises(ValueError, match="tokenizer: give it or repeat_prompt, not both"):
        with kp.hf.compress(model, "snapkv", BUDGET, **OPTS, prefill_max_held=BOUND,
                            prefill_signal="reconstruct", tokenizer=object(), repeat_prompt=PROMPT):
            pass
    with pytest.raises(ValueError, match="tokenizer: kvzip builds its repeat prompt .* pass "
                                         "repeat_prompt="):  # the tiny model has no tokenizer
        kp.hf.KVCompressor(model, "snapkv", BUDGET, options=kp.policy.Options(**OPTS),
                           prefill_max_held=BOUND, prefill_signal="reconstruct")
    with kp.hf.compress(model, "snapkv", BUDGET, **OPTS, prefill_max_held=BOUND,
                        prefill_chunk=CHUNK, prefill_signal="reconstruct", repeat_prompt=PROMPT):
        with pytest.raises(ValueError, match="inputs_embeds: prefill_signal 'reconstruct'"):
            model(inputs_embeds=model.model.embed_tokens(ids[:1]))
