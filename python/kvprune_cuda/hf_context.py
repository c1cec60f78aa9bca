"""Compress a context once, answer any number of questions from it (``kp.hf.compress_context``).

The query-agnostic setting: a chat, a document or a prefix cache is compressed before any
question is known, so the scores cannot come from the question. Besides every policy of
:mod:`kvprune_cuda.hf`, policy ``"kvzip"`` scores each context key by how much the model
attends to it while reconstructing the context from its own cache (KVzip, Kim et al. 2025):
after the prefill, a "repeat the previous context" prompt followed by the context itself is
fed in chunks, teacher-forced, on the uncompressed cache, and a key's score is the maximum,
over the reconstruction queries and the query heads of its KV group, of its attention
probability (``kp.window_scores(qreduce="max", gqa="max", out=...)``, one fp32 buffer per
layer, chunks folded in place), normalised as KVzip does over the sinks, the chunk being
reconstructed and the reconstruction tokens (``softmax="chunk"``) or over every key the
query sees (``"all"``). The reconstruction tokens' own keys are dropped after each chunk.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

import kvprune_cuda as kp
from kvprune_cuda import hf
from kvprune_cuda._hf_ragged import RaggedLayer

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
SCOPES = ("layer", "global", "head")


@dataclass(frozen=True)
class RepeatPrompt:
    """Token ids of kvzip's reconstruction queries.

    Chunk ``c`` of the context (positions ``[skip, n)`` cut into ``chunk_size`` pieces) is
    reconstructed by ``first`` (c = 0) or ``next`` + the last ``overlap`` tokens of chunk
    ``c-1``, then ``suffix`` (what closes the user's turn and opens the answer), then the
    chunk's own tokens. ``skip`` leading tokens (a chat template's header) are not
    reconstructed, but they are scored like every other context key.
    """

    first: Sequence[int]
    next: Sequence[int]
    suffix: Sequence[int]
    skip: int = 0
    overlap: int = 8

    def __post_init__(self) -> None:
        for name in ("skip", "overlap"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")

    @classmethod
    def from_tokenizer(cls, tokenizer, context_ids: Optional[torch.Tensor] = None) -> "RepeatPrompt":
        """The prompts, closed by the chat template's end of a user turn when the tokenizer has
        a template (``"\\n"`` otherwise); ``skip`` is the template's header length when
        ``context_ids`` starts with it."""
        ids = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
        pre, post = "", "\n"
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": "@@"}],
                                                 add_generation_prompt=True, tokenize=False)
            pre, post = text.split("@@", 1)
        head = ids(pre) if pre else []
        skip = 0
        if context_ids is not None and head and context_ids.shape[1] > len(head):
            if context_ids[:, :len(head)].eq(torch.tensor(head, device=context_ids.device)).all():
                skip = len(head)
        return cls(first=ids(FIRST_PROMPT), next=ids(NEXT_PROMPT), suffix=ids(post), skip=skip)

    def spans(self, n: int, chunk_size: int) -> list[tuple[int, int]]:
        """The context positions ``[start, end)`` each chunk reconstructs."""
        return [(s, min(s + chunk_size, n)) for s in range(self.skip, n, chunk_size)]

    def chunks(self, context_ids: torch.Tensor, chunk_size: int) -> list[torch.Tensor]:
        """The reconstruction inputs, one ``[B, r_c]`` tensor per chunk (of :meth:`spans`)."""
        n = context_ids.shape[1]
        if self.skip >= n:
            raise ValueError(f"repeat_prompt: skip = {self.skip} leaves none of the {n} context "
                             "tokens to reconstruct")
        dev, b = context_ids.device, context_ids.shape[0]
        row = lambda xs: torch.tensor(list(xs), dtype=context_ids.dtype, device=dev).expand(b, -1)  # noqa: E731
        out, prev = [], None
        for s, e in self.spans(n, chunk_size):
            piece = context_ids[:, s:e]
            head = row(self.first) if prev is None else torch.cat(
                [row(self.next), prev[:, max(prev.shape[1] - self.overlap, 0):]], 1)
            out.append(torch.cat([head, row(self.suffix), piece], 1))
            prev = piece
        return out


class CompressedContext:
    """A compressed context to answer questions from; made by :func:`compress_context`.

    ``tokens_per_layer`` / ``bytes_per_layer``: what each layer holds (K and V; for streaming
    and h2o the slots of their fixed-capacity cache, whose int32 positions and h2o's fp32
    scores add 4-8 bytes per slot and KV head); tokens per KV head and row, averaged (an int
    unless ``budget_scope="head"`` made the heads differ); ``tokens_per_head``: per layer,
    the ``[B][Hkv]`` counts;
    ``prefill_seconds``: the context's forward; ``compress_seconds``: what compression
    added (kvzip's reconstruction forwards and scoring, selection, compaction).
    """

    def __init__(self, model, compressor: "hf.KVCompressor", context_ids: torch.Tensor, cache,
                 prefill_seconds: float, compress_seconds: float) -> None:
        self.model, self.context_ids = model, context_ids
        self.policy, self.budget = compressor.policy, compressor.budget
        self._compressor = compressor
        self._layers = [cache.layers[i] for i in range(len(compressor.layers))]
        self._state = compressor.snapshot()
        self.prefill_seconds, self.compress_seconds = prefill_seconds, compress_seconds
        self.tokens_per_head = [_held(lay).tolist() for lay in self._layers]
        self.tokens_per_layer = [_mean(t) for t in self.tokens_per_head]
        self.bytes_per_layer = [hf.layer_bytes(cache, i) for i in range(len(self._layers))]

    @property
    def context_len(self) -> int:
        return self.context_ids.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_per_layer)

    def __repr__(self) -> str:
        t = [x for layer in self.tokens_per_head for row in layer for x in row]
        return (f"CompressedContext(policy={self.policy!r}, context_len={self.context_len}, "
                f"tokens per head {min(t)}..{max(t)} (mean {sum(t) / len(t):.1f}), "
                f"{self.nbytes / 2**20:.2f} MiB, prefill {self.prefill_seconds:.2f} s + "
                f"compression {self.compress_seconds:.2f} s)")

    def cache(self):
        """A new DynamicCache for one question: it shares this context's K/V tensors where
        decoding appends by concatenation (they are never written; per-head layers append
        beside them), and holds a copy of the fixed-capacity (streaming / h2o) layers, which
        decoding writes in place."""
        from transformers import DynamicCache

        from kvprune_cuda._hf_fixed import FixedCapacityLayer

        c = DynamicCache()
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
                hf.set_cache_kv(c, i, lay.keys, lay.values)
        return c

    def generate(self, question_ids: torch.Tensor, **generate_kwargs):
        """``model.generate`` continuing the compressed context with ``question_ids`` [B, q].

        Returns what ``generate`` returns with the context cut off: ``[B, q + new]`` ids (or
        its output object with ``sequences`` cut the same way). Positions continue the
        context's (``n, n+1, ...``). The compressed context is not modified, so questions can
        follow one another. Streaming and h2o decode in a copy of their fixed-capacity cache,
        making room for the question and each new token (see :mod:`kvprune_cuda.hf`); the
        other policies let the cache grow by the new tokens.
        """
        for name in ("input_ids", "past_key_values", "cache", "attention_mask", "cache_position",
                     "position_ids", "inputs_embeds"):
            if name in generate_kwargs:
                raise ValueError(f"{name}: set by CompressedContext.generate itself")
        if not isinstance(question_ids, torch.Tensor) or question_ids.dim() != 2:
            raise ValueError("question_ids: expected a [B, q] tensor of token ids")
        b, n = self.context_ids.shape
        if question_ids.shape[0] != b or question_ids.shape[1] < 1:
            raise ValueError(f"question_ids: expected [{b}, q >= 1], got {list(question_ids.shape)}")
        q = question_ids.to(self.context_ids.device)
        mask = torch.ones(b, n + q.shape[1], dtype=torch.long, device=q.device)
        params = inspect.signature(self.model.forward).parameters
        if "cache_position" in params:  # transformers < 5.2x: generate slices ids by cache_position
            ids, cut = torch.cat([self.context_ids, q], 1), n
            extra = {"cache_position": torch.arange(n, n + q.shape[1], device=q.device)}
        else:  # later: only the new ids, positions from the full-length attention mask
            ids, cut, extra = q, 0, {}
        extra[_cache_name(self.model)] = self.cache()
        comp = self._compressor
        comp.restore(self._state)
        comp.attach()
        try:
            with torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=mask, **extra,
                                          **generate_kwargs)
        finally:
            comp.detach()
        if isinstance(out, torch.Tensor):
            return out[:, cut:]
        out.sequences = out.sequences[:, cut:]
        return out


def compress_context(model, context_ids: torch.Tensor, policy: str = "kvzip",
                     budget: Union[int, float] = 0.2, *, budget_scope: str = "layer",
                     n_sink: int = 4, window: Optional[int] = None, kernel_size: int = 7, pool: str = "max",
                     gqa: Optional[str] = None, chunk_size: int = 2048, softmax: str = "chunk",
                     tokenizer=None, repeat_prompt: Optional[RepeatPrompt] = None
                     ) -> CompressedContext:
    """Prefills ``context_ids`` [B, n] (rows of equal length, no padding) once and compresses it.

    Args:
        policy: "kvzip" (reconstruction scoring, above), "snapkv" (the context's last
            ``window`` queries vote), "h2o" (every context query's attention), "streaming"
            or "full" (no eviction).
        budget: tokens kept per layer: a fraction of ``n`` in (0, 1] or a count; with
            ``budget_scope="global"`` it is the mean over layers, each layer keeping what
            :func:`kvprune_cuda.layer_budgets` allocates from its scores; with ``"head"`` the
            mean over layers, rows and KV heads, each head keeping what
            :func:`kvprune_cuda.head_budgets` allocates (KVzip's own allocation), held in a
            ragged per-head layer that frees the rest (neither for "streaming" / "full").
        n_sink, window: the first / last context positions every layer keeps (``window``
            default: 0 for kvzip, which protects only the sinks as KVzip does; 32 otherwise,
            also snapkv's observation window).
        kernel_size, pool: snapkv's pooling; gqa: how a KV group's query heads combine
            ("max" for kvzip, as KVzip defines it; "mean" otherwise).
        chunk_size: context tokens reconstructed per kvzip forward (memory: the cache grows
            by one chunk plus the prompt while it is scored).
        softmax: the keys kvzip's reconstruction probabilities are normalised over: "chunk"
            (KVzip's own: the sinks, the chunk being reconstructed and the reconstruction
            tokens) or "all" (every key the query sees, the whole context included); see
            :meth:`~kvprune_cuda.hf.KVCompressor.score_reconstruction`.
        tokenizer, repeat_prompt: kvzip's reconstruction prompt; by default built with
            :meth:`RepeatPrompt.from_tokenizer` from ``tokenizer`` (else the model's own,
            loaded from ``model.config.name_or_path``).
    """
    if policy not in hf.POLICIES:
        raise ValueError(f"policy: expected one of {hf.POLICIES}, got {policy!r}")
    if budget_scope not in SCOPES:
        raise ValueError(f"budget_scope: expected one of {SCOPES}, got {budget_scope!r}")
    if budget_scope != "layer" and policy in ("streaming", "full"):
        raise ValueError(f"budget_scope: {budget_scope!r} ranks scores; policy {policy!r} has none")
    if not isinstance(context_ids, torch.Tensor) or context_ids.dim() != 2 or context_ids.shape[1] < 1:
        raise ValueError("context_ids: expected a [B, n >= 1] tensor of token ids")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}")
    if softmax not in hf.SOFTMAX:
        raise ValueError(f"softmax: expected one of {hf.SOFTMAX}, got {softmax!r}")
    gqa = gqa or ("max" if policy == "kvzip" else "mean")
    window = (0 if policy == "kvzip" else 32) if window is None else window
    n = context_ids.shape[1]
    comp = hf.KVCompressor(model, policy, budget, n_sink=n_sink, window=window,
                           kernel_size=kernel_size, pool=pool, gqa=gqa, compress_on_prefill=False)
    prompt = None
    if policy == "kvzip":
        prompt = repeat_prompt or RepeatPrompt.from_tokenizer(
            tokenizer or _model_tokenizer(model), context_ids)
    from transformers import DynamicCache

    cache = DynamicCache()
    comp.attach()
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            comp.base(input_ids=context_ids, use_cache=True, **{_cache_name(comp.base): cache})
            t1 = time.perf_counter()
            if prompt is not None:
                comp.score_reconstruction(lambda: _reconstruct(
                    comp, cache, prompt, context_ids, chunk_size), softmax=softmax)
            _compress(comp, cache, policy, budget, budget_scope, n)
            t2 = time.perf_counter()
    finally:
        comp.detach()
    return CompressedContext(model, comp, context_ids, cache, t1 - t0, t2 - t1)


def _reconstruct(comp: "hf.KVCompressor", cache, prompt: RepeatPrompt, context_ids: torch.Tensor,
                 chunk_size: int) -> None:
    """Teacher-forced reconstruction forwards, the cache cropped back to the context after each."""
    n = context_ids.shape[1]
    for ids, span in zip(prompt.chunks(context_ids, chunk_size), prompt.spans(n, chunk_size)):
        comp.reconstruct_span = span
        comp.base(input_ids=ids, use_cache=True, **{_cache_name(comp.base): cache})
        for i in range(len(comp.layers)):
            k, v = hf.cache_kv(cache, i)
            hf.set_cache_kv(cache, i, k[:, :, :n], v[:, :, :n])


def _compress(comp: "hf.KVCompressor", cache, policy: str, budget, scope: str, n: int) -> None:
    if scope == "layer" or policy == "full":
        comp.compress_cache(cache, policy, 1.0 if policy == "full" else budget)
        return
    kb = max(hf.resolve_budget(budget, n), comp.n_sink + comp.window)
    layers = sorted(comp.layers)
    scores = [comp.selection_scores(cache, i, policy) for i in layers]
    if scope == "head":
        counts = kp.head_budgets(scores, kb, n_sink=comp.n_sink, window=comp.window)
        for i, c_l, s in zip(layers, counts, scores):
            comp.compress_heads(cache, i, c_l, s)
        return
    budgets = kp.layer_budgets(scores, kb, n_sink=comp.n_sink, window=comp.window)
    for i, k_l, s in zip(layers, budgets, scores):  # selects from the scores just ranked
        comp.compress_layer(cache, i, policy, k_l, scores=s)


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


def _cache_name(module) -> str:
    """The forward's cache argument: ``cache`` from transformers 5.2x, ``past_key_values`` before."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _model_tokenizer(model):
    from transformers import AutoTokenizer

    path = getattr(model.config, "name_or_path", None)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"tokenizer: kvzip builds its repeat prompt with the model's tokenizer; "
                         f"pass tokenizer= or repeat_prompt= (loading {path!r} failed: {e})") from e
