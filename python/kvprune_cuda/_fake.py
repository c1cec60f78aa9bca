"""Fake (meta) implementations of every op (prefill, paged and decode): output shapes for
torch.compile and FakeTensor tracing."""

from __future__ import annotations

import torch

from kvprune_cuda import _C  # noqa: F401  (the op schemas must exist before registering)


def _kept(k: torch.Tensor, budget: int) -> torch.Tensor:
    return k.new_empty((k.shape[0], k.shape[1], budget, k.shape[3]))


@torch.library.register_fake("kvprune::window_scores")
def _window_scores(q, k, lse, scale, gqa, seq_lens, qreduce="sum", k_scale=None,
                   query_weight=None, key_weight=None):
    return q.new_empty((q.shape[0], k.shape[1], k.shape[2]), dtype=torch.float32)


@torch.library.register_fake("kvprune::window_scores_out")
def _window_scores_out(q, k, lse, scale, gqa, seq_lens, qreduce, out, k_scale=None,
                       query_weight=None, key_weight=None):
    return None


@torch.library.register_fake("kvprune::pool_scores")
def _pool_scores(scores, kernel_size, mode, window, seq_lens, shift=0):
    return torch.empty_like(scores)


@torch.library.register_fake("kvprune::select_keep")
def _select_keep(scores, budget, n_sink, window, seq_lens):
    return scores.new_empty((scores.shape[0], scores.shape[1], budget), dtype=torch.int32)


@torch.library.register_fake("kvprune::gather_kv")
def _gather_kv(k, v, idx):
    return _kept(k, idx.shape[2]), _kept(v, idx.shape[2])


@torch.library.register_fake("kvprune::gather_kv_out")
def _gather_kv_out(k, v, idx, out_k, out_v):
    return None


@torch.library.register_fake("kvprune::snapkv")
def _snapkv(q, k, v, budget, n_sink, window, kernel_size, pool, gqa, lse, scale, seq_lens,
            k_scale=None, pool_shift=0):
    idx = k.new_empty((k.shape[0], k.shape[1], budget), dtype=torch.int32)
    return _kept(k, budget), _kept(v, budget), idx


@torch.library.register_fake("kvprune::snapkv_out")
def _snapkv_out(q, k, v, budget, n_sink, window, kernel_size, pool, gqa, lse, scale, seq_lens,
                out_k, out_v, k_scale=None, pool_shift=0):
    return k.new_empty((k.shape[0], k.shape[1], budget), dtype=torch.int32)


@torch.library.register_fake("kvprune::snapkv_select")
def _snapkv_select(q, k, budget, n_sink, window, kernel_size, pool, gqa, lse, scale, seq_lens,
                   k_scale=None, pool_shift=0):
    return k.new_empty((k.shape[0], k.shape[1], budget), dtype=torch.int32)


@torch.library.register_fake("kvprune::streaming")
def _streaming(k, v, budget, n_sink, seq_lens):
    idx = k.new_empty((k.shape[0], k.shape[1], budget), dtype=torch.int32)
    return _kept(k, budget), _kept(v, budget), idx


@torch.library.register_fake("kvprune::paged_window_scores")
def _paged_window_scores(q, k_cache, block_table, seq_lens, lse, scale, gqa, layout, k_scale=None):
    heads, block_size = (k_cache.shape[2], k_cache.shape[1]) if layout == "NHD" else k_cache.shape[1:3]
    return q.new_empty((q.shape[0], heads, block_table.shape[1] * block_size), dtype=torch.float32)


@torch.library.register_fake("kvprune::paged_compact")
def _paged_compact(k_cache, v_cache, block_table, seq_lens, idx, layout):
    return torch.empty_like(seq_lens)


# ------------------------------------------------------------------ decode ops
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


@torch.library.register_fake("kvprune::gather_kv_rope")
def _gather_kv_rope(k, v, idx, theta, rotary_dim, layout, inv_freq):
    return _kept(k, idx.shape[2]), _kept(v, idx.shape[2])


@torch.library.register_fake("kvprune::gather_kv_rope_out")
def _gather_kv_rope_out(k, v, idx, out_k, out_v, theta, rotary_dim, layout, inv_freq):
    return None
