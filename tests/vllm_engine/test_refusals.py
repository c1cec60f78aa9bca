"""Every vLLM setting kvprune_cuda.vllm does not support is refused at engine start, with an
error naming it (kvprune_cuda.vllm.support; docs/vllm.md's configuration matrix).

The configurations are vLLM's own (``EngineArgs(...).create_engine_config()``, as the engine
builds them); one engine is started to show the refusal stops it before it serves.
"""

from __future__ import annotations

import gc
import os
import types

import pytest

vllm = pytest.importorskip("vllm")

import transformers  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda.vllm.support import check_engine, check_kv_cache_groups  # noqa: E402
from test_engine import model_dir  # noqa: E402,F401  (fixture)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def config(model, **settings):
    return EngineArgs(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
                      **settings, **kp.vllm.engine_args("snapkv", 0.2)).create_engine_config()


@pytest.mark.parametrize("settings, named", [
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
    ({"data_parallel_size": 2}, "data_parallel_size=2"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}},
     "kv_transfer_config"),
    ({"kv_offloading_size": 1.0}, "kv_transfer_config"),  # vLLM turns it into a connector
    ({"kv_events_config": {"enable_kv_cache_events": True}}, "kv_events_config"),
    ({"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype='bfloat16'"),
    ({"kv_sharing_fast_prefill": True}, "kv_sharing_fast_prefill"),
    ({"enable_lora": True}, "enable_lora"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                             "prompt_lookup_max": 2}}, None),  # n-gram drafts: supported
])
def test_unsupported_settings_are_refused_by_name(model_dir, settings, named):
    cfg = config(model_dir, **settings)
    if named is None:
        check_engine(cfg)
        return
    with pytest.raises(NotImplementedError, match=named.replace("[", r"\[")):
        check_engine(cfg)


def test_defaults_are_accepted_and_async_scheduling_is_refused(model_dir):
    """vLLM's defaults pass (compile mode and the multiprocess engine core included); the CPU
    platform turns async scheduling off, and were it on, it is refused."""
    cfg = config(model_dir)
    check_engine(cfg)
    assert not cfg.scheduler_config.async_scheduling and cfg.compilation_config.mode != 0
    cfg.scheduler_config.async_scheduling = True
    with pytest.raises(NotImplementedError, match="async_scheduling"):
        check_engine(cfg)


def test_sliding_window_model_is_refused(tmp_path):
    cfg = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, use_sliding_window=True,
                                   sliding_window=128, max_window_layers=0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="sliding-window attention"):
        check_engine(config(str(tmp_path)))


@pytest.mark.parametrize("flag, what", [("is_encoder_decoder", "encoder-decoder"),
                                        ("is_hybrid", "hybrid"),
                                        ("is_multimodal_model", "multimodal")])
def test_model_kinds_are_refused(model_dir, flag, what):
    cfg = config(model_dir)
    model = types.SimpleNamespace(runner_type="generate", get_sliding_window=lambda: None,
                                  **{flag: True})
    cfg_view = types.SimpleNamespace(**{k: getattr(cfg, k) for k in (
        "scheduler_config", "parallel_config", "cache_config", "speculative_config",
        "kv_transfer_config", "kv_events_config", "ec_transfer_config", "lora_config")},
        model_config=model)
    with pytest.raises(NotImplementedError, match=f"model: {what} models"):
        check_engine(cfg_view)


def test_kv_cache_groups_other_than_one_full_attention_group_are_refused():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype="float32")
    window = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype="float32",
                               sliding_window=64)
    groups = lambda *specs: types.SimpleNamespace(  # noqa: E731
        kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=s) for s in specs])
    check_kv_cache_groups(groups(full))
    for bad in (groups(window), groups(full, window)):
        with pytest.raises(NotImplementedError, match="kv_cache_groups"):
            check_kv_cache_groups(bad)


def test_a_refused_engine_does_not_start(model_dir):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(Exception, match="kv_events_config"):
        vllm.LLM(model_dir, dtype="float32", max_model_len=1024, skip_tokenizer_init=True,
                 enforce_eager=True, kv_events_config={"enable_kv_cache_events": True},
                 **kp.vllm.engine_args("snapkv", 0.2))
    gc.collect()


@pytest.mark.parametrize("field, value, named", [
    ("ec_transfer_config", object(), "ec_transfer_config"),
    ("parallel_config", types.SimpleNamespace(decode_context_parallel_size=2),
     "decode_context_parallel_size=2"),
    ("parallel_config", types.SimpleNamespace(prefill_context_parallel_size=2),
     "prefill_context_parallel_size=2"),
    ("model_config", types.SimpleNamespace(runner_type="pooling"), "runner: 'pooling'"),
    ("model_config", types.SimpleNamespace(runner_type="generate", is_attention_free=True),
     "attention-free"),
])
def test_settings_vllm_cannot_build_here_are_refused(model_dir, field, value, named):
    """Settings whose vLLM config cannot be built on this CPU-only, one-rank machine (context
    parallelism needs TP >= its size; encoder-cache transfer and pooling/attention-free models
    need other models): the same check on the engine's config with that one field set."""
    cfg = config(model_dir)
    view = types.SimpleNamespace(**{k: getattr(cfg, k) for k in (
        "scheduler_config", "parallel_config", "cache_config", "speculative_config",
        "kv_transfer_config", "kv_events_config", "ec_transfer_config", "lora_config",
        "model_config")})
    setattr(view, field, value)
    with pytest.raises(NotImplementedError, match=named):
        check_engine(view)
