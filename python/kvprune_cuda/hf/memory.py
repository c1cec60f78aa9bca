"""What a cache, a compressor or a compressed context holds, in bytes.

Counted by storage: each distinct tensor storage once, whole (a view that keeps a larger
buffer alive costs that buffer), so a report is what freeing the object would give back.
"""

from __future__ import annotations

import gc
import types
from typing import Iterable, Optional

import torch

from kvprune_cuda.hf._compat import cache_kv, num_layers


def tensor_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped)."""
    seen: dict = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[(s.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def layer_tensors(cache, layer_idx: int) -> list:
    """The tensors one layer of a DynamicCache holds (kvprune's layers list their own)."""
    layer = cache.layers[layer_idx] if hasattr(cache, "layers") else None
    if layer is not None and hasattr(layer, "tensors"):  # a FixedCapacityLayer / RaggedLayer
        return layer.tensors()
    return list(cache_kv(cache, layer_idx))


def layer_bytes(cache, layer_idx: int) -> int:
    """Bytes one layer of a DynamicCache holds: K and V (padding slots included), plus the
    positions, scores and index tensors of kvprune's own layers."""
    return tensor_bytes(layer_tensors(cache, layer_idx))


def kv_bytes(cache) -> int:
    """Bytes a DynamicCache holds, all layers (:func:`layer_bytes`)."""
    return sum(layer_bytes(cache, i) for i in range(num_layers(cache)))


def reachable_bytes(obj) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj`` through its attributes,
    containers and closures, not entering ``torch.nn.Module`` s (the model's weights), classes
    or Python modules: what freeing ``obj`` could give back. A check of any object's report
    (``nbytes``) that does not trust the report's own bookkeeping."""
    stop = (torch.nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
    seen, storages, todo = set(), {}, [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            storages[(s.device, s.data_ptr())] = s.nbytes()
            continue
        if isinstance(o, stop) and o is not obj:
            continue
        todo.extend(gc.get_referents(o))
    return sum(storages.values())
