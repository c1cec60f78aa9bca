"""What every engine integration does with a policy, written once for kp.hf and kp.vllm
(docs/integration.md lists the rest of an integration's duties).

* :func:`keep_last`: the observed queries. A policy whose ``evidence`` is
  ``"window_queries"`` scores with the last ``window`` post-RoPE queries a layer saw: a
  prompt's (SnapKV voting, possibly over several prefill chunks or forwards) or a request's
  recent decode steps (the decode-time rule). The recorded ones followed by a forward's, cut to
  the last ``keep`` and copied, so no view keeps a whole prefill's queries alive.
* :func:`kept_indices`: which of a layer's tokens to keep, from those queries and the keys:
  the policy's fused selection (:meth:`~kvprune_cuda.policy.Policy.select_indices`) where it
  has one, else its scores ranked by :func:`kvprune_cuda.select_keep` after its sinks and
  window.

Torch-only.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvprune_cuda import policy as policies
from kvprune_cuda._ops import select_keep


def keep_last(recorded: Optional[torch.Tensor], new: torch.Tensor, keep: int,
              dim: int) -> torch.Tensor:
    """The last ``keep`` queries of ``recorded`` (None: none yet) followed by ``new`` along the
    query dimension ``dim`` (kp.hf: [B, Hq, q, D], dim 2; kp.vllm: [q, Hq, D], dim 0), a copy."""
    n = new.shape[dim]
    new = new.narrow(dim, n - min(keep, n), min(keep, n))
    room = keep - new.shape[dim]  # for the recorded ones' tail
    if recorded is None or room == 0:
        return new.clone()
    r = recorded.shape[dim]
    return torch.cat([recorded.narrow(dim, r - min(room, r), min(room, r)), new], dim)


def kept_indices(policy: "policies.Policy", queries: Optional[torch.Tensor], keys: torch.Tensor,
                 kept: int, *, scale: Optional[float] = None) -> torch.Tensor:
    """int32 [B, Hkv, kept]: ascending positions of ``keys`` [B, Hkv, N, D] (post-RoPE, last dim
    contiguous) to keep per KV head, ``kept < N``: the sinks, the last ``window`` and the top
    scores of ``policy`` from ``queries`` [B, Hq, M, D] (its last ``observed_queries(N)`` are
    used; None when it observes none) with the softmax ``scale`` (None: 1/sqrt(D)): the
    policy's fused selection where it has one, else its ``score`` ranked."""
    w = policy.observed_queries(keys.shape[2])
    m = 0 if queries is None else queries.shape[2]
    if m < w:
        raise ValueError(f"queries: {m} queries, the policy observes the last {w}")
    window = None if not w else queries[:, :, m - w:].contiguous()
    fused = policy.select_indices(window, keys, kept, scale=scale)
    if fused is not None:
        return fused
    scores = policy.score(window, keys, scale=scale)
    return select_keep(scores, kept, n_sink=policy.n_sink, window=policy.window)
