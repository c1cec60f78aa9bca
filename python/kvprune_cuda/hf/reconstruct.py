"""kvzip's reconstruction: the "repeat the previous context" prompts (:class:`RepeatPrompt`),
the teacher-forced forwards that feed them, chunk by chunk, on the uncompressed context cache
(:func:`reconstruction_forwards`), and the scoring that folds their attention into each
context key while they run (:func:`score_reconstruction`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from kvprune_cuda import policy as policies
from kvprune_cuda.hf._compat import cache_kv, cache_name, num_layers, set_cache_kv
from kvprune_cuda.hf.lse import attention_lse
from kvprune_cuda.hf.scoring import fold_reconstruction, left_padding, post_rope_queries
from kvprune_cuda.policy.output_weight import value_output_norms

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"


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
        out, prev = [], None
        for s, e in self.spans(n, chunk_size):
            piece = context_ids[:, s:e]
            out.append(self.chunk_input(piece, prev))
            prev = piece
        return out

    def chunk_input(self, piece: torch.Tensor, prev: Optional[torch.Tensor]) -> torch.Tensor:
        """[B, r]: the reconstruction input of the chunk ``piece`` [B, c] of token ids that
        follows ``prev`` [B, p] (its last ``overlap`` tokens are quoted; None: the first
        chunk)."""
        row = lambda xs: torch.tensor(list(xs), dtype=piece.dtype,  # noqa: E731
                                      device=piece.device).expand(piece.shape[0], -1)
        head = row(self.first) if prev is None else torch.cat(
            [row(self.next), prev[:, max(prev.shape[1] - self.overlap, 0):]], 1)
        return torch.cat([head, row(self.suffix), piece], 1)

    def extra_tokens(self) -> int:
        """The most tokens a chunk's reconstruction input has beyond the chunk's own."""
        return max(len(self.first), len(self.next) + self.overlap) + len(self.suffix)


def reconstruction_forwards(base, cache, prompt: RepeatPrompt, context_ids: torch.Tensor,
                            chunk_size: int) -> Iterator[tuple[int, int]]:
    """Runs the reconstruction forwards of ``context_ids`` [B, n] through ``base`` (the model's
    decoder) on ``cache``, yielding each chunk's context span ``(start, end)`` before its
    forward, and crops the cache back to the context after each (the reconstruction tokens'
    own keys are dropped; after the last, the context's K/V are copied out of the buffer that
    also held them, which the cache would otherwise keep alive). For
    :func:`score_reconstruction`."""
    n = context_ids.shape[1]
    chunks = prompt.chunks(context_ids, chunk_size)
    for c, (ids, span) in enumerate(zip(chunks, prompt.spans(n, chunk_size))):
        yield span
        repeat_chunk(base, cache, ids, n, copy=c == len(chunks) - 1)


def repeat_chunk(base, cache, ids: torch.Tensor, n: int, copy: bool = False) -> None:
    """One reconstruction forward of ``ids`` [B, r] through ``base`` on ``cache``, then every
    layer cropped back to its first ``n`` tokens (``copy``: copied out of the buffer that also
    held the reconstruction's, which the cache would otherwise keep alive)."""
    base(input_ids=ids, use_cache=True, **{cache_name(base): cache})
    for i in range(num_layers(cache)):
        k, v = cache_kv(cache, i)
        k, v = k[:, :, :n], v[:, :, :n]
        set_cache_kv(cache, i, k.clone() if copy else k, v.clone() if copy else v)


class ReconstructionScorer:
    """What the hooks do with each layer's reconstruction forward (``KVCompressor.intercept``
    while :func:`score_reconstruction` runs): fold the chunk's maxima into the layer's
    ``LayerState.kvzip`` (:func:`~kvprune_cuda.hf.scoring.fold_reconstruction`)."""

    def __init__(self, kvzip: "policies.KVzip", n: int) -> None:
        self.kvzip, self.n = kvzip, n
        self.span: Optional[tuple[int, int]] = None  # the running forward's context span
        self.lse: dict = {}  # layer -> (queries, lse) as the model's attention gave them (hf.lse)

    def __call__(self, module, st, hs: torch.Tensor, position_embeddings, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """``hs`` [B, r, hidden] the chunk's attention inputs; ``k`` / ``v`` [B, Hkv, n + r, D]
        the context's and the chunk's own keys and values."""
        qn, lse = self.lse.pop(module.layer_idx, (None, None))
        if qn is None:
            qn = post_rope_queries(module, hs, *position_embeddings)
        weights = None
        if self.kvzip.weight == "output":  # only the scored span's values: computed once per span
            weights = lambda s, e: output_weights(module, hs, v[:, :, s:e])  # noqa: E731
        fold_reconstruction(st, self.kvzip, qn, lse, k, self.n, self.span,
                            getattr(module, "scaling", None), weights)


def output_weights(module, hs: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KVzip+'s weights for one reconstruction forward of ``module``: fp32 [B, Hq, m] the
    output norm of each context value ``values`` [B, Hkv, m, D] per query head, fp32
    [B, Hq, r] one over the norm of each query token's attention input ``hs`` [B, r, hidden]
    (the same for every head)."""
    proj = getattr(module, "o_proj", None)
    if proj is None or getattr(proj, "weight", None) is None:
        raise ValueError(f"weight: kvzip's 'output' weighting (the default) needs the attention's "
                         f"o_proj; {type(module).__name__} has none (weight='none' scores "
                         f"without it)")
    key_weight = value_output_norms(proj.weight, values)
    query_weight = 1.0 / hs.float().norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)  # [B, r], finite
    return key_weight, query_weight[:, None].expand(-1, key_weight.shape[1], -1).contiguous()


def score_reconstruction(comp, forward_chunks: Callable[[], Iterator[tuple[int, int]]],
                         kvzip: Optional["policies.KVzip"] = None, n: Optional[int] = None) -> None:
    """KVzip scoring of the context that the cache of ``comp`` (an attached
    :class:`~kvprune_cuda.hf.KVCompressor`) holds (``n`` tokens, without padding; None:
    ``comp.seen``, uncompressed): ``forward_chunks()``
    is a generator that runs the teacher-forced reconstruction forwards, yielding before each
    the span ``(start, end)`` of the context positions it reconstructs, and crops the cache
    back to the context after each (:func:`reconstruction_forwards`). Per layer, each context
    key's score is the largest attention probability any reconstruction query gives it
    (``kvzip.gqa`` over a KV group; ``kvzip.softmax``: the keys it is normalised over), left
    in ``comp.layers[i].kvzip``; ``kvzip`` defaults to the compressor's policy. The rest of
    the compressor's state is as before."""
    kvzip = kvzip or comp.policy
    if not isinstance(kvzip, policies.KVzip):
        raise ValueError(f"kvzip: expected a kp.policy.KVzip, got {kvzip!r}")
    n = comp.seen if n is None else n
    if left_padding(comp.prefill_valid, n) is not None:
        raise ValueError("context_ids: kvzip scoring needs rows without padding")
    snap = comp.snapshot()
    scorer = ReconstructionScorer(kvzip, n)
    comp.intercept = scorer
    try:
        with attention_lse(comp.model, scorer.lse):
            for span in forward_chunks():
                scorer.span = span
    finally:
        comp.intercept = None
        scores = [s.kvzip for s in comp.layers]
        comp.restore(snap)
    for st, s in zip(comp.layers, scores):
        st.kvzip = s


def model_tokenizer(model, instead: str = "tokenizer= or repeat_prompt="):
    """The tokenizer at ``model.config.name_or_path`` (kvzip's repeat prompt, when no
    tokenizer or prompt is given; ``instead``: what the caller takes to avoid it)."""
    from transformers import AutoTokenizer

    path = getattr(model.config, "name_or_path", None)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"tokenizer: kvzip builds its repeat prompt with the model's tokenizer; "
                         f"pass {instead} (loading {path!r} failed: {e})") from e
