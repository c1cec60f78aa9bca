"""kvprune_cuda: KV-cache compression kernels for LLM inference.

StreamingLLM attention sinks + SnapKV observation-window voting with 1-D pooling,
as PyTorch ops on CPU and CUDA (``torch.ops.kvprune.*``), plus a torch-free C++
core. See README.md for the semantics; ``kvprune_cuda.reference`` is the spec in
plain PyTorch.
"""

from kvprune_cuda import _fake  # noqa: F401  (registers every op's fake impl for torch.compile)
from kvprune_cuda import paged  # noqa: F401  (kp.paged.*: engine-native block-table caches)
from kvprune_cuda import policy  # noqa: F401  (kp.policy: the compression policies, torch-only)
from kvprune_cuda import testing  # noqa: F401  (kp.testing.emulate_cuda)
from kvprune_cuda._ops import (
    KeptKV,
    build_info,
    cpu_workspace_bytes,
    gather_kv,
    pool_scores,
    release_cpu_workspace,
    select_keep,
    snapkv,
    snapkv_select,
    streaming,
    window_scores,
)
from kvprune_cuda.budget import head_budgets, layer_budgets
from kvprune_cuda.decode import (
    DecodeCache,
    Rope,
    decode_scores,
    h2o_evict,
    rerotate_keys,
    streaming_append,
)

__version__ = build_info()["version"]


def __getattr__(name):
    # ``kp.hf`` (Hugging Face) and ``kp.vllm`` are imported on first use only: they need
    # ``transformers`` / ``vllm``, which the core package does not depend on.
    if name in ("hf", "vllm"):
        import importlib

        return importlib.import_module(f"kvprune_cuda.{name}")
    raise AttributeError(f"module 'kvprune_cuda' has no attribute {name!r}")

__all__ = [
    "KeptKV",
    "build_info",
    "cpu_workspace_bytes",
    "release_cpu_workspace",
    "gather_kv",
    "pool_scores",
    "select_keep",
    "snapkv",
    "snapkv_select",
    "streaming",
    "window_scores",
    "layer_budgets",
    "head_budgets",
    "DecodeCache",
    "Rope",
    "decode_scores",
    "h2o_evict",
    "rerotate_keys",
    "streaming_append",
]
