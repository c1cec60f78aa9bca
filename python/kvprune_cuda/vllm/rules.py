"""When a step compresses a request and how many tokens it keeps: the rule the scheduler and
the workers share, on :mod:`kvprune_cuda.policy`.

A request is compressed in the step that computes the last token of its prompt (its only
step, or the last chunk of a chunked prefill), when it has generated nothing yet (a
preempted request, recomputed with its outputs, stays dense) and the policy keeps fewer
tokens than the prompt holds. With prefix caching, the prompt's first ``pinned`` tokens are
kept whole and never rewritten: those read from the prefix cache and those in blocks another
request shares at that step; the budget applies to the rest (:func:`kept_tokens`). Only the
scheduler sees block sharing, so it decides and hands each step's decisions to the workers
(:mod:`kvprune_cuda.vllm.plan`). Earlier prefill
chunks of a request that may be compressed are recorded by the workers (:func:`records`):
the observation window may span chunks. With a bounded prefill
(:class:`~kvprune_cuda.policy.PrefillBound`, ``engine_args(prefill_max_held=...)``) an earlier
chunk that leaves the request holding more than the bound compresses it too
(:func:`prefill_compresses`), so a prompt longer than the KV pool can run; :func:`bounded_peak`
is the most a request then holds.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from kvprune_cuda import policy as policies


def kept_tokens(policy: "policies.Policy", prompt_len: int, pinned: int = 0) -> Optional[int]:
    """Tokens a prompt of ``prompt_len`` keeps when its first ``pinned`` are kept whole: those
    plus the policy's budget of the other ``prompt_len - pinned`` (kp.hf's rule; with
    ``pinned = 0`` exactly kp.hf's), or None when nothing is evicted."""
    own = prompt_len - pinned
    if own < 1:
        return None
    kept = pinned + policy.kept_tokens(own)
    return kept if kept < prompt_len else None


def with_pinned(policy: "policies.Policy", kept: int, pinned: int) -> "policies.Policy":
    """The policy that selects ``kept`` tokens with the first ``pinned`` kept whole: the same
    policy with at least ``pinned`` sinks. kp.hf with it keeps what the engine keeps."""
    return dataclasses.replace(policy, budget=kept, n_sink=max(policy.n_sink, pinned))


def compresses(policy: "policies.Policy", num_computed: int, num_scheduled: int,
               prompt_len: int, num_output: int = 0, pinned: int = 0,
               held: Optional[int] = None) -> Optional[int]:
    """Tokens kept by a request whose step computes ``num_scheduled`` tokens from
    ``num_computed`` (of a ``prompt_len``-token prompt, ``num_output`` tokens generated so
    far, the first ``pinned`` kept whole; ``held``: the tokens it then holds, fewer than the
    prompt's after a bounded prefill's compressions, None: all); None when this step does not
    compress it."""
    if num_output or num_computed >= prompt_len or num_computed + num_scheduled != prompt_len:
        return None
    kept = kept_tokens(policy, prompt_len, pinned)
    return None if kept is None or (held is not None and kept >= held) else kept


def prefill_end(prompt_len: int, num_output: int) -> int:
    """The position where a request's prefill ends, vLLM's rule: its prompt's length, or for a
    request resumed after preemption (``num_output`` tokens generated) the replay of its
    prompt and outputs but the last, whose KV the next step writes."""
    return max(prompt_len, prompt_len + num_output - 1)


def prefill_compresses(bound: Optional["policies.PrefillBound"], num_computed: int,
                       num_scheduled: int, prompt_len: int, held: int, pinned: int = 0,
                       num_output: int = 0) -> Optional[int]:
    """Tokens kept by a request whose step computes an earlier chunk of its prefill
    (``num_scheduled`` tokens from ``num_computed``, ending before :func:`prefill_end`: a
    prompt's, or a resumed request's replay of its prompt and ``num_output`` outputs) and then
    holds ``held`` tokens, the first ``pinned`` whole: the bound's target once ``held`` is over
    it (:meth:`~kvprune_cuda.policy.PrefillBound.compresses`); None: no compression."""
    if bound is None or num_computed + num_scheduled >= prefill_end(prompt_len, num_output):
        return None
    return bound.compresses(held, pinned)


def bounded_peak(bound: "policies.PrefillBound", rule: Optional["policies.DecodeRule"],
                 chunk: int) -> Optional[int]:
    """The most tokens one request holds when its prompt prefills in chunks of at most
    ``chunk`` under ``bound`` (no prefix shared) and its generation runs under ``rule``:
    ``max(bound + chunk, rule's target) + interval``; None without a rule (a generation
    may then grow to the model's length)."""
    if rule is None:
        return None
    return max(bound.peak(chunk), rule.target()) + rule.interval


def decode_positions(num_computed: int, num_scheduled: int, prompt_len: int,
                     num_output: int) -> int:
    """How many of a step's ``num_scheduled`` tokens (from position ``num_computed``) are
    generated tokens past the prompt: 1 for a decode step; for the recompute of a request
    resumed after preemption (prompt and outputs in one prefill, maybe chunked), those of its
    chunk past the prompt; 0 for a prompt's own prefill."""
    if not num_output:
        return 0
    return max(0, num_computed + num_scheduled - max(num_computed, prompt_len))


def decode_compresses(rule: Optional["policies.DecodeRule"], num_computed: int,
                      num_scheduled: int, prompt_len: int, num_output: int, held: int,
                      pinned: int = 0) -> Optional[int]:
    """Tokens kept by a request past its prompt whose step computes ``num_scheduled`` tokens
    from position ``num_computed`` and then holds ``held`` tokens (the first ``pinned``
    whole): ``rule`` counts the generated tokens from the prompt's end and sees the step's
    :func:`decode_positions` as one forward (a resumed request is compressed back in the step
    that completes its recompute, if that crossed a multiple of ``interval``). None: no
    compression."""
    q_len = decode_positions(num_computed, num_scheduled, prompt_len, num_output)
    if rule is None or not q_len:
        return None
    return rule.compresses(num_computed + num_scheduled - prompt_len, q_len, held, pinned)


def records(policy: "policies.Policy", num_computed: int, num_scheduled: int,
            prompt_len: int, num_output: int = 0) -> bool:
    """Whether this step is an earlier prefill chunk of a request that a later step may
    compress: its queries are kept for the observation window."""
    return (not num_output and num_computed + num_scheduled < prompt_len
            and kept_tokens(policy, prompt_len) is not None
            and policy.observed_queries(prompt_len) > 0)
