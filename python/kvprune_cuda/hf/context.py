"""Compress a context once, answer any number of questions from it.

The query-agnostic setting: a chat, a document or a prefix cache is compressed before any
question is known, so the scores cannot come from the question.
:func:`score_context` prefills the context once and records the evidence of one or more
policies (snapkv's window queries, h2o's attention sums, kvzip's reconstruction maxima:
:mod:`kvprune_cuda.policy`); :meth:`ScoredContext.compress` then compresses it under any of
them, any budget and budget scope, as often as wanted, and :meth:`ScoredContext.extend`
continues it with more tokens (a question, to compress query-aware without prefilling the
context again); :func:`compress_context` does both for one policy. A :class:`CompressedContext` answers questions (:meth:`CompressedContext.generate`)
and reports what it holds: ``nbytes`` counts every tensor it keeps.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Optional, Sequence, Union

import torch

from kvprune_cuda import policy as policies
from kvprune_cuda.hf._compat import cache_kv, cache_name, new_dynamic_cache, set_cache_kv
from kvprune_cuda.hf.fixed_layer import FixedCapacityLayer
from kvprune_cuda.hf.hooks import KVCompressor
from kvprune_cuda.hf.memory import layer_tensors, tensor_bytes
from kvprune_cuda.hf.ragged_layer import RaggedLayer
from kvprune_cuda.hf.reconstruct import (RepeatPrompt, model_tokenizer, reconstruction_forwards,
                                         score_reconstruction)
from kvprune_cuda.hf.scoring import MASKED


class CompressedContext:
    """A compressed context to answer questions from; made by :func:`compress_context` or
    :meth:`ScoredContext.compress`.

    ``tokens_per_head``: per layer, the ``[B][Hkv]`` tokens held; ``tokens_per_layer``: their
    mean per layer (an int unless per-head budgets made the heads differ);
    ``bytes_per_layer``: everything a layer holds (K/V; a fixed-capacity layer's int32 slot
    positions and h2o's fp32 scores; a per-head layer's index tensors; the slot validity
    masks); ``nbytes``: ``sum(bytes_per_layer)`` plus the context's token ids (kept for
    ``generate``); ``prefill_seconds``: the context's forward; ``compress_seconds``: what
    compression added (kvzip's reconstruction forwards and scoring, selection, compaction).
    """

    def __init__(self, model, policy: "policies.Policy", context_ids: torch.Tensor, cache,
                 state: dict, prefill_seconds: float, compress_seconds: float) -> None:
        self.model, self.policy, self.context_ids = model, policy, context_ids
        self._layers = list(cache.layers)
        self._state = state  # KVCompressor.snapshot() after compression: slot masks, positions
        self.prefill_seconds, self.compress_seconds = prefill_seconds, compress_seconds
        self.tokens_per_head = [_held(lay).tolist() for lay in self._layers]
        self.tokens_per_layer = [_mean(t) for t in self.tokens_per_head]
        self.bytes_per_layer = [tensor_bytes([*layer_tensors(cache, i), st.slot_valid])
                                for i, st in enumerate(state["layers"])]

    @classmethod
    def from_cache(cls, model, context_ids: torch.Tensor, cache,
                   prefill_seconds: float = 0.0, compress_seconds: float = 0.0
                   ) -> "CompressedContext":
        """A context of ``context_ids`` [B, n] held by ``cache``, a DynamicCache whose layers
        hold ``[B, Hkv, k_l, D]`` tokens of it compressed some other way (e.g. by another
        library's press), every slot valid; questions continue at position ``n`` and the
        cache grows by them."""
        comp = KVCompressor(model, "full", compress_on_prefill=False)
        for i, st in enumerate(comp.layers):
            k = cache_kv(cache, i)[0]
            st.slot_valid = torch.ones(k.shape[:3], dtype=torch.bool, device=k.device)
            st.layout = MASKED
        comp.seen = comp.prompt_len = context_ids.shape[1]
        return cls(model, comp.policy, context_ids, cache, comp.snapshot(), prefill_seconds,
                   compress_seconds)

    @property
    def budget(self):
        return self.policy.budget

    @property
    def context_len(self) -> int:
        return self.context_ids.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_per_layer) + tensor_bytes((self.context_ids,
                                                         self._state["prefill_valid"]))

    def __repr__(self) -> str:
        t = [x for layer in self.tokens_per_head for row in layer for x in row]
        return (f"CompressedContext(policy={self.policy.name!r}, context_len={self.context_len}, "
                f"tokens per head {min(t)}..{max(t)} (mean {sum(t) / len(t):.1f}), "
                f"{self.nbytes / 2**20:.2f} MiB, prefill {self.prefill_seconds:.2f} s + "
                f"compression {self.compress_seconds:.2f} s)")

    def cache(self):
        """A new DynamicCache for one question: it shares this context's K/V tensors where
        decoding appends by concatenation (they are never written; per-head layers append
        beside them), and holds a copy of the fixed-capacity (streaming / h2o) layers, which
        decoding writes in place."""
        c = new_dynamic_cache()
        for i, lay in enumerate(self._layers):
            if isinstance(lay, RaggedLayer):
                empty = lay.new_k[:, :, :0]
                c.update(empty, empty, i)
                c.layers[i] = lay.fork()
                continue
            c.update(lay.keys[:, :, :0], lay.values[:, :, :0], i)
            if isinstance(lay, FixedCapacityLayer):
                c.layers[i] = lay.copy()
            else:
                set_cache_kv(c, i, lay.keys, lay.values)
        return c

    def generate(self, question_ids: torch.Tensor, **generate_kwargs):
        """``model.generate`` continuing the compressed context with ``question_ids`` [B, q].

        Returns what ``generate`` returns with the context cut off: ``[B, q + new]`` ids (or
        its output object with ``sequences`` cut the same way). Positions continue the
        context's (``n, n+1, ...``). The compressed context is not modified, so questions can
        follow one another. Streaming and h2o decode in a copy of their fixed-capacity cache,
        making room for the question and each new token; the other policies let the cache
        grow by the new tokens.
        """
        q = self._continuation("question_ids", question_ids, "generate", generate_kwargs)
        b, n = self.context_ids.shape
        mask = torch.ones(b, n + q.shape[1], dtype=torch.long, device=q.device)
        params = inspect.signature(self.model.forward).parameters
        if "cache_position" in params:  # transformers < 5.2x: generate slices ids by cache_position
            ids, cut = torch.cat([self.context_ids, q], 1), n
            extra = {"cache_position": torch.arange(n, n + q.shape[1], device=q.device)}
        else:  # later: only the new ids, positions from the full-length attention mask
            ids, cut, extra = q, 0, {}
        extra[cache_name(self.model)] = self.cache()
        with self._attached(), torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, **extra, **generate_kwargs)
        if isinstance(out, torch.Tensor):
            return out[:, cut:]
        out.sequences = out.sequences[:, cut:]
        return out

    def forward(self, ids: torch.Tensor, **forward_kwargs):
        """The model's output (``logits`` [B, q, vocab], ...) for ``ids`` [B, q] read after
        the compressed context in one forward, teacher-forced: what the model predicts at each
        of the continuation's tokens given what the context kept (e.g. a perplexity, or the
        likelihood of candidate answers). Positions continue the context's, as in
        :meth:`generate`; the compressed context is not modified. Streaming and h2o hold a
        fixed-capacity cache: ``ids`` must fit the room beside its sinks (and h2o's recent
        window), else a ValueError says how many tokens one forward can take."""
        q = self._continuation("ids", ids, "forward", forward_kwargs)
        with self._attached(), torch.no_grad():
            return self.model(input_ids=q, use_cache=True, **{cache_name(self.model): self.cache()},
                              **forward_kwargs)

    def _continuation(self, arg: str, ids, method: str, kwargs: dict) -> torch.Tensor:
        """``ids`` [B, q >= 1] on the context's device, checked (``arg``: its name), and none
        of the arguments ``method`` sets itself among ``kwargs``."""
        for name in ("input_ids", "past_key_values", "cache", "attention_mask", "cache_position",
                     "position_ids", "inputs_embeds"):
            if name in kwargs:
                raise ValueError(f"{name}: set by CompressedContext.{method} itself")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"{arg}: expected a [B, q] tensor of token ids")
        b = self.context_ids.shape[0]
        if ids.shape[0] != b or ids.shape[1] < 1:
            raise ValueError(f"{arg}: expected [{b}, q >= 1], got {list(ids.shape)}")
        return ids.to(self.context_ids.device)

    @contextlib.contextmanager
    def _attached(self):
        """The model's attention continuing this context: a compressor restored to the state
        compression left (slot masks, positions), attached for the block."""
        comp = KVCompressor(self.model, self.policy, compress_on_prefill=False)
        comp.restore(self._state)
        comp.attach()
        try:
            yield
        finally:
            comp.detach()


def _check_recorded_with(policy: "policies.Policy", scored: Sequence["policies.Policy"]) -> None:
    """``policy`` ranks the evidence the first scored policy of its kind records (one per kind
    and context), so the options that shape that evidence
    (:attr:`~kvprune_cuda.policy.Policy.recorded_with`) must be its own."""
    recorder = next((p for p in scored if p.evidence == policy.evidence), None)
    f = policy.evidence_mismatch(recorder) if recorder is not None else None
    if f is not None:
        raise ValueError(f"policy: {f}={getattr(policy, f)!r}, but the context's "
                         f"{recorder.name} evidence is recorded with "
                         f"{f}={getattr(recorder, f, None)!r} (one per context); score "
                         f"another context for this policy")


class ScoredContext:
    """A prefilled, uncompressed context with the evidence of one or more policies recorded,
    to compress as often as wanted (:meth:`compress`); made by :func:`score_context` and
    :meth:`extend`.

    ``nbytes``: the full K/V plus the recorded evidence (window queries, score buffers);
    ``prefill_seconds``; ``score_seconds`` (kvzip's reconstruction)."""

    def __init__(self, model, context_ids: torch.Tensor, scored: Sequence["policies.Policy"],
                 cache, state: dict, prefill_seconds: float, score_seconds: float,
                 options: Optional["policies.Options"] = None) -> None:
        self.model, self.context_ids, self.policies = model, context_ids, list(scored)
        self._options = options  # score_context's, for policies named later
        self._kv = [cache_kv(cache, i) for i in range(len(state["layers"]))]
        self._state = state
        self.prefill_seconds, self.score_seconds = prefill_seconds, score_seconds

    @property
    def nbytes(self) -> int:
        kv = tensor_bytes(t for pair in self._kv for t in pair)
        return kv + sum(s.nbytes() for s in self._state["layers"]) + tensor_bytes(
            (self.context_ids, self._state["prefill_valid"]))

    def _policy(self, policy) -> "policies.Policy":
        if policy is None:
            return self.policies[0]
        if isinstance(policy, policies.Policy):
            _check_recorded_with(policy, self.policies)
            return policy
        named = [p for p in self.policies if p.name == policy]
        if named:
            return named[0]
        return policies.make(policy, self._options)  # full / streaming: need no evidence

    def compress(self, budget: Union[int, float, None] = None, budget_scope: Optional[str] = None,
                 policy: Union[str, "policies.Policy", None] = None) -> CompressedContext:
        """The context compressed to ``budget`` (default the policy's: a fraction of the
        context in (0, 1] or a token count per layer, the mean over layers / heads for the
        "global" / "head" scopes) under ``policy`` (default the first scored; another scored
        one by name; "full" and "streaming" need no evidence: built with score_context's
        options), the budget shared as
        ``budget_scope`` says (default the policy's measured best:
        :attr:`~kvprune_cuda.policy.Policy.default_scope`)."""
        p = self._policy(policy)
        if budget is not None:
            p = policies.make(p, budget=budget)
        scope = p.default_scope if budget_scope is None else budget_scope
        t0 = time.perf_counter()
        cache = new_dynamic_cache()
        for i, (k, v) in enumerate(self._kv):
            cache.update(k, v, i)  # shares the tensors: compression builds new ones
        comp = KVCompressor(self.model, p, compress_on_prefill=False)
        comp.restore(self._state)
        comp.compress_cache(cache, p, p.budget, scope)
        state = comp.snapshot()
        seconds = time.perf_counter() - t0 + self.score_seconds
        return CompressedContext(self.model, p, self.context_ids, cache, state,
                                 self.prefill_seconds, seconds)

    def extend(self, ids: torch.Tensor) -> "ScoredContext":
        """This context followed by ``ids`` [B, m], prefilled on top of its cache, so the
        context is not prefilled again: e.g. a document scored once, then each question
        appended to compress the document query-aware (snapkv voting with the question).

        The snapkv and h2o evidence continues as one prefill of the whole would have recorded
        it: the window queries are the last ``window`` of the context and ``ids``, h2o's sums
        take every new query's attention too. kvzip's is dropped: its reconstruction covered
        the context alone (name kvzip again in :func:`score_context` of the whole instead).
        This context is not modified; the extension holds K/V of its own (the context's and
        ``ids``'s, concatenated). ``prefill_seconds``: the extension's forward."""
        b = self.context_ids.shape[0]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != b or ids.shape[1] < 1:
            shape = list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"ids: expected a [{b}, m >= 1] tensor of token ids, got {shape}")
        ids = ids.to(self.context_ids.device)
        kept = [p for p in self.policies if p.evidence != "reconstruction"]
        kept = kept or [policies.make("full", self._options)]
        comp = KVCompressor(self.model, kept[0], compress_on_prefill=False, observe=kept[1:])
        comp.restore(self._state)
        for st in comp.layers:
            st.kvzip = None
        cache = new_dynamic_cache()
        for i, (k, v) in enumerate(self._kv):
            cache.update(k, v, i)
        comp.attach()
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                comp.base(input_ids=ids, use_cache=True,
                          **{cache_name(comp.base): cache})
                seconds = time.perf_counter() - t0
        finally:
            comp.detach()
        return ScoredContext(self.model, torch.cat([self.context_ids, ids], 1), kept, cache,
                             comp.snapshot(), seconds, 0.0, self._options)


def score_context(model, context_ids: torch.Tensor,
                  policy: Union[str, "policies.Policy", Sequence] = "kvzip", *,
                  n_sink: Optional[int] = None, window: Optional[int] = None,
                  kernel_size: Optional[int] = None, pool: Optional[str] = None,
                  pool_shift: Optional[int] = None,
                  gqa: Optional[str] = None, chunk_size: Optional[int] = None,
                  softmax: Optional[str] = None, head_floor: Optional[float] = None,
                  novelty: Optional[float] = None, weight: Optional[str] = None, tokenizer=None,
                  repeat_prompt: Optional[RepeatPrompt] = None) -> ScoredContext:
    """Prefills ``context_ids`` [B, n] (rows of equal length, no padding) once and records the
    evidence of ``policy`` (a name, a :class:`~kvprune_cuda.policy.Policy` or a sequence of
    them); the options build every named policy (None: each policy's default, e.g. window 0
    and gqa "max" for kvzip, window 32 and gqa "mean" otherwise; see :mod:`kvprune_cuda.policy`).

    kvzip's reconstruction prompt: ``repeat_prompt``, else built by
    :meth:`RepeatPrompt.from_tokenizer` from ``tokenizer`` (else the model's own, loaded from
    ``model.config.name_or_path``).
    """
    if not isinstance(context_ids, torch.Tensor) or context_ids.dim() != 2 or context_ids.shape[1] < 1:
        raise ValueError("context_ids: expected a [B, n >= 1] tensor of token ids")
    named = [policy] if isinstance(policy, (str, policies.Policy)) else list(policy)
    if not named:
        raise ValueError("policy: expected at least one policy")
    options = policies.Options(n_sink=n_sink, window=window, kernel_size=kernel_size, pool=pool,
                               pool_shift=pool_shift, gqa=gqa, chunk_size=chunk_size,
                               softmax=softmax, head_floor=head_floor, novelty=novelty,
                               weight=weight)
    scored = [policies.make(p, options) for p in named]
    for i, p in enumerate(scored):
        _check_recorded_with(p, scored[:i])
    kvzip = next((p for p in scored if isinstance(p, policies.KVzip)), None)
    prompt = None
    if kvzip is not None:
        prompt = repeat_prompt or RepeatPrompt.from_tokenizer(
            tokenizer or model_tokenizer(model), context_ids)
    comp = KVCompressor(model, scored[0], compress_on_prefill=False, observe=scored[1:])
    cache = new_dynamic_cache()
    comp.attach()
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            comp.base(input_ids=context_ids, use_cache=True, **{cache_name(comp.base): cache})
            t1 = time.perf_counter()
            if kvzip is not None:
                score_reconstruction(comp, lambda: reconstruction_forwards(
                    comp.base, cache, prompt, context_ids, kvzip.chunk_size), kvzip)
            t2 = time.perf_counter()
    finally:
        comp.detach()
    return ScoredContext(model, context_ids, scored, cache, comp.snapshot(), t1 - t0, t2 - t1,
                         options)


def compress_context(model, context_ids: torch.Tensor, policy: Union[str, "policies.Policy"] = "kvzip",
                     budget: Union[int, float, None] = None, *,
                     budget_scope: Optional[str] = None, tokenizer=None,
                     repeat_prompt: Optional[RepeatPrompt] = None,
                     **options) -> CompressedContext:
    """Prefills ``context_ids`` [B, n] (rows of equal length, no padding) once and compresses
    it: :func:`score_context` (``tokenizer``, ``repeat_prompt``; ``options``: n_sink, window,
    kernel_size, pool, pool_shift, gqa, chunk_size, softmax, head_floor, novelty, weight, as
    :class:`kvprune_cuda.policy.Options` names them: another name is a TypeError) then :meth:`ScoredContext.compress`.

    ``budget``: tokens kept per layer, a fraction of ``n`` in (0, 1] or a count (None: the
    policy's own, 0.2 for a name; likewise each option left out keeps the policy's); with
    ``budget_scope="global"`` the mean over layers (:func:`kvprune_cuda.layer_budgets`), with
    ``"head"`` the mean over layers, rows and KV heads (:func:`kvprune_cuda.head_budgets`,
    KVzip's own allocation, held in a per-head layer that frees the rest); neither for
    "streaming" / "full". ``budget_scope=None``: the policy's measured default ("head" for
    kvzip, "layer" for the others)."""
    if budget_scope is not None and budget_scope not in policies.SCOPES:
        raise ValueError(f"budget_scope: expected one of {policies.SCOPES}, got {budget_scope!r}")
    if budget_scope not in (None, "layer") and not policies.make(policy).ranks:
        raise ValueError(f"budget_scope: {budget_scope!r} ranks scores; policy {policy!r} has none")
    p = policies.make(policy, policies.Options(**options), budget=budget)
    scored = score_context(model, context_ids, p, tokenizer=tokenizer, repeat_prompt=repeat_prompt)
    return scored.compress(budget_scope=budget_scope)


def _held(lay) -> torch.Tensor:
    """int64 [B, Hkv]: tokens a cache layer holds per row and KV head."""
    if isinstance(lay, RaggedLayer):
        return lay.tokens
    b, hkv, t = lay.keys.shape[:3]
    return torch.full((b, hkv), t, dtype=torch.int64)


def _mean(per_head: list) -> Union[int, float]:
    """The mean of a ``[B][Hkv]`` list of counts: an int when they are all equal."""
    flat = [x for row in per_head for x in row]
    return flat[0] if len(set(flat)) == 1 else sum(flat) / len(flat)
