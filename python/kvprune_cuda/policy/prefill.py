"""Bounded-peak prefill: a prompt prefilled in chunks is compressed whenever it holds more than
``max_held`` tokens, so a prompt longer than the KV memory can still run (:class:`PrefillBound`,
:func:`make_prefill_bound`); the same rule in kp.hf and kp.vllm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvprune_cuda._args import check_fraction, check_int, check_str
from kvprune_cuda._ops import pool_scores, select_keep, window_scores
from kvprune_cuda.policy.base import Policy
from kvprune_cuda.policy.full import Full
from kvprune_cuda.policy.kvzip import KVzip
from kvprune_cuda.policy.novelty import reserve_novel

# the evidence a chunk's compression can be given without the rest of the prompt: the keys,
# and the last `window` queries seen so far (the current chunk's, and the chunks' before)
BOUNDED_EVIDENCE = ("none", "window_queries")
# what ranks the held tokens at a chunk's compression: "max", each key's largest attention
# probability from any query of the prompt so far (a running maximum, KVzip-style maxima over
# the prompt's own forward); "far", the same from the queries at least `window` positions
# after the key (a local head's look at its neighbours does not count); "window", the
# policy's own selection by the last window queries; "reconstruct", KVzip's maxima from a
# forward that repeats each chunk after it (kp.hf only: a forward an engine does not plan)
SIGNALS = ("max", "far", "window", "reconstruct")
IN_FORWARD = ("max", "far")  # the signals the prompt's own forward gives (kp.vllm runs these)


@dataclass(frozen=True)
class PrefillBound:
    """While a prompt prefills in chunks, after each chunk but the last, a request holding
    more than :meth:`target` tokens is compressed to :meth:`target` over the tokens it holds:
    the sinks (the first ``pinned`` tokens too, kept whole), the last ``window`` tokens (the
    current chunk's end) and the best-ranked others by ``signal`` (:data:`SIGNALS`): "max"
    (default), each held key's largest attention probability from any query of the prompt so
    far (:meth:`scores` of every chunk's queries, :meth:`carry` over chunks), pooled with the
    policy's pool (:meth:`select`); "far", the same over the queries at least ``window``
    positions after the key (:meth:`far`); "window", ``policy``'s own selection (snapkv: voted for by
    the last ``window`` queries of the prompt so far, pooled over neighbours in the held
    order); "reconstruct", each key's largest KVzip+ score from a forward that repeats the
    key's chunk right after it (:attr:`scorer`: each attention probability normalised over the
    sinks, the chunk and the repetition, times the key's value output norm over the query's
    input norm; kp.hf only). ``novelty`` (a fraction, with "max", "far" or "reconstruct"): that share of each earlier chunk's
    kept tokens (at most those left beside the sinks and the window) goes first, in every KV
    head, to the held keys most unlike the head's others
    (:func:`~kvprune_cuda.policy.novelty.key_novelty`: a needle in prose that no later query
    looks at yet), the rest by the signal. The chunk that ends the prompt is compressed to the policy's budget of the whole
    prompt as an unbounded prefill is (from the tokens still held; nothing when they fit it).
    So a request never holds more than ``target + chunk`` tokens while it prefills (with
    "reconstruct", a chunk's repetition too: :meth:`peak`). Positions
    are never changed (kept keys keep their rotation)."""

    policy: Policy
    max_held: int
    signal: str = "max"
    novelty: float = 0.0

    def __post_init__(self) -> None:
        check_int("prefill_max_held", self.max_held, 1)
        check_str("prefill_signal", self.signal, SIGNALS)
        check_fraction("prefill_novelty", self.novelty)
        if self.novelty and not self.carries:
            raise ValueError(f"prefill_novelty: reserves keys beside the running maxima; "
                             f"prefill_signal {self.signal!r} ranks by the policy's own "
                             "selection (use 'max', 'far' or 'reconstruct')")
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

    def compresses(self, held: int, pinned: int = 0) -> Optional[int]:
        """Tokens to keep after an earlier chunk (not the prompt's last, whose own compression
        applies) that leaves the request holding ``held`` tokens; None: no compression."""
        target = self.target(pinned)
        return target if held > target else None

    @property
    def carries(self) -> bool:
        """Whether the signal is a running maximum carried over the chunks (:meth:`carry`),
        not the policy's selection."""
        return self.signal != "window"

    @property
    def in_forward(self) -> bool:
        """Whether the running maxima come from the chunks' own queries (:meth:`scores`)."""
        return self.signal in IN_FORWARD

    @property
    def repeats(self) -> bool:
        """Whether the running maxima come from a repetition of each chunk ("reconstruct":
        :attr:`scorer`, a forward of its own)."""
        return self.signal == "reconstruct"

    @property
    def scorer(self) -> KVzip:
        """The reconstruction scoring of "reconstruct": KVzip's defaults (KVzip+ weighting,
        each chunk's softmax over the sinks, the chunk and its repetition) with the policy's
        sinks."""
        return KVzip(n_sink=self.policy.n_sink)

    @property
    def far(self) -> int:
        """The least distance from a key to a query that counts in :meth:`scores`: the
        policy's ``window`` for "far" (the keys no query of the chunk is that far from are
        its last ``window``, kept anyway, and scored by the next chunk's), 0 for "max"."""
        return self.policy.window if self.signal == "far" else 0

    def peak(self, chunk: int, pinned: int = 0, repeat: int = 0) -> int:
        """The most tokens a request holds while it prefills in chunks of at most ``chunk``
        (and, with "reconstruct", ``repeat`` tokens of the repetition's prompt before the
        chunk's own repeated tokens)."""
        return self.target(pinned) + chunk + ((chunk + repeat) if self.repeats else 0)

    def scores(self, queries: torch.Tensor, keys: torch.Tensor,
               scale: Optional[float] = None) -> torch.Tensor:
        """fp32 [B, Hkv, n]: each of ``keys`` [B, Hkv, n, D]'s largest attention probability
        from the chunk's post-RoPE ``queries`` [B, Hq, T, D] (the last T positions, causal),
        the most over a KV head's query heads; with :attr:`far` = d > 0, from the queries d or
        more positions after the key, each normalised over the keys it counts for (0 where no
        query is that far: the last d keys)."""
        d, n, t = self.far, keys.shape[2], queries.shape[2]
        if n <= d:
            return torch.zeros(keys.shape[0], keys.shape[1], n, dtype=torch.float32,
                               device=keys.device)
        # query i (at n - t + i) counts the keys up to n - t + i - d: the causal alignment of
        # the last queries over the first n - d keys, less those that count none (the first
        # t - (n - d), when the chunk is more than n - d long)
        blind = max(0, t - (n - d))
        fresh = window_scores(queries[:, :, blind:].contiguous(), keys[:, :, :n - d],
                              scale=scale, gqa="max", qreduce="max")
        return torch.nn.functional.pad(fresh, (0, d)) if d else fresh

    @staticmethod
    def carry(held: Optional[torch.Tensor], fresh: torch.Tensor) -> torch.Tensor:
        """The running maximum: ``fresh`` (fp32 [B, Hkv, n], this chunk's :meth:`scores`) with
        its first M positions raised to ``held`` (fp32 [B, Hkv, M], the scores carried for
        the keys held before the chunk; None: none)."""
        if held is not None:
            m = held.shape[-1]
            fresh[..., :m] = torch.maximum(fresh[..., :m], held)
        return fresh

    def select(self, scores: torch.Tensor, kept: int, pinned: int = 0,
               keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        """int32 [B, Hkv, kept] ascending positions to keep by the carried ``scores`` (fp32
        [B, Hkv, n]): the sinks (and the first ``pinned``), the last ``window``, with
        :attr:`novelty` the ``int(novelty * kept)`` most novel of the other held ``keys``
        [B, Hkv, n, D] (needed then only; at most the slots the sinks and window leave), and
        the top pooled scores (the policy's pool, if it has one; "reconstruct" ranks its maxima
        unpooled, as KVzip does; the reserve is raised after pooling, so it does not spread to
        neighbours)."""
        p = self.policy
        kernel = 1 if self.repeats else getattr(p, "kernel_size", 1)
        if kernel > 1:
            scores = pool_scores(scores.contiguous(), kernel, getattr(p, "pool", "max"),
                                 window=p.window, shift=getattr(p, "shift", 0))
        first = max(p.n_sink, pinned)
        if self.novelty:
            if keys is None:
                raise ValueError(f"keys: prefill_novelty = {self.novelty} ranks the held keys")
            scores = reserve_novel(scores, keys, min(int(self.novelty * kept),
                                                     kept - first - p.window), first, p.window)
        return select_keep(scores.contiguous(), kept, n_sink=first, window=p.window)


def make_prefill_bound(max_held: Optional[int], policy: Policy, signal: Optional[str] = None,
                       novelty: Optional[float] = None) -> Optional[PrefillBound]:
    """The :class:`PrefillBound` of ``policy`` at ``max_held`` tokens ranking by ``signal``
    (None: "max") with ``novelty`` (None: 0) reserved for novel keys; None: unbounded."""
    if max_held is None:
        for name, value in (("prefill_signal", signal), ("prefill_novelty", novelty)):
            if value is not None:
                raise ValueError(f"{name}: given without prefill_max_held")
        return None
    return PrefillBound(policy, max_held, "max" if signal is None else signal,
                        0.0 if novelty is None else novelty)
