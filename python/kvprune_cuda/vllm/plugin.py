"""The ``kvprune_cuda`` vLLM general plugin (entry point group ``vllm.general_plugins``, in
pyproject.toml): vLLM's start-up check that one request of ``max_model_len`` tokens fits the KV
pool, made against the most one request holds when kvprune_cuda.vllm bounds both its prefill
(``prefill_max_held``) and its generation (a decode-time rule): then vLLM may start with a
``max_model_len`` longer than the pool holds, and only then.

vLLM loads every general plugin in each of its processes (more than once in some); the engine
core calls ``get_kv_cache_configs`` once, before its scheduler exists. :func:`register` wraps
it there, idempotently; the wrapper leaves an engine without kvprune_cuda.vllm, or without
``prefill_max_held``, or one whose ``max_model_len`` vLLM fits itself (``-1``), to vLLM's own
check. An operator who restricts the plugins (``VLLM_PLUGINS``) must name ``kvprune_cuda``.
"""

from __future__ import annotations

from typing import Optional

NO_DECODE_RULE = (" kvprune_cuda.vllm: prefill_max_held bounds what a prompt holds while it "
                  "prefills, not its generation, which may grow to max_model_len; add a "
                  "decode-time rule (decode=, max_held=, interval=; --kv-decode, "
                  "--kv-max-held, --kv-interval) for a max_model_len longer than the KV pool")


def bounded_length(vllm_config) -> Optional[int]:
    """The most tokens one request holds in this engine (:func:`~kvprune_cuda.vllm.rules.
    bounded_peak`), when kvprune_cuda.vllm bounds its prefill and its generation and that is
    less than ``max_model_len``; None otherwise."""
    from kvprune_cuda.vllm import config, rules

    model = vllm_config.model_config
    if not config.is_configured(vllm_config) or getattr(model, "original_max_model_len", 0) == -1:
        return None
    bound = config.prefill_from_vllm_config(vllm_config)
    if bound is None:
        return None
    peak = rules.bounded_peak(bound, config.decode_from_vllm_config(vllm_config),
                              vllm_config.scheduler_config.max_num_batched_tokens)
    return peak if peak is not None and peak < model.max_model_len else None


def _checked_against_the_bound(get_kv_cache_configs):
    """vLLM's ``get_kv_cache_configs`` with ``max_model_len`` read as :func:`bounded_length`
    while it runs (its memory check, and its log of the requests the pool holds at once)."""
    def run(vllm_config, *args, **kwargs):
        model = vllm_config.model_config
        length = bounded_length(vllm_config)
        if length is None:
            try:
                return get_kv_cache_configs(vllm_config, *args, **kwargs)
            except ValueError as e:
                from kvprune_cuda.vllm import config

                if (config.is_configured(vllm_config)
                        and config.prefill_from_vllm_config(vllm_config) is not None
                        and config.decode_from_vllm_config(vllm_config) is None):
                    raise ValueError(str(e) + NO_DECODE_RULE) from e
                raise
        configured, model.max_model_len = model.max_model_len, length
        try:
            return get_kv_cache_configs(vllm_config, *args, **kwargs)
        finally:
            model.max_model_len = configured
    run.kvprune_bounded = True
    return run


def register() -> None:
    """Wraps the engine core's ``get_kv_cache_configs`` (once per process)."""
    import vllm.v1.engine.core as core

    if not getattr(core.get_kv_cache_configs, "kvprune_bounded", False):
        core.get_kv_cache_configs = _checked_against_the_bound(core.get_kv_cache_configs)
