"""The compression policies, one small class each, shared by ``kp.hf`` and ``kp.vllm``.

Torch-only (no transformers, no vllm). A policy object holds its options, validates them
(a ValueError naming the argument) and answers three questions for any integration:

* how many tokens a prompt of ``n`` keeps (:meth:`Policy.kept_tokens`: ``budget`` resolved
  against ``n``, never below :attr:`Policy.min_keep`, the sinks and the recent window);
* how many of the prompt's last queries it observes (:meth:`Policy.observed_queries`), so an
  integration computes and keeps no query the policy does not use;
* how it scores the keys (:meth:`Policy.score`, fp32 ``[B, Hkv, n]``; higher is kept first by
  :func:`kvprune_cuda.select_keep`, after the ``n_sink`` sinks and the last ``window``
  tokens, which every policy keeps).

A policy also declares the evidence it scores by (:attr:`Policy.evidence`): nothing, the
last ``window`` observed queries, attention accumulated over forwards, or the model's
reconstruction of the context; integrations (``kp.hf``, ``kp.vllm``) ask the policy, never
its class. A new policy is one small class anywhere (a frozen dataclass extending
:class:`Policy`, with a ``name``, its ``evidence`` and its ``score``) made known by its name
with :func:`register` (docs/policy.md, "Write your own policy"): the built-ins are such
classes, one file each. :class:`Options` carries a user's options (n_sink, window, ...) from an
integration's entry point to every policy it builds (:func:`make`).

:class:`DecodeRule` (``decode.py``) is the periodic decode-time rule built on them
(:func:`make_decode`): every ``interval`` generated tokens, a cache holding more than
``max_held`` tokens is compressed back to ``max_held`` by a policy's selection.
:class:`PrefillBound` (``prefill.py``, :func:`make_prefill_bound`) bounds a chunked prefill the
same way: after each chunk, a prompt holding more than ``prefill_max_held`` tokens is compressed.
"""

from kvprune_cuda.policy.base import EVIDENCE, GQA, SCOPES, Options, Policy, resolve_budget
from kvprune_cuda.policy.registry import make, register, registered
from kvprune_cuda.policy.full import Full
from kvprune_cuda.policy.streaming import Streaming
from kvprune_cuda.policy.snapkv import SnapKV
from kvprune_cuda.policy.h2o import H2O
from kvprune_cuda.policy.kvzip import KVzip
from kvprune_cuda.policy.decode import DECODE_POLICIES, DecodeRule, make_decode
from kvprune_cuda.policy.prefill import PrefillBound, make_prefill_bound

POLICIES = ("full", "streaming", "snapkv", "h2o", "kvzip")  # the built-in policies

__all__ = ["POLICIES", "EVIDENCE", "GQA", "SCOPES", "Options", "Policy", "Full", "Streaming",
           "SnapKV", "H2O", "KVzip", "register", "registered", "make", "resolve_budget",
           "DECODE_POLICIES", "DecodeRule", "make_decode", "PrefillBound",
           "make_prefill_bound"]
