"""Bounded-peak prefill: a prompt prefilled in chunks is compressed whenever it holds more than
``max_held`` tokens, so a prompt longer than the KV memory can still run (:class:`PrefillBound`,
:func:`make_prefill_bound`); the same rule in kp.hf and kp.vllm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvprune_cuda._args import check_int
from kvprune_cuda.policy.base import Policy
from kvprune_cuda.policy.full import Full

# the evidence a chunk's compression can be given without the rest of the prompt: the keys,
# and the last `window` queries seen so far (the current chunk's, and the chunks' before)
BOUNDED_EVIDENCE = ("none", "window_queries")


@dataclass(frozen=True)
class PrefillBound:
    """While a prompt prefills in chunks, after each chunk but the last, a request holding
    more than :meth:`target` tokens is compressed to :meth:`target` by ``policy``'s selection
    over the tokens it holds: the sinks (the first ``pinned`` tokens too, kept whole), the
    last ``window`` tokens (the current chunk's end) and the best-scored others (snapkv: voted
    for by the last ``window`` queries of the prompt so far, pooled over neighbours in the
    held order). The chunk that ends the prompt is compressed to the policy's budget of the
    whole prompt as an unbounded prefill is (from the tokens still held; nothing when they
    fit it). So a request never holds more than ``target + chunk`` tokens while it prefills.
    Positions are never changed (kept keys keep their rotation)."""

    policy: Policy
    max_held: int

    def __post_init__(self) -> None:
        check_int("prefill_max_held", self.max_held, 1)
        p = self.policy
        if isinstance(p, Full) or p.fixed_capacity or p.evidence not in BOUNDED_EVIDENCE:
            why = ("keeps every token" if isinstance(p, Full) else
                   "holds a fixed-capacity ring" if p.fixed_capacity else
                   f"scores by {p.evidence!r}, which a chunk cannot give")
            raise ValueError(f"prefill_max_held: policy {p.name!r} {why}; a bounded prefill "
                             f"selects by {BOUNDED_EVIDENCE} (e.g. 'snapkv')")

    def target(self, pinned: int = 0) -> int:
        """Tokens held after a chunk's compression, the first ``pinned`` (sinks at least)
        kept whole."""
        return max(self.max_held, max(self.policy.n_sink, pinned) + self.policy.window)

    def compresses(self, held: int, prompt_done: bool, pinned: int = 0) -> Optional[int]:
        """Tokens to keep after a chunk that leaves the request holding ``held`` tokens
        (``prompt_done``: the chunk ended the prompt, whose own compression then applies);
        None: no compression."""
        if prompt_done:
            return None
        target = self.target(pinned)
        return target if held > target else None

    def peak(self, chunk: int, pinned: int = 0) -> int:
        """The most tokens a request holds while it prefills in chunks of at most ``chunk``."""
        return self.target(pinned) + chunk


def make_prefill_bound(max_held: Optional[int], policy: Policy) -> Optional[PrefillBound]:
    """The :class:`PrefillBound` of ``policy`` at ``max_held`` tokens (None: unbounded)."""
    return None if max_held is None else PrefillBound(policy, max_held)
