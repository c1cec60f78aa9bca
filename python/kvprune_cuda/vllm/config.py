"""How kvprune_cuda.vllm's policy and decode-time rule travel to every vLLM process.

:func:`engine_config` writes them into vLLM's ``additional_config`` (the policy's fields and its
class by module path); :func:`from_vllm_config` and :func:`decode_from_vllm_config` rebuild them
in each process (the scheduler's, every worker's), importing and registering the policy class.
:func:`engine_policy` refuses, by name, a policy the engine cannot run.
"""

from __future__ import annotations

import importlib
from typing import Optional, Union

from kvprune_cuda import policy as policies

# The evidence the engine's hooks give a prompt policy: the keys, the last window queries
# (attention accumulated over forwards: h2o runs as a decode-time rule; reconstruction: kvzip
# runs in kp.hf.compress_context)
ENGINE_EVIDENCE = ("none", "window_queries")
CONFIG_KEY = "kvprune"  # the entry of vLLM's additional_config that holds the policy


def engine_policy(policy: Union[str, "policies.Policy"] = "snapkv",
                  budget: Union[int, float, None] = None,
                  options: Optional["policies.Options"] = None, **fields) -> "policies.Policy":
    """The :class:`kvprune_cuda.policy.Policy` ``policy`` (a name :func:`kvprune_cuda.policy.
    registered` knows, or a policy object) with ``budget``, ``options`` and its own ``fields``
    (a configuration read back), refused (ValueError naming ``policy``) unless the engine gives
    it its evidence and every vLLM process can import its class."""
    p = policies.make(policy, options, budget=budget, **fields)
    if p.evidence not in ENGINE_EVIDENCE:
        raise ValueError(f"policy: {p.name!r} scores by {p.evidence!r}; kp.vllm gives a prompt "
                         f"policy {ENGINE_EVIDENCE} (h2o: decode='h2o'; kvzip: "
                         "kp.hf.compress_context)")
    cls = type(p)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ValueError(f"policy: {cls.__qualname__} is defined in {cls.__module__!r}"
                         f"{' inside a function' if '<locals>' in cls.__qualname__ else ''}; "
                         "vLLM's processes import a policy class by its module path: define it "
                         "at the top level of an importable module")
    return p


def class_path(policy: "policies.Policy") -> str:
    cls = type(policy)
    return f"{cls.__module__}:{cls.__qualname__}"


def policy_class(path: str) -> type:
    """The policy class at ``path`` ("module:qualname"), imported and registered."""
    module, _, qualname = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"policy: this vLLM process cannot import {path} ({e}); put its "
                         "module on the path of every process (PYTHONPATH)") from e
    return policies.register(obj)


def engine_config(policy: "policies.Policy", decode: Optional["policies.DecodeRule"],
                  prefill: Optional["policies.PrefillBound"] = None) -> dict:
    """The ``additional_config`` entry that carries ``policy`` (its class by module path, its
    fields), ``decode`` and the ``prefill`` bound to every process."""
    rule = None
    if decode is not None:
        rule = {k: v for k, v in decode.policy.to_config().items() if k not in ("policy", "budget")}
        rule.update(decode=decode.policy.name, max_held=decode.max_held, interval=decode.interval)
    return {**policy.to_config(), "class": class_path(policy), "decode": rule,
            "prefill_max_held": None if prefill is None else prefill.max_held,
            "prefill_signal": None if prefill is None else prefill.signal,
            "prefill_novelty": None if prefill is None else prefill.novelty}


def _config(vllm_config) -> dict:
    extra = getattr(vllm_config, "additional_config", None) or {}
    if CONFIG_KEY not in extra:
        raise ValueError("additional_config: no 'kvprune' entry; build the engine "
                         "arguments with kvprune_cuda.vllm.engine_args()")
    return dict(extra[CONFIG_KEY])


def from_vllm_config(vllm_config) -> "policies.Policy":
    """The prompt's policy in the engine's configuration (its class imported and registered
    in this process)."""
    config = _config(vllm_config)
    config.pop("decode", None)
    config.pop("prefill_max_held", None)
    config.pop("prefill_signal", None)
    config.pop("prefill_novelty", None)
    if "class" in config:
        policy_class(config.pop("class"))
    return engine_policy(**{"policy": None, **config})


def decode_from_vllm_config(vllm_config) -> Optional["policies.DecodeRule"]:
    """The decode-time rule in the engine's configuration (None: none)."""
    rule = _config(vllm_config).get("decode")
    return None if rule is None else policies.make_decode(**rule)


def engine_prefill_bound(max_held: Optional[int], policy: "policies.Policy",
                         signal: Optional[str], novelty: Optional[float]
                         ) -> Optional["policies.PrefillBound"]:
    """:func:`kvprune_cuda.policy.make_prefill_bound`, refusing the signals vLLM cannot give: a
    bound must rank by what the prompt's own forward and the held keys give."""
    bound = policies.make_prefill_bound(max_held, policy, signal, novelty)
    if bound is not None and bound.repeats:
        raise ValueError("prefill_signal: 'reconstruct' repeats each chunk in a forward of its "
                         "own, which vLLM's scheduler does not plan (kp.hf only); use 'max', "
                         "'far' or 'window'")
    return bound


def prefill_from_vllm_config(vllm_config) -> Optional["policies.PrefillBound"]:
    """The bounded prefill in the engine's configuration (None: unbounded)."""
    config = _config(vllm_config)
    return engine_prefill_bound(config.get("prefill_max_held"), from_vllm_config(vllm_config),
                                config.get("prefill_signal"), config.get("prefill_novelty"))


def is_configured(vllm_config) -> bool:
    """Whether the engine runs kvprune_cuda.vllm (its ``additional_config`` entry)."""
    return CONFIG_KEY in (getattr(vllm_config, "additional_config", None) or {})
