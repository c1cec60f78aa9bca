"""Selection and compaction: how many tokens each layer (or KV head) keeps, which ones, and
the compressed cache layer that holds them.

One budget's walk: :func:`compress_cache` resolves it once against the context length
(``policy.kept_tokens``), then per scope -- "layer": every layer keeps that count;
"global": :func:`kvprune_cuda.layer_budgets` shares ``L x`` it over the layers by the
policy's scores; "head": :func:`kvprune_cuda.head_budgets` shares it over every (layer, row,
KV head) -- and :func:`compress_layer` / :func:`compress_heads` select and compact.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

import kvprune_cuda as kp
from kvprune_cuda import policy as policies
from kvprune_cuda.hf import scoring
from kvprune_cuda.hf._compat import cache_kv, set_cache_kv
from kvprune_cuda.hf.fixed_layer import fixed_layer
from kvprune_cuda.hf.ragged_layer import ragged_layer
from kvprune_cuda.hf.scoring import FIXED, MASKED, RAGGED, LayerState


def _fused(st: LayerState, policy: "policies.Policy", i: int, k: torch.Tensor,
           v: torch.Tensor, kept: int, lens: Optional[torch.Tensor]):
    """The policy's fused selection (:meth:`kvprune_cuda.policy.Policy.select`) of ``kept`` of
    layer ``i``'s unpadded ``k``, ``v`` [B, Hkv, n, D] by its observed window queries; None:
    none."""
    q = scoring.window_queries(st, policy, i) if policy.evidence == "window_queries" else None
    return policy.select(q, k, v, kept, seq_lens=lens)


def compress_layer(st: LayerState, cache, i: int, policy: "policies.Policy", kept: int,
                   prefill_valid: Optional[torch.Tensor],
                   scores: Optional[torch.Tensor] = None) -> int:
    """Compresses layer ``i`` of ``cache`` (uncompressed) to ``kept`` tokens per KV head;
    returns the tokens the layer then holds per head. Each head keeps ``kp.select_keep`` of
    ``scores`` (fp32 [B, Hkv, n], unpadded rows; default the policy's own: its fused
    selection where it has one, :meth:`~kvprune_cuda.policy.Policy.select`: snapkv's
    ``kp.snapkv``, streaming's ``kp.streaming``). Fixed-capacity policies (streaming,
    h2o) become a FixedCapacityLayer of ``kept`` slots; the others stay dense, with
    ``st.slot_valid`` marking the holes of left-padded rows."""
    k, v = cache_kv(cache, i)
    b, hkv, n, _ = k.shape
    pad = scoring.left_padding(prefill_valid, n)
    fixed = policy.fixed_capacity
    if kept >= n and not fixed:
        valid = (torch.ones(b, n, dtype=torch.bool, device=k.device)
                 if prefill_valid is None or prefill_valid.shape[1] != n else prefill_valid)
        st.slot_valid, st.layout = valid[:, None, :].expand(b, hkv, n).clone(), MASKED
        st.drop_evidence()
        return n
    lens = None
    if pad is not None:
        k, v = scoring.shift_rows(k, pad, 2), scoring.shift_rows(v, pad, 2)
        lens = (n - pad).to(torch.int32)
    if kept >= n:  # streaming / h2o with room to spare: everything, the cache fills later
        pos = torch.arange(n, device=k.device, dtype=torch.int32).expand(b, hkv, n)
        kk, vv, idx = k, v, (pos if lens is None else
                             torch.where(pos < lens[:, None, None], pos, -1))
    elif scores is None and (fused := _fused(st, policy, i, k, v, kept, lens)) is not None:
        kk, vv, idx = fused
    else:
        if scores is None and policy.evidence not in scoring.RECORDED:  # scored on the unpadded k
            s = scoring.selection_scores(st, policy, k, i, seq_lens=lens)
        else:  # recorded or given: in the cache's left-padded layout
            s = scoring.selection_scores(st, policy, k, i) if scores is None else scores
            s = s if pad is None else scoring.shift_rows(s, pad, 2)
        idx = kp.select_keep(s.contiguous(), kept, n_sink=policy.n_sink, window=policy.window,
                             seq_lens=lens)
        kk, vv = kp.gather_kv(k, v, idx)
    h2o = None
    if policy.evidence == "attention":  # the kept slots' accumulated attention goes along
        s = scoring.recorded_evidence(st, policy, i)
        s = s if pad is None else scoring.shift_rows(s, pad, 2)
        h2o = torch.gather(s, 2, idx.clamp_min(0).long()) * (idx >= 0)
    st.drop_evidence()
    if not fixed:
        set_cache_kv(cache, i, kk.contiguous(), vv.contiguous())
        st.slot_valid, st.layout = idx >= 0, MASKED
        return min(kept, n)
    seen = torch.full((b,), n, dtype=torch.int32, device=k.device) if lens is None else lens
    cache.layers[i] = fixed_layer(kk, vv, idx, seen, capacity=kept, n_sink=policy.n_sink,
                                  recent=policy.window, h2o_scores=h2o)
    st.slot_valid, st.layout = None, FIXED
    return min(kept, n)


def keep_positions(st: LayerState, cache, i: int, idx: torch.Tensor) -> None:
    """Layer ``i`` of ``cache`` (dense, rows without padding) keeps the positions ``idx``
    (int32 [B, Hkv, k], ascending, every one valid); a bounded prefill's running maxima
    (``st.bound``) follow them."""
    k, v = cache_kv(cache, i)
    kk, vv = kp.gather_kv(k, v, idx)
    set_cache_kv(cache, i, kk, vv)
    if st.bound is not None:
        st.bound = st.bound.gather(2, idx.long())
    st.slot_valid, st.layout = idx >= 0, MASKED


def compress_heads(st: LayerState, cache, i: int, policy: "policies.Policy",
                   counts: torch.Tensor, scores: torch.Tensor,
                   prefill_valid: Optional[torch.Tensor]) -> None:
    """Compresses layer ``i`` (uncompressed, unpadded rows) to ``counts[b, h]`` tokens per KV
    head (int64 [B, Hkv]), each head keeping its top ``scores`` (fp32 [B, Hkv, n]); the layer
    becomes a RaggedLayer that frees the rest."""
    k, v = cache_kv(cache, i)
    if scoring.left_padding(prefill_valid, k.shape[2]) is not None:
        raise ValueError("attention_mask: per-head budgets need rows without padding")
    cache.layers[i] = ragged_layer(k, v, scores, counts, n_sink=policy.n_sink,
                                   window=policy.window)
    st.slot_valid, st.layout = cache.layers[i].valid(), RAGGED
    st.drop_evidence()


def compress_cache(states: Sequence[LayerState], cache, policy: "policies.Policy",
                   budget: Union[int, float], scope: str,
                   prefill_valid: Optional[torch.Tensor]) -> Optional[int]:
    """Compresses every layer of ``cache`` (uncompressed, ``n`` tokens) to ``budget`` under
    ``scope`` (module doc); returns the tokens each layer holds per head when they are all
    equal, else None."""
    if scope not in policies.SCOPES:
        raise ValueError(f"budget_scope: expected one of {policies.SCOPES}, got {scope!r}")
    if scope != "layer" and not policy.ranks:
        raise ValueError(f"budget_scope: {scope!r} ranks scores; policy {policy.name!r} has none")
    n = cache_kv(cache, 0)[0].shape[2]
    kept = policy.kept_tokens(n, budget)
    layers = range(len(states))
    if scope == "layer":
        held = {compress_layer(states[i], cache, i, policy, kept, prefill_valid) for i in layers}
        return held.pop() if len(held) == 1 else None
    if scoring.left_padding(prefill_valid, n) is not None:
        raise ValueError(f"attention_mask: budget_scope {scope!r} needs rows without padding")
    scores = [scoring.selection_scores(states[i], policy, cache_kv(cache, i)[0], i)
              for i in layers]
    if scope == "head":
        counts = kp.head_budgets(scores, kept, n_sink=policy.n_sink, window=policy.window)
        for i in layers:
            compress_heads(states[i], cache, i, policy, counts[i], scores[i], prefill_valid)
        return None
    per_layer = kp.layer_budgets(scores, kept, n_sink=policy.n_sink, window=policy.window)
    for i in layers:  # selects from the scores just ranked
        compress_layer(states[i], cache, i, policy, per_layer[i], prefill_valid, scores[i])
    return per_layer[0] if len(set(per_layer)) == 1 else None
