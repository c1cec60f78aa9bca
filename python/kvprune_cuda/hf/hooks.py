"""The hooks that make a transformers model record evidence for, and run on, a compressed cache.

A forward hook on every attention module recomputes that layer's post-RoPE queries from
the layer input (the module's own ``q_proj`` / ``q_norm`` / ``apply_rotary_pos_emb``), only as
many as the observed policies use (:meth:`~kvprune_cuda.policy.Policy.observed_queries`:
snapkv its window, h2o all of them, streaming / kvzip / full none), and records them
(:mod:`~kvprune_cuda.hf.scoring`). With ``compress_on_prefill`` it compresses the layer's
``DynamicCache`` entry right after the prefill forward of that layer
(:mod:`~kvprune_cuda.hf.select`). Kept keys keep their original RoPE rotation and new tokens
keep their original positions (``cache_position`` / ``position_ids`` count tokens seen, not
tokens held), so nothing is re-rotated. Once a cache is compressed the hooks build each
layer's attention mask themselves (``[B, Hq, q, held + q]``, additive), so left-padded batches
and multi-token forwards on a compressed cache stay exact; a fixed-capacity layer (streaming,
h2o) fills its own. With a decode-time rule (``decode=``,
:class:`~kvprune_cuda.policy.DecodeRule`) a layer is compressed again after the decode
forwards the rule picks (every ``interval`` generated tokens, once it holds more than
``max_held``), snapkv voting with the last ``window`` decode queries, h2o by each held
key's attention summed over the decode forwards. With ``prefill_max_held`` (:class:`~kvprune_cuda.policy.PrefillBound`) a prompt
longer than ``prefill_chunk`` tokens on an empty cache is prefilled in chunks (the base model's
forward runs once per chunk, each chunk a forward on the cache the chunks before left) and
after each chunk a layer holding more than ``prefill_max_held`` tokens is compressed back to
it, so the prefill's peak stays bounded whatever the prompt's length (a later long forward on
a cache already holding tokens is not split). With the "reconstruct" signal a forward repeats
each chunk but the last after it (KVzip's reconstruction; its own keys dropped again) and the
compression follows it. Only ``DynamicCache``
(the default) with eager or SDPA attention is supported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Iterable, Iterator, Optional, Union

import torch

from kvprune_cuda import policy as policies
from kvprune_cuda._args import check_int
from kvprune_cuda.hf import scoring, select
from kvprune_cuda.hf._compat import (cache_arg, cache_kv, cache_name, new_dynamic_cache, set_cache_kv,
                                     takes_cache_position)
from kvprune_cuda.hf.decode_step import decode_step
from kvprune_cuda.hf.memory import tensor_bytes
from kvprune_cuda.hf.reconstruct import RepeatPrompt, model_tokenizer, repeat_chunk, score_reconstruction
from kvprune_cuda.hf.scoring import FIXED, LayerState


class KVCompressor:
    """Hooks that make ``model`` compress its DynamicCache. Prefer :func:`compress` and
    :func:`~kvprune_cuda.hf.compress_context`.

    ``policy``: a name :func:`kvprune_cuda.policy.registered` knows (built with ``budget`` and
    ``options``, a :class:`kvprune_cuda.policy.Options`, or its fields as keywords) or a
    :class:`~kvprune_cuda.policy.Policy`; ``decode``, ``max_held``, ``interval``: the decode-time
    rule (:func:`kvprune_cuda.policy.make_decode`). ``observe``: further policies whose evidence is
    recorded alongside (their window queries, h2o sums), e.g. to compress one prefill several
    ways. ``compress_on_prefill=False`` only records (kvzip always: its scores need the
    reconstruction forwards, :func:`~kvprune_cuda.hf.reconstruct.score_reconstruction`).
    ``prefill_max_held``, ``prefill_chunk`` (default :data:`PREFILL_CHUNK`), ``prefill_signal``,
    ``prefill_novelty``: the bounded-peak prefill (module doc; :func:`kvprune_cuda.policy.make_prefill_bound`);
    ``repeat_prompt``: the "reconstruct" signal's (None: built from the model's tokenizer, here,
    before any forward).

    After a forward: ``prompt_len`` (tokens of the compressed prompt) and ``compressed_len``
    (tokens each layer holds per head right after compression; None when layers or heads
    differ); ``peak_held``: the most tokens one layer held at once (per row and KV head,
    fixed-capacity layers aside) since the sequence began; :attr:`nbytes`: what the hooks'
    own state holds.
    """

    def __init__(self, model, policy: Union[str, "policies.Policy"] = "snapkv",
                 budget: Union[int, float, None] = None, *,
                 options: Optional["policies.Options"] = None, compress_on_prefill: bool = True,
                 observe: Iterable["policies.Policy"] = (), decode: Optional[str] = None,
                 max_held: Optional[int] = None, interval: Optional[int] = None,
                 prefill_max_held: Optional[int] = None, prefill_chunk: Optional[int] = None,
                 prefill_signal: Optional[str] = None, prefill_novelty: Optional[float] = None,
                 repeat_prompt: Optional[RepeatPrompt] = None, **option_fields) -> None:
        if option_fields:  # n_sink=..., window=...: an Options' fields given one by one
            options = dataclasses.replace(options or policies.Options(), **option_fields)
        self.policy = policies.make(policy, options, budget=budget)
        self.decode = policies.make_decode(decode, max_held, interval, options, prompt=self.policy)
        if self.decode is not None and self.policy.fixed_capacity:
            raise ValueError(f"decode: the prompt policy {self.policy.name!r} already holds a "
                             "fixed-capacity ring while decoding; use it with 'snapkv' or "
                             "'full'")
        if self.policy.evidence == "reconstruction" and compress_on_prefill:
            raise ValueError(f"policy: {self.policy.name!r} scores by reconstructing the "
                             "context after its prefill; use kp.hf.compress_context")
        self.prefill_bound = policies.make_prefill_bound(prefill_max_held, self.policy,
                                                         prefill_signal, prefill_novelty)
        if self.prefill_bound is None and prefill_chunk is not None:
            raise ValueError("prefill_chunk: given without prefill_max_held")
        self.prefill_chunk = PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
        check_int("prefill_chunk", self.prefill_chunk, 1)
        if self.prefill_bound is not None and not compress_on_prefill:
            raise ValueError("prefill_max_held: bounds a prefill that compresses "
                             "(compress_on_prefill=True)")
        repeats = self.prefill_bound is not None and self.prefill_bound.repeats
        if repeat_prompt is not None and not repeats:
            raise ValueError("repeat_prompt: only a bounded prefill with prefill_signal="
                             "'reconstruct' repeats the prompt")
        if repeat_prompt is not None and (not isinstance(repeat_prompt, RepeatPrompt)
                                          or repeat_prompt.skip):
            raise ValueError(f"repeat_prompt: expected a RepeatPrompt with skip 0 (a bounded "
                             f"prefill repeats every chunk whole), got {repeat_prompt!r}")
        if repeats and repeat_prompt is None:
            repeat_prompt = RepeatPrompt.from_tokenizer(model_tokenizer(model, "repeat_prompt="))
        self.repeat_prompt = repeat_prompt  # "reconstruct"'s (None: another signal)
        self.observed = [self.policy, *observe]
        self.model = model
        self.compress_on_prefill = compress_on_prefill
        self.base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
        self.attn = [m for m in model.modules()
                     if hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "layer_idx")]
        if not self.attn:
            raise ValueError("model: no attention modules with q_proj/k_proj/layer_idx found")
        self._handles: list = []
        self._has_cache_position = takes_cache_position(self.base)
        # while set, takes every uncompressed layer's forward instead of the recording and
        # compression: (module, LayerState, hidden states, position embeddings, keys, values) -> None
        # (kvzip's reconstruction forwards: hf.reconstruct.score_reconstruction)
        self.intercept: Optional[Callable] = None
        self._prompt_end: Optional[int] = None  # while a bounded prefill runs: its length
        self._outer = False  # the forward that a bounded prefill splits into chunks is running
        self._chunked = None  # the base model's forward as attach wrapped it (bounded prefill)
        self.reset()

    # ----------------------------------------------------------------- state
    def reset(self) -> None:
        """Forgets the sequence (a new prefill starts from an empty cache)."""
        self.layers = [LayerState() for _ in self.attn]
        self.seen = 0                    # tokens processed so far (original positions)
        self.prompt_len: Optional[int] = None
        self.compressed_len: Optional[int] = None
        self.prefill_valid: Optional[torch.Tensor] = None  # bool [B, N] of the prefill
        self._new_valid: Optional[torch.Tensor] = None     # bool [B, q] of the current forward
        self._cache = None                                 # the cache of the forward running
        self._left: Optional[int] = None  # cache length the last forward left (None: unknown)
        self.peak_held = 0

    @property
    def compressed(self) -> bool:
        return any(s.compressed for s in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes the hooks' state holds (recorded queries and scores, slot masks)."""
        return sum(s.nbytes() for s in self.layers) + tensor_bytes((self.prefill_valid,))

    def snapshot(self) -> dict:
        """The recorded state (shares tensors; the hooks replace them, never write in place)."""
        return {"layers": [s.copy() for s in self.layers], "seen": self.seen,
                "prompt_len": self.prompt_len, "compressed_len": self.compressed_len,
                "prefill_valid": self.prefill_valid}

    def restore(self, snap: dict) -> None:
        self.layers = [s.copy() for s in snap["layers"]]
        self.seen, self.prompt_len = snap["seen"], snap["prompt_len"]
        self.compressed_len, self.prefill_valid = snap["compressed_len"], snap["prefill_valid"]
        self._left = None

    # ----------------------------------------------------------------- hooks
    def attach(self) -> "KVCompressor":
        if self._handles:
            return self
        h = self._handles
        h.append(self.base.register_forward_pre_hook(self._base_pre, with_kwargs=True))
        h.append(self.base.register_forward_hook(self._base_post, with_kwargs=True))
        for m in self.attn:
            h.append(m.register_forward_pre_hook(self._attn_pre, with_kwargs=True))
            h.append(m.register_forward_hook(self._attn_post, with_kwargs=True))
        if self.prefill_bound is not None:  # the instance's forward, until detach
            self._chunked = self._chunking(self.base.forward)
            self.base.forward = self._chunked
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._chunked is not None and self.base.__dict__.get("forward") is self._chunked:
            del self.base.forward  # the forward it had before attach again
        self._chunked = None

    # ----------------------------------------------------------------- bounded prefill
    def _splits(self, args, kwargs) -> bool:
        """Whether this base forward is a prompt that the bounded prefill splits in chunks:
        longer than ``prefill_chunk`` tokens, on an empty cache (or none yet: one is made)."""
        if self.prefill_bound is None or self._prompt_end is not None:
            return False
        ids = kwargs.get("input_ids", args[0] if args else None)
        x = ids if ids is not None else kwargs.get("inputs_embeds")
        cache = cache_arg(kwargs)
        return (x is not None and x.shape[1] > self.prefill_chunk
                and kwargs.get("use_cache") is not False
                and (cache is None or cache.get_seq_length() == 0))

    def _chunking(self, forward):
        """``forward`` (the base model's), running a prompt :meth:`_splits` as chunks."""
        @functools.wraps(forward)  # its signature (cache_name, takes_cache_position read it)
        def run(*args, **kwargs):
            if not self._splits(args, kwargs):
                return forward(*args, **kwargs)
            if len(args) > 1:
                raise ValueError("prefill_max_held: pass the model's inputs by keyword")
            if args:
                kwargs["input_ids"] = args[0]
            try:
                return self._prefill_in_chunks(kwargs)
            except BaseException:  # _base_post will not run: the split forward ends here
                self._outer = False
                raise
        return run

    def _prefill_in_chunks(self, kwargs: dict):
        """The base model's forward over a prompt, one forward per chunk of
        ``prefill_chunk`` tokens on the same cache; returns the last chunk's output (its
        hidden states: logits for the last chunk's tokens only)."""
        name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
        x = kwargs.pop(name)
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            raise ValueError("attention_mask: a bounded prefill (prefill_max_held) takes a "
                             "[B, n] mask (or none)")
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError("attention_mask: a bounded prefill (prefill_max_held) needs rows "
                             "without padding")
        for flag in ("output_hidden_states", "output_attentions"):
            if kwargs.get(flag):
                raise ValueError(f"{flag}: a bounded prefill (prefill_max_held) runs the prompt "
                                 "in chunks and returns the last chunk's outputs only")
        by_position = {k: kwargs.pop(k) for k in ("position_ids", "cache_position")
                       if isinstance(kwargs.get(k), torch.Tensor)}
        n = x.shape[1]
        per_token = [k for k, t in kwargs.items()
                     if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == n]
        if per_token:  # not split by this code: refused rather than given whole to each chunk
            raise ValueError(f"{per_token[0]}: a bounded prefill (prefill_max_held) splits "
                             "input_ids / inputs_embeds, attention_mask and positions only")
        repeats = self.prefill_bound.repeats
        if repeats and name != "input_ids":
            raise ValueError("inputs_embeds: prefill_signal 'reconstruct' repeats the prompt's "
                             "token ids; pass input_ids")
        if cache_arg(kwargs) is None:
            kwargs[cache_name(self.base)] = new_dynamic_cache()
        self._prompt_end = n
        try:
            for start in range(0, n, self.prefill_chunk):
                end = min(n, start + self.prefill_chunk)
                part = {**kwargs, name: x[:, start:end],
                        **{k: t[..., start:end] for k, t in by_position.items()}}
                if isinstance(mask, torch.Tensor):
                    part["attention_mask"] = mask[..., :end]
                out = self.base(**part)
                if repeats and end < n:
                    self._repeat_chunk(cache_arg(kwargs), x[:, start:end],
                                       x[:, :start] if start else None)
        finally:
            self._prompt_end = None
        return out

    def _repeat_chunk(self, cache, piece: torch.Tensor, prev: Optional[torch.Tensor]) -> None:
        """The "reconstruct" signal after a chunk ``piece`` [B, c] of token ids (after ``prev``,
        the prompt before it; None: the first): one forward repeats the chunk on the cache,
        whose KVzip maxima over the chunk's keys (``prefill_bound.scorer``) join the held keys'
        running maxima; its own keys are dropped; then every layer holding more than the
        bound's target is compressed to it."""
        bound = self.prefill_bound
        ids, n = self.repeat_prompt.chunk_input(piece, prev), cache.get_seq_length()

        def forwards():
            yield n - piece.shape[1], n  # the chunk's keys: the last the layers hold
            repeat_chunk(self.base, cache, ids, n)

        score_reconstruction(self, forwards, bound.scorer, n)
        for i, st in enumerate(self.layers):
            st.bound, st.kvzip = bound.carry(st.bound, st.kvzip), None
            k, v = cache_kv(cache, i)
            kept = bound.compresses(k.shape[2])
            if kept is not None:
                select.keep_positions(st, cache, i, bound.select(st.bound, kept, keys=k))
            else:  # out of the buffer that held the repetition too (a view would keep it)
                set_cache_kv(cache, i, k.clone(), v.clone())

    def _bounded_chunk(self, module, st: LayerState, cache, i: int, hs, kwargs) -> None:
        """After a bounded prefill's chunk ``hs`` [B, q, hidden] in layer ``i``: the prompt's
        compression after its last chunk, else the bound's (the recorded window queries stay,
        for the next chunk's to join); with a "max" or "far" signal every chunk's queries first
        raise the held keys' running maxima (``st.bound``); "reconstruct" compresses after the
        chunk's repetition (:meth:`_repeat_chunk`)."""
        end = self.seen + hs.shape[1]
        if end == self._prompt_end:
            kept = self.policy.kept_tokens(end)
            self.compressed_len = select.compress_layer(st, cache, i, self.policy, kept, None)
            self.prompt_len = end
            return
        bound = self.prefill_bound
        if bound.repeats:
            return
        k, v = cache_kv(cache, i)
        if bound.in_forward:
            cos, sin = kwargs["position_embeddings"]
            qn = scoring.post_rope_queries(module, hs, cos, sin).to(k.dtype)
            st.bound = bound.carry(st.bound, bound.scores(qn, k, getattr(module, "scaling", None)))
        kept = bound.compresses(k.shape[2])
        if kept is None:
            return
        if bound.signal == "window":
            queries = st.queries
            select.compress_layer(st, cache, i, self.policy, kept, None)
            st.queries = queries
            return
        select.keep_positions(st, cache, i, bound.select(st.bound, kept, keys=k))

    def _base_pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        x = ids if ids is not None else kwargs.get("inputs_embeds")
        b, q = x.shape[0], x.shape[1]
        cache = cache_arg(kwargs)
        held = cache.get_seq_length() if cache is not None else 0
        if self._splits(args, kwargs):  # the chunks' own forwards do the work
            self.reset()
            self._outer = True
            return args, kwargs
        if held == 0:
            self.reset()
        self._cache = cache
        self._refuse_rollback(held, kwargs.get("cache_position"))
        mask = kwargs.get("attention_mask")
        mask2d = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        new_valid = (mask2d[:, -q:].bool() if mask2d is not None
                     else torch.ones(b, q, dtype=torch.bool, device=x.device))
        self._new_valid = new_valid
        fixed = any(s.layout == FIXED for s in self.layers)
        if mask2d is not None and fixed and not bool(new_valid.all()):
            raise ValueError("attention_mask: new tokens on a streaming / h2o cache cannot be padding")
        if not self.compressed:
            self.seen = held
            if held == 0:
                self.prefill_valid = new_valid
            elif self.prefill_valid is not None:
                self.prefill_valid = torch.cat([self.prefill_valid, new_valid], 1)
            return args, kwargs
        pos = torch.arange(self.seen, self.seen + q, device=x.device)
        if self._has_cache_position and kwargs.get("cache_position") is None:
            kwargs["cache_position"] = pos
        if kwargs.get("position_ids") is None:
            cp = kwargs.get("cache_position")
            kwargs["position_ids"] = (pos if cp is None else cp).unsqueeze(0).expand(b, q)
        kwargs["attention_mask"] = None  # each attention layer gets its own mask (_attn_pre)
        return args, kwargs

    def _base_post(self, module, args, kwargs, output):
        if self._outer and self._prompt_end is None:  # the split forward's end
            self._outer = False
            return output
        self.seen += self._new_valid.shape[1]
        self._left = None if self._cache is None else self._cache.get_seq_length()
        self._cache = self._new_valid = None  # the forward's own: nothing outlives it
        return output

    def _refuse_rollback(self, held: int, cache_position) -> None:
        """A cache that was compressed, or whose decode evidence is recorded, cannot be
        rolled back: raises if it is shorter or longer than the last forward left it
        (cropped) or if the new tokens do not start where that forward ended."""
        if (not self.compressed and self.decode is None) or self.intercept is not None:
            return
        start = (int(cache_position[0]) if isinstance(cache_position, torch.Tensor)
                 and cache_position.numel() else self.seen)
        if held == 0 or ((self._left is None or held == self._left) and start == self.seen):
            return
        raise ValueError(
            f"cache_position: the new tokens start at position {start} of a cache holding "
            f"{held} tokens, but kvprune's last forward ended at position {self.seen} with "
            f"{self._left} tokens held: a compressed cache (or one under a decode-time rule) "
            "cannot be cropped or rolled back, as assisted and prompt-lookup generation do, "
            "nor handed to a second generate(); generate without candidates, from a new cache")

    def _attn_pre(self, module, args, kwargs):
        st = self.layers[module.layer_idx]
        if not st.compressed:
            return args, kwargs
        hs = kwargs.get("hidden_states", args[0] if args else None)
        b, q = hs.shape[:2]
        hq = module.config.num_attention_heads
        if st.layout == FIXED:  # the layer fills the mask once the new tokens are in their slots
            layer = self._cache.layers[module.layer_idx]
            kwargs["attention_mask"] = layer.expect(hq, q, hs.dtype)
            return args, kwargs
        past = st.slot_valid                                              # [B, Hkv, P]
        g = hq // past.shape[1]
        causal = torch.ones(q, q, dtype=torch.bool, device=hs.device).tril()
        new = self._new_valid[:, None, None, :] & causal                  # [B, 1, q, q]
        if bool(past.all()):
            pm = torch.ones(b, 1, q, past.shape[2], dtype=torch.bool, device=hs.device)
            allowed = torch.cat([pm, new], -1)
        else:
            pm = past.repeat_interleave(g, 1)[:, :, None, :].expand(b, hq, q, past.shape[2])
            allowed = torch.cat([pm, new.expand(b, hq, q, q)], -1)
        m = torch.zeros(allowed.shape, dtype=hs.dtype, device=hs.device)
        kwargs["attention_mask"] = m.masked_fill_(~allowed, torch.finfo(hs.dtype).min)
        return args, kwargs

    def _attn_post(self, module, args, kwargs, output):
        i = module.layer_idx
        st = self.layers[i]
        cache = cache_arg(kwargs)
        cache = self._cache if cache is None else cache  # (an empty DynamicCache is falsy)
        if cache is None:
            return output
        hs = kwargs.get("hidden_states", args[0] if args else None)
        q_len = hs.shape[1]
        if st.layout == FIXED:
            layer = cache.layers[i]
            if layer.h2o:
                cos, sin = kwargs["position_embeddings"]
                queries = scoring.post_rope_queries(module, hs, cos, sin).to(layer.keys.dtype)
                layer.accumulate(queries, scale=getattr(module, "scaling", None),
                                 gqa=self.policy.gqa)
            return output
        bounded = self._prompt_end is not None  # a chunk of a bounded prefill
        if st.compressed:  # masked or ragged: the new tokens join the slot validity
            nv = self._new_valid[:, None, :].expand(-1, st.slot_valid.shape[1], -1)
            st.slot_valid = torch.cat([st.slot_valid, nv], 2)
            self.peak_held = max(self.peak_held, st.slot_valid.shape[2])
            if not bounded:
                self._decode_step(module, st, cache, i, hs, kwargs)
                return output
        k, v = cache_kv(cache, i)
        self.peak_held = max(self.peak_held, k.shape[2])
        if self.intercept is not None:
            self.intercept(module, st, hs, kwargs["position_embeddings"], k, v)
            return output
        n_q = max(p.observed_queries(q_len) for p in self.observed)
        if n_q:
            cos, sin = kwargs["position_embeddings"]
            qn = scoring.post_rope_queries(module, hs[:, q_len - n_q:], cos[:, q_len - n_q:],
                                           sin[:, q_len - n_q:]).to(k.dtype)
            self._record(st, qn, k)
        if bounded:
            self._bounded_chunk(module, st, cache, i, hs, kwargs)
        elif self.compress_on_prefill and self.seen == 0 and k.shape[2] == q_len:  # a prefill
            n, held = k.shape[2], k.shape[2]
            if not isinstance(self.policy, policies.Full):  # full: plain attention, no masks
                held = select.compress_layer(st, cache, i, self.policy,
                                             self.policy.kept_tokens(n), self.prefill_valid)
            self.prompt_len, self.compressed_len = n, held
        else:
            self._decode_step(module, st, cache, i, hs, kwargs)
        return output

    def _decode_step(self, module, st: LayerState, cache, i: int, hs, kwargs) -> None:
        """The decode-time rule after a forward past the prompt (:mod:`~kvprune_cuda.hf.decode_step`)."""
        if self.decode is None or self.prompt_len is None:
            return
        generated = self.seen + hs.shape[1] - self.prompt_len
        if generated < 1:
            return
        kept = decode_step(self.decode, st, module, cache, i, hs, kwargs["position_embeddings"],
                           generated)
        if kept is not None:
            self.compressed_len = kept

    def _record(self, st: LayerState, qn: torch.Tensor, k: torch.Tensor) -> None:
        """Records the observed queries ``qn`` [B, Hq, n_q, D] for every observed policy."""
        window = max((p.window for p in self.observed if p.evidence == "window_queries"),
                     default=0)
        if window:
            scoring.record_queries(st, qn, window)
        for p in self.observed:
            if p.evidence == "attention":
                pad = scoring.left_padding(self.prefill_valid, k.shape[2])
                scoring.accumulate_h2o(st, p, qn, k, pad)
                break

    # ----------------------------------------------------------------- compression
    def selection_scores(self, cache, i: int, policy: Optional["policies.Policy"] = None
                         ) -> torch.Tensor:
        """fp32 [B, Hkv, n]: the scores ``policy`` (default the compressor's) ranks layer
        ``i``'s uncompressed, unpadded cache by (:func:`~kvprune_cuda.hf.scoring.selection_scores`)."""
        k = cache_kv(cache, i)[0]
        if scoring.left_padding(self.prefill_valid, k.shape[2]) is not None:
            raise ValueError("attention_mask: ranking scores needs rows without padding")
        return scoring.selection_scores(self.layers[i], policy or self.policy, k, i)

    def compress_layer(self, cache, i: int, scores: torch.Tensor,
                       kept: Optional[int] = None) -> None:
        """Compresses layer ``i`` of ``cache`` (uncompressed) to ``kept`` tokens per KV head
        (default the policy's count for its length), each head keeping the sinks, the window
        and its top ``scores`` (fp32 [B, Hkv, n], e.g. a scoring of your own)."""
        n = cache_kv(cache, i)[0].shape[2]
        kept = self.policy.kept_tokens(n) if kept is None else kept
        held = select.compress_layer(self.layers[i], cache, i, self.policy, kept,
                                     self.prefill_valid, scores)
        self.prompt_len, self.compressed_len, self._left = n, held, None

    def compress_cache(self, cache, policy: Optional["policies.Policy"] = None,
                       budget: Union[int, float, None] = None, scope: str = "layer") -> None:
        """Compresses every layer of ``cache`` now (e.g. a context before its question
        arrives) under ``policy`` (default the compressor's, which it then becomes) to
        ``budget`` (default the policy's) shared as ``scope`` says (:mod:`~kvprune_cuda.hf.select`)."""
        policy = policy or self.policy
        if budget is None:
            budget = policy.budget
        else:  # the policy ranks for the budget it keeps (kvzip's reservations are shares of it)
            policy = policies.make(policy, budget=budget)
        n = cache_kv(cache, 0)[0].shape[2]
        self.compressed_len = select.compress_cache(self.layers, cache, policy, budget, scope,
                                                    self.prefill_valid)
        self.prompt_len, self.policy, self._left = n, policy, None


PREFILL_CHUNK = 2048  # tokens per chunk of a bounded prefill, unless prefill_chunk says


@contextlib.contextmanager
def compress(model, policy: Union[str, "policies.Policy"] = "snapkv",
             budget: Union[int, float, None] = None, *, n_sink: Optional[int] = None,
             window: Optional[int] = None, kernel_size: Optional[int] = None,
             pool: Optional[str] = None, gqa: Optional[str] = None,
             pool_shift: Optional[int] = None,
             decode: Optional[str] = None, max_held: Optional[int] = None,
             interval: Optional[int] = None, prefill_max_held: Optional[int] = None,
             prefill_chunk: Optional[int] = None,
             prefill_signal: Optional[str] = None,
             prefill_novelty: Optional[float] = None, tokenizer=None,
             repeat_prompt: Optional[RepeatPrompt] = None) -> Iterator[KVCompressor]:
    """Within the block, ``model`` compresses its KV cache after each prefill to ``budget``
    tokens per layer (a fraction of the prompt in (0, 1] or a count; at least
    ``n_sink + window``) under ``policy`` ("full", "streaming", "snapkv", "h2o", or a
    :class:`~kvprune_cuda.policy.Policy`; see :mod:`kvprune_cuda.policy`; options left None
    keep the policy's own: budget 0.2, n_sink 4, window 32, kernel_size 49, pool_shift 16 for a name), and with ``decode`` ("streaming" | "snapkv" | "h2o") again every
    ``interval`` generated tokens once it holds more than ``max_held``
    (:class:`kvprune_cuda.policy.DecodeRule`). With ``prefill_max_held``, a prompt longer
    than ``prefill_chunk`` tokens (default 2048) is prefilled in chunks and compressed back to
    ``prefill_max_held`` tokens after every chunk that leaves more, so a layer never holds
    more than ``prefill_max_held + prefill_chunk`` tokens ("reconstruct": a chunk's repetition
    more), the held tokens ranked by
    ``prefill_signal`` ("max", the default: each key's largest attention from any prompt query
    so far; "far": from the queries at least ``window`` positions after it; "window": the
    policy's own selection; "reconstruct": KVzip's maxima from a forward that repeats each
    chunk after it, a second pass over the prompt, with ``repeat_prompt`` or one built from
    ``tokenizer`` (else the model's own; :class:`RepeatPrompt`), holding a chunk's repetition
    besides), ``prefill_novelty`` of each compression's kept tokens going first
    to each head's most novel keys (default 0) (:class:`kvprune_cuda.policy.PrefillBound`;
    rows without padding; the split forward returns the last chunk's hidden states). Yields the :class:`KVCompressor` (``prompt_len``, ``compressed_len``,
    ``peak_held``, ``nbytes``)."""
    options = policies.Options(n_sink=n_sink, window=window, kernel_size=kernel_size, pool=pool,
                               gqa=gqa, pool_shift=pool_shift)
    if tokenizer is not None:
        if prefill_signal != "reconstruct":
            raise ValueError("tokenizer: builds the repeat prompt of prefill_signal="
                             "'reconstruct' only")
        if repeat_prompt is not None:
            raise ValueError("tokenizer: give it or repeat_prompt, not both")
        repeat_prompt = RepeatPrompt.from_tokenizer(tokenizer)
    comp = KVCompressor(model, policy, budget, options=options, decode=decode, max_held=max_held,
                        interval=interval, prefill_max_held=prefill_max_held,
                        prefill_chunk=prefill_chunk, prefill_signal=prefill_signal,
                        prefill_novelty=prefill_novelty, repeat_prompt=repeat_prompt).attach()
    try:
        yield comp
    finally:
        comp.detach()

