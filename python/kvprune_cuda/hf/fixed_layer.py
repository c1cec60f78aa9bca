"""A transformers cache layer that is a fixed-capacity kvprune decode cache (kp.hf's "streaming"
and "h2o" once a prefill is compressed).

A forward of T new tokens on a layer of capacity C:

1. makes room and writes the tokens in place (:func:`kvprune_cuda.streaming_append`):
   streaming overwrites the T oldest non-sink slots of its ring; h2o first frees, per KV head,
   the T slots of lowest accumulated attention outside the sinks and the ``recent`` newest
   tokens (:func:`kvprune_cuda.h2o_evict`, in pieces of at most 64 tokens, each piece also
   protecting the pieces written before it);
2. the model attends over the C slots, causally by position: query t (position
   ``seq_lens - T + t``) sees slot s iff ``0 <= slot_pos[s] <= seq_lens - T + t`` (the additive
   mask is filled by :meth:`FixedCapacityLayer.update`);
3. h2o adds this forward's attention to the slot scores (:func:`kvprune_cuda.decode_scores`,
   called by kp.hf's hooks after the attention).

This is StreamingLLM's own order (room for the incoming tokens first, then attention over the
cache); H2O's victims are chosen from the scores accumulated before the new tokens arrive.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import DynamicLayer

import kvprune_cuda as kp

H2O_EVICT_MAX = 64  # kp.h2o_evict's largest ``num``


class FixedCapacityLayer(DynamicLayer):
    """One layer of a DynamicCache held in a :class:`kvprune_cuda.DecodeCache` (see module doc).

    ``keys`` / ``values`` are the cache's ``[B, Hkv, C, D]`` slot tensors, so code that reads a
    DynamicCache layer sees the slots (in slot order, not position order).
    """

    def __init__(self, cache: kp.DecodeCache, *, n_sink: int, recent: int) -> None:
        super().__init__()
        self.decode = cache
        self.n_sink, self.recent = int(n_sink), int(recent)
        self.keys, self.values = cache.k, cache.v
        self.dtype, self.device = cache.k.dtype, cache.k.device
        self.is_initialized = True
        self._mask: Optional[torch.Tensor] = None  # [B, Hq, T, C] to fill at the next update

    @property
    def capacity(self) -> int:
        return self.decode.k.shape[2]

    @property
    def h2o(self) -> bool:
        return self.decode.h2o_scores is not None

    def copy(self) -> "FixedCapacityLayer":
        """An independent copy (every tensor cloned), e.g. to decode one question of many."""
        c = kp.DecodeCache(*(None if t is None else t.clone() for t in self.decode))
        return FixedCapacityLayer(c, n_sink=self.n_sink, recent=self.recent)

    def tensors(self) -> list:
        """What the layer holds: K/V slots, their int32 positions, the rows' int32 token
        counts and h2o's fp32 slot scores."""
        return [t for t in self.decode if t is not None]

    def room(self) -> int:
        """The most new tokens one forward may bring (they must not evict each other)."""
        return self.capacity - self.n_sink - (self.recent if self.h2o else 0)

    def expect(self, query_heads: int, num_new: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive attention mask ``[B, query_heads, num_new, C]`` the next :meth:`update`
        fills once the new tokens are in their slots."""
        if num_new > self.room():
            what = "sinks and recent window" if self.h2o else "sinks"
            raise ValueError(
                f"input_ids: a forward of {num_new} new tokens does not fit a fixed-capacity "
                f"cache of {self.capacity} slots whose {what} take {self.capacity - self.room()}"
                f" (at most {self.room()} per forward)")
        b = self.decode.k.shape[0]
        self._mask = torch.zeros(b, query_heads, num_new, self.capacity, dtype=dtype,
                                 device=self.device)
        return self._mask

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Writes the ``[B, Hkv, T, D]`` new keys/values in place; returns the slot tensors."""
        c, t = self.decode, key_states.shape[2]
        if not self.h2o:
            kp.streaming_append(c.k, c.v, c.slot_pos, c.seq_lens, key_states, value_states,
                                n_sink=self.n_sink)
        for s in range(0, t if self.h2o else 0, H2O_EVICT_MAX):
            m = min(H2O_EVICT_MAX, t - s)
            slots = kp.h2o_evict(c.h2o_scores, c.slot_pos, c.seq_lens, n_sink=self.n_sink,
                                 recent=self.recent + s, num=m)
            kp.streaming_append(c.k, c.v, c.slot_pos, c.seq_lens, key_states[:, :, s:s + m],
                                value_states[:, :, s:s + m], n_sink=self.n_sink, slots=slots)
        if self._mask is not None:
            self._fill_mask(self._mask, t)
            self._mask = None
        return c.k, c.v

    def _fill_mask(self, mask: torch.Tensor, t: int) -> None:
        c = self.decode
        pos = c.seq_lens[:, None] - t + torch.arange(t, device=self.device, dtype=torch.int32)
        sp = c.slot_pos[:, :, None, :]                                    # [B, Hkv, 1, C]
        seen = (sp >= 0) & (sp <= pos[:, None, :, None])                  # [B, Hkv, T, C]
        seen = seen.repeat_interleave(mask.shape[1] // seen.shape[1], 1)
        mask.masked_fill_(~seen, torch.finfo(mask.dtype).min)

    def accumulate(self, queries: torch.Tensor, *, scale: Optional[float], gqa: str) -> None:
        """h2o: adds the attention of this forward's post-RoPE ``queries`` [B, Hq, T, D]."""
        c = self.decode
        kp.decode_scores(queries, c.k, c.slot_pos, c.seq_lens, c.h2o_scores, scale=scale, gqa=gqa)

    def get_seq_length(self) -> int:
        return self.capacity

    def get_max_cache_shape(self) -> int:
        return self.capacity

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a fixed-capacity (streaming / h2o) cache cannot be cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.decode = kp.DecodeCache(*(None if x is None else x.repeat_interleave(repeats, 0)
                                       for x in self.decode))
        self.keys, self.values = self.decode.k, self.decode.v

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.decode = kp.DecodeCache(*(None if x is None else x[indices] for x in self.decode))
        self.keys, self.values = self.decode.k, self.decode.v


def fixed_layer(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, seen: torch.Tensor, *,
                capacity: int, n_sink: int, recent: int,
                h2o_scores: Optional[torch.Tensor] = None) -> FixedCapacityLayer:
    """A layer of ``capacity`` slots holding the tokens ``k``/``v`` [B, Hkv, m, D] (m <= capacity)
    at positions ``idx`` int32 [B, Hkv, m] (ascending, -1 = none), ``seen`` int32 [B] tokens
    seen per row. With ``h2o_scores`` (fp32 [B, Hkv, m]) an h2o layer, tokens in slots
    ``0..m-1``; else a streaming ring, each position in the slot kp.streaming_append gives it
    (``p`` below ``n_sink``, else ``n_sink + (p - n_sink) % (capacity - n_sink)``), so the
    ring goes on overwriting the oldest."""
    b, hkv, m, d = k.shape
    c = kp.DecodeCache.empty(b, hkv, capacity, d, dtype=k.dtype, device=k.device,
                             h2o=h2o_scores is not None)
    dest = torch.arange(m, device=k.device).expand(b, hkv, m)
    if h2o_scores is None:
        ring = torch.where(idx < n_sink, idx, n_sink + (idx - n_sink) % (capacity - n_sink))
        dest = torch.where(idx >= 0, ring.long(), dest)
    else:
        c.h2o_scores[:, :, :m] = h2o_scores
    c.k.scatter_(2, dest[..., None].expand(b, hkv, m, d), k)
    c.v.scatter_(2, dest[..., None].expand(b, hkv, m, d), v)
    c.slot_pos.scatter_(2, dest, idx.to(torch.int32))
    c.seq_lens.copy_(seen)
    return FixedCapacityLayer(c, n_sink=n_sink, recent=recent)
