"""kp.hf's decode-time rule (:class:`kvprune_cuda.policy.DecodeRule`) after a forward past the
prompt: record the decode evidence the rule scores by, and compress the layer when it says
so (snapkv voting with the last ``window`` decode queries, h2o by each held key's attention
summed over the decode forwards). Positions are never changed."""

from __future__ import annotations

from typing import Optional

import torch

import kvprune_cuda as kp
from kvprune_cuda import policy as policies
from kvprune_cuda.engine import kept_indices
from kvprune_cuda.hf import scoring
from kvprune_cuda.hf._compat import cache_kv, set_cache_kv


def decode_step(rule: "policies.DecodeRule", st: "scoring.LayerState", module, cache, i: int,
                hs: torch.Tensor, position_embeddings: tuple, generated: int) -> Optional[int]:
    """After a forward of ``hs`` [B, q, hidden] (layer ``i``'s input, ``module`` its attention)
    that brought the generated tokens to ``generated``: records the rule's evidence in ``st``
    and compresses the layer's entry of ``cache`` when the rule says so; returns the tokens
    the layer then holds (None: not compressed)."""
    q_len = hs.shape[1]
    p, scale = rule.policy, getattr(module, "scaling", None)
    k, v = cache_kv(cache, i)
    n = p.observed_queries(q_len)  # snapkv: its window; h2o: every query
    if n:
        cos, sin = position_embeddings
        qn = scoring.post_rope_queries(module, hs[:, q_len - n:], cos[:, q_len - n:],
                                       sin[:, q_len - n:]).to(k.dtype)
        if rule.accumulates:  # h2o: from the first generated token on (st.h2o restarts)
            past = st.h2o if generated > q_len else None
            st.h2o = rule.accumulate(past, qn, k, scale=scale)
        else:
            scoring.record_queries(st, qn, p.window)
    kept = rule.compresses(generated, q_len, k.shape[2])
    if kept is None:
        return None
    if st.layout not in (scoring.FULL, scoring.MASKED) or (
            st.slot_valid is not None and not bool(st.slot_valid.all())):
        raise ValueError("attention_mask: decode-time compression needs rows without "
                         "padding and one token count per layer")
    if rule.accumulates:  # h2o: by the sums
        idx = kp.select_keep(st.h2o, kept, n_sink=p.n_sink, window=p.window)
    else:
        idx = kept_indices(p, st.queries, k, kept, scale=scale)
    kk, vv = kp.gather_kv(k, v, idx)
    set_cache_kv(cache, i, kk.contiguous(), vv.contiguous())
    if rule.accumulates:  # the kept keys keep their sums
        st.h2o = st.h2o.gather(2, idx.long())
    st.slot_valid, st.layout = idx >= 0, scoring.MASKED
    return kept
