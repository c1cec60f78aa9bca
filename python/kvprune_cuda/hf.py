"""Hugging Face ``transformers`` integration: compress a causal LM's KV cache with kvprune ops.

Optional: this module needs ``transformers`` (tested: 4.56.2, 5.2.0, 5.24.0) only at the point of use;
``import kvprune_cuda`` never imports it. Usage::

    import kvprune_cuda as kp
    with kp.hf.compress(model, policy="snapkv", budget=0.2, n_sink=4, window=32, kernel_size=7):
        out = model.generate(**inputs, max_new_tokens=32)

Policies (``budget``: a fraction of the prompt length in (0, 1], or a token count):

* ``"full"``      -- nothing is evicted (baseline; identical to plain ``generate``).
* ``"streaming"`` -- StreamingLLM: ``kp.streaming`` after prefill keeps the ``n_sink`` sinks and
  the most recent tokens, and each layer becomes a fixed-capacity ring of ``budget`` slots:
  ``kp.streaming_append`` writes every later token over the oldest non-sink one, in place.
* ``"snapkv"``    -- dual stage: sinks pinned + SnapKV voting by the real post-RoPE queries of
  the last ``window`` prompt positions of each layer, GQA-native (``kp.snapkv``, no repeated
  K), max/avg pooling, recent window kept. The cache then grows by the generated tokens
  (as in SnapKV).
* ``"h2o"``       -- heavy hitters: every query's attention probabilities (GQA-reduced,
  ``kp.window_scores``) accumulate into a per-key score; after prefill the cache keeps sinks,
  the last ``window`` tokens and the highest-score keys (``kp.select_keep`` /
  ``kp.gather_kv``), and each layer becomes a fixed-capacity cache of ``budget`` slots: per
  KV head, ``kp.h2o_evict`` frees the lowest-score slot outside sinks and recent window for
  each new token, ``kp.streaming_append`` writes it there and ``kp.decode_scores`` adds the
  step's attention to the scores.
* ``"kvzip"``     -- query-agnostic: keys scored by the model's attention while it reconstructs
  the context (:func:`compress_context` only: it runs the reconstruction forwards).

:func:`compress_context` (in ``hf_context``) prefills a context once, compresses it under any
policy, with a uniform budget, a global one per layer (``kp.layer_budgets``) or per KV head
(``kp.head_budgets``, a ragged per-head cache layer), and answers any number of
questions from it (``kvc.generate``).

How it hooks in: a forward hook on every attention module recomputes that layer's post-RoPE
queries from the layer input (the module's own ``q_proj`` / ``q_norm`` /
``apply_rotary_pos_emb``), keeps the last ``window`` of them, and compresses the layer's
``DynamicCache`` entry right after the prefill forward of that layer. Kept keys keep their
original RoPE rotation and new tokens keep their original positions (``cache_position`` /
``position_ids`` count tokens seen, not tokens held), so nothing is re-rotated. Once a cache
is compressed, the hooks build each layer's attention mask themselves (``[B, Hq, q, held+q]``,
additive), so left-padded batches and multi-token forwards on a compressed cache (e.g. a
question after a compressed context: the query-agnostic setting) stay exact. Streaming and h2o
layers are then :class:`~kvprune_cuda._hf_fixed.FixedCapacityLayer` s (a ``kp.DecodeCache``
in the DynamicCache): a forward of T tokens makes room for them, writes them in place and
attends over the ``budget`` slots, causal by position (StreamingLLM's order; at most
``budget - n_sink`` new tokens per forward, ``budget - n_sink - window`` for h2o). Left padding is
handled by shifting each row to right padding and passing ``seq_lens`` to the kernels.
Only ``DynamicCache`` (the default) with eager or SDPA attention is supported.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Iterator, Optional, Union

import torch

import kvprune_cuda as kp
from kvprune_cuda._hf_lse import attention_lse

POLICIES = ("full", "streaming", "snapkv", "h2o", "kvzip")
SOFTMAX = ("chunk", "all")  # kvzip: the keys a reconstruction query's softmax covers


def resolve_budget(budget: Union[int, float], n: int) -> int:
    """Tokens kept for a prompt of ``n`` tokens: ``round(budget * n)`` for a float in (0, 1], else ``budget``."""
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget: a float must be a fraction in (0, 1], got {budget}")
        return max(1, int(round(budget * n)))
    if int(budget) < 1:
        raise ValueError(f"budget: a token count must be >= 1, got {budget}")
    return int(budget)


def cache_kv(cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [B, Hkv, L, D] of one layer of a transformers DynamicCache."""
    if hasattr(cache, "layers"):
        lay = cache.layers[layer_idx]
        return lay.keys, lay.values
    return cache.key_cache[layer_idx], cache.value_cache[layer_idx]


def set_cache_kv(cache, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
    if hasattr(cache, "layers"):
        cache.layers[layer_idx].keys, cache.layers[layer_idx].values = k, v
    else:
        cache.key_cache[layer_idx], cache.value_cache[layer_idx] = k, v


def layer_bytes(cache, layer_idx: int) -> int:
    """Bytes of K and V one layer of a DynamicCache holds (padding slots included)."""
    if hasattr(cache, "layers") and hasattr(cache.layers[layer_idx], "nbytes"):  # per-head layer
        return cache.layers[layer_idx].nbytes()
    k, v = cache_kv(cache, layer_idx)
    if k is None or not k.numel():
        return 0
    return k.numel() * k.element_size() + v.numel() * v.element_size()


def kv_bytes(cache) -> int:
    """Bytes of K and V actually held by a DynamicCache (all layers, padding slots included)."""
    n = len(cache.layers) if hasattr(cache, "layers") else len(cache.key_cache)
    return sum(layer_bytes(cache, i) for i in range(n))


def _cache_arg(kwargs):
    """The cache a forward received (``past_key_values``; ``cache`` in transformers >= 5.2x)."""
    for name in ("past_key_values", "cache", "past_key_value"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def _shift_rows(x: torch.Tensor, shift: torch.Tensor, dim: int) -> torch.Tensor:
    """out[b, ..., j, ...] = x[b, ..., (j + shift[b]) mod N, ...] along ``dim`` (left -> right padding)."""
    n = x.shape[dim]
    idx = (torch.arange(n, device=x.device)[None, :] + shift[:, None]) % n  # [B, N]
    shape = [1] * x.dim()
    shape[0], shape[dim] = x.shape[0], n
    idx = idx.view(shape).expand_as(x)
    return torch.gather(x, dim, idx)


class _Layer:
    """Per-layer state: last-window post-RoPE queries, H2O scores, slot validity once compressed."""

    def __init__(self) -> None:
        self.q_win: Optional[torch.Tensor] = None   # [B, Hq, <=W, D]
        self.h2o: Optional[torch.Tensor] = None     # fp32 [B, Hkv, L], aligned with cache slots
        self.valid: Optional[torch.Tensor] = None   # bool [B, Hkv, L]; None = not compressed
        self.kvzip: Optional[torch.Tensor] = None   # fp32 [B, Hkv, n] reconstruction scores
        self.fixed = False  # a FixedCapacityLayer in the cache (streaming / h2o, compressed)
        self.ragged = False  # a RaggedLayer in the cache (a token count per KV head)


class KVCompressor:
    """Hooks that make ``model`` compress its DynamicCache. Prefer :func:`compress`.

    ``compress_on_prefill=False`` only records queries / scores (for :meth:`compress_cache`,
    e.g. to compress one captured prefill under several policies). Policy ``"kvzip"`` needs
    reconstruction forwards after the prefill (:meth:`score_reconstruction`; use
    :func:`compress_context`), so it only records.
    """

    def __init__(self, model, policy: str = "snapkv", budget: Union[int, float] = 0.2, *,
                 n_sink: int = 4, window: int = 32, kernel_size: int = 7, pool: str = "max",
                 gqa: str = "mean", compress_on_prefill: bool = True,
                 track_h2o: Optional[bool] = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
        if policy == "kvzip" and compress_on_prefill:
            raise ValueError("policy: 'kvzip' scores by reconstructing the context after its "
                             "prefill; use kp.hf.compress_context")
        resolve_budget(budget, 1)
        self.model = model
        self.policy, self.budget = policy, budget
        self.n_sink, self.window, self.kernel_size = int(n_sink), int(window), int(kernel_size)
        if isinstance(budget, int) and policy != "full" and budget < self._min_keep(policy):
            raise ValueError(f"budget: {budget} tokens < {self._min_keep(policy)}, the least "
                             f"policy {policy!r} keeps with n_sink = {n_sink}, window = {window}")
        self.pool, self.gqa = pool, gqa
        self.compress_on_prefill = compress_on_prefill
        self.track_h2o = (policy == "h2o") if track_h2o is None else track_h2o
        self.base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
        self.attn = [m for m in model.modules()
                     if hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "layer_idx")]
        if not self.attn:
            raise ValueError("model: no attention modules with q_proj/k_proj/layer_idx found")
        self._handles: list = []
        self._reconstructing: Optional[int] = None  # context length while scoring a reconstruction
        self.reconstruct_span: Optional[tuple[int, int]] = None  # context chunk being reconstructed
        params = inspect.signature(self.base.forward).parameters
        self._has_cache_position = "cache_position" in params
        self.reset()

    # ----------------------------------------------------------------- state
    def reset(self) -> None:
        """Forgets the sequence (a new prefill starts from an empty cache)."""
        self.layers = {m.layer_idx: _Layer() for m in self.attn}
        self.seen = 0                   # tokens processed so far (original positions)
        self.prompt_len: Optional[int] = None
        self.kept: Optional[int] = None  # tokens per layer right after compression (heads alike)
        self._prefill_valid: Optional[torch.Tensor] = None  # bool [B, N] of the prefill
        self._new_valid: Optional[torch.Tensor] = None      # bool [B, q] of the current forward
        self._cache = None

    @property
    def compressed(self) -> bool:
        return any(s.valid is not None or s.fixed for s in self.layers.values())

    def snapshot(self) -> dict:
        """The captured state (shares tensors; the hooks never modify them in place)."""
        return {"layers": {i: vars(s).copy() for i, s in self.layers.items()}, "seen": self.seen,
                "prompt_len": self.prompt_len, "kept": self.kept,
                "prefill_valid": self._prefill_valid}

    def restore(self, snap: dict) -> None:
        for i, d in snap["layers"].items():
            self.layers[i].__dict__.update(d)
        self.seen, self.prompt_len, self.kept = snap["seen"], snap["prompt_len"], snap["kept"]
        self._prefill_valid = snap["prefill_valid"]

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
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _base_pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        emb = kwargs.get("inputs_embeds")
        x = ids if ids is not None else emb
        b, q = x.shape[0], x.shape[1]
        cache = _cache_arg(kwargs)
        held = cache.get_seq_length() if cache is not None else 0
        if held == 0:
            self.reset()
        self._cache = cache
        mask = kwargs.get("attention_mask")
        mask2d = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        new_valid = (mask2d[:, -q:].bool() if mask2d is not None
                     else torch.ones(b, q, dtype=torch.bool, device=x.device))
        self._new_valid = new_valid
        if mask2d is not None and any(s.fixed for s in self.layers.values()) and not bool(new_valid.all()):
            raise ValueError("attention_mask: new tokens on a streaming / h2o cache cannot be padding")
        if not self.compressed:
            self.seen = held
            if held == 0:
                self._prefill_valid = new_valid
            elif self._prefill_valid is not None:
                self._prefill_valid = torch.cat([self._prefill_valid, new_valid], 1)
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
        self.seen += self._new_valid.shape[1]
        return output

    def _attn_pre(self, module, args, kwargs):
        st = self.layers[module.layer_idx]
        if st.valid is None and not st.fixed:
            return args, kwargs
        hs = kwargs.get("hidden_states", args[0] if args else None)
        b, q = hs.shape[:2]
        hq = module.config.num_attention_heads
        if st.fixed:  # the layer fills the mask once the new tokens are in their slots
            layer = self._cache.layers[module.layer_idx]
            kwargs["attention_mask"] = layer.expect(hq, q, hs.dtype)
            return args, kwargs
        past = st.valid                                                   # [B, Hkv, P]
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
        cache = _cache_arg(kwargs)
        cache = self._cache if cache is None else cache
        if cache is None:
            return output
        hs = kwargs.get("hidden_states", args[0] if args else None)
        q_len = hs.shape[1]
        if st.ragged:  # compressed per head: only the new tokens' validity to record
            self._append_valid(st)
            return output
        k, v = cache_kv(cache, i)
        if self._reconstructing is not None:
            self._fold_reconstruction(module, st, hs, kwargs["position_embeddings"], k)
            return output
        if st.fixed:
            if self.policy == "h2o":
                cos, sin = kwargs["position_embeddings"]
                cache.layers[i].accumulate(self._queries(module, hs, cos, sin).to(k.dtype),
                                           scale=getattr(module, "scaling", None), gqa=self.gqa)
            return output
        if self.policy == "full" and self.compress_on_prefill and st.valid is None:
            if self.seen == 0 and k.shape[2] == q_len:  # nothing to record: plain attention
                self.prompt_len = self.kept = q_len
            return output
        cos, sin = kwargs["position_embeddings"]
        n_q = q_len if self.track_h2o else min(q_len, self.window)
        qn = self._queries(module, hs[:, -n_q:], cos[:, -n_q:], sin[:, -n_q:]).to(k.dtype)
        w = qn[:, :, -self.window:]
        st.q_win = w if st.q_win is None else torch.cat([st.q_win, w], 2)[:, :, -self.window:]
        if self.track_h2o:
            self._accumulate_h2o(st, qn, k)
        if st.valid is not None:
            self._append_valid(st)
        elif self.compress_on_prefill and self.seen == 0 and k.shape[2] == q_len:
            if self.policy == "full":
                self.prompt_len = self.kept = q_len
            else:
                self.compress_layer(cache, i)
        return output

    # ----------------------------------------------------------------- pieces
    def _append_valid(self, st: _Layer) -> None:
        """The current forward's new tokens join a compressed layer's slot validity."""
        nv = self._new_valid[:, None, :].expand(-1, st.valid.shape[1], -1)
        st.valid = torch.cat([st.valid, nv], 2)

    @staticmethod
    def _queries(module, hs, cos, sin) -> torch.Tensor:
        """Post-RoPE queries [B, Hq, n, D] of ``hs`` [B, n, hidden], as the module computes them."""
        b, n = hs.shape[:2]
        q = module.q_proj(hs).view(b, n, -1, module.head_dim)
        if getattr(module, "q_norm", None) is not None:
            q = module.q_norm(q)
        q = q.transpose(1, 2)
        rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
        return rope(q, q, cos, sin)[0]

    def _left_pad(self, n_tok: int) -> Optional[torch.Tensor]:
        """Per-row left padding of the (uncompressed) cache, or None if there is none."""
        pv = self._prefill_valid
        if pv is None or pv.shape[1] != n_tok or bool(pv.all()):
            return None
        n = pv.sum(1)
        pad = pv.shape[1] - n
        ok = torch.arange(pv.shape[1], device=pv.device)[None, :] >= pad[:, None]
        if not torch.equal(ok, pv):
            raise ValueError("attention_mask: only left padding is supported")
        return pad

    def score_reconstruction(self, forward_chunks, gqa: Optional[str] = None,
                             softmax: str = "chunk") -> None:
        """KVzip scoring: runs ``forward_chunks()`` (teacher-forced reconstruction forwards on
        the uncompressed cache of a context of ``self.seen`` tokens) and folds, per layer, the
        maximum attention probability each context key gets from any reconstruction query
        (``kp.window_scores(qreduce="max", out=...)``; ``gqa``, default the compressor's,
        combines the query heads of a KV group). ``forward_chunks`` crops the cache back to the
        context after each forward.

        ``softmax``: which keys a reconstruction query's probabilities are normalised over.
        ``"chunk"`` (KVzip's own, and kvpress's ``KVzipPress``): the sinks, the context chunk
        it reconstructs and the reconstruction tokens; only that chunk's keys are scored, so
        ``forward_chunks`` must set ``self.reconstruct_span = (start, end)`` (the chunk's
        context positions) before each forward. ``"all"``: every key the query sees, the
        whole context included (the model's own attention probabilities)."""
        if softmax not in SOFTMAX:
            raise ValueError(f"softmax: expected one of {SOFTMAX}, got {softmax!r}")
        n = self.seen
        if self._left_pad(n) is not None:
            raise ValueError("context_ids: kvzip scoring needs rows without padding")
        snap = self.snapshot()
        self._reconstructing, self._reconstruct_gqa = n, gqa or self.gqa
        self._reconstruct_softmax, self.reconstruct_span = softmax, None
        self._reconstruct_lse = {}
        try:
            with attention_lse(self.model, self._reconstruct_lse):  # queries (+ lse for "all")
                forward_chunks()
        finally:
            self._reconstructing, self._reconstruct_lse = None, {}
            scores = {i: s.kvzip for i, s in self.layers.items()}
            self.restore(snap)
        for i, s in scores.items():
            self.layers[i].kvzip = s

    def _fold_reconstruction(self, module, st: _Layer, hs, rope, k) -> None:
        """One chunk's maxima into st.kvzip (k: [B, Hkv, n + r, D], the context and the r
        reconstruction tokens). Softmax "all": with the queries and lse of the layer's own
        attention call when it gave them (``_hf_lse``), else recomputed (two passes);
        "chunk": over the sinks, the chunk and the reconstruction keys (two passes)."""
        qn, lse = self._reconstruct_lse.pop(module.layer_idx, (None, None))
        if qn is None:
            qn = self._queries(module, hs, *rope)
        if st.kvzip is None:
            st.kvzip = torch.zeros(k.shape[0], k.shape[1], self._reconstructing,
                                   dtype=torch.float32, device=k.device)
        scale = getattr(module, "scaling", None)
        if self._reconstruct_softmax == "all":
            kp.window_scores(qn.to(k.dtype), k, lse=lse, scale=scale, gqa=self._reconstruct_gqa,
                             qreduce="max", out=st.kvzip)
            return
        if self.reconstruct_span is None:
            raise RuntimeError("softmax 'chunk': forward_chunks must set reconstruct_span "
                               "before each reconstruction forward")
        s, e = self.reconstruct_span
        sink, r = min(self.n_sink, s), hs.shape[1]
        keys = torch.cat([k[:, :, s:e], k[:, :, :sink], k[:, :, k.shape[2] - r:]], 2)
        chunk = st.kvzip[:, :, s:e].contiguous()  # the chunk's keys come first: out's M = e - s
        kp.window_scores(qn.to(k.dtype), keys, scale=scale, gqa=self._reconstruct_gqa,
                         qreduce="max", out=chunk)
        st.kvzip[:, :, s:e] = chunk

    def selection_scores(self, cache, i: int, policy: Optional[str] = None) -> torch.Tensor:
        """fp32 [B, Hkv, n]: the scores by which ``policy`` ranks layer ``i``'s (uncompressed,
        unpadded) cache: pooled window scores (snapkv), accumulated attention (h2o) or
        reconstruction maxima (kvzip)."""
        policy = policy or self.policy
        st = self.layers[i]
        k = cache_kv(cache, i)[0]
        if self._left_pad(k.shape[2]) is not None:
            raise ValueError("attention_mask: per-layer budgets need rows without padding")
        if policy == "snapkv":
            s = kp.window_scores(st.q_win, k, gqa=self.gqa)
            return kp.pool_scores(s, self.kernel_size, self.pool, window=self.window)
        return self._recorded_scores(st, policy, i)

    @staticmethod
    def _recorded_scores(st: _Layer, policy: str, i: int) -> torch.Tensor:
        s = {"h2o": st.h2o, "kvzip": st.kvzip}.get(policy)
        if s is None:
            raise RuntimeError(f"policy: {policy!r} has no scores recorded for layer {i} (h2o: "
                             "track_h2o=False?; kvzip: score_reconstruction not run)")
        return s

    def _accumulate_h2o(self, st: _Layer, qn: torch.Tensor, k: torch.Tensor) -> None:
        pad = self._left_pad(k.shape[2]) if st.valid is None else None
        if pad is None:
            s = kp.window_scores(qn, k, gqa=self.gqa)
        else:
            lens = (k.shape[2] - pad).to(torch.int32)
            s = _shift_rows(kp.window_scores(qn, _shift_rows(k, pad, 2), gqa=self.gqa,
                                             seq_lens=lens), -pad, 2)
        if st.h2o is not None and st.h2o.shape[2] <= s.shape[2]:
            s[:, :, : st.h2o.shape[2]] += st.h2o
        st.h2o = s

    def compress_layer(self, cache, i: int, policy: Optional[str] = None,
                       budget: Union[int, float, None] = None,
                       scores: Optional[torch.Tensor] = None) -> None:
        """Compresses layer ``i`` of ``cache`` (not yet compressed) with the captured queries,
        or by ``scores`` (fp32 [B, Hkv, n], unpadded rows: :meth:`selection_scores`) when given.
        Streaming and h2o layers become fixed-capacity caches of the budget's size."""
        policy = policy or self.policy
        st = self.layers[i]
        k, v = cache_kv(cache, i)
        b, hkv, n, _ = k.shape
        kb = resolve_budget(self.budget if budget is None else budget, n)
        if policy != "full":
            kb = max(kb, self._min_keep(policy))
        self.prompt_len = n
        pad = self._left_pad(n)
        fixed = policy in ("streaming", "h2o")
        if policy == "full" or (kb >= n and not fixed):
            valid = (torch.ones(b, n, dtype=torch.bool, device=k.device)
                     if self._prefill_valid is None or self._prefill_valid.shape[1] != n
                     else self._prefill_valid)
            st.valid = valid[:, None, :].expand(b, hkv, n).clone()
            self.kept = n
            return
        lens = None
        if pad is not None:
            k, v = _shift_rows(k, pad, 2), _shift_rows(v, pad, 2)
            lens = (n - pad).to(torch.int32)
        if kb >= n:  # streaming / h2o with room to spare: everything, the cache fills later
            pos = torch.arange(n, device=k.device, dtype=torch.int32).expand(b, hkv, n)
            kk, vv, idx = k, v, (pos if lens is None else
                                 torch.where(pos < lens[:, None, None], pos, -1))
        elif policy == "streaming":
            kk, vv, idx = kp.streaming(k, v, kb, n_sink=self.n_sink, seq_lens=lens)
        elif policy == "snapkv" and scores is None:
            kk, vv, idx = kp.snapkv(st.q_win, k, v, kb, n_sink=self.n_sink, window=self.window,
                                    kernel_size=self.kernel_size, pool=self.pool, gqa=self.gqa,
                                    seq_lens=lens)
        elif policy in ("snapkv", "h2o", "kvzip"):
            s = self._recorded_scores(st, policy, i) if scores is None else scores
            s = s if pad is None else _shift_rows(s, pad, 2)
            idx = kp.select_keep(s.contiguous(), kb, n_sink=self.n_sink, window=self.window,
                                 seq_lens=lens)
            kk, vv = kp.gather_kv(k, v, idx)
        else:
            raise ValueError(f"policy: {policy!r}")
        if st.h2o is not None:
            s = st.h2o if pad is None else _shift_rows(st.h2o, pad, 2)
            st.h2o = torch.gather(s, 2, idx.clamp_min(0).long()) * (idx >= 0)
        st.kvzip = None
        self.kept = min(kb, n)
        if not fixed:
            set_cache_kv(cache, i, kk.contiguous(), vv.contiguous())
            st.valid = idx >= 0
            return
        from kvprune_cuda._hf_fixed import fixed_layer

        seen = torch.full((b,), n, dtype=torch.int32, device=k.device) if lens is None else lens
        cache.layers[i] = fixed_layer(kk, vv, idx, seen, capacity=kb, n_sink=self.n_sink,
                                      recent=self.window,
                                      h2o_scores=(self._recorded_scores(st, policy, i)
                                                  if policy == "h2o" else None))
        st.h2o, st.fixed = None, True

    def compress_heads(self, cache, i: int, counts: torch.Tensor, scores: torch.Tensor) -> None:
        """Compresses layer ``i`` of ``cache`` (not yet compressed, unpadded rows) to
        ``counts[b, h]`` tokens per KV head (int64 [B, Hkv], e.g. a layer of
        :func:`kvprune_cuda.head_budgets`), each head keeping its top ``scores`` (fp32
        [B, Hkv, n]); the layer becomes a :class:`~kvprune_cuda._hf_ragged.RaggedLayer`."""
        from kvprune_cuda._hf_ragged import ragged_layer

        st = self.layers[i]
        k, v = cache_kv(cache, i)
        if self._left_pad(k.shape[2]) is not None:
            raise ValueError("attention_mask: per-head budgets need rows without padding")
        cache.layers[i] = ragged_layer(k, v, scores, counts, n_sink=self.n_sink, window=self.window)
        st.valid, st.ragged, st.kvzip, st.h2o = cache.layers[i].valid(), True, None, None
        self.prompt_len, self.kept = k.shape[2], None

    def _min_keep(self, policy: str) -> int:
        """The smallest budget ``policy`` can work with: sinks and window, plus, for the
        fixed-capacity policies, a ring slot (streaming) or a free slot for h2o's next token."""
        extra = {"streaming": 1 if self.window == 0 else 0, "h2o": 1}.get(policy, 0)
        return self.n_sink + self.window + extra

    def compress_cache(self, cache, policy: Optional[str] = None,
                       budget: Union[int, float, None] = None) -> None:
        """Compresses every layer of ``cache`` now (e.g. a context before its question arrives)."""
        for i in sorted(self.layers):
            if self.layers[i].valid is None:
                self.compress_layer(cache, i, policy, budget)
        if policy is not None:
            self.policy = policy
        if budget is not None:
            self.budget = budget


@contextlib.contextmanager
def compress(model, policy: str = "snapkv", budget: Union[int, float] = 0.2, *, n_sink: int = 4,
             window: int = 32, kernel_size: int = 7, pool: str = "max", gqa: str = "mean",
             ) -> Iterator[KVCompressor]:
    """Within the block, ``model`` compresses its KV cache after each prefill (see module doc).

    Yields the :class:`KVCompressor` (``.kept``, ``.prompt_len``; :func:`kv_bytes` of a cache).
    """
    kvc = KVCompressor(model, policy, budget, n_sink=n_sink, window=window,
                       kernel_size=kernel_size, pool=pool, gqa=gqa).attach()
    try:
        yield kvc
    finally:
        kvc.detach()


def __getattr__(name):
    # kp.hf.compress_context / CompressedContext live in hf_context, which imports this module:
    # resolved on first use, so either module can be imported first.
    if name in ("CompressedContext", "compress_context", "RepeatPrompt"):
        from kvprune_cuda import hf_context

        return getattr(hf_context, name)
    raise AttributeError(f"module 'kvprune_cuda.hf' has no attribute {name!r}")
