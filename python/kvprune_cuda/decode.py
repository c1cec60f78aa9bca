"""Decode-time eviction: a fixed-capacity per-layer KV cache with a StreamingLLM
ring or H2O heavy-hitter eviction, and RoPE re-rotation of cached keys.

The cache of one layer is a handful of tensors the engine owns (``DecodeCache``):

========== ================================ =============================================
tensor     shape / dtype                    meaning
========== ================================ =============================================
k, v       [B, Hkv, C, D] fp16/bf16/fp32    key/value of the token in each slot (any
                                            strides, last dim contiguous)
slot_pos   int32 [B, Hkv, C]                original stream position of each slot's token,
                                            -1 = empty (per KV head: H2O heads diverge)
seq_lens   int32 [B]                        tokens seen so far per sequence (this layer's)
h2o_scores fp32 [B, Hkv, C]                 accumulated attention per slot (H2O only)
========== ================================ =============================================

Per decode step (all ops run on the tensors' device, CUDA on the current stream,
without host syncs, so a step can be captured in a CUDA graph):

StreamingLLM::

    kp.streaming_append(c.k, c.v, c.slot_pos, c.seq_lens, k_new, v_new, n_sink=4)
    out = kp.decode_scores(q, c.k, c.slot_pos, c.seq_lens, v_cache=c.v)   # or your attention

H2O::

    kp.streaming_append(c.k, c.v, c.slot_pos, c.seq_lens, k_new, v_new, n_sink=4, slots=next_slot)
    out = kp.decode_scores(q, c.k, c.slot_pos, c.seq_lens, c.h2o_scores, v_cache=c.v)
    next_slot = kp.h2o_evict(c.h2o_scores, c.slot_pos, c.seq_lens, n_sink=4, recent=32)

(``next_slot`` may start as ``None`` or anything while the cache is filling: slots are
only consulted for positions >= capacity.)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kvprune_cuda import _C  # noqa: F401  (loads the library that registers the ops)

_ops = torch.ops.kvprune

ROPE_LAYOUTS = ("neox", "gptj")


class Rope(NamedTuple):
    """Rotary embedding of the model, for re-rotating cached post-RoPE keys.

    Attributes:
        theta: base of the default frequencies ``inv_freq[i] = theta ** (-2i / rotary_dim)``.
        rotary_dim: rotated dims (even, <= D); ``None`` = the full head dim. Dims beyond it
            are left alone (partial rotary, e.g. GPT-NeoX / Phi).
        layout: ``"neox"`` pairs ``(i, i + rotary_dim/2)`` (rotate_half: Llama, Qwen,
            Mistral, NeoX); ``"gptj"`` pairs ``(2i, 2i+1)`` (interleaved: GPT-J, ChatGLM).
        inv_freq: optional fp32 [rotary_dim // 2] frequencies on the cache's device, for
            scaled RoPE (linear, NTK, Llama-3); overrides ``theta``.

    A key at position ``old`` moves to ``new`` by rotating each pair ``(x, y)`` by
    ``(new - old) * inv_freq[i]``: ``x' = x cos - y sin, y' = y cos + x sin``. The angle is
    formed and reduced in double precision, cos/sin and the rotation are fp32, the result
    is rounded once to the cache dtype.
    """

    theta: float = 10000.0
    rotary_dim: Optional[int] = None
    layout: str = "neox"
    inv_freq: Optional[torch.Tensor] = None

    def resolved(self, head_dim: int) -> tuple[float, int, str, Optional[torch.Tensor]]:
        """(theta, rotary_dim, layout, inv_freq) with rotary_dim defaulted to head_dim."""
        rotary_dim = head_dim if self.rotary_dim is None else int(self.rotary_dim)
        return float(self.theta), rotary_dim, self.layout, self.inv_freq


class DecodeCache(NamedTuple):
    """The fixed-capacity decode cache of one layer (see the module docstring)."""

    k: torch.Tensor           # [B, Hkv, C, D]
    v: torch.Tensor           # [B, Hkv, C, D]
    slot_pos: torch.Tensor    # int32 [B, Hkv, C], -1 = empty
    seq_lens: torch.Tensor    # int32 [B]
    h2o_scores: Optional[torch.Tensor]  # fp32 [B, Hkv, C] or None

    @classmethod
    def empty(
        cls,
        batch: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        h2o: bool = False,
    ) -> "DecodeCache":
        """An empty cache: slot_pos = -1, seq_lens = 0, h2o_scores = 0 (with ``h2o=True``)."""
        shape = (batch, kv_heads, capacity, head_dim)
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            torch.full((batch, kv_heads, capacity), -1, dtype=torch.int32, device=device),
            torch.zeros(batch, dtype=torch.int32, device=device),
            torch.zeros((batch, kv_heads, capacity), dtype=torch.float32, device=device) if h2o else None,
        )


def streaming_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    *,
    n_sink: int = 4,
    slots: Optional[torch.Tensor] = None,
) -> None:
    """Writes T new tokens per sequence into the fixed-capacity cache, in place. O(1) per token.

    Token ``t`` of row ``b`` has stream position ``p = seq_lens[b] + t`` and goes to slot:

    * ``p`` while ``p < C`` (the cache fills in order);
    * without ``slots`` (StreamingLLM): ``n_sink + (p - n_sink) % (C - n_sink)`` -- the sinks
      ``[0, n_sink)`` stay, the rest is a ring whose oldest token is overwritten. After any
      number of steps the cache holds exactly positions ``[0, n_sink)`` and the last
      ``C - n_sink`` positions. If one call writes more tokens than the ring holds, only the
      last ``C - n_sink`` of them are written;
    * with ``slots`` (H2O, int32 [B, Hkv, T], usually from :func:`h2o_evict`):
      ``slots[b, h, t]``; a value outside ``[0, C)`` drops the token. Slots of one row must
      be distinct.

    ``slot_pos[b, h, slot]`` is set to ``p`` and ``seq_lens`` is advanced by T (it counts
    tokens seen, not tokens held). Each layer owns its own ``seq_lens``.

    Args:
        k_cache, v_cache: [B, Hkv, C, D] caches (mutated).
        slot_pos: int32 [B, Hkv, C] positions per slot, -1 = empty (mutated).
        seq_lens: int32 [B] tokens seen so far (mutated: += T). Must be >= 0.
        k_new, v_new: [B, Hkv, T, D] post-RoPE keys / values of the new tokens, cache dtype.
        n_sink: attention sinks kept forever, ``0 <= n_sink < C``.
        slots: optional int32 [B, Hkv, T] destination slots for positions >= C.
    """
    _ops.streaming_append(k_cache, v_cache, slot_pos, seq_lens, k_new, v_new, n_sink, slots)


def rerotate_keys(
    k: torch.Tensor,
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    *,
    rope: Rope = Rope(),
) -> torch.Tensor:
    """Moves cached post-RoPE keys from positions ``old_pos`` to ``new_pos``, in place.

    ``k[b,h,s] <- R(new_pos[b,h,s] - old_pos[b,h,s]) k[b,h,s]`` (see :class:`Rope`), which
    equals applying RoPE at ``new_pos`` to the un-rotated key. Entries with a negative old
    or new position (empty slots) are left unchanged. Typical use: StreamingLLM with
    positions inside the cache (``new_pos`` = rank of the slot in the cache), or moving
    kept keys after a compaction.

    Args:
        k: [B, H, N, D] keys (any strides, last dim contiguous), rotated in place.
        old_pos, new_pos: int32 positions broadcastable to [B, H, N] (e.g. ``slot_pos``,
            or an ``arange(N)``), contiguous along the last dim.
        rope: the model's rotary embedding.

    Returns:
        ``k`` (the same tensor).
    """
    theta, rotary_dim, layout, inv_freq = rope.resolved(k.shape[-1])
    _ops.rerotate_keys(k, old_pos, new_pos, theta, rotary_dim, layout, inv_freq)
    return k


def decode_scores(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    slot_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    h2o_scores: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    gqa: str = "mean",
    v_cache: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Decode attention probabilities over the cache, accumulated into H2O scores.

    The T queries of row b are the last T appended tokens, at positions
    ``n - T + t`` (``n = seq_lens[b]``, i.e. call after :func:`streaming_append`). Query
    head h reads KV head ``g = h // (Hq // Hkv)`` and sees slot s iff
    ``0 <= slot_pos[b,g,s] <= n - T + t`` (causal among speculative tokens)::

        a[h,t,s]          = softmax_s(q[b,h,t] . k_cache[b,g,s] * scale)      (fp32)
        h2o_scores[b,g,s] += reduce_{h in g} sum_t a[h,t,s]      reduce = gqa: mean | max | sum
        out[b,h,t]        = sum_s a[h,t,s] v_cache[b,g,s]                      (with v_cache)

    A query that sees no slot contributes nothing and gets a zero output.

    Args:
        q: [B, Hq, T, D] post-RoPE decode queries (T = 1, or a few speculative tokens).
        k_cache: [B, Hkv, C, D] cache keys, dtype of q.
        slot_pos: int32 [B, Hkv, C]; seq_lens: int32 [B].
        h2o_scores: optional fp32 [B, Hkv, C], accumulated in place.
        scale: softmax scale, default 1/sqrt(D).
        gqa: how the query heads of a KV head combine into its score: "mean", "max", "sum".
        v_cache: optional [B, Hkv, C, D]; when given, the attention output is returned too,
            so an engine reads K once per step.

    Returns:
        [B, Hq, T, D] attention output (dtype of q) if ``v_cache`` is given, else None.
    """
    out = _ops.decode_scores(q, k_cache, slot_pos, seq_lens, h2o_scores, scale, gqa, v_cache)
    return out if v_cache is not None else None


def h2o_evict(
    h2o_scores: torch.Tensor,
    slot_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    n_sink: int = 4,
    recent: int = 32,
    num: int = 1,
) -> torch.Tensor:
    """Chooses (and frees) the slots the next ``num`` appended tokens of each (b, KV head) use.

    Token t of the next append has position ``p = seq_lens[b] + t``:

    * ``p < C``: its slot is ``p`` (the cache is still filling, nothing is evicted);
    * ``p >= C``: a slot is evicted -- a hole left by an earlier eviction if any (lowest slot
      first), else the slot with the lowest H2O score among tokens at positions
      ``[n_sink, seq_lens[b] - recent)`` (sinks and the ``recent`` newest tokens are never
      evicted); ties go to the oldest position. The evicted slot gets ``slot_pos = -1``
      and ``h2o_scores = 0`` (the new token starts from zero). Evicted slots are listed
      in ascending slot order after the in-order ones.

    Each KV head chooses on its own, so heads diverge. Calling it twice without an append
    in between returns the same slots. ``C >= n_sink + recent + num`` is required.

    Args:
        h2o_scores: fp32 [B, Hkv, C] (mutated). slot_pos: int32 [B, Hkv, C] (mutated).
        seq_lens: int32 [B] tokens seen so far.
        n_sink, recent: protected sinks and recent window. num: tokens of the next append
            (1 to 64).

    Returns:
        int32 [B, Hkv, num] slots, to pass as ``slots=`` to :func:`streaming_append`
        (-1 only if no candidate exists, which a consistent full cache never hits).
    """
    return _ops.h2o_evict(h2o_scores, slot_pos, seq_lens, n_sink, recent, num)
