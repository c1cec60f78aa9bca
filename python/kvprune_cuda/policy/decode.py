"""The decode-time rule: every ``interval`` generated tokens, a cache holding more than
``max_held`` tokens is compressed back to ``max_held`` by a policy's selection
(:class:`DecodeRule`, :func:`make_decode`); the same in kp.hf and kp.vllm."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from kvprune_cuda._args import check_int, check_str
from kvprune_cuda.policy.base import Options, Policy
from kvprune_cuda.policy.registry import make

DECODE_POLICIES = ("streaming", "snapkv", "h2o")


@dataclass(frozen=True)
class DecodeRule:
    """Periodic decode-time compression, the same in kp.hf and kp.vllm.

    After a forward that brings the request's generated tokens in the cache (prompt positions
    excluded) to ``g`` from ``g - q_len``, if ``g`` crossed a multiple of ``interval`` and the
    cache holds more than :meth:`target` tokens, it is compressed to :meth:`target` by
    ``policy``'s selection over the held tokens: ``"streaming"`` keeps the sinks and the most
    recent tokens; ``"snapkv"`` scores every held key by the last ``window`` decode queries
    (SnapKV voting over the request's own recent decode queries, pooled) and keeps the sinks,
    the last ``window`` tokens and the top scores; ``"h2o"`` keeps the sinks, the last
    ``window`` tokens and the held keys with the largest accumulated attention
    (:meth:`accumulate`: every decode query's probabilities, from the forward of the first
    generated token on; the prompt's queries do not count, so the rule is the same after any
    prompt policy). Positions are never changed (kept keys keep their rotation).
    ``policy.budget`` is ``max_held``.
    """

    policy: Policy
    interval: int

    def __post_init__(self) -> None:
        check_str("decode", self.policy.name, DECODE_POLICIES)
        check_int("interval", self.interval, 1)
        if self.policy.evidence == "window_queries" and self.interval < self.policy.window:
            raise ValueError(f"interval: {self.interval} < window {self.policy.window}; snapkv "
                             "votes with the last window decode queries, all after the last "
                             "compression")

    @property
    def max_held(self) -> int:
        return self.policy.budget

    @property
    def accumulates(self) -> bool:
        """Whether every decode forward adds to the held keys' scores (h2o), rather than
        the last ``window`` decode queries voting at compression time (snapkv)."""
        return self.policy.evidence == "attention"

    def accumulate(self, scores: Optional[torch.Tensor], queries: torch.Tensor,
                   keys: torch.Tensor, *, scale: Optional[float] = None) -> torch.Tensor:
        """h2o: ``scores`` (fp32 [B, Hkv, M], the held keys' sums so far; None: none yet) plus
        the attention probabilities of a decode forward's post-RoPE ``queries``
        [B, Hq, q, D] (the last q positions, causal) over the held ``keys`` [B, Hkv, N, D]
        (N >= M; the new keys start at 0): fp32 [B, Hkv, N]."""
        new = self.policy.score(queries, keys, scale=scale)
        if scores is not None:
            new[..., : scores.shape[-1]] += scores
        return new

    def target(self, pinned: int = 0) -> int:
        """Tokens held after a compression, the first ``pinned`` (sinks at least) kept whole."""
        return max(self.max_held, max(self.policy.n_sink, pinned) + self.policy.window)

    def compresses(self, generated: int, q_len: int, held: int, pinned: int = 0
                   ) -> Optional[int]:
        """Tokens to keep after a forward of ``q_len`` tokens that brought the generated
        tokens to ``generated`` and the cache to ``held`` tokens; None: no compression."""
        if generated < 1 or generated // self.interval == (generated - q_len) // self.interval:
            return None
        target = self.target(pinned)
        return target if held > target else None


def make_decode(decode: Optional[str], max_held: Optional[int], interval: Optional[int],
                options: Optional[Options] = None, prompt: Optional[Policy] = None,
                **given) -> Optional[DecodeRule]:
    """The :class:`DecodeRule` ``decode`` ("streaming" | "snapkv" | "h2o"; None: no decode-time
    compression) that compresses to ``max_held`` tokens every ``interval`` generated tokens,
    its policy built with ``options`` and the fields ``given`` (as :func:`make` builds one),
    but for the fields the ``prompt`` policy (the request's own at prefill) has: those are
    the prompt's, so the rule scores as the prompt did."""
    if decode is None:
        if max_held is not None or interval is not None:
            raise ValueError("decode: max_held / interval given without a decode policy")
        return None
    check_str("decode", decode, DECODE_POLICIES)
    for name, value in (("max_held", max_held), ("interval", interval)):
        if value is None:  # missing, not of a wrong type
            raise ValueError(f"{name}: decode {decode!r} needs it (a token count)")
        check_int(name, value)
    if prompt is not None:  # the prompt's fields win
        own = {f.name for f in fields(prompt)}
        options = Options(**{f.name: getattr(prompt if f.name in own else options, f.name, None)
                             for f in fields(Options)})
    try:
        policy = make(decode, options, budget=max_held, **given)
    except ValueError as e:
        raise ValueError(str(e).replace("budget:", "max_held:", 1)) from None
    return DecodeRule(policy, interval)
