"""What an integration records for a policy's evidence, written once for kp.hf and kp.vllm.

A policy whose ``evidence`` is ``"window_queries"`` scores with the last ``window`` post-RoPE
queries a layer saw: a prompt's (SnapKV voting, possibly over several prefill chunks or
forwards) or a request's recent decode steps (the decode-time rule). :func:`keep_last` keeps
them: the recorded ones followed by a forward's, cut to the last ``keep`` and copied, so no view
keeps a whole prefill's queries alive. Torch-only.
"""

from __future__ import annotations

from typing import Optional

import torch


def keep_last(recorded: Optional[torch.Tensor], new: torch.Tensor, keep: int,
              dim: int) -> torch.Tensor:
    """The last ``keep`` queries of ``recorded`` (None: none yet) followed by ``new`` along the
    query dimension ``dim`` (kp.hf: [B, Hq, q, D], dim 2; kp.vllm: [q, Hq, D], dim 0), a copy."""
    n = new.shape[dim]
    new = new.narrow(dim, n - min(keep, n), min(keep, n))
    both = new if recorded is None else torch.cat([recorded, new], dim)
    m = both.shape[dim]
    return both.narrow(dim, m - min(keep, m), min(keep, m)).clone()
