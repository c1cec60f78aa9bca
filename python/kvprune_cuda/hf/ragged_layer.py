"""A transformers cache layer whose KV heads hold different numbers of tokens (kp.hf's
``budget_scope="head"``).

The compressed context is packed: head ``(b, h)`` holds its ``lens[b, h]`` kept tokens,
ascending by position, one after the other in ``past_k`` / ``past_v`` ``[sum(lens), D]``, so
the memory of every evicted token is really freed. Tokens that arrive later (a question, the
answer) are appended to every head alike, dense ``[B, Hkv, t, D]``.

A forward gets, from :meth:`RaggedLayer.update`, a padded copy ``[B, Hkv, P + t, D]``
(``P = max(lens)``): each head's kept tokens, zero rows up to ``P``, then the appended tokens.
kp.hf's hooks mask the padding (:meth:`RaggedLayer.valid`). The copy lives for one layer's
attention call: at most one layer's ``P + t`` tokens per head of transient memory.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import DynamicLayer

import kvprune_cuda as kp


class RaggedLayer(DynamicLayer):
    """One layer of a DynamicCache with a token count per KV head (see module doc).

    ``keys`` / ``values`` are the padded ``[B, Hkv, P + t, D]`` view attention sees, built on
    each access; :attr:`tokens` / :meth:`nbytes` are what the layer holds. A DynamicLayer
    (whose mask sizes and maximum length, version-dependent methods, come from
    :meth:`get_seq_length`) that cannot be cropped, offloaded or reset.
    """

    is_croppable = False

    def __init__(self, past_k: torch.Tensor, past_v: torch.Tensor, lens: torch.Tensor,
                 new_k: Optional[torch.Tensor] = None, new_v: Optional[torch.Tensor] = None) -> None:
        # past_k / past_v: [sum(lens), D]; lens: int64 [B, Hkv] (CPU); new_k / new_v: [B, Hkv, t, D]
        self.past_k, self.past_v, self.lens = past_k, past_v, lens
        self.width = int(lens.max()) if lens.numel() else 0  # P: the longest head's kept tokens
        b, hkv = lens.shape
        d = past_k.shape[-1]
        empty = past_k.new_empty(b, hkv, 0, d)
        self.new_k = empty if new_k is None else new_k
        self.new_v = empty if new_v is None else new_v
        self.dtype, self.device = past_k.dtype, past_k.device
        self.is_initialized = True
        valid = torch.arange(self.width)[None, None, :] < lens[..., None]  # [B, Hkv, P]
        self._valid = valid.to(self.device)
        head, pos = valid.view(b * hkv, self.width).nonzero(as_tuple=True)  # of each packed token
        # int32 [sum(lens)]: the packed tokens' head (b * Hkv + h) and slot in the padded view
        self._head = head.to(device=self.device, dtype=torch.int32)
        self._pos = pos.to(device=self.device, dtype=torch.int32)

    @classmethod
    def from_selection(cls, k: torch.Tensor, v: torch.Tensor, idx: list) -> "RaggedLayer":
        """The layer holding, for each head, ``k``/``v`` [B, Hkv, n, D] at the positions
        ``idx[b][h]`` (int64 1D, ascending)."""
        b, hkv = k.shape[:2]
        rows = [(i, h) for i in range(b) for h in range(hkv)]
        lens = torch.tensor([[idx[i][h].numel() for h in range(hkv)] for i in range(b)],
                            dtype=torch.int64)
        pick = lambda x: torch.cat([x[i, h].index_select(0, idx[i][h]) for i, h in rows])  # noqa: E731
        return cls(pick(k), pick(v), lens)

    # ----------------------------------------------------------------- what it holds
    @property
    def tokens(self) -> torch.Tensor:
        """int64 [B, Hkv]: tokens held per head (kept context + appended)."""
        return self.lens + self.new_k.shape[2]

    def tensors(self) -> list:
        """What the layer holds: the packed and appended K/V, the counts, the padded view's
        validity and the packed tokens' int32 slot indices."""
        return [self.past_k, self.past_v, self.new_k, self.new_v, self.lens, self._valid,
                self._head, self._pos]

    def valid(self) -> torch.Tensor:
        """bool [B, Hkv, P]: which slots of the padded context part hold a token."""
        return self._valid

    def fork(self) -> "RaggedLayer":
        """A layer sharing this one's context tensors (never written), nothing appended."""
        return RaggedLayer(self.past_k, self.past_v, self.lens)

    # ----------------------------------------------------------------- the cache layer
    def _padded(self, past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, P + t, D]: no host sync (the packed tokens' slots are precomputed)."""
        b, hkv, t, d = new.shape
        out = past.new_zeros(b, hkv, self.width + t, d)
        slot = self._head.long() * (self.width + t) + self._pos
        out.view(-1, d).index_copy_(0, slot, past)
        out[:, :, self.width:] = new
        return out

    @property
    def keys(self) -> torch.Tensor:
        return self._padded(self.past_k, self.new_k)

    @property
    def values(self) -> torch.Tensor:
        return self._padded(self.past_v, self.new_v)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a RaggedLayer is built from a selection, never lazily")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Appends ``[B, Hkv, T, D]`` to every head; returns the padded K and V."""
        self.new_k = torch.cat([self.new_k, key_states], 2)
        self.new_v = torch.cat([self.new_v, value_states], 2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.width + self.new_k.shape[2]

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a per-head (ragged) cache layer cannot be cropped")

    def offload(self) -> None:
        raise NotImplementedError("a per-head (ragged) cache layer cannot be offloaded")

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        raise NotImplementedError("a per-head (ragged) cache layer cannot be reset in place")

    def _rows(self, rows: torch.Tensor) -> None:
        """Keeps batch rows ``rows`` (int64 1D, repeats allowed), in that order."""
        rows = rows.cpu()
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), self.lens.reshape(-1).cumsum(0)])
        hkv = self.lens.shape[1]
        pieces = [(int(starts[r * hkv + h]), int(starts[r * hkv + h + 1]))
                  for r in rows.tolist() for h in range(hkv)]
        take = lambda x: torch.cat([x[a:b] for a, b in pieces])  # noqa: E731
        dev = self.new_k.device
        self.__init__(take(self.past_k), take(self.past_v), self.lens[rows],
                      self.new_k[rows.to(dev)], self.new_v[rows.to(dev)])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(torch.arange(self.lens.shape[0]).repeat_interleave(repeats))


def ragged_layer(k: torch.Tensor, v: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor, *,
                 n_sink: int, window: int) -> RaggedLayer:
    """The per-head compressed layer of ``k``/``v`` [B, Hkv, n, D] (unpadded rows): head
    ``(b, h)`` keeps :func:`kvprune_cuda.select_keep` of its ``scores`` (fp32 [B, Hkv, n])
    with budget ``counts[b, h]`` (int64 [B, Hkv], e.g. a layer of
    :func:`kvprune_cuda.head_budgets`; at most ``n`` are kept, so no index is -1)."""
    b, hkv, n = scores.shape
    idx = [[None] * hkv for _ in range(b)]
    for i in range(b):
        for h in range(hkv):
            idx[i][h] = kp.select_keep(scores[i:i + 1, h:h + 1].contiguous(),
                                       min(int(counts[i, h]), n), n_sink=n_sink,
                                       window=window)[0, 0].long()
    return RaggedLayer.from_selection(k, v, idx)
