"""What kp.hf's objects report holding is what they hold.

Every tensor storage reachable from a CompressedContext, a ScoredContext or a
``kp.hf.compress`` compressor after ``generate`` (the model's own parameters and buffers
aside) is counted, each storage once and whole (``kp.hf.memory.reachable_bytes``: a walk of
the object graph, independent of the objects' own bookkeeping; its own test below), and
compared with the object's ``nbytes``.
The only slack allowed is ``SLACK`` bytes for small bookkeeping tensors (none today).
Skipped without ``transformers``.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvprune_cuda as kp  # noqa: E402
from test_hf import _ids, model  # noqa: E402,F401  (model: the module-scoped tiny Qwen2)
from kvprune_cuda.hf.memory import reachable_bytes  # noqa: E402
from test_hf_context import PROMPT, SINKS  # noqa: E402

SLACK = 0
N = 200  # large against the window, so a leak of the context's queries cannot hide


def _context(model, ctx, policy, scope, window):
    kw = dict(n_sink=SINKS, window=window, chunk_size=64,
              repeat_prompt=PROMPT if policy == "kvzip" else None)
    return kp.hf.compress_context(model, ctx, policy, 0.1, budget_scope=scope, **kw)


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("policy,scope", [
    ("kvzip", "head"), ("kvzip", "global"), ("kvzip", "layer"), ("snapkv", "head"),
    ("snapkv", "global"), ("snapkv", "layer"), ("h2o", "head"), ("h2o", "global"),
    ("h2o", "layer"), ("streaming", "layer"), ("full", "layer")])
def test_compressed_context_holds_what_it_reports(model, gen, policy, scope, window):
    if policy == "snapkv" and window == 0:
        pytest.skip("snapkv votes with its window: needs window >= 1")
    ctx = _ids(gen, 1, N)
    kvc = _context(model, ctx, policy, scope, window)
    got = reachable_bytes(kvc)
    assert kvc.nbytes <= got <= kvc.nbytes + SLACK, (got, kvc.nbytes)
    kv = sum(kp.hf.memory.layer_bytes(kvc.cache(), i) for i in range(len(kvc.bytes_per_layer)))
    assert kvc.nbytes < 2 * kv  # what is not K/V (positions, masks, ids) stays small
    kvc.generate(_ids(gen, 1, 4), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert reachable_bytes(kvc) == got  # answering a question leaves nothing behind


def test_compressed_context_is_smaller_than_the_dense_cache(model, gen):
    """The 10 % context holds about a tenth of the dense K/V (kvzip used to keep every
    context query alive, several times the dense cache)."""
    ctx = _ids(gen, 1, N)
    dense = transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=ctx, past_key_values=dense, use_cache=True)
    full = kp.hf.kv_bytes(dense)
    for policy in ("kvzip", "snapkv", "h2o"):
        kvc = _context(model, ctx, policy, None, 0 if policy == "kvzip" else 8)
        assert reachable_bytes(kvc) < 0.2 * full, policy


def test_scored_context_holds_what_it_reports(model, gen):
    ctx = _ids(gen, 1, N)
    scored = kp.hf.score_context(model, ctx, ("kvzip", "snapkv", "h2o"), n_sink=SINKS,
                                 chunk_size=64, repeat_prompt=PROMPT)
    got = reachable_bytes(scored)
    assert scored.nbytes <= got <= scored.nbytes + SLACK, (got, scored.nbytes)
    before = got
    for policy in ("kvzip", "snapkv", "h2o", "streaming"):
        scored.compress(0.1, policy=policy)
    assert reachable_bytes(scored) == before  # compressing leaves the scored context as it was
    ext = scored.extend(_ids(gen, 1, 12))  # its own K/V of N + 12 tokens, kvzip's scores dropped
    got = reachable_bytes(ext)
    assert ext.nbytes <= got <= ext.nbytes + SLACK, (got, ext.nbytes)
    assert reachable_bytes(scored) == before  # extending leaves it as it was too


@pytest.mark.parametrize("policy", ["full", "streaming", "snapkv", "h2o"])
def test_compressor_holds_what_it_reports_after_generate(model, gen, policy):
    ids = _ids(gen, 2, N)
    with kp.hf.compress(model, policy=policy, budget=0.1, n_sink=SINKS, window=8) as comp:
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                           pad_token_id=0)
    got = reachable_bytes(comp)
    assert comp.nbytes <= got <= comp.nbytes + SLACK, (got, comp.nbytes)
    assert got < 2 * 2 * 32 * N  # masks and window queries only: no cache, no prompt queries


def test_reachable_bytes_counts_whole_storages_once():
    big = torch.zeros(1000)
    holder = {"view": big[:10], "again": big[5:], "other": [torch.ones(3, dtype=torch.int64)]}
    assert reachable_bytes(holder) == 1000 * 4 + 3 * 8
    assert reachable_bytes({"model": torch.nn.Linear(4, 4)}) == 0  # a module: not entered
