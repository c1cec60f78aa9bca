"""Which vLLM configurations kvprune_cuda.vllm runs, and the refusal of every other one.

The scheduler and each worker call :func:`check_engine` when the engine starts, so an engine
(or an OpenAI server) with a setting the integration does not support fails to start, with an
error naming the setting, instead of answering wrongly. docs/vllm.md's configuration matrix
lists each setting as tested or refused, with its test.
"""

from __future__ import annotations

from typing import Optional

from kvprune_cuda.vllm.cpu_cache import FP8_CACHE_DTYPES

# kv_cache_dtype values the CPU cache compaction addresses (tests/vllm_engine covers each)
KV_CACHE_DTYPES = ("auto",) + tuple(FP8_CACHE_DTYPES)


def _speculative(config, rule) -> Optional[str]:
    """Speculative decoding runs beside the prompt's compression with n-gram drafts only: a
    drafter with a model of its own keeps KV layers that kvprune would not compact; and not
    with a decode-time rule, whose compaction steps would count drafts vLLM may reject."""
    spec = getattr(config, "speculative_config", None)
    if spec is None:
        return None
    if rule is not None:
        return ("speculative_config: kvprune_cuda.vllm's decode-time rule (decode=) does not "
                "run with speculative decoding; compress the prompt only (decode=None) or turn "
                "speculative decoding off")
    method = getattr(spec, "method", None)
    if method != "ngram":
        return (f"speculative_config: kvprune_cuda.vllm runs beside n-gram drafts only (method "
                f"'ngram'), not {method!r}, whose draft model keeps a KV cache kvprune does not "
                "compact")
    return None


def _scheduling(config, rule) -> Optional[str]:
    sched = getattr(config, "scheduler_config", None)
    if getattr(sched, "async_scheduling", False):
        return ("async_scheduling: the next step is scheduled before this one's blocks are "
                "compacted and freed; start vLLM with --no-async-scheduling")
    return None


def _parallel(config, rule) -> Optional[str]:
    par = getattr(config, "parallel_config", None)
    for name, why in (
            ("pipeline_parallel_size", "a step's blocks would be freed while later stages "
                                       "still read them (vLLM's batch queue)"),
            ("data_parallel_size", "not tested"),
            ("decode_context_parallel_size", "the KV cache is split across ranks by token"),
            ("prefill_context_parallel_size", "the KV cache is split across ranks by token")):
        if getattr(par, name, 1) > 1:
            return f"{name}={getattr(par, name)}: not supported by kvprune_cuda.vllm ({why})"
    return None


def _kv_transfer(config, rule) -> Optional[str]:
    if getattr(config, "kv_transfer_config", None) is not None:
        return ("kv_transfer_config: KV connectors (offloading, prefill/decode disaggregation) "
                "would move blocks that kvprune rewrites or frees")
    cache = getattr(config, "cache_config", None)
    if getattr(cache, "kv_offloading_size", None) is not None:
        return "kv_offloading_size: KV offloading would move blocks that kvprune rewrites"
    events = getattr(config, "kv_events_config", None)
    if getattr(events, "enable_kv_cache_events", False):
        return ("kv_events_config: KV cache events would publish prefix-cache hashes of "
                "blocks that kvprune rewrites (not supported)")
    if getattr(config, "ec_transfer_config", None) is not None:
        return "ec_transfer_config: encoder cache transfer is not supported by kvprune_cuda.vllm"
    return None


def _model(config, rule) -> Optional[str]:
    model = getattr(config, "model_config", None)
    if model is None:
        return None
    if getattr(model, "runner_type", "generate") != "generate":
        return f"runner: {model.runner_type!r} models are not supported (generation only)"
    for flag, what in (("is_encoder_decoder", "encoder-decoder"), ("is_hybrid", "hybrid"),
                       ("is_attention_free", "attention-free"),
                       ("is_multimodal_model", "multimodal")):
        if getattr(model, flag, False):
            return f"model: {what} models are not supported by kvprune_cuda.vllm"
    window = model.get_sliding_window() if hasattr(model, "get_sliding_window") else None
    if window is not None:
        return (f"model: sliding-window attention ({window}) is not supported by "
                "kvprune_cuda.vllm (full-attention layers only)")
    return None


def _cache(config, rule) -> Optional[str]:
    cache = getattr(config, "cache_config", None)
    dtype = getattr(cache, "cache_dtype", "auto")
    if dtype not in KV_CACHE_DTYPES:
        return f"kv_cache_dtype={dtype!r}: kvprune_cuda.vllm runs {KV_CACHE_DTYPES}"
    if getattr(cache, "kv_sharing_fast_prefill", False):
        return "kv_sharing_fast_prefill: layers sharing a KV cache are not supported"
    if getattr(config, "lora_config", None) is not None:
        return "enable_lora: LoRA is not tested with kvprune_cuda.vllm"
    return None


CHECKS = (_speculative, _scheduling, _parallel, _kv_transfer, _model, _cache)


def check_engine(vllm_config, rule=None) -> None:
    """NotImplementedError naming the first setting of ``vllm_config`` that kvprune_cuda.vllm
    does not support (``rule``: the decode-time rule, or None)."""
    for check in CHECKS:
        reason = check(vllm_config, rule)
        if reason is not None:
            raise NotImplementedError(reason)


def check_kv_cache_groups(kv_cache_config) -> None:
    """NotImplementedError unless every layer is in one KV cache group of full attention: one
    block table and one kept count per request serve every layer."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    if len(groups) != 1 or type(specs[0]) is not FullAttentionSpec \
            or specs[0].sliding_window is not None or specs[0].attention_chunk_size is not None:
        raise NotImplementedError(
            f"kv_cache_groups: kvprune_cuda.vllm needs every layer in one group of full "
            f"attention; this model has {[type(s).__name__ for s in specs]}")


def check_layer(layer) -> None:
    """NotImplementedError for an attention layer compaction cannot serve alone."""
    if getattr(layer, "kv_sharing_target_layer_name", None) is not None:
        raise NotImplementedError(
            f"model: layer {layer.layer_name} shares the KV cache of "
            f"{layer.kv_sharing_target_layer_name} (not supported)")
    if getattr(layer.impl, "sliding_window", -1) not in (None, -1):
        raise NotImplementedError(
            f"model: layer {layer.layer_name} uses sliding-window attention (not supported)")
