"""Fake (meta) implementations of the decode ops, for torch.compile and FakeTensor tracing."""

from __future__ import annotations

import torch

from kvprune_cuda import _C  # noqa: F401  (the op schemas must exist before registering)


@torch.library.register_fake("kvprune::streaming_append")
def _streaming_append(k_cache, v_cache, slot_pos, seq_lens, k_new, v_new, n_sink, slots):
    return None


@torch.library.register_fake("kvprune::rerotate_keys")
def _rerotate_keys(k, old_pos, new_pos, theta, rotary_dim, layout, inv_freq):
    return None


@torch.library.register_fake("kvprune::decode_scores")
def _decode_scores(q, k_cache, slot_pos, seq_lens, h2o_scores, scale, gqa, v_cache):
    if v_cache is None:
        return q.new_empty((0,))
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("kvprune::h2o_evict")
def _h2o_evict(h2o_scores, slot_pos, seq_lens, n_sink, recent, num):
    return slot_pos.new_empty((slot_pos.shape[0], slot_pos.shape[1], num))


def _kept(k: torch.Tensor, budget: int) -> torch.Tensor:
    return k.new_empty((k.shape[0], k.shape[1], budget, k.shape[3]))


@torch.library.register_fake("kvprune::gather_kv_rope")
def _gather_kv_rope(k, v, idx, theta, rotary_dim, layout, inv_freq):
    return _kept(k, idx.shape[2]), _kept(v, idx.shape[2])


@torch.library.register_fake("kvprune::gather_kv_rope_out")
def _gather_kv_rope_out(k, v, idx, out_k, out_v, theta, rotary_dim, layout, inv_freq):
    return None
