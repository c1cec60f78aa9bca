"""A policy written outside kvprune_cuda, as a user would (docs/policy.md, "Write your own
policy"): not a subclass of a built-in, it scores by the last window queries."""

from dataclasses import dataclass
from typing import ClassVar

import torch

import kvprune_cuda as kp


@kp.policy.register
@dataclass(frozen=True)
class QueryKeyMax(kp.policy.Policy):
    """Keeps the keys that some recent query dots most strongly with: the largest ``q . k``
    over the last ``window`` queries and the query heads of each KV group."""

    name: ClassVar[str] = "qk-max"
    evidence: ClassVar[str] = "window_queries"

    def score(self, queries, keys, *, scale=None, seq_lens=None):
        b, hq, w, d = queries.shape                   # [B, Hq, W, D]
        hkv, n = keys.shape[1], keys.shape[2]         # keys [B, Hkv, n, D]
        q = queries.float().reshape(b, hkv, hq // hkv * w, d)
        return torch.einsum("bgqd,bgnd->bgqn", q, keys.float()).amax(dim=2)  # fp32 [B, Hkv, n]
