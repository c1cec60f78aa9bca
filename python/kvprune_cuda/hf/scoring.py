"""What the hooks record per layer, and the scores a policy ranks a layer's keys by.

Per layer (:class:`LayerState`): the last observed post-RoPE queries (a copy, so no view
keeps a whole prefill's queries alive), h2o's accumulated attention and kvzip's
reconstruction maxima, and, once the layer is compressed, how its cache is laid out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvprune_cuda import policy as policies
from kvprune_cuda.engine import keep_last
from kvprune_cuda.hf._compat import rope
from kvprune_cuda.hf.memory import tensor_bytes

# LayerState.layout: how a layer's cache holds the context
FULL = "full"        # uncompressed: every slot valid, the cache grows
MASKED = "masked"    # compressed dense [B, Hkv, k, D]; slot_valid marks padding rows' holes
FIXED = "fixed"      # a FixedCapacityLayer (streaming / h2o): the layer fills its own mask
RAGGED = "ragged"    # a RaggedLayer (a count per KV head); slot_valid is its padding mask


@dataclass
class LayerState:
    """One layer's recorded evidence and, once compressed, its layout."""

    queries: Optional[torch.Tensor] = None       # [B, Hq, <=W, D] the last observed queries
    h2o: Optional[torch.Tensor] = None           # fp32 [B, Hkv, L] accumulated attention
    kvzip: Optional[torch.Tensor] = None         # fp32 [B, Hkv, n] reconstruction maxima
    slot_valid: Optional[torch.Tensor] = None    # bool [B, Hkv, L] once compressed (masked, ragged)
    layout: str = FULL
    bound: Optional[torch.Tensor] = None         # fp32 [B, Hkv, L] a bounded prefill's maxima

    @property
    def compressed(self) -> bool:
        return self.layout != FULL

    def nbytes(self) -> int:
        return tensor_bytes((self.queries, self.h2o, self.kvzip, self.slot_valid, self.bound))

    def drop_evidence(self) -> None:
        self.queries = self.h2o = self.kvzip = self.bound = None

    def copy(self) -> "LayerState":
        """A copy sharing the tensors (they are replaced, never written in place)."""
        return LayerState(self.queries, self.h2o, self.kvzip, self.slot_valid, self.layout,
                          self.bound)


def post_rope_queries(module, hs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Post-RoPE queries [B, Hq, n, D] of ``hs`` [B, n, hidden], as the module computes them."""
    b, n = hs.shape[:2]
    q = module.q_proj(hs).view(b, n, -1, module.head_dim)
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    return rope(module)(q, q, cos, sin)[0]


def shift_rows(x: torch.Tensor, shift: torch.Tensor, dim: int) -> torch.Tensor:
    """out[b, ..., j, ...] = x[b, ..., (j + shift[b]) mod N, ...] along ``dim`` (left -> right padding)."""
    n = x.shape[dim]
    idx = (torch.arange(n, device=x.device)[None, :] + shift[:, None]) % n  # [B, N]
    shape = [1] * x.dim()
    shape[0], shape[dim] = x.shape[0], n
    return torch.gather(x, dim, idx.view(shape).expand_as(x))


def left_padding(prefill_valid: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
    """int64 [B]: each row's left padding of an uncompressed cache of ``n`` tokens whose
    validity is ``prefill_valid`` (bool [B, n]); None if no row is padded."""
    pv = prefill_valid
    if pv is None or pv.shape[1] != n or bool(pv.all()):
        return None
    pad = pv.shape[1] - pv.sum(1)
    ok = torch.arange(pv.shape[1], device=pv.device)[None, :] >= pad[:, None]
    if not torch.equal(ok, pv):
        raise ValueError("attention_mask: only left padding is supported")
    return pad


def record_queries(st: LayerState, qn: torch.Tensor, keep: int) -> None:
    """Keeps the last ``keep`` of the observed queries ``qn`` [B, Hq, q, D] (of this and
    earlier forwards), copied."""
    st.queries = keep_last(st.queries, qn, keep, 2)


def accumulate_h2o(st: LayerState, h2o: "policies.H2O", qn: torch.Tensor, k: torch.Tensor,
                   pad: Optional[torch.Tensor]) -> None:
    """Adds the attention of ``qn`` [B, Hq, q, D] over ``k`` [B, Hkv, L, D] to ``st.h2o``."""
    if pad is None:
        s = h2o.score(qn, k)
    else:
        lens = (k.shape[2] - pad).to(torch.int32)
        s = shift_rows(h2o.score(qn, shift_rows(k, pad, 2), seq_lens=lens), -pad, 2)
    if st.h2o is not None and st.h2o.shape[2] <= s.shape[2]:
        s[:, :, : st.h2o.shape[2]] += st.h2o
    st.h2o = s


def fold_reconstruction(st: LayerState, kvzip: "policies.KVzip", qn: torch.Tensor,
                        lse: Optional[torch.Tensor], k: torch.Tensor, n: int,
                        span: Optional[tuple[int, int]], scale: Optional[float],
                        weights: Optional[Callable[[int, int], tuple]] = None) -> None:
    """One reconstruction chunk's maxima into ``st.kvzip`` (fp32 [B, Hkv, n]).

    ``qn`` [B, Hq, r, D] the chunk's reconstruction queries, ``k`` [B, Hkv, n + r, D] the
    context and their own keys; ``lse`` fp32 [B, Hq, r] their normaliser over all of ``k`` when
    the model's attention gave it. Softmax "all": over every key the query sees; "chunk": over
    the sinks, the chunk ``span = (start, end)`` and the reconstruction keys (two passes).
    ``weights`` (kvzip's ``weight="output"``): ``(start, end) ->`` the weights of the scored
    keys ``[start, end)``, fp32 [B, Hq, end - start], and of the queries, fp32 [B, Hq, r]
    (:func:`~kvprune_cuda.hf.reconstruct.output_weights`)."""
    if st.kvzip is None:
        st.kvzip = torch.zeros(k.shape[0], k.shape[1], n, dtype=torch.float32, device=k.device)
    if kvzip.softmax == "all":
        kvzip.score(qn.to(k.dtype), k, lse=lse, scale=scale, out=st.kvzip,
                    weights=None if weights is None else weights(0, n))
        return
    if span is None:
        raise RuntimeError("softmax 'chunk': each reconstruction forward needs its span "
                           "(score_reconstruction's forward_chunks yields it)")
    s, e = span
    sink, r = min(kvzip.n_sink, s), qn.shape[2]
    keys = torch.cat([k[:, :, s:e], k[:, :, :sink], k[:, :, k.shape[2] - r:]], 2)
    chunk = st.kvzip[:, :, s:e].contiguous()  # the chunk's keys come first: out's M = e - s
    kvzip.score(qn.to(k.dtype), keys, scale=scale, out=chunk,
                weights=None if weights is None else weights(s, e))
    st.kvzip[:, :, s:e] = chunk


def window_queries(st: LayerState, policy: "policies.Policy", layer: int) -> torch.Tensor:
    """[B, Hq, W, D]: the last ``policy.window`` queries recorded for ``layer``."""
    if st.queries is None or st.queries.shape[2] < policy.window:
        raise RuntimeError(f"policy: {policy.name!r} needs {policy.window} observed queries "
                           f"in layer {layer}; the compressor recorded "
                           f"{0 if st.queries is None else st.queries.shape[2]}")
    return st.queries[:, :, st.queries.shape[2] - policy.window:]


RECORDED = ("attention", "reconstruction")  # evidence whose scores the forwards accumulated


def recorded_evidence(st: LayerState, policy: "policies.Policy", layer: int) -> torch.Tensor:
    """fp32 [B, Hkv, n]: the evidence ``policy`` recorded over the forwards (one of
    :data:`RECORDED`: h2o's accumulated attention, kvzip's reconstruction maxima), in the
    cache's own layout."""
    recorded = dict(zip(RECORDED, (st.h2o, st.kvzip)))[policy.evidence]
    if recorded is None:
        raise RuntimeError(f"policy: {policy.name!r} has no {policy.evidence} scores recorded "
                           f"for layer {layer} (attention: not observed by the compressor; "
                           "reconstruction: none run)")
    return recorded


def selection_scores(st: LayerState, policy: "policies.Policy", k: torch.Tensor, layer: int,
                     seq_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 [B, Hkv, n]: the scores ``policy`` ranks a layer's uncompressed keys by: the window
    queries' pooled vote (snapkv), recency (streaming), computed now from ``k`` [B, Hkv, n, D]
    (rows valid up to ``seq_lens``, right padding; None: all); from the evidence
    :data:`RECORDED` over the forwards (h2o, kvzip: :meth:`Policy.rank_recorded`, which
    also gets ``k``), in the cache's own layout."""
    if policy.evidence == "window_queries":
        return policy.score(window_queries(st, policy, layer), k, seq_lens=seq_lens)
    if policy.evidence in RECORDED:
        return policy.rank_recorded(recorded_evidence(st, policy, layer), k)
    return policy.score(None, k, seq_lens=seq_lens)
