"""What differs between the supported transformers versions (4.56.2 .. 5.24), in one place:
how a DynamicCache stores its layers, what a forward calls its cache argument, whether it
takes ``cache_position``, and where a model family keeps its RoPE function."""

from __future__ import annotations

import inspect
import sys

import torch


def cache_kv(cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [B, Hkv, L, D] of one layer of a transformers DynamicCache."""
    if hasattr(cache, "layers"):
        lay = cache.layers[layer_idx]
        return lay.keys, lay.values
    return cache.key_cache[layer_idx], cache.value_cache[layer_idx]


def set_cache_kv(cache, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Replaces one layer's (keys, values) [B, Hkv, L, D]."""
    if hasattr(cache, "layers"):
        cache.layers[layer_idx].keys, cache.layers[layer_idx].values = k, v
    else:
        cache.key_cache[layer_idx], cache.value_cache[layer_idx] = k, v


def num_layers(cache) -> int:
    return len(cache.layers) if hasattr(cache, "layers") else len(cache.key_cache)


def cache_arg(kwargs: dict):
    """The cache a forward received (``past_key_values``; ``cache`` in transformers >= 5.2x)."""
    for name in ("past_key_values", "cache", "past_key_value"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def cache_name(module) -> str:
    """The forward's cache argument: ``cache`` from transformers 5.2x, ``past_key_values`` before."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def takes_cache_position(module) -> bool:
    """Whether ``module.forward`` has a ``cache_position`` argument (it went in 5.2x)."""
    return "cache_position" in inspect.signature(module.forward).parameters


def rope(module):
    """The ``apply_rotary_pos_emb`` of the attention module's model family."""
    return sys.modules[type(module).__module__].apply_rotary_pos_emb


def new_dynamic_cache():
    from transformers import DynamicCache

    return DynamicCache()
